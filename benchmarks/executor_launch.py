"""What a trial's launch costs through Slurm or Ray against the same trial on this machine.

    sbatch --nodes 2 --wrap "python benchmarks/executor_launch.py --engine slurm --rounds 5"
    # on the project's one-host test cluster first:
    #   scripts/slurm_cluster.sh start /tmp/slurm && export SLURM_CONF=/tmp/slurm/slurm.conf
    python benchmarks/executor_launch.py --engine ray --rounds 5   # starts a local 2-node Ray

Each round runs the same mlp trial of two gloo ranks twice, interleaved: on this machine
(torchrun, standalone rendezvous) and through the engine on two nodes, one rank each (a Slurm
job step inside an allocation of two nodes or more, or a Ray placement group; torchrun's c10d
rendezvous at the first node, the node part relaying the files back). With ``--engine ray`` and
no RAY_ADDRESS, a local cluster of two nodes is started for the run. For each it prints the
start-up (from the launch until the tuner reads the trial's first event, the model built:
process start, imports, rendezvous, the build) and the wall time of the whole trial, then the
medians and their differences. On a one-host cluster both run on the same cores, so the
difference is the engine's own cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.config.knobs import Config  # noqa: E402
from autotune.trial import launch  # noqa: E402
from autotune.trial.executors import Executor  # noqa: E402
from autotune.trial.executors.slurm import Slurm  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.workloads import WorkloadSpec  # noqa: E402

SETTINGS = MeasureSettings(max_seconds=3.0, min_window_s=0.1)


def one(executor: Executor | None, workdir: Path, index: int) -> tuple[float, float, str]:
    """(start-up seconds, wall seconds, status) of one trial."""
    spec = TrialSpec(WorkloadSpec("mlp", {}), Config(micro_batch_size=32, world_size=2), "cpu",
                     SETTINGS)
    p = launch.plan(spec, workdir=workdir, timeout_s=120)
    if executor is not None:
        p = executor.plan(p, 0, f"bench-{index:04d}", index)
    first: list[float] = []
    start = time.monotonic()
    raw = launch.execute(p, on_event=lambda e: first.append(time.monotonic())
                         if not first else None)
    wall = time.monotonic() - start
    return (first[0] - start if first else float("nan")), wall, classify(raw).status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", choices=("slurm", "ray"), default="slurm")
    args = parser.parse_args()
    cluster = None
    if args.engine == "ray" and not os.environ.get("RAY_ADDRESS"):
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
    try:
        return _rounds(args.engine, args.rounds)
    finally:
        if cluster is not None:
            cluster.shutdown()


def _rounds(engine: str, rounds: int) -> int:
    from autotune.trial.executors.ray_cluster import Ray

    remote: Executor = Slurm(2, 1, 1, "launch-bench") if engine == "slurm" \
        else Ray(2, 1, 1, "launch-bench")
    work = Path(tempfile.mkdtemp(prefix="autotune-launch-bench-"))
    rows: dict[str, list[tuple[float, float]]] = {"local": [], engine: []}
    print(f"{remote.describe()}; mlp, 2 gloo ranks, {SETTINGS.max_seconds:g} s measuring budget")
    for r in range(rounds):
        for label, executor in (("local", None), (engine, remote)):
            startup, wall, status = one(executor, work / f"{label}-{r}", r)
            rows[label].append((startup, wall))
            print(f"round {r + 1} {label:5s} start-up {startup:6.2f} s  wall {wall:6.2f} s  "
                  f"{status}", flush=True)
    med = {k: (statistics.median(s for s, _ in v), statistics.median(w for _, w in v))
           for k, v in rows.items()}
    for k, (s, w) in med.items():
        print(f"median {k:5s} start-up {s:6.2f} s  wall {w:6.2f} s")
    print(f"{engine} - local: start-up {med[engine][0] - med['local'][0]:+.2f} s, "
          f"wall {med[engine][1] - med['local'][1]:+.2f} s per trial")
    return 0


if __name__ == "__main__":
    sys.exit(main())
