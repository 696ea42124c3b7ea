"""The same BERT tuned both ways on this machine: the built-in ``bert`` workload (autotune's own
loop) and a Hugging Face Trainer script training the same model on the same data
(``benchmarks/scripts/hf_bert.py``, tuned with ``autotune run -- CMD``); then each winner
measured again, interleaved, through both paths.

    python benchmarks/script_vs_builtin.py                    # BERT-base, 10 min per study
    python benchmarks/script_vs_builtin.py --size tiny --timeout 3m --rounds 2

Two studies (fresh, under --out), then --rounds rounds of four fresh trials each, in the same
order every round: the built-in winner in the built-in loop, the script's winner in the script,
and each winner in the other path. Prints each path's winner and its median samples/sec, and the
Trainer path's overhead: the built-in loop's rate over the script's for the same config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.config.knobs import Config, env_for  # noqa: E402
from autotune.machine.hardware import detect  # noqa: E402
from autotune.profile import Profile, load_profile  # noqa: E402
from autotune.trial import launch  # noqa: E402
from autotune.trial.command import parse_command  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.workloads import WorkloadSpec  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "scripts" / "hf_bert.py"


def tune(out: Path, name: str, timeout: str, flags: list[str], log: Any) -> Profile:
    """One study, fresh, with the search's defaults but no confirmation (the rounds below are
    the side-by-side)."""
    argv = [sys.executable, "-m", "autotune", "run", "--timeout", timeout, "--confirm-top",
            "0", "--study", name, "--out", str(out / name), *flags]
    print(f"tuning {name}: {' '.join(argv[3:])}", file=log, flush=True)
    subprocess.run(argv, cwd=out, check=True, stdout=log, stderr=subprocess.STDOUT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return load_profile(out / name / "profile.yaml", check_fingerprint=False)


def measure(path: str, config: Config, size: str, folder: Path,
            settings: MeasureSettings) -> dict[str, Any]:
    """One fresh trial of ``config`` through ``path`` ("builtin" or "script")."""
    hw = detect()
    workload = WorkloadSpec("bert", {"size": size})
    spec = TrialSpec(workload, config, hw.device, settings)
    if path == "builtin":
        p = launch.plan(spec, workdir=folder, timeout_s=600)
    else:
        command = parse_command([sys.executable, str(SCRIPT), "--size", size])
        profile = Profile(workload={"name": "hf_bert"}, config=config, env=env_for(config),
                          result={"samples_per_sec": 0.0}, baseline={}, speedup=None,
                          fingerprint=hw.fingerprint(), provenance={"candidate": True})
        p = launch.plan_command(spec, command, workdir=folder, timeout_s=600,
                                profile=profile.to_yaml())
    m = classify(launch.execute(p), hw.device)
    return {"status": m.status, "reason": m.reason, "samples_per_sec": m.samples_per_sec,
            "spread_cv": m.spread_cv, "wall_s": m.wall_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="base", choices=("base", "tiny"))
    parser.add_argument("--timeout", default="10m", help="each study's --timeout")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trial-seconds", type=float, default=90.0,
                        help="measuring budget of each side-by-side trial")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="autotune-script-vs-builtin-"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "studies.log", "w") as log:
        builtin = tune(out, "builtin", args.timeout, ["--model", "bert", "--param",
                                                      f"size={args.size}"], log)
        script = tune(out, "script", args.timeout, ["--", sys.executable, str(SCRIPT),
                                                    "--size", args.size], log)
    settings = MeasureSettings(max_seconds=args.trial_seconds)
    plan = [("builtin winner, built-in loop", "builtin", builtin.config),
            ("script winner, HF script", "script", script.config),
            ("builtin winner, HF script", "script", builtin.config),
            ("script winner, built-in loop", "builtin", script.config)]
    rounds: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in plan}
    for r in range(args.rounds):
        for i, (label, path, config) in enumerate(plan):
            got = measure(path, config, args.size, out / "rounds" / f"{r}-{i}", settings)
            rounds[label].append(got)
            if not args.json:
                rate = got["samples_per_sec"]
                print(f"round {r + 1}: {label:<30} "
                      + (f"{rate:.3f} samples/s" if rate else f"{got['status']}: "
                                                              f"{got['reason']}"), flush=True)
    medians = {label: statistics.median(g["samples_per_sec"] for g in got
                                        if g["samples_per_sec"]) if any(
        g["samples_per_sec"] for g in got) else None for label, got in rounds.items()}
    doc = {"size": args.size, "rounds": args.rounds, "out": str(out),
           "builtin": {"config": builtin.config.describe(),
                       "search_samples_per_sec": builtin.samples_per_sec,
                       "speedup": builtin.speedup},
           "script": {"config": script.config.describe(),
                      "search_samples_per_sec": script.samples_per_sec,
                      "speedup": script.speedup, "notes": script.notes},
           "medians": medians, "measurements": rounds}
    overheads = {}
    for which in ("builtin", "script"):
        loop, hf = medians[f"{which} winner, built-in loop"], medians[f"{which} winner, HF script"]
        if loop and hf:
            overheads[which] = loop / hf
    doc["loop_over_script"] = overheads
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"\nbuilt-in winner: {builtin.config.describe()} (search {builtin.samples_per_sec:.3f} "
          f"samples/s, {builtin.speedup}x)")
    print(f"script winner:   {script.config.describe()} (search {script.samples_per_sec:.3f} "
          f"samples/s, {script.speedup}x)")
    for label, rate in medians.items():
        wall = statistics.median(g["wall_s"] for g in rounds[label])
        print(f"  {label:<30} median {rate:.3f} samples/s, trial wall {wall:.0f}s" if rate
              else f"  {label}: no result")
    for which, ratio in overheads.items():
        print(f"  {which} winner: built-in loop / HF script = {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
