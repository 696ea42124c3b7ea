"""An independent check of a profile's claim: its config and its baseline, interleaved.

    python benchmarks/winner_vs_baseline.py studies/<study>/profile.yaml --rounds 3
    python benchmarks/winner_vs_baseline.py profile.yaml --against old-knobs
    python benchmarks/winner_vs_baseline.py profile.yaml --measured --rounds 2 \
        --config amp=bf16,optimizer_impl=fused,micro_batch_size=8 \
        --config amp=bf16,optimizer_impl=fused,micro_batch_size=16

``--measured`` adds every distinct config the profile's study measured ok (read from the storage
its provenance names; ``--measured-top N``: the N fastest by their search trials), ``--config``
named configs (knob=value over the baseline's config, repeatable): all of them run in every round
beside the two, and the end says where the profile's config stands against the fastest of them (its
median over the fastest median).

``--against old-knobs`` compares the profile's config with the same config whose model and
process knobs (compile, optimizer_impl, matmul_precision, attention, activation_checkpointing,
cpu_threads, malloc_retain) are at their baseline: what the winner owes to those knobs alone.

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

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.config.knobs import Config  # noqa: E402
from autotune.machine.hardware import detect  # noqa: E402
from autotune.profile import Profile, load_profile  # noqa: E402
from autotune.trial.launch import execute, plan  # noqa: E402
from autotune.trial.measurement import classify  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.workloads import WorkloadSpec  # noqa: E402

MODEL_KNOBS = ("compile", "optimizer_impl", "matmul_precision", "attention",
               "activation_checkpointing", "cpu_threads", "malloc_retain")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trial-seconds", type=float, default=MeasureSettings().max_seconds)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--against", choices=("baseline", "old-knobs"), default="baseline")
    parser.add_argument("--measured", action="store_true",
                        help="also every distinct config the profile's study measured ok")
    parser.add_argument("--measured-top", type=int, default=None, metavar="N",
                        help="with --measured: only the N fastest by their search trials")
    parser.add_argument("--config", action="append", default=[], metavar="KNOB=VALUE,...",
                        help="also this config (knobs over the baseline's), repeatable")
    parser.add_argument("--storage", help="the study's storage, when not where the profile's "
                        "provenance says (a relative SQLite path read from elsewhere)")
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
    for config in (measured(profile, args.storage)[:args.measured_top] if args.measured
                   else []) + [
            named(text, against) for text in args.config]:
        if config not in configs.values():
            configs[config.describe()] = config
    settings = MeasureSettings(max_seconds=args.trial_seconds)
    rates: dict[str, list[float]] = {name: [] for name in configs}
    dropped: dict[str, str] = {}  # a re-checked config that could not be measured: why
    with tempfile.TemporaryDirectory() as tmp:
        # One compile cache for the rounds, as in a study: compiling is outside the windows.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tmp) / "compile-cache"))
        for r in range(args.rounds):
            for name, config in configs.items():
                if name in dropped:
                    continue
                spec = TrialSpec(workload, config, hw.device, settings,
                                 memory_limit_bytes=profile.result.get("memory_limit_bytes"))
                m = classify(execute(plan(spec, workdir=Path(tmp) / f"{r}-{name}",
                                          timeout_s=3 * args.trial_seconds + 60)), hw.device)
                if not m.ok or not m.samples_per_sec:
                    print(f"round {r + 1} {name}: {m.status}: {m.reason}", file=sys.stderr)
                    if name in ("baseline", "profile"):
                        return 1  # the comparison this benchmark exists for cannot be made
                    dropped[name] = f"{m.status}: {m.reason}"  # out of the later rounds
                    rates.pop(name, None)
                    continue
                rates[name].append(m.samples_per_sec)
                if not args.json:
                    label = name if name == config.describe() else \
                        f"{name:<8} {config.describe():<40}"
                    print(f"round {r + 1} {label} {m.samples_per_sec:8.3f} samples/s "
                          f"({len(m.windows)} windows)", flush=True)
    if len(rates) > 2 or dropped:
        medians = {name: statistics.median(r) for name, r in rates.items()}
        fastest = max(medians, key=lambda n: medians[n])
        for name in sorted(medians, key=lambda n: -medians[n]):
            if not args.json:
                print(f"  {name:<48} median {medians[name]:8.3f} samples/s "
                      f"({medians[name] / medians['profile']:.3f}x the profile's)")
        if not args.json:
            for name, why in dropped.items():
                print(f"  {name:<48} not measured within --trial-seconds ({why})")
            print(f"the profile's config is at {medians['profile'] / medians[fastest]:.3f}x the "
                  f"fastest of {len(medians)} configs measured ({fastest})")
    ratios = [w / b for w, b in zip(rates["profile"], rates["baseline"], strict=True)]
    median = statistics.median(ratios)
    spread = statistics.stdev(ratios) / statistics.fmean(ratios) if len(ratios) > 1 else None
    doc = {"profile": str(args.profile), "hardware": hw.describe(), "rounds": args.rounds,
           "against": args.against, "against_config": against.describe(),
           "samples_per_sec": rates, "ratios": [round(x, 4) for x in ratios],
           "median_ratio": round(median, 4),
           "ratio_spread_cv": None if spread is None else round(spread, 4),
           "profile_speedup": profile.speedup,
           "configs": {name: c.to_dict() for name, c in configs.items()},
           "not_measured": dropped,
           "profile_vs_fastest": round(statistics.median(rates["profile"]) / max(
               statistics.median(r) for r in rates.values()), 4)}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"per-round ratios {', '.join(f'{x:.3f}' for x in ratios)}; median "
              f"{median:.3f}x" + ("" if spread is None else f", spread {100 * spread:.1f}%")
              + (f"; the profile claims {profile.speedup}" if args.against == "baseline"
                 else f" over the same config without the model knobs ({against.describe()})"))
    return 0


def measured(profile: Profile, url: str | None = None) -> list[Config]:
    """Every distinct config the profile's study measured ok, fastest trial first."""
    from autotune.tuner import snapshot, storage

    where = profile.provenance
    study = optuna.load_study(study_name=where["study"],
                              storage=storage.open_storage(url or str(where["storage"])))
    snap = snapshot.read(study)
    return [r.config for r in snap.ok_within_limit()]


def named(text: str, base: Config) -> Config:
    """``knob=value,...`` over ``base``, each value checked by the knob registry."""
    values = base.to_dict()
    for part in text.split(","):
        name, _, value = (x.strip() for x in part.partition("="))
        values[name] = int(value) if value.isdigit() else \
            {"true": True, "false": False}.get(value, value)
    if values["num_workers"] and values["prefetch_factor"] is None:
        values["prefetch_factor"] = 2  # DataLoader's default with workers, as the search sets it
    return Config.from_dict(values)


if __name__ == "__main__":
    sys.exit(main())
