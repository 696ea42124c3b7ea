"""How many trials does each search strategy need to find the fastest config? A replay benchmark.

    python benchmarks/search_efficiency.py measure --workload mlp   # once per machine (minutes)
    python benchmarks/search_efficiency.py measure --workload bert
    python benchmarks/search_efficiency.py replay [--json]          # seconds

``measure`` runs every config of a reduced space (the grid) as a real trial on this machine and
keeps the table, with the machine's fingerprint, under ``benchmarks/data/``. A second pass measures
a sample of configs again in fresh processes: the between-run noise the replay draws from.

``replay`` runs each strategy against the table, 20 seeds each, the same budget of trials for all:
an evaluation returns the config's measured samples/sec with noise drawn from its recorded spread;
a config whose measured peak is above the replay's memory limit is an OOM. Strategies:

  autotune       this project's own search (staged largest-fit per precision, memory model,
                 multivariate TPE, in-trial pruning, early stop): the real ``Runner``, each
                 trial answered by the replay measurer (``autotune.testing.replay``)
  random         uniform random configs from the grid, without repeats
  tpe            plain Optuna TPE (default settings) on the same space
  largest_batch  Lightning's batch-size finder, power mode: double from the grid's smallest batch
                 until OOM, keep the last batch that fit (other knobs at their defaults)
  oom_halving    Hugging Face / accelerate: start at 128, halve on OOM, keep the first that fits

Each reports ``median_trials_to_2pct`` (evaluations until its pick is within 2% of the grid's true
optimum and stays there; null when the median seed never gets there; the same for 5%) and
``regret_at_N`` (how far its pick after N evaluations is below the optimum, median over seeds). A
strategy's pick is the config it would export: the best it observed (noisy; the batch finders
rank by batch size), judged by the table's measured value. autotune's confirmation is left out:
it re-measures, so it would spend evaluations the others do not get.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optuna  # noqa: E402

from autotune.config.knobs import Config  # noqa: E402
from autotune.console import QuietReporter  # noqa: E402
from autotune.machine.hardware import detect  # noqa: E402
from autotune.testing.hardware import fake_cpu  # noqa: E402
from autotune.testing.replay import Grid  # noqa: E402
from autotune.trial.launch import execute, plan  # noqa: E402
from autotune.trial.measurement import Measurement, classify  # noqa: E402
from autotune.trial.spec import MeasureSettings, TrialSpec  # noqa: E402
from autotune.tuner.runner import Runner, RunOptions  # noqa: E402
from autotune.workloads import WorkloadSpec  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"

# The reduced spaces. Every combination is measured; bf16 runs on every CPU (emulated where the
# CPU has no native bf16, so there it is a knob that hurts: a trap the search must avoid).
GRIDS: dict[str, dict[str, Any]] = {
    "mlp": {
        "spec": "mlp", "params": {},
        "knobs": {"micro_batch_size": [16, 32, 64, 128, 256, 512, 1024, 2048],
                  "grad_accum_steps": [1, 2], "amp": ["off", "bf16"], "num_workers": [0, 1, 2]},
        "measure": {"max_seconds": 20.0},
        # On CPU, memory hardly moves with this model's batch (0.31-0.45 GiB, most of it torch
        # itself): the replay keeps the machine's default limit, where everything fits.
        "replay_limit_gib": None,
    },
    "bert": {
        "spec": "bert", "params": {"size": "tiny", "seq_len": 128},
        "knobs": {"micro_batch_size": [4, 8, 16, 32, 64, 128],
                  "grad_accum_steps": [1, 2], "amp": ["off", "bf16"], "num_workers": [0, 1, 2]},
        "measure": {"max_seconds": 20.0},
        # Activations grow with the batch here (0.7 GiB at 4, 6.7 GiB at 128 in fp32): the replay
        # puts a 4 GiB wall between 64 and 128, as a small accelerator would.
        "replay_limit_gib": 4.0,
    },
}
REPEATS = 12  # configs measured a second time, for the between-run noise


def grid_configs(grid: dict[str, Any]) -> list[Config]:
    names = list(grid["knobs"])
    configs = []
    for values in itertools.product(*(grid["knobs"][n] for n in names)):
        c = dict(zip(names, values, strict=True))
        if c.get("num_workers"):
            c["prefetch_factor"] = 2
        configs.append(Config.from_dict(c))
    return configs


def _measure_one(grid: dict[str, Any], config: Config, device: str, tmp: Path) -> dict[str, Any]:
    p = plan(TrialSpec(WorkloadSpec(grid["spec"], grid["params"]), config, device=device,
                       measure=MeasureSettings.from_dict(grid["measure"])),
             workdir=tmp, timeout_s=180)
    m = classify(execute(p), device)
    return {"status": m.status, "reason": m.reason, "samples_per_sec": m.samples_per_sec,
            "spread_cv": m.spread_cv, "peak_memory_bytes": m.peak_memory_bytes,
            "wall_s": round(m.wall_s, 2),
            "window_rates": [w["samples"] / w["seconds"] for w in m.windows]}


def measure(workload: str, out: Path) -> int:
    grid = GRIDS[workload]
    hw = detect()
    doc: dict[str, Any] = {"workload": workload, "spec": grid["spec"], "params": grid["params"],
                           "knobs": grid["knobs"], "measure": grid["measure"],
                           "fingerprint": hw.fingerprint(), "hardware": hw.describe(),
                           "rows": [], "repeats": []}
    if out.exists():  # resume: a crash or Ctrl-C loses at most the running config
        doc = json.loads(out.read_text())
    done = {json.dumps(r["config"], sort_keys=True) for r in doc["rows"]}
    configs = grid_configs(grid)
    random.Random(0).shuffle(configs)  # drift over the hours must not line up with a knob
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(configs):
            key = json.dumps(config.to_dict(), sort_keys=True)
            if key in done:
                continue
            row = {"config": config.to_dict(),
                   **_measure_one(grid, config, hw.device, Path(tmp) / f"{i:03d}")}
            doc["rows"].append(row)
            out.write_text(json.dumps(doc, indent=1))
            print(f"[{len(doc['rows'])}/{len(configs)} {time.monotonic() - start:.0f}s] "
                  f"{_short(config)}: {row['status']} {row['samples_per_sec'] or 0:.1f} samples/s",
                  flush=True)
        ok = [r for r in doc["rows"] if r["status"] == "ok"]
        sample = random.Random(1).sample(ok, min(REPEATS, len(ok)))
        for j, row in enumerate(sample[len(doc["repeats"]):]):
            again = _measure_one(grid, Config.from_dict(row["config"]), hw.device,
                                 Path(tmp) / f"r{j:03d}")
            doc["repeats"].append({"config": row["config"], **again})
            out.write_text(json.dumps(doc, indent=1))
            print(f"[repeat {len(doc['repeats'])}/{len(sample)}] "
                  f"{_short(Config.from_dict(row['config']))}: {row['samples_per_sec']:.1f} "
                  f"then {again['samples_per_sec'] or 0:.1f}", flush=True)
    print(f"wrote {out}")
    return 0


def _short(config: Config) -> str:
    return (f"micro {config.micro_batch_size} accum {config.grad_accum_steps} amp {config.amp} "
            f"workers {config.num_workers}")


# -- replay ---------------------------------------------------------------------------------------

KEY = ("micro_batch_size", "grad_accum_steps", "amp", "num_workers")
SEEDS = 20
BUDGET = 30
CHECKPOINTS = (10, 20, 30)


def _key(config: dict[str, Any] | Config) -> tuple[Any, ...]:
    data = config.to_dict() if isinstance(config, Config) else config
    return tuple(data[k] for k in KEY)


class Table(Grid):
    """A measured grid as an oracle (``autotune.testing.replay.Grid``): true values, and noisy
    evaluations drawn from the spread, under the replay's memory limit."""

    def __init__(self, doc: dict[str, Any]) -> None:
        gib = GRIDS[doc["workload"]].get("replay_limit_gib")
        # Without a wall of its own, the limit autotune would use here: 80% of the free RAM.
        super().__init__(doc, int(gib * 2**30) if gib else
                         int(0.8 * fake_cpu().memory_available_bytes), KEY)


