"""What a trial's launch costs through Slurm against the same trial on this machine.

    sbatch --nodes 2 --wrap "python benchmarks/executor_launch.py --rounds 5"
    # or, on the project's one-host test cluster:
    #   scripts/slurm_cluster.sh start /tmp/slurm && export SLURM_CONF=/tmp/slurm/slurm.conf

Inside an allocation of two nodes or more. Each round runs the same mlp trial of two gloo ranks
twice, interleaved: on this machine (torchrun, standalone rendezvous) and as a Slurm job step on
two nodes, one rank each (srun, torchrun's c10d rendezvous at the first node, the node part
relaying the files back). For each it prints the start-up (from the launch until the tuner reads
the trial's first event, the model built: process start, imports, rendezvous, the build) and the
wall time of the whole trial, then the medians and their differences. On the one-host test
cluster both run on the same cores, so the difference is the engine's own cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.config.knobs import Config  # noqa: E402
from autotune.trial import launch  # noqa: E402
from autotune.trial.executors.slurm import Slurm  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.workloads import WorkloadSpec  # noqa: E402

SETTINGS = MeasureSettings(max_seconds=3.0, min_window_s=0.1)


def one(executor: Slurm | None, workdir: Path, index: int) -> tuple[float, float, str]:
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
    args = parser.parse_args()
    slurm = Slurm(2, 1, 1, "launch-bench")
    work = Path(tempfile.mkdtemp(prefix="autotune-launch-bench-"))
    rows: dict[str, list[tuple[float, float]]] = {"local": [], "slurm": []}
    print(f"{slurm.describe()}; mlp, 2 gloo ranks, {SETTINGS.max_seconds:g} s measuring budget")
    for r in range(args.rounds):
        for label, executor in (("local", None), ("slurm", slurm)):
            startup, wall, status = one(executor, work / f"{label}-{r}", r)
            rows[label].append((startup, wall))
            print(f"round {r + 1} {label:5s} start-up {startup:6.2f} s  wall {wall:6.2f} s  "
                  f"{status}", flush=True)
    med = {k: (statistics.median(s for s, _ in v), statistics.median(w for _, w in v))
           for k, v in rows.items()}
    for k, (s, w) in med.items():
        print(f"median {k:5s} start-up {s:6.2f} s  wall {w:6.2f} s")
    print(f"slurm - local: start-up {med['slurm'][0] - med['local'][0]:+.2f} s, "
          f"wall {med['slurm'][1] - med['local'][1]:+.2f} s per trial")
    return 0


if __name__ == "__main__":
    sys.exit(main())
