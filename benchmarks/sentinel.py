"""The sentinel's own cost and noise on this machine, and whether it sees a machine that changes.

    python benchmarks/sentinel.py --runs 10
    python benchmarks/sentinel.py --runs 6 --load 1     # the second half beside a busy process

Each run is a fresh process that imports torch and takes one reading as a trial does
(``trial.sentinel.read``, the precisions asked by --precisions). Prints each reading, its
seconds (the cost added to every trial), and per rate the spread across runs (CV, and the
robust one the tuner's threshold uses: ``tuner.drift.noise``). With --load N, the second half
of the runs shares the CPU with N busy-looping processes (a noisy neighbour on a shared VM): the
readings should fall by more than the tuner's threshold (``tuner.drift.threshold``). --json
prints one JSON document instead.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.trial.sentinel import rates  # noqa: E402
from autotune.tuner.drift import changes, noise, threshold  # noqa: E402

READ = ("import json, sys, torch; from autotune.trial.sentinel import read; "
        "print(json.dumps(read(torch.device('cpu'), sys.argv[1].split(','))))")


def _busy() -> None:
    while True:
        pass


def reading(precisions: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", READ, precisions], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--load", type=int, default=0,
                        help="busy processes beside the second half of the runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    quiet_n = args.runs // 2 if args.load else args.runs
    readings = [reading(args.precisions) for _ in range(quiet_n)]
    loaded: list[dict[str, float]] = []
    if args.load:
        hogs = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.load)]
        for h in hogs:
            h.start()
        try:
            loaded = [reading(args.precisions) for _ in range(args.runs - quiet_n)]
        finally:
            for h in hogs:
                h.terminate()
    robust = noise(readings)
    doc = {"readings": readings, "loaded": loaded,
           "seconds": [r["seconds"] for r in readings + loaded], "rates": {}}
    for name in sorted(rates(readings[0])):
        values = [r[name] for r in readings]
        mean = statistics.fmean(values)
        doc["rates"][name] = {
            "median": statistics.median(values),
            "cv": statistics.stdev(values) / mean if len(values) > 1 else 0.0,
            "robust_cv": robust.get(name), "threshold": threshold(robust.get(name)),
            **({"loaded_median": statistics.median(r[name] for r in loaded)} if loaded else {})}
    doc["flagged_under_load"] = [c.line() for c in changes(readings, [loaded])] if loaded else []
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    for i, r in enumerate(readings + loaded):
        tag = " (loaded)" if i >= quiet_n else ""
        print(f"run {i + 1}{tag}: " + ", ".join(f"{k} {v:,.1f}" for k, v in r.items()))
    secs = doc["seconds"]
    print(f"cost per trial: {statistics.median(secs):.2f} s median ({min(secs):.2f}-"
          f"{max(secs):.2f})")
    for name, s in doc["rates"].items():
        extra = (f", under load {s['loaded_median']:,.1f} "
                 f"({100 * (s['loaded_median'] / s['median'] - 1):+.0f}%)"
                 if "loaded_median" in s else "")
        robust_cv = "-" if s["robust_cv"] is None else f"{100 * s['robust_cv']:.1f}%"
        print(f"{name}: median {s['median']:,.1f}, CV {100 * s['cv']:.1f}%, robust CV "
              f"{robust_cv}, the tuner's threshold {100 * s['threshold']:.1f}%{extra}")
    for line in doc["flagged_under_load"]:
        print(f"flagged: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