def run_autotune(table: Table, seed: int, tmp: Path) -> list[tuple[tuple[Any, ...], float | None]]:
    """autotune's own search loop, each trial's process replaced by an evaluation of the
    table (the replay measurer, seeded)."""
    doc = table.doc
    tmp.mkdir(parents=True, exist_ok=True)
    space = tmp / "space.yaml"
    space.write_text("knobs:\n" + "".join(
        f"  {name}: {{choices: {json.dumps(values)}}}\n" for name, values in doc["knobs"].items()))
    # A journal file, not SQLite: the same study and decisions, without a disk commit for each
    # of the thousands of writes a run makes (SQLite took most of the replay's time).
    opts = RunOptions(model=doc["spec"], params=dict(doc["params"]), space=str(space),
                      storage=f"journal:///{tmp}/s{seed}.log", trials=BUDGET, seed=seed,
                      memory_limit=f"{table.limit}B", studies_dir=tmp, out_dir=tmp / f"o{seed}",
                      confirm_top=0, hardware=fake_cpu(cores=2, bf16=True), probe=False)
    measure = table.measurer(seed)
    Runner(opts, QuietReporter(), measure=measure).run()
    return [(_key(a.config), a.answer.samples_per_sec if a.answer.ok else None)
            for a in measure.asked]


