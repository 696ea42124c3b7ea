"""How often the pick is the best config when single readings are noisy: the real tuner,
in-process, against a replayed BERT-like grid with injected noise, with and without trying the
changes the search left behind on one noisy reading (``tuner.stages.combination``), the
incumbent at the neighbouring batch its line read within the noise (``tuner.stages.neighbours``)
and measuring again a losing reading whose windows spread wide (``tuner.rereads``).

    python benchmarks/pick_noise.py --seeds 30
    python benchmarks/pick_noise.py --seeds 30 --sigma 0.06 --json
    python benchmarks/pick_noise.py --seeds 30 --stretch 0.1 --paired

The grid is modelled on a default BERT run on a 2-core Zen 4 (issue notes, docs/benchmarks.md):
fp32 1.32 samples/s at micro-batch 8, bf16 2.35; fused and foreach AdamW about alike (+17%),
eager attention +6% with the fused optimizer and +2% with foreach (so bf16 + fused + eager at
micro-batch 8 is the fastest config, foreach + eager 4% behind it, fused alone 6%); micro-batch
4, 16 and 32 slower by 10%, 3% and 7%; compiling costs 10%, checkpointing 20%, one CPU thread
40%; every other knob changes nothing.
Each trial reads its config's rate times a log-normal draw of --sigma (the process-to-process
noise of these VMs: 2-14%) with 2% window noise. Each seed runs a whole default-space study
(--trials trials and the interleaved confirmation) on a made-up 2-core CPU with native bf16;
the pick is the confirmed winner. With --stretch P, each trial is read in a slow stretch with
probability P: its three windows run at s, s + (1 - s) / 4 and s + (1 - s) / 2 of the rate, s
drawn from 0.6-0.85 (a Xeon run's trial read windows of 5.09, 5.33 and 6.08 samples/s where
the config runs at 7.1-7.5). Prints, for each mode, how often the pick is within 1% and
within 5% of the best config's rate, the pick's rate over the best's (median, worst), and the
trials spent.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import random
import statistics
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optuna  # noqa: E402
from rich.console import Console  # noqa: E402

from autotune.config.knobs import Config  # noqa: E402
from autotune.console import ConsoleReporter  # noqa: E402
from autotune.testing.hardware import fake_cpu  # noqa: E402
from autotune.testing.replay import Asked, ReplayMeasurer  # noqa: E402
from autotune.trial.measurement import Measurement, Status  # noqa: E402
from autotune.trial.protocol import WindowStats  # noqa: E402
from autotune.trial.result import Window  # noqa: E402
from autotune.trial.spec import MeasureSettings  # noqa: E402
from autotune.tuner import rereads, snapshot, stages  # noqa: E402
from autotune.tuner.runner import Runner, RunOptions  # noqa: E402

MICRO = {4: 0.90, 8: 1.0, 16: 0.97, 32: 0.93, 64: 0.85, 128: 0.75}
OPTIMIZER = {"fused": 1.17, "foreach": 1.168}
EAGER = {"fused": 1.06, "foreach": 1.02}


BEST = 2.35 * 1.17 * 1.06  # bf16, fused, eager, micro-batch 8
GIB = 2**30


def rate(c: Config) -> float:
    """The config's true samples/s in the modelled grid."""
    base = (2.35 if c.amp == "bf16" else 1.32) * MICRO.get(c.micro_batch_size, 0.7)
    base *= OPTIMIZER.get(c.optimizer_impl, 1.0)
    if c.attention == "eager":
        base *= EAGER.get(c.optimizer_impl, 1.0)
    if c.compile != "off":
        base *= 0.9
    if c.activation_checkpointing:
        base *= 0.8  # recomputes the forward
    if c.cpu_threads == 1:
        base *= 0.6  # one of the two cores
    return base / max(1, c.grad_accum_steps) ** 0.02


