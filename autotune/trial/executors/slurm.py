"""Trials as Slurm job steps, inside an allocation (an ``sbatch`` script or ``salloc``).

Each trial is one step on whole nodes of the allocation, one task per node::

    srun --nodes N --ntasks-per-node 1 --nodelist A,B --exact --kill-on-bad-exit=1 --time M:SS
         --cpus-per-task C [--gpus-per-node P] --job-name autotune.STUDY.TRIAL
         python -m autotune.trial.executors.node --nnodes=N --nproc-per-node=P
         --rdzv-backend=c10d --rdzv-endpoint=ADDR_OF_A:PORT ...

Slurm binds the devices (so the device lock is not used), forwards the trial's environment and
brings each task's stdout back, which is how the results come back (``executors.relay``): the
nodes need no file system shared with the tuner, only the same Python environment. Trials on
disjoint node sets run side by side as concurrent steps. A trial that overruns its timeout is
ended through Slurm: ``scancel`` of its step by the tuner, and the step's own time limit should
the tuner be gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, replace

from autotune.errors import UsageError
from autotune.trial.executors import node_env, slots, trial_name
from autotune.trial.plans import TrialPlan

# A step's own time limit is the trial's timeout and this much more: the tuner ends it first.
STEP_GRACE_S = 60
_CPUS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclass(frozen=True)
class Allocation:
    """The Slurm job this tuner runs in: its id, nodes, and the CPUs and GPUs on each."""

    job_id: str
    nodes: tuple[str, ...]
    cpus_per_node: int
    gpus_per_node: int

    @classmethod
    def here(cls) -> Allocation:
        """The allocation of this process's job; a one-line error outside one."""
        env = os.environ
        job = env.get("SLURM_JOB_ID")
        if not job:
            raise UsageError("--executor slurm runs inside a Slurm allocation and SLURM_JOB_ID is "
                             "not set: submit the run with sbatch (or start it under salloc); "
                             "see docs/clusters.md")
        if shutil.which("srun") is None or shutil.which("scontrol") is None:
            raise UsageError("--executor slurm needs srun and scontrol on PATH, and they are not: "
                             "load your cluster's Slurm module first")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        names = _scontrol("show", "hostnames", nodelist).split() if nodelist else []
        return cls(job, tuple(names), cpus_per_node(env.get("SLURM_JOB_CPUS_PER_NODE", "")),
                   gpus_per_node(env))


def cpus_per_node(text: str) -> int:
    """The fewest CPUs any node of the job has, from SLURM_JOB_CPUS_PER_NODE ("72(x2),36");
    0 when it does not say."""
    counts = [int(m.group(1)) for m in _CPUS.finditer(text)]
    return min(counts) if counts else 0