def run_random(table: Table, seed: int) -> list[tuple[tuple[Any, ...], float | None]]:
    rng = random.Random(seed)
    keys = list(table.rows)
    rng.shuffle(keys)
    return [(k, _observed(table.evaluate(k, rng))) for k in keys[:BUDGET]]


def run_tpe(table: Table, seed: int) -> list[tuple[tuple[Any, ...], float | None]]:
    rng = random.Random(seed)
    log: list[tuple[tuple[Any, ...], float | None]] = []

    def objective(trial: optuna.Trial) -> float:
        key = tuple(trial.suggest_categorical(k, table.doc["knobs"][k]) for k in KEY)
        value = _observed(table.evaluate(key, rng))
        log.append((key, value))
        if value is None:
            raise RuntimeError("failed")  # OOM or error: a failed trial, as a user would see it
        return value

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are expected here
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=seed))
    study.optimize(objective, n_trials=BUDGET, catch=(RuntimeError,))
    return log


def _baseline_line(table: Table, micro: int) -> tuple[Any, ...]:
    """The batch finders change only the batch: fp32, no accumulation, no loader workers."""
    return (micro, 1, "off", 0)


def run_largest_batch(table: Table, seed: int) -> list[tuple[tuple[Any, ...], float | None]]:
    """Lightning's power mode: double until OOM; the last batch that fit is the answer."""
    rng = random.Random(seed)
    micros = sorted(table.doc["knobs"]["micro_batch_size"])
    log: list[tuple[tuple[Any, ...], float | None]] = []
    for micro in micros:
        m = table.evaluate(_baseline_line(table, micro), rng)
        # It ranks by batch size: the largest batch that fit is its answer, not the fastest.
        log.append((_baseline_line(table, micro), float(micro) if m.ok else None))
        if not m.ok:
            return log
    return log