def replay(seed: int, sigma: float, stretch: float = 0.0,
           paired: bool = False) -> ReplayMeasurer:
    """Each trial reads the config's rate times this process's luck (log-normal, ``sigma``)
    and 2% window noise, with a 1% data wait (so the diagnosis reads it as compute-bound);
    with probability ``stretch`` its windows run through a slow stretch that is ending. With
    ``paired``, each ask draws from a stream of its own (the seed, the config, the how-many-th
    ask of it), so two modes read the same numbers for every config both ask for, instead of
    sharing one stream that an extra trial shifts for all that follow."""
    shared = random.Random(seed)

    def answer(asked: Asked) -> Measurement:
        rng = random.Random(zlib.crc32(f"{seed}|{asked.config}|{asked.nth}".encode())) \
            if paired else shared
        luck = math.exp(rng.gauss(0.0, sigma))
        slow = rng.uniform(0.6, 0.85) if stretch and rng.random() < stretch else 1.0
        rates = [rate(asked.config) * luck * (slow + (1.0 - slow) * i / 4)
                 * (1.0 + rng.gauss(0.0, 0.02)) for i in range(3)]
        windows = [cast(Window, {"samples": x, "seconds": 1.0, "data_wait_s": 0.01})
                   for x in rates]
        stats = WindowStats(windows)
        return Measurement(Status.OK, samples_per_sec=stats.median, spread_cv=stats.spread,
                           windows=windows, breakdown=stats.breakdown, peak_memory_bytes=GIB,
                           wall_s=30.0)

    return ReplayMeasurer(answer)


MODES = {"neither": (False, False, False), "combination": (True, False, False),
         "combination + neighbours": (True, True, False),
         "combination + neighbours + re-reads": (True, True, True)}


def one(seed: int, sigma: float, trials: int, mode: str, stretch: float,
        paired: bool = False) -> dict[str, Any]:
    """One study: its pick's true rate over the best's, its trials, its combination,
    neighbour and re-read trials."""
    stages.COMBINE, stages.NEIGHBOURS, rereads.REREAD = MODES[mode]
    measure = replay(seed, sigma, stretch, paired)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/s.db"
        opts = RunOptions(hardware=fake_cpu(bf16=True), trials=trials, seed=seed, probe=False,
                          storage=url, studies_dir=Path(tmp), trial_timeout_s=60.0,
                          measure=MeasureSettings(min_window_s=0.1, max_seconds=5.0))
        reporter = ConsoleReporter(Console(file=io.StringIO(), highlight=False, markup=False))
        summary = Runner(opts, reporter, measure=measure).run()
        study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
        snap = snapshot.read(study)
    pick = summary.best.config if summary.best is not None else Config()
    return {"seed": seed, "pick": pick.describe(), "ratio": rate(pick) / BEST,
            "trials": len(snap.measured),
            "combined": sum((r.stage or "").startswith("combination: ") for r in snap.records),
            "neighbours": sum((r.stage or "").startswith("neighbour: ") for r in snap.records),
            "rereads": sum(r.reread_of is not None for r in snap.records)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--sigma", type=float, default=0.05)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--stretch", type=float, default=0.0)
    parser.add_argument("--paired", action="store_true",
                        help="each ask of a config its own random stream (see replay)")
    parser.add_argument("--modes", nargs="*", choices=list(MODES), default=list(MODES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    logging.disable(logging.WARNING)
    doc: dict[str, Any] = {"sigma": args.sigma, "stretch": args.stretch, "trials": args.trials,
                           "paired": args.paired, "modes": {}}
    for mode in args.modes:
        runs = [one(s, args.sigma, args.trials, mode, args.stretch, args.paired)
                for s in range(args.seeds)]
        ratios = [r["ratio"] for r in runs]
        doc["modes"][mode] = {
            "within_1pct": sum(r >= 0.99 for r in ratios) / len(ratios),
            "within_5pct": sum(r >= 0.95 for r in ratios) / len(ratios),
            "median_ratio": statistics.median(ratios), "worst_ratio": min(ratios),
            "median_trials": statistics.median(r["trials"] for r in runs),
            "combination_trials": sum(r["combined"] for r in runs),
            "neighbour_trials": sum(r["neighbours"] for r in runs),
            "reread_trials": sum(r["rereads"] for r in runs),
            "picks": sorted({r["pick"] for r in runs})}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{args.seeds} seeds, noise {100 * args.sigma:.0f}% per trial, slow stretches in "
          f"{100 * args.stretch:.0f}% of trials, {args.trials} trials")
    for mode, m in doc["modes"].items():
        print(f"{mode}: pick within 1% of the best in {100 * m['within_1pct']:.0f}% of seeds, "
              f"within 5% in {100 * m['within_5pct']:.0f}%; pick/best median "
              f"{m['median_ratio']:.3f}, worst {m['worst_ratio']:.3f}; {m['median_trials']:g} "
              f"trials; {m['combination_trials']} combination, {m['neighbour_trials']} "
              f"neighbour and {m['reread_trials']} re-read trials in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
