"""What reporting a step costs a training script: ``autotune.step()`` and
``autotune.should_stop()`` outside a trial (the production script) and inside one.

    python benchmarks/step_cost.py              # 200k calls each way
    python benchmarks/step_cost.py --calls 1000000 --json

Each way runs in a fresh process (the reporting state is per process): "outside" without
AUTOTUNE_TRIAL_DIR, "inside" with one pointing at a temporary folder, as in a trial, so each
call appends its line to the step file. Prints the cost per call pair in microseconds, and what
share of a 1 ms optimizer step (about the fastest step on this CPU, a tiny MLP) that is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_TIMED = """
import sys, time
import autotune
n = int(sys.argv[1])
for _ in range(1000):  # the first call opens the trial's file
    autotune.step(8)
    autotune.should_stop()
best = float("inf")
for _ in range(5):
    t = time.perf_counter()
    for _ in range(n):
        autotune.step(8)
        autotune.should_stop()
    best = min(best, (time.perf_counter() - t) / n)
empty = float("inf")
for _ in range(5):
    t = time.perf_counter()
    for _ in range(n):
        pass
    empty = min(empty, (time.perf_counter() - t) / n)
print(max(best - empty, 0.0))
"""


def cost(calls: int, trial_dir: str | None) -> float:
    """Seconds per step() + should_stop() pair, the empty loop taken off (best of 5)."""
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_TRIAL_DIR"}
    env["PYTHONPATH"] = str(ROOT)
    if trial_dir is not None:
        env["AUTOTUNE_TRIAL_DIR"] = trial_dir
        env["AUTOTUNE_SAMPLES_PER_STEP"] = "8"
    out = subprocess.run([sys.executable, "-c", _TIMED, str(calls)], env=env, check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    outside = cost(args.calls, None)
    with tempfile.TemporaryDirectory(prefix="autotune-step-cost-") as folder:
        inside = cost(args.calls, folder)
        lines = sum(1 for _ in open(Path(folder) / "steps.rank0.jsonl"))
    doc = {"calls": args.calls, "outside_us": outside * 1e6, "inside_us": inside * 1e6,
           "inside_share_of_1ms_step": inside / 1e-3, "lines_written": lines}
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"step() + should_stop(), per optimizer step ({args.calls:,} calls, best of 5):")
    print(f"  outside a trial  {doc['outside_us']:.3f} us")
    share = 100 * doc["inside_share_of_1ms_step"]
    print(f"  inside a trial   {doc['inside_us']:.3f} us  ({share:.2f}% "
          f"of a 1 ms step; {lines:,} step lines written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
