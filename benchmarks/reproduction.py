"""Does a training loop reproduce its profile's throughput? Side by side, interleaved.

    python benchmarks/reproduction.py --rounds 3                      # tunes mlp first (~1 min)
    python benchmarks/reproduction.py --profile studies/<study>/profile.yaml --rounds 5

Each round runs `autotune profile check --rounds 1` (a trial process measuring the profile's
config exactly as its figure was measured) and then `examples/train_plain.py` (a plain loop that
applies the profile through its methods), one after the other, so both see the same machine.
Printed per round: the check's samples/s (the median of its windows), the loop's over its whole
timed run and the median of its 0.5 s windows; at the end, the loop/check ratios of the medians
and of the best rounds (other load only slows a run, so the fastest is the least disturbed).
Timing ratios live here, not in the test suite: a shared machine drifts 20-30% within minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def tune(workdir: Path) -> Path:
    """A short mlp study with its confirmation, as the test suite's tuned profile."""
    subprocess.run([sys.executable, "-m", "autotune", "run", "--model", "mlp", "--trials", "3",
                    "--trial-seconds", "6", "--window-seconds", "0.5", "--trial-timeout", "60s",
                    "--confirm-top", "1", "--confirm-rounds", "2"], cwd=workdir, env=ENV,
                   check=True, capture_output=True)
    (path,) = workdir.glob("studies/*/profile.yaml")
    return path


def check_round(profile: Path, workdir: Path) -> float:
    out = subprocess.run([sys.executable, "-m", "autotune", "profile", "check", str(profile),
                          "--rounds", "1", "--threshold", "0.01"], cwd=workdir, env=ENV,
                         capture_output=True, text=True, check=True)
    found = re.search(r"round 1/1: ([\d,.]+) samples/s", out.stdout)
    if found is None:
        raise SystemExit(f"profile check printed no rate:\n{out.stdout}{out.stderr}")
    return float(found.group(1).replace(",", ""))


def loop_run(profile: Path, workdir: Path, seconds: float) -> dict[str, float]:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_plain.py"),
                          "--profile", str(profile), "--seconds", str(seconds)], cwd=workdir,
                         env=ENV, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, help="a profile (default: tune mlp first)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="the loop's timed run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="autotune-reproduction-") as tmp:
        workdir = Path(tmp)
        profile = args.profile.resolve() if args.profile else tune(workdir)
        rows = []
        for r in range(args.rounds):
            check = check_round(profile, workdir)
            loop = loop_run(profile, workdir, args.seconds)
            rows.append({"round": r + 1, "check": check, "loop_whole": loop["samples_per_sec"],
                         "loop_median": loop["median_window_samples_per_sec"]})
            if not args.json:
                print(f"round {r + 1}: check {check:,.1f}  loop whole-run "
                      f"{loop['samples_per_sec']:,.1f}  loop median window "
                      f"{loop['median_window_samples_per_sec']:,.1f} samples/s", flush=True)
    summary = {}
    for kind in ("loop_whole", "loop_median"):
        summary[f"{kind}/check, medians"] = statistics.median(x[kind] for x in rows) / \
            statistics.median(x["check"] for x in rows)
        summary[f"{kind}/check, best"] = max(x[kind] for x in rows) / max(x["check"] for x in rows)
    if args.json:
        print(json.dumps({"profile": str(profile), "rounds": rows, "ratios": summary}, indent=1))
    else:
        for name, value in summary.items():
            print(f"{name}: {value:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
