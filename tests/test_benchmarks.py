"""The search benchmark replays the committed grids (seconds) and reports every strategy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.config.knobs import Config
from tests.conftest import ROOT


def test_search_benchmark_replays_the_measured_grid() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "search_efficiency.py"), "replay",
         str(ROOT / "benchmarks" / "data" / "grid_mlp.json"), "--seeds", "2", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["grid_size"] == 96
    assert set(report["strategies"]) == {"autotune", "random", "tpe", "largest_batch",
                                         "oom_halving"}
    for name, s in report["strategies"].items():
        assert s["seeds"] == 2, name
        for n in (10, 20, 30):
            assert 0.0 <= s[f"regret_at_{n}"] <= 1.0, (name, n)
        reach = s["median_trials_to_2pct"]
        assert reach is None or 1 <= reach <= 30
    # Every measured row is a real trial outcome on this grid's machine.
    grid = json.loads((ROOT / "benchmarks" / "data" / "grid_mlp.json").read_text())
    assert grid["fingerprint"] and len(grid["rows"]) == 96 and len(grid["repeats"]) == 12


def test_slow_replay_charges_time_and_reports_every_strategy() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "slow_replay.py"), "--seeds", "1", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    # The grid's machine has no native bf16: autotune narrows it out, as a run there would;
    # the row searching bf16 anyway is kept beside it.
    assert set(report["strategies"]) == {"autotune", "autotune+bf16", "random", "tpe",
                                         "largest_batch", "oom_halving"}
    assert 1.0 <= report["step_s_range"][0] < report["step_s_range"][1]
    assert 0.0 <= report["measurable_optimum"]["regret"] < 1.0
    for name, s in report["strategies"].items():
        for minutes in (4, 8, 12):
            assert 0.0 <= s[f"regret_at_{minutes}m"] <= 1.0, (name, minutes)
        assert s["minutes_measuring_nothing"] >= 0.0 and s["evaluations"] >= 1


@pytest.mark.slow  # real trial processes
def test_winner_vs_baseline_runs_both_interleaved_and_reports_the_ratio(tuned_mlp: Path) -> None:
    # One call: the profile and its baseline, the study's measured configs and a named one, in
    # every one of two rounds.
    storage = f"sqlite:///{tuned_mlp.parent.parent.parent / 'studies' / 'autotune.db'}"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "winner_vs_baseline.py"), str(tuned_mlp),
         "--rounds", "2", "--trial-seconds", "1", "--json", "--measured", "--measured-top", "1",
         "--storage", storage, "--config", "micro_batch_size=8,num_workers=1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    rates = doc["samples_per_sec"]
    assert len(rates["baseline"]) == len(rates["profile"]) == 2
    assert doc["ratios"] == [round(w / b, 4) for w, b in zip(rates["profile"],
                                                            rates["baseline"], strict=True)]
    assert doc["ratio_spread_cv"] is not None and doc["median_ratio"] > 0
    named = Config.from_dict(doc["configs"]["batch 8x1, fp32, workers 1, prefetch 2"])
    assert (named.micro_batch_size, named.num_workers) == (8, 1)
    assert len(doc["configs"]) >= 3 and all(len(r) == 2 for r in rates.values())
    assert 0 < doc["profile_vs_fastest"] <= 1.0


@pytest.mark.slow  # real trial processes, three of them compiling
def test_compile_cache_benchmark_times_cold_and_warm_compiles(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_cache.py"), "--model",
         "autotune.testing.workloads:tiny", "--micro", "4", "--trial-seconds", "1", "--json"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    eager, cold, warm, larger = doc["trials"]
    assert eager["compile_step_s"] is None and eager["compile_s"] is None
    for compiled in (cold, warm, larger):
        assert compiled["compile_step_s"] > 0 and compiled["compile_s"] is not None
    assert "micro 8" in larger["trial"] and larger["config"].startswith("batch 8x1")
    assert doc["cache_saves_s"] == round(cold["compile_step_s"] - warm["compile_step_s"], 2)


def test_trial_step_benchmark_times_every_kind_of_step_in_one_process() -> None:
    """The trial's step against a plain one, in one process (mlp, two rounds): every kind is
    timed in every round and set against the plain step; what the ratios read is the
    benchmark's to say, not this test's."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trial_step.py"), "--model", "mlp",
         "--micro", "32", "--amp", "off", "--blocks", "2", "--steps", "1", "--warmup", "1",
         "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["results"]
    assert row["amp"] == "off" and row["nonfinite"] == 0
    assert set(row["rates"]) == {"trial", "plain", "checked", "scaled"}
    assert all(len(v) == 2 and min(v) > 0 for v in row["rates"].values())
    assert set(row["ratio_median"]) == {"trial", "checked", "scaled"}
