"""Where steps take seconds and the budget is minutes: what does each strategy find in time?

    python benchmarks/slow_replay.py [--seeds 20] [--factor 20] [--json]    # seconds

The replay of ``search_efficiency.py`` counts trials; on a CPU where one BERT step takes 10-40 s,
trials are not the budget, minutes are, and a trial that cannot fit warm-up and its windows in
its measuring budget costs minutes and measures nothing. This replay slows the measured BERT
grid (``benchmarks/data/grid_bert.json``) down by ``--factor`` (20: steps of ~10-40 s, as BERT-base
on this project's 2-core CPUs) and charges each evaluation the time it would take:

  start-up      STARTUP_S (process start, imports, model build)
  measured      warm-up (the first step at 1.6x, then steps until two agree: 3 steps) and timed
                windows of max(1 s, one step) until the protocol's fewest (three; two where a
                step fills a window), within the measuring budget; fewer windows when the
                budget ends first (one window: spread unknown)
  too slow      warm-up and one window cannot fit the budget: start-up and the first step
  past limit    a config whose peak passes the memory limit: start-up and the first step

Strategies: ``autotune`` is this project's search on the grid's machine as its fingerprint
describes it (no native bf16 on the BERT grid's: the space is narrowed to fp32, as a run there
would narrow it), the step-time model sizing each trial's budget and ruling out what it knows
cannot fit, at no cost (configs the memory model rules out cost nothing either); the others
measure every config with the default 60 s budget (random, plain TPE, Lightning's largest
batch, accelerate's OOM halving). ``autotune+bf16`` is autotune told the machine has native
bf16 (as this replay assumed before it read the grid's fingerprint): it then searches bf16 too.
Each strategy's pick at T minutes is the best config it measured with at least two windows by
then (a one-window figure has no spread), judged by the table's true value. Reported per
strategy, median over seeds: regret at 4, 8 and 12 minutes of search, and the minutes spent on
evaluations that measured nothing (too slow, past the limit).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optuna  # noqa: E402

from autotune.config.knobs import Config  # noqa: E402
from autotune.console import QuietReporter  # noqa: E402
from autotune.testing.hardware import fake_cpu  # noqa: E402
from autotune.testing.replay import ReplayMeasurer  # noqa: E402
from autotune.trial.measurement import Measurement, median_and_cv  # noqa: E402
from autotune.trial.protocol import (  # noqa: E402
    measuring_seconds,
    steps_per_window,
    window_counts,
)
from autotune.trial.spec import MeasureSettings  # noqa: E402
from autotune.tuner.budget import MAX_BUDGET_SHARE  # noqa: E402
from autotune.tuner.runner import Runner, RunOptions  # noqa: E402
from benchmarks.search_efficiency import KEY, Table, _key  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
STARTUP_S = 15.0
TRIAL_TIMEOUT_S = 180.0
SEARCH_MINUTES = (4, 8, 12)
TRIALS = 30
DEFAULT = MeasureSettings()

# One evaluation: (config key, observed samples/s or None, windows, seconds it cost).
Eval = tuple[tuple[Any, ...], float | None, int, float]


class SlowTable:
    """The BERT grid with every step ``factor`` times longer; evaluations cost simulated time."""

    def __init__(self, doc: dict[str, Any], factor: float) -> None:
        self.table = Table(doc)
        self.factor = factor
        self.step_s: dict[tuple[Any, ...], float] = {}
        for key, r in self.table.rows.items():
            samples = Config.from_dict(r["config"]).samples_per_step
            if r.get("samples_per_sec"):
                self.step_s[key] = factor * samples / r["samples_per_sec"]
            else:  # too slow even unslowed: the step its trial reported
                found = re.search(r"takes ~([\d.]+)s", r.get("reason") or "")
                self.step_s[key] = factor * float(found.group(1)) if found else 1e9

    def true(self, key: tuple[Any, ...]) -> float:
        return self.table.true(key) / self.factor

    @property
    def optimum(self) -> float:
        return max(self.true(k) for k in self.table.rows)

    def measurable(self) -> tuple[tuple[Any, ...], float]:
        """The fastest config whose warm-up and two windows fit the longest measuring budget a
        trial can get (``MAX_BUDGET_SHARE`` of the trial timeout): the best any strategy here
        can confirm."""
        best = max((k for k in self.table.rows
                    if measuring_seconds(self.step_s[k], DEFAULT)
                    <= MAX_BUDGET_SHARE * TRIAL_TIMEOUT_S and self.true(k) > 0),
                   key=self.true)
        return best, self.true(best)

    def evaluate(self, key: tuple[Any, ...], settings: MeasureSettings,
                 rng: random.Random) -> tuple[Measurement, float]:
        """The measurement a trial of ``key`` would give under ``settings``, and its cost."""
        r, step = self.table.rows[key], self.step_s[key]
        if r["status"] == "ok" and r["peak_memory_bytes"] > self.table.limit:
            return Measurement("oom", "past the replay's memory limit",
                               peak_memory_bytes=r["peak_memory_bytes"],
                               wall_s=STARTUP_S + 1.6 * step), STARTUP_S + 1.6 * step
        warm = 3.6 * step
        window = max(settings.min_window_s, step)
        shared = 1 if step >= settings.min_window_s else 0  # warm-up's last step: window 1
        fit = int((settings.max_seconds - warm) // window) + shared
        if r["status"] != "ok" or fit < 1 or STARTUP_S + warm + window > TRIAL_TIMEOUT_S:
            cost = STARTUP_S + min(1.6 * step, TRIAL_TIMEOUT_S)
            return Measurement("timeout", f"one step takes ~{step:.1f}s", wall_s=cost,
                               rough_samples_per_sec=None), cost
        windows = min(fit, window_counts(steps_per_window(step, settings), settings)[0])
        base = self.true(key)
        run = math.exp(rng.gauss(0.0, self.table.run_sigma))
        cv = r["spread_cv"] or 0.02
        rates = [base * run * (1.0 + rng.gauss(0.0, cv)) for _ in range(windows)]
        med, spread = median_and_cv(rates)
        seconds = warm + (windows - shared) * window
        wall = STARTUP_S + seconds
        return Measurement(
            "ok", None, samples_per_sec=med, spread_cv=spread if windows > 1 else None,
            windows=[{"samples": x * window, "seconds": window, "steps": 1} for x in rates],
            peak_memory_bytes=r["peak_memory_bytes"], wall_s=wall,
            timings={"warmup_s": warm, "measure_s": windows * window}), wall


def native_bf16(doc: dict[str, Any]) -> bool:
    """Whether the grid's machine computes bf16 natively, as its hardware line says: where it
    does not, autotune narrows the space to fp32 (as a run on that machine would), while the
    other strategies sample every row of the grid."""
    return "no native bf16" not in str(doc.get("hardware", ""))


def run_autotune(table: SlowTable, seed: int, tmp: Path, bf16: bool | None = None) -> list[Eval]:
    doc = table.table.doc
    tmp.mkdir(parents=True, exist_ok=True)
    space = tmp / "space.yaml"
    space.write_text("knobs:\n" + "".join(
        f"  {name}: {{choices: {json.dumps(values)}}}\n" for name, values in doc["knobs"].items()))
    opts = RunOptions(model=doc["spec"], params=dict(doc["params"]), space=str(space),
                      storage=f"journal:///{tmp}/s{seed}.log", trials=TRIALS, seed=seed,
                      memory_limit=f"{table.table.limit}B", studies_dir=tmp,
                      out_dir=tmp / f"o{seed}", confirm_top=0, trial_timeout_s=TRIAL_TIMEOUT_S,
                      hardware=fake_cpu(cores=2, bf16=native_bf16(doc) if bf16 is None else bf16),
                      probe=False)
    # autotune's search, each trial's process replaced by the slowed table's evaluation; what
    # an evaluation cost is its measurement's wall time.
    rng = random.Random(seed)
    measure = ReplayMeasurer(lambda asked: table.evaluate(_key(asked.config), asked.settings,
                                                          rng)[0])
    Runner(opts, QuietReporter(), measure=measure).run()
    return [(_key(a.config), a.answer.samples_per_sec if a.answer.ok else None,
             len(a.answer.windows), a.answer.wall_s) for a in measure.asked]


def _fixed_budget(table: SlowTable, keys: list[tuple[Any, ...]], rng: random.Random,
                  ) -> list[Eval]:
    out = []
    for key in keys:
        m, cost = table.evaluate(key, DEFAULT, rng)
        out.append((key, m.samples_per_sec if m.ok else None, len(m.windows), cost))
    return out


def run_random(table: SlowTable, seed: int) -> list[Eval]:
    rng = random.Random(seed)
    keys = list(table.table.rows)
    rng.shuffle(keys)
    return _fixed_budget(table, keys[:TRIALS], rng)


def run_tpe(table: SlowTable, seed: int) -> list[Eval]:
    rng = random.Random(seed)
    log: list[Eval] = []

    def objective(trial: optuna.Trial) -> float:
        key = tuple(trial.suggest_categorical(k, table.table.doc["knobs"][k]) for k in KEY)
        (entry,) = _fixed_budget(table, [key], rng)
        log.append(entry)
        if entry[1] is None:
            raise RuntimeError("failed")
        return entry[1]

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=seed))
    study.optimize(objective, n_trials=TRIALS, catch=(RuntimeError,))
    return log


def run_largest_batch(table: SlowTable, seed: int) -> list[Eval]:
    """Lightning's power mode: double the batch until a config fails; the last that ran wins
    (ranked by batch size: its value is the batch)."""
    rng, log = random.Random(seed), []
    for micro in sorted(table.table.doc["knobs"]["micro_batch_size"]):
        (key, rate, windows, cost), = _fixed_budget(table, [(micro, 1, "off", 0)], rng)
        log.append((key, float(micro) if rate else None, windows, cost))
        if rate is None:
            break
    return log


def run_oom_halving(table: SlowTable, seed: int) -> list[Eval]:
    """accelerate's find_executable_batch_size: 128, halved until one runs."""
    rng, log = random.Random(seed), []
    micros = sorted(table.table.doc["knobs"]["micro_batch_size"], reverse=True)
    for micro in micros:
        (key, rate, windows, cost), = _fixed_budget(table, [(micro, 1, "off", 0)], rng)
        log.append((key, float(micro) if rate else None, windows, cost))
        if rate is not None:
            break
    return log


