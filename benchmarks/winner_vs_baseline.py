"""An independent check of a profile's claim: its config and its baseline, interleaved.

    python benchmarks/winner_vs_baseline.py studies/<study>/profile.yaml --rounds 3
    python benchmarks/winner_vs_baseline.py profile.yaml --against old-knobs

``--against old-knobs`` compares the profile's config with the same config whose model and
process knobs (compile, optimizer_impl, matmul_precision, attention, activation_checkpointing,
cpu_threads) are at their baseline: what the winner owes to those knobs alone.

Each round runs the baseline's config and the profile's config, each in a fresh trial process
(B W B W ...), measured with the search's default settings (not the confirmation's), so the
check shares nothing with the run that made the claim but the machine. Prints each round's
samples/sec, the per-round ratio, and the median ratio with its spread (CV of the per-round
ratios). --json prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.config.knobs import Config  # noqa: E402
from autotune.machine.hardware import detect  # noqa: E402
from autotune.profile import load_profile  # noqa: E402
from autotune.trial.launch import execute, plan  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.workloads import WorkloadSpec  # noqa: E402

MODEL_KNOBS = ("compile", "optimizer_impl", "matmul_precision", "attention",
               "activation_checkpointing", "cpu_threads")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trial-seconds", type=float, default=MeasureSettings().max_seconds)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--against", choices=("baseline", "old-knobs"), default="baseline")
    args = parser.parse_args()

    profile = load_profile(args.profile)
    if not profile.baseline.get("config"):
        print("the profile has no baseline to compare with", file=sys.stderr)
        return 2
    hw = detect()
    workload = WorkloadSpec(profile.workload.get("spec") or profile.workload["name"],
                            dict(profile.workload.get("params") or {}))
    against = Config.from_dict(profile.baseline["config"]) if args.against == "baseline" else \
        replace(profile.config, **{k: getattr(Config(), k) for k in MODEL_KNOBS})
    configs = {"baseline": against, "profile": profile.config}
    settings = MeasureSettings(max_seconds=args.trial_seconds)
    rates: dict[str, list[float]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        # One compile cache for the rounds, as in a study: compiling is outside the windows.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tmp) / "compile-cache"))
        for r in range(args.rounds):
            for name, config in configs.items():
                spec = TrialSpec(workload, config, hw.device, settings,
                                 memory_limit_bytes=profile.result.get("memory_limit_bytes"))
                m = classify(execute(plan(spec, workdir=Path(tmp) / f"{r}-{name}",
                                          timeout_s=3 * args.trial_seconds + 60)), hw.device)
                if not m.ok or not m.samples_per_sec:
                    print(f"round {r + 1} {name}: {m.status}: {m.reason}", file=sys.stderr)
                    return 1
                rates[name].append(m.samples_per_sec)
                if not args.json:
                    print(f"round {r + 1} {name:<8} {config.describe():<40} "
                          f"{m.samples_per_sec:8.3f} samples/s ({len(m.windows)} windows)",
                          flush=True)
    ratios = [w / b for w, b in zip(rates["profile"], rates["baseline"], strict=True)]
    median = statistics.median(ratios)
    spread = statistics.stdev(ratios) / statistics.fmean(ratios) if len(ratios) > 1 else None
    doc = {"profile": str(args.profile), "hardware": hw.describe(), "rounds": args.rounds,
           "against": args.against, "against_config": against.describe(),
           "samples_per_sec": rates, "ratios": [round(x, 4) for x in ratios],
           "median_ratio": round(median, 4),
           "ratio_spread_cv": None if spread is None else round(spread, 4),
           "profile_speedup": profile.speedup}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"per-round ratios {', '.join(f'{x:.3f}' for x in ratios)}; median "
              f"{median:.3f}x" + ("" if spread is None else f", spread {100 * spread:.1f}%")
              + (f"; the profile claims {profile.speedup}" if args.against == "baseline"
                 else f" over the same config without the model knobs ({against.describe()})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
