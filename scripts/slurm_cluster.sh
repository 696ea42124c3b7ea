#!/usr/bin/env bash
# A one-host Slurm cluster for the executor's tests: four nodes (n1..n4, one slurmd each on
# ports 6818-6821, all on 127.0.0.1) stand in for four machines; proctrack/linuxproc, no cgroups.
#
#   scripts/slurm_cluster.sh start DIR   # installs Debian's slurmctld, slurmd and munge if missing
#   export SLURM_CONF=DIR/slurm.conf     # then srun, sbatch, squeue reach it
#   scripts/slurm_cluster.sh stop DIR
#
# Runs as root (slurmd starts each job's processes as its user). Exits non-zero when the cluster
# did not come up, with the daemons' logs' last lines.
set -euo pipefail
action=${1:?start or stop}
dir=$(realpath -m "${2:?a directory for the config, state and logs of the cluster}")
nodes=4

stop() {
  for pid in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid; do
    [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  for _ in $(seq 50); do
    pgrep -f "slurm(ctld|d) -f $dir/slurm.conf" >/dev/null || return 0
    sleep 0.2
  done
  pkill -9 -f "slurm(ctld|d) -f $dir/slurm.conf" || true
}

if [ "$action" = stop ]; then stop; exit 0; fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v munged >/dev/null || ! command -v srun >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      slurmctld slurmd slurm-client munge) >/dev/null
fi
mkdir -p "$dir/state"
host=$(hostname)
cat > "$dir/slurm.conf" <<CONF
ClusterName=autotune
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=6817
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ReturnToService=2
MpiDefault=none
KillWait=5
InactiveLimit=0
MinJobAge=5
CONF
for i in $(seq $nodes); do
  echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((6817 + i)) CPUs=2 RealMemory=4000 State=UNKNOWN" >> "$dir/slurm.conf"
done
echo "PartitionName=debug Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP" >> "$dir/slurm.conf"

if ! pgrep -x munged >/dev/null; then
  mkdir -p /run/munge
  [ -s /etc/munge/munge.key ] || mungekey --create 2>/dev/null \
    || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  chown -R munge: /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  runuser -u munge -- munged || munged --force
fi
stop  # an earlier cluster of this directory
# Another cluster of this script (another directory) holds the ports: stop it too.
for conf in $(pgrep -a -f "slurm(ctld|d) -f /.*/slurm.conf" | grep -o "/[^ ]*/slurm.conf" | sort -u); do
  if [ "$conf" != "$dir/slurm.conf" ] && grep -q "^ClusterName=autotune$" "$conf" 2>/dev/null; then
    "$0" stop "$(dirname "$conf")"
  fi
done
rm -rf "$dir"/state/* "$dir"/spool-*
slurmctld -f "$dir/slurm.conf"
for i in $(seq $nodes); do slurmd -f "$dir/slurm.conf" -N "n$i"; done
export SLURM_CONF="$dir/slurm.conf"
for _ in $(seq 60); do
  if [ "$(sinfo -h -o '%t %D' 2>/dev/null)" = "idle $nodes" ]; then
    echo "slurm: $nodes nodes idle (SLURM_CONF=$SLURM_CONF)"
    exit 0
  fi
  sleep 0.5
done
echo "slurm did not come up:" >&2
sinfo >&2 || true
tail -n 5 "$dir"/*.log >&2 || true
exit 1