STRATEGIES: dict[str, Callable[[SlowTable, int], list[Eval]]] = {
    "random": run_random, "tpe": run_tpe, "largest_batch": run_largest_batch,
    "oom_halving": run_oom_halving}


def pick_at(table: SlowTable, log: list[Eval], seconds: float) -> float:
    """True samples/s of the best config measured with two or more windows within
    ``seconds`` of search (0 when none)."""
    spent, best_seen, pick = 0.0, -1.0, 0.0
    for key, observed, windows, cost in log:
        spent += cost
        if spent > seconds:
            break
        if observed is not None and windows >= 2 and observed > best_seen:
            best_seen, pick = observed, table.true(key)
    return pick


def _nothing_within(log: list[Eval], seconds: float) -> float:
    """Seconds of the first ``seconds`` of search spent on evaluations that measured
    nothing."""
    spent = nothing = 0.0
    for _, rate, _, cost in log:
        part = max(0.0, min(cost, seconds - spent))
        nothing += part if rate is None else 0.0
        spent += cost
    return nothing


def summarise(table: SlowTable, runs: list[list[Eval]]) -> dict[str, Any]:
    opt = table.optimum
    out: dict[str, Any] = {}
    for minutes in SEARCH_MINUTES:
        out[f"regret_at_{minutes}m"] = round(statistics.median(
            1.0 - pick_at(table, log, 60.0 * minutes) / opt for log in runs), 4)
    out["minutes_measuring_nothing"] = round(statistics.median(
        sum(cost for _, rate, _, cost in log if rate is None) / 60.0 for log in runs), 2)
    # The same within the budget the regrets are read at: a strategy that goes on measuring
    # past it (autotune runs until its trials end) is not charged for what comes after.
    last = 60.0 * SEARCH_MINUTES[-1]
    out[f"minutes_measuring_nothing_by_{SEARCH_MINUTES[-1]}m"] = round(statistics.median(
        _nothing_within(log, last) / 60.0 for log in runs), 2)
    out["evaluations"] = statistics.median(len(log) for log in runs)
    out["one_window_measurements"] = statistics.median(
        sum(1 for _, rate, w, _ in log if rate is not None and w < 2) for log in runs)
    return out


