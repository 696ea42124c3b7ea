"""What watching a trial's memory costs the trial: interleaved runs of one config, side by side.

    python benchmarks/sampling.py --model bert --amp bf16 --micro-batch 8 --rounds 3

Three ways to watch the trial's process tree at the launcher's 5 Hz, one trial process each, in
rotating order so that drift of the machine falls on all of them alike:
  pss    PSS of every process at every sample (what autotune did before TreeMemory)
  tree   TreeMemory: RSS at every sample, PSS only at new highs, over the limit, every 5 s
  none   no sampling at all (what a training script pays)
Prints each run and the median samples/sec of each way, and their ratios to ``none``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune.trial.launch as launch  # noqa: E402
from autotune.config.knobs import Config  # noqa: E402
from autotune.machine.hardware import detect  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.workloads import WorkloadSpec  # noqa: E402


class EveryPss(launch.TreeMemory):
    """The old way: PSS of every process of the tree at every sample."""

    def sample(self) -> bool:
        pss = sum(launch._memory(p, "pss") for p in launch._tree(self.pid))
        self.peak = max(self.peak, pss)
        return self.limit is not None and pss > self.limit


class Nothing(launch.TreeMemory):
    def sample(self) -> bool:
        return False


WAYS: dict[str, type[launch.TreeMemory]] = {"pss": EveryPss, "tree": launch.TreeMemory,
                                             "none": Nothing}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--amp", default="bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trial-seconds", type=float, default=40.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    hw = detect()
    config = Config(micro_batch_size=args.micro_batch, grad_accum_steps=1, amp=args.amp)
    names = list(WAYS)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                launch.TreeMemory = WAYS[name]  # type: ignore[misc]  # what execute() builds
                p = launch.plan(TrialSpec(WorkloadSpec(args.model, {}), config, device=hw.device,
                                          measure=MeasureSettings(
                                              max_seconds=args.trial_seconds,
                                              min_window_s=args.trial_seconds / 12,
                                              target_cv=0.0)),
                                workdir=Path(tmp) / f"{r}-{name}", timeout_s=args.trial_seconds * 4)
                m = classify(launch.execute(p), hw.device)
                runs[name].append({"status": m.status, "samples_per_sec": m.samples_per_sec,
                                   "peak_memory_bytes": m.peak_memory_bytes})
                if not args.json:
                    print(f"round {r + 1} {name:4s} {m.status} {m.samples_per_sec or 0:.4g} "
                          f"samples/s, peak {m.peak_memory_bytes / 2**30:.2f} GiB", flush=True)
    medians = {name: statistics.median([x["samples_per_sec"] for x in v
                                        if x["status"] == "ok"] or [0.0])
               for name, v in runs.items()}
    base = medians["none"] or float("nan")
    report = {"model": args.model, "config": config.to_dict(), "hardware": hw.describe(),
              "runs": runs, "medians": medians,
              "ratio_to_none": {k: round(v / base, 4) for k, v in medians.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name in names:
            print(f"{name:4s} median {medians[name]:.4g} samples/s, "
                  f"{report['ratio_to_none'][name]:.3f}x of none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
