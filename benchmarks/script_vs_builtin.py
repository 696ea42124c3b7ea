"""The same BERT tuned both ways on this machine: the built-in ``bert`` workload (autotune's own
loop) and a Hugging Face Trainer script training the same model on the same data, tuned with
``autotune run -- CMD``: by default ``benchmarks/scripts/hf_bert_unchanged.py``, a Trainer
script that knows nothing of autotune (reached by the bootstrap), or with ``--script edited``
``benchmarks/scripts/hf_bert.py``, which loads its profile and adds autotune's callback. Then
each winner measured again, interleaved, through both paths.

    python benchmarks/script_vs_builtin.py                    # BERT-base, 10 min per study
    python benchmarks/script_vs_builtin.py --timeout default  # each study's default budget
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
import time
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

SCRIPTS = {"unchanged": ROOT / "benchmarks" / "scripts" / "hf_bert_unchanged.py",
           "edited": ROOT / "benchmarks" / "scripts" / "hf_bert.py"}


def script_command(which: str, size: str, out: Path) -> list[str]:
    """The script's command line as its user runs it."""
    if which == "edited":
        return [sys.executable, str(SCRIPTS[which]), "--size", size]
    return [sys.executable, str(SCRIPTS[which]), "--size", size, "--output_dir",
            str(out / "user-output"), "--learning_rate", "1e-4", "--weight_decay", "0.01",
            "--dataloader_drop_last", "true"]


def tune(out: Path, name: str, timeout: str, flags: list[str], log: Any) -> tuple[Profile, float]:
    """One study, fresh: with ``timeout`` "default", exactly as `autotune run` runs with no
    budget flag (its confirmation included); else with that --timeout and no confirmation (the
    rounds below are the side-by-side). Returns the profile and the study's wall seconds."""
    budget = [] if timeout == "default" else ["--timeout", timeout, "--confirm-top", "0"]
    argv = [sys.executable, "-m", "autotune", "run", *budget, "--study", name, "--out",
            str(out / name), *flags]
    print(f"tuning {name}: {' '.join(argv[3:])}", file=log, flush=True)
    start = time.monotonic()
    subprocess.run(argv, cwd=out, check=True, stdout=log, stderr=subprocess.STDOUT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return (load_profile(out / name / "profile.yaml", check_fingerprint=False),
            time.monotonic() - start)


def measure(path: str, config: Config, size: str, folder: Path,
            settings: MeasureSettings, script: str = "unchanged") -> dict[str, Any]:
    """One fresh trial of ``config`` through ``path`` ("builtin" or "script")."""
    hw = detect()
    workload = WorkloadSpec("bert", {"size": size})
    spec = TrialSpec(workload, config, hw.device, settings)
    if path == "builtin":
        p = launch.plan(spec, workdir=folder, timeout_s=600)
    else:
        command = parse_command(script_command(script, size, folder))
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
    parser.add_argument("--timeout", default="10m", help="each study's --timeout; 'default': "
                        "no budget flag at all (the default budget, with its confirmation)")
    parser.add_argument("--script", default="unchanged", choices=tuple(SCRIPTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trial-seconds", type=float, default=90.0,
                        help="measuring budget of each side-by-side trial")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="autotune-script-vs-builtin-"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "studies.log", "w") as log:
        builtin, builtin_s = tune(out, "builtin", args.timeout,
                                  ["--model", "bert", "--param", f"size={args.size}"], log)
        script, script_s = tune(out, "script", args.timeout,
                                ["--", *script_command(args.script, args.size, out)], log)
    settings = MeasureSettings(max_seconds=args.trial_seconds)
    plan = [("builtin winner, built-in loop", "builtin", builtin.config),
            ("script winner, HF script", "script", script.config),
            ("builtin winner, HF script", "script", builtin.config),
            ("script winner, built-in loop", "builtin", script.config)]
    rounds: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in plan}
    for r in range(args.rounds):
        for i, (label, path, config) in enumerate(plan):
            got = measure(path, config, args.size, out / "rounds" / f"{r}-{i}", settings,
                          args.script)
            rounds[label].append(got)
            if not args.json:
                rate = got["samples_per_sec"]
                print(f"round {r + 1}: {label:<30} "
                      + (f"{rate:.3f} samples/s" if rate else f"{got['status']}: "
                                                              f"{got['reason']}"), flush=True)
    medians = {label: statistics.median(g["samples_per_sec"] for g in got
                                        if g["samples_per_sec"]) if any(
        g["samples_per_sec"] for g in got) else None for label, got in rounds.items()}
    doc = {"size": args.size, "rounds": args.rounds, "out": str(out), "script_kind": args.script,
           "builtin": {"config": builtin.config.describe(),
                       "search_samples_per_sec": builtin.samples_per_sec,
                       "speedup": builtin.speedup, "study_s": builtin_s,
                       "trials": builtin.provenance.get("trials")},
           "script": {"config": script.config.describe(),
                      "search_samples_per_sec": script.samples_per_sec,
                      "speedup": script.speedup, "notes": script.notes, "study_s": script_s,
                      "trials": script.provenance.get("trials")},
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
    for name, p, seconds in (("built-in", builtin, builtin_s), ("script", script, script_s)):
        print(f"\n{name} study: {seconds / 60:.1f} min, {p.provenance.get('trials')} trials; "
              f"winner {p.config.describe()} ({p.samples_per_sec:.3f} samples/s, speedup "
              f"{p.speedup}x)", end="")
    print()
    for label, rate in medians.items():
        wall = statistics.median(g["wall_s"] for g in rounds[label])
        print(f"  {label:<30} median {rate:.3f} samples/s, trial wall {wall:.0f}s" if rate
              else f"  {label}: no result")
    for which, ratio in overheads.items():
        print(f"  {which} winner: built-in loop / HF script = {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
