"""Measure one config several times in fresh trial processes: how repeatable is a trial?

    python benchmarks/repeatability.py --model bert --runs 5 --amp bf16 --micro-batch 8

Prints each run's samples/sec, its in-trial spread, and the CV across runs (the noise a winner
must beat). --json prints one JSON document instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.config.knobs import Config  # noqa: E402
from autotune.machine.hardware import detect  # noqa: E402
from autotune.trial.launch import execute, plan  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.workloads import WorkloadSpec  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--amp", default="bf16")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--trial-seconds", type=float, default=60.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    hw = detect()
    config = Config(micro_batch_size=args.micro_batch, grad_accum_steps=args.accum, amp=args.amp,
                    num_workers=args.workers, prefetch_factor=2 if args.workers else None)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            p = plan(TrialSpec(WorkloadSpec(args.model, {}), config, device=hw.device,
                               measure=MeasureSettings(max_seconds=args.trial_seconds)),
                     workdir=Path(tmp) / str(i), timeout_s=300)
            m = classify(execute(p), hw.device)
            runs.append({"status": m.status, "samples_per_sec": m.samples_per_sec,
                         "in_trial_cv": m.spread_cv, "windows": len(m.windows),
                         "wall_s": round(m.wall_s, 2), "overhead_share": m.overhead_share()})
            if not args.json:
                spread = "n/a" if m.spread_cv is None else f"{100 * m.spread_cv:.1f}%"
                print(f"run {i + 1}: {m.status} {m.samples_per_sec or 0:.3f} samples/s "
                      f"(in-trial CV {spread}, {len(m.windows)} windows, "
                      f"{m.wall_s:.1f}s, overhead {100 * (m.overhead_share() or 0):.0f}%)",
                      flush=True)
    rates = [r["samples_per_sec"] for r in runs if r["status"] == "ok"]
    cv = statistics.stdev(rates) / statistics.fmean(rates) if len(rates) > 1 else None
    report = {"model": args.model, "config": config.to_dict(), "hardware": hw.describe(),
              "runs": runs, "median": statistics.median(rates) if rates else None,
              "cv_across_runs": cv}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"median {report['median']:.3f} samples/s; CV across {len(rates)} runs: "
              f"{100 * cv:.2f}%" if cv is not None else "not enough ok runs for a CV")
    return 0


if __name__ == "__main__":
    sys.exit(main())
