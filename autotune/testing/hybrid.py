"""One trial of a sharded config as a Slurm step on two nodes of the allocation this runs in,
for the test of hybrid sharding across nodes (``tests/test_slurm.py``).

    python -m autotune.testing.hybrid OUT.json CONFIG_JSON

plans the trial as the tuner does (``trial.launch.plan``), hands it to the Slurm executor on two
nodes with ``world_size / 2`` ranks each, runs and classifies it, and writes its outcome, its
ranks and the sharding the trial read back from FSDP to OUT.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from autotune.config.knobs import Config
from autotune.trial.executors.slurm import Slurm
from autotune.trial.launch import execute, plan
from autotune.trial.measurement import classify
from autotune.trial.spec import MeasureSettings, TrialSpec
from autotune.workloads import WorkloadSpec


def main(argv: list[str]) -> int:
    out, config = Path(argv[0]), Config.from_dict(json.loads(argv[1]))
    executor = Slurm(nnodes=2, nproc=config.world_size // 2, parallel=1, study="hybrid")
    spec = TrialSpec(WorkloadSpec("gpt2", {"size": "tiny", "seq_len": 32}), config,
                     measure=MeasureSettings(min_window_s=0.1, max_seconds=4.0))
    with tempfile.TemporaryDirectory() as tmp:
        p = executor.plan(plan(spec, workdir=Path(tmp), timeout_s=120), 0, "hybrid", 0)
        m = classify(execute(p))
    out.write_text(json.dumps({"status": m.status.value, "reason": m.reason,
                               "ranks": sorted(r["rank"] for r in m.ranks),
                               "sharding": m.applied.get("sharding")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