def run_oom_halving(table: Table, seed: int) -> list[tuple[tuple[Any, ...], float | None]]:
    """accelerate's find_executable_batch_size: start at 128, halve on OOM, keep the first
    that runs."""
    rng = random.Random(seed)
    micros = sorted(table.doc["knobs"]["micro_batch_size"])
    micro = max([m for m in micros if m <= 128], default=micros[0])
    log: list[tuple[tuple[Any, ...], float | None]] = []
    while True:
        m = table.evaluate(_baseline_line(table, micro), rng)
        log.append((_baseline_line(table, micro), float(micro) if m.ok else None))
        smaller = [x for x in micros if x <= micro // 2]
        if m.ok or not smaller:
            return log
        micro = smaller[-1]


def _observed(m: Measurement) -> float | None:
    return m.samples_per_sec if m.ok else None


STRATEGIES: dict[str, Callable[..., list[tuple[tuple[Any, ...], float | None]]]] = {
    "random": run_random, "tpe": run_tpe, "largest_batch": run_largest_batch,
    "oom_halving": run_oom_halving}


Log = list[tuple[tuple[Any, ...], float | None]]


def picks(table: Table, log: Log) -> list[float]:
    """True value of the strategy's pick after each of BUDGET evaluations: the config it ranks
    first so far (by observed samples/sec; the batch finders by batch size), judged by the
    table. A strategy that stopped keeps its last pick."""
    best_seen, pick, out = -1.0, 0.0, []
    for key, observed in log[:BUDGET]:
        if observed is not None and observed > best_seen:
            best_seen, pick = observed, table.true(key)
        out.append(pick)
    return out + [pick] * (BUDGET - len(out))


def summarise(table: Table, runs: list[Log]) -> dict[str, Any]:
    opt = table.optimum
    curves = [picks(table, log) for log in runs]
    def median_reach(share: float) -> tuple[int | None, int]:
        # The evaluations after which the pick is within the share of the optimum and stays
        # there for the rest of the budget (a finder whose pick moves away has not reached it).
        reach = [next((i + 1 for i in range(BUDGET) if min(c[i:]) >= share * opt), None)
                 for c in curves]
        reached = sorted(r for r in reach if r is not None)
        return (reached[len(reach) // 2] if len(reached) > len(reach) // 2 else None,
                len(reached))

    to_2, within_2 = median_reach(0.98)
    to_5, within_5 = median_reach(0.95)
    out: dict[str, Any] = {"median_trials_to_2pct": to_2, "seeds_within_2pct": within_2,
                           "median_trials_to_5pct": to_5, "seeds_within_5pct": within_5,
                           "seeds": len(runs),
                           "median_evaluations": statistics.median(min(len(r), BUDGET)
                                                                   for r in runs)}
    for n in CHECKPOINTS:
        out[f"regret_at_{n}"] = round(statistics.median(1.0 - c[n - 1] / opt for c in curves), 4)
    return out


def replay(paths: list[Path], seeds: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for path in paths:
        table = Table(json.loads(path.read_text()))
        results: dict[str, Any] = {}
        with tempfile.TemporaryDirectory() as tmp:
            results["autotune"] = summarise(table, [
                run_autotune(table, seed, Path(tmp) / str(seed)) for seed in range(seeds)])
        for name, fn in STRATEGIES.items():
            results[name] = summarise(table, [fn(table, seed) for seed in range(seeds)])
        grid = len(table.rows)
        report[table.doc["workload"]] = {
            "grid_size": grid, "optimum_samples_per_sec": table.optimum,
            "memory_limit_bytes": table.limit, "between_run_sigma": round(table.run_sigma, 4),
            "goal_trials": math.ceil(0.15 * grid), "fingerprint": table.doc["fingerprint"],
            "strategies": results}
    return report


def _print(report: dict[str, Any]) -> None:
    for workload, r in report.items():
        print(f"\n{workload}: grid of {r['grid_size']} configs, optimum "
              f"{r['optimum_samples_per_sec']:,.1f} samples/s, replay memory limit "
              f"{r['memory_limit_bytes'] / 2**30:.2f} GiB, between-run noise "
              f"{100 * r['between_run_sigma']:.1f}%; goal: within 2% in <= {r['goal_trials']} "
              "trials")
        print(f"  {'strategy':<14} {'trials to 2%':>12} {'seeds in 2%':>11} {'trials to 5%':>12} "
              f"{'seeds in 5%':>11} " + " ".join(f"{'regret@' + str(n):>10}" for n in CHECKPOINTS)
              + f" {'evaluations':>11}")
        for name, s in r["strategies"].items():
            to_2 = "-" if s["median_trials_to_2pct"] is None else str(s["median_trials_to_2pct"])
            to_5 = "-" if s["median_trials_to_5pct"] is None else str(s["median_trials_to_5pct"])
            print(f"  {name:<14} {to_2:>12} {s['seeds_within_2pct']:>5}/{s['seeds']:<5} "
                  f"{to_5:>12} {s['seeds_within_5pct']:>5}/{s['seeds']:<5} "
                  + " ".join(f"{100 * s[f'regret_at_{n}']:>9.1f}%" for n in CHECKPOINTS)
                  + f" {s['median_evaluations']:>11}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="measure the full grid of one workload on this machine")
    m.add_argument("--workload", choices=sorted(GRIDS), required=True)
    m.add_argument("--out", type=Path)
    r = sub.add_parser("replay", help="replay every strategy against the measured grids")
    r.add_argument("grids", nargs="*", type=Path)
    r.add_argument("--seeds", type=int, default=SEEDS)
    r.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    if args.command == "measure":
        return measure(args.workload, args.out or DATA / f"grid_{args.workload}.json")
    paths = args.grids or sorted(DATA.glob("grid_*.json"))
    report = replay(paths, args.seeds)
    if args.json:
        # The first workload's table is the document's top level; all of them under "workloads".
        first = next(iter(report.values()))
        print(json.dumps({"grid_size": first["grid_size"], "strategies": first["strategies"],
                          "workloads": report}, indent=1))
    else:
        _print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