def gpus_per_node(env: dict[str, str] | os._Environ[str]) -> int:
    """GPUs the job has on each node, from what Slurm sets (0 without GPUs)."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(key, "")
        found = re.findall(r"\d+", value.rsplit(":", 1)[-1]) if value else []
        if found:
            return int(found[0])
    return 0


def _scontrol(*args: str) -> str:
    try:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30,
                             check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"scontrol {' '.join(args)} failed ({exc}): is this a Slurm "
                         "allocation?") from None
    if out.returncode:
        raise UsageError(f"scontrol {' '.join(args)} failed: {out.stderr.strip()[:200]}")
    return out.stdout


def node_address(node: str) -> str:
    """The address of ``node`` as Slurm knows it (NodeAddr), where the trial's rendezvous
    store listens."""
    found = re.search(r"\bNodeAddr=(\S+)", _scontrol("show", "node", "-o", node))
    return found.group(1) if found else node


class Slurm:
    """Runs each trial as a step on ``nnodes`` whole nodes of the allocation, up to ``slots``
    trials at a time on disjoint nodes."""

    name = "slurm"

    def __init__(self, nnodes: int, nproc: int, parallel: int | None, study: str,
                 allocation: Allocation | None = None) -> None:
        self.alloc = allocation or Allocation.here()
        self.nnodes, self.nproc, self.study = nnodes, nproc, study
        self.slots = slots(len(self.alloc.nodes), nnodes, parallel, "the allocation",
                           "ask sbatch for --nodes")
        if self.alloc.gpus_per_node and nproc > self.alloc.gpus_per_node:
            raise UsageError(f"--nproc {nproc}: the allocation has {self.alloc.gpus_per_node} "
                             "GPU(s) per node; use --nproc "
                             f"{self.alloc.gpus_per_node} or ask sbatch for more")

    def describe(self) -> str:
        return (f"Slurm job {self.alloc.job_id}: {len(self.alloc.nodes)} node(s), "
                f"{self.slots} trial(s) at a time on {self.nnodes} node(s) each")

    def nodes_of(self, slot: int) -> tuple[str, ...]:
        return self.alloc.nodes[slot * self.nnodes:(slot + 1) * self.nnodes]

    def plan(self, p: TrialPlan, slot: int, trial: str, port_seed: int) -> TrialPlan:
        """``p`` (a trial planned for this machine) as a step on this slot's nodes."""
        nodes = self.nodes_of(slot)
        flags: tuple[str, ...] = ()
        world = self.nnodes * self.nproc
        if world > 1:
            host = node_address(nodes[0])
            flags = (f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc}",
                     "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{_port(host, port_seed)}",
                     f"--rdzv-id={trial_name(self.study, trial)}", "--max-restarts=0")
        limit = int(p.timeout_s) + STEP_GRACE_S
        srun = ["srun", f"--nodes={self.nnodes}", "--ntasks-per-node=1",
                f"--nodelist={','.join(nodes)}", "--exact", "--kill-on-bad-exit=1",
                f"--time={limit // 60}:{limit % 60:02d}",
                f"--job-name={trial_name(self.study, trial)}", f"--jobid={self.alloc.job_id}"]
        if self.alloc.cpus_per_node:
            srun.append(f"--cpus-per-task={self.alloc.cpus_per_node}")
        if self.alloc.gpus_per_node:
            srun.append(f"--gpus-per-node={self.nproc}")
        argv = (*srun, sys.executable, "-m", "autotune.trial.executors.node", *flags)
        return replace(p, argv=argv, env=node_env(p), torchrun=flags, engine=self.name,
                       step=trial_name(self.study, trial), memory_limit_bytes=None)

    def clean(self) -> list[str]:
        """End the steps an earlier driver of this study left running in this allocation (it
        was killed: its trials are measured again); returns their ids."""
        prefix = trial_name(self.study, "")
        found = [sid for sid, name in _steps(self.alloc.job_id) if name.startswith(prefix)]
        for sid in found:
            _scancel(sid)
        return found


def end(p: TrialPlan) -> None:
    """End a trial's step through Slurm (``scancel`` of the step it runs as)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or not p.step:
        return
    for sid, name in _steps(job):
        if name == p.step:
            _scancel(sid)


def _steps(job: str) -> list[tuple[str, str]]:
    """(step id, step name) of the job's running steps."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        out = subprocess.run(["squeue", "--steps", "--noheader", "--jobs", job, "--format",
                              "%i %j"], capture_output=True, text=True, timeout=30, check=False)
        return [tuple(ln.split(None, 1)) for ln in out.stdout.splitlines()  # type: ignore[misc]
                if len(ln.split(None, 1)) == 2]
    return []


def _scancel(step_id: str) -> None:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(["scancel", "--quiet", step_id], capture_output=True, timeout=30,
                       check=False)


def _port(host: str, seed: int) -> int:
    """The rendezvous port of a trial: one of a range, by the trial's seed (trials side by
    side run on disjoint nodes, so only another program on the first node can hold it); when
    ``host`` is this machine, the first of them that is free here. A port taken on a remote
    node fails that trial's rendezvous."""
    base = 20000 + (seed * 37) % 20000
    local = host in ("127.0.0.1", "localhost", socket.gethostname())
    for port in range(base, base + 50) if local else (base,):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    return base