def replay(path: Path, factor: float, seeds: int) -> dict[str, Any]:
    table = SlowTable(copy.deepcopy(json.loads(path.read_text())), factor)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["autotune"] = summarise(table, [run_autotune(table, s, Path(tmp) / str(s))
                                                for s in range(seeds)])
        if not native_bf16(table.table.doc):
            # As this replay ran before it read the grid's fingerprint: bf16 searched too.
            results["autotune+bf16"] = summarise(table, [
                run_autotune(table, s, Path(tmp) / f"b{s}", bf16=True) for s in range(seeds)])
    for name, fn in STRATEGIES.items():
        results[name] = summarise(table, [fn(table, s) for s in range(seeds)])
    steps = sorted(v for v in table.step_s.values() if v < 1e8)
    reachable, rate = table.measurable()
    return {"grid": path.name, "factor": factor,
            "optimum_samples_per_sec": round(table.optimum, 4),
            "optimum_config": list(max(table.table.rows, key=table.true)),
            "measurable_optimum": {"config": list(reachable), "samples_per_sec": round(rate, 4),
                                   "regret": round(1.0 - rate / table.optimum, 4)},
            "step_s_range": [round(steps[0], 1), round(steps[-1], 1)], "seeds": seeds,
            "strategies": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=Path, default=DATA / "grid_bert.json")
    parser.add_argument("--factor", type=float, default=20.0)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = replay(args.grid, args.factor, args.seeds)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"\n{report['grid']} slowed {report['factor']:g}x: steps of {report['step_s_range'][0]}"
          f"-{report['step_s_range'][1]} s, optimum {report['optimum_samples_per_sec']:.3f} "
          f"samples/s ({report['optimum_config']}), {report['seeds']} seeds; a pick needs two "
          "or more windows")
    best = report["measurable_optimum"]
    print(f"  the fastest config whose warm-up and two windows fit a {TRIAL_TIMEOUT_S:.0f}s trial "
          f"timeout: {best['config']}, {best['samples_per_sec']:.3f} samples/s (regret "
          f"{100 * best['regret']:.1f}%: no strategy can confirm better)")
    last = SEARCH_MINUTES[-1]
    print(f"  {'strategy':<14}" + "".join(f"{'regret@' + str(m) + 'm':>12}"
                                          for m in SEARCH_MINUTES)
          + f"{'min. measuring nothing':>24}{f'of it by {last}m':>14}{'one-window':>12}"
          f"{'evaluations':>13}")
    for name, s in report["strategies"].items():
        print(f"  {name:<14}" + "".join(f"{100 * s[f'regret_at_{m}m']:>11.1f}%"
                                        for m in SEARCH_MINUTES)
              + f"{s['minutes_measuring_nothing']:>24}"
              f"{s[f'minutes_measuring_nothing_by_{last}m']:>14}"
              f"{s['one_window_measurements']:>12}{s['evaluations']:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
