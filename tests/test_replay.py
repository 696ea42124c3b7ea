"""The test doubles that stand in for trial processes and for studies that ran: the replay
measurer (``autotune.testing.replay``) and the crafted study (``autotune.testing.records``)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

from autotune.config.knobs import Config
from autotune.testing.records import CraftedStudy, ok
from autotune.testing.replay import Grid, ReplayMeasurer, Row
from autotune.trial.measurement import PRUNED, Measurement, Status
from autotune.trial.spec import MeasureSettings
from autotune.tuner import record
from autotune.tuner.budget import StepTimeModel

GIB = 2**30
SETTINGS = MeasureSettings()
GRID = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "grid_bert.json"


def ask(measure: ReplayMeasurer, config: Config, prune_below: float | None = None,
        on_event: Any = None) -> Measurement:
    return measure(config, Path("t"), 60.0, SETTINGS, prune_below, on_event)


def test_a_row_without_noise_measures_its_rate_exactly_in_every_window() -> None:
    measure = ReplayMeasurer({8: Row(120.0, 2 * GIB)}, key=lambda c: c.micro_batch_size)
    m = ask(measure, Config(micro_batch_size=8))
    assert m.status == Status.OK and m.samples_per_sec == 120.0 and m.spread_cv == 0.0
    assert [w["samples"] / w["seconds"] for w in m.windows] == [120.0] * 3
    assert m.peak_memory_bytes == 2 * GIB
    with pytest.raises(KeyError, match="no answer for 16"):
        ask(measure, Config(micro_batch_size=16))


def test_window_noise_is_drawn_from_the_seed() -> None:
    def rates(seed: int) -> list[float]:
        m = ask(ReplayMeasurer(lambda a: Row(100.0, window_cv=0.05), seed=seed), Config())
        return [w["samples"] for w in m.windows]

    assert rates(1) == rates(1) and rates(1) != rates(2)
    assert all(80.0 < r < 120.0 for r in rates(1))


def test_windows_clearly_below_the_best_are_pruned_as_a_running_trial_is() -> None:
    measure = ReplayMeasurer(lambda a: Row(50.0, wall_s=9.0))
    m = ask(measure, Config(), prune_below=100.0)
    assert m.status == Status.PRUNED and m.ended_by == PRUNED
    assert (m.reason or "").startswith("its first 2 windows reached at most")
    assert len(m.windows) == 2 and m.wall_s == pytest.approx(6.0)
    assert ask(measure, Config(), prune_below=55.0).ok  # within reach of the best


def test_a_peak_past_the_limit_ends_out_of_memory_and_other_outcomes_as_given() -> None:
    measure = ReplayMeasurer(lambda a: Row(100.0, 3 * GIB), limit=2 * GIB)
    m = ask(measure, Config())
    assert m.status == Status.OOM and "above the replay limit" in (m.reason or "")
    failed = ReplayMeasurer(lambda a: Row(status="timeout", reason="one step takes ~90s",
                                          extra={"rough_samples_per_sec": 0.1}))
    m = ask(failed, Config())
    assert m.status == Status.TIMEOUT and m.rough_samples_per_sec == 0.1
    given = Measurement(Status.DIVERGED, "the loss was NaN")
    assert ask(ReplayMeasurer(lambda a: given), Config()) is given  # answered as it is
    with pytest.raises(ValueError, match="needs its samples_per_sec"):
        Row()


def test_what_was_asked_is_kept_with_its_answer_and_windows_go_to_the_progress_events() -> None:
    measure = ReplayMeasurer(lambda a: Row(10.0 * (a.nth + 1)))
    events: list[dict[str, Any]] = []
    ask(measure, Config(micro_batch_size=8))
    ask(measure, Config(micro_batch_size=16), prune_below=1.0, on_event=events.append)
    again = ask(measure, Config(micro_batch_size=8))
    assert again.samples_per_sec == 20.0  # the second ask of that config
    assert [a.nth for a in measure.asked] == [0, 0, 1]
    assert [c.micro_batch_size for c in measure.configs] == [8, 16, 8]
    second = measure.asked[1]
    assert second.prune_below == 1.0 and second.settings == SETTINGS
    assert second.workdir == Path("t") and second.timeout == 60.0 and second.answer.ok
    assert [a.answer for a in measure.of(Config(micro_batch_size=8))][1] is again
    assert [e["event"] for e in events] == ["window"] * 3
    assert events[0]["samples_per_sec"] == 10.0 and events[2]["index"] == 2


def test_a_grid_replays_its_rows_under_its_limit() -> None:
    doc = json.loads(GRID.read_text())
    grid = Grid(doc, 4 * GIB)
    assert len(grid.rows) == len(doc["rows"]) and 0.0 < grid.run_sigma < 1.0
    fits = next(k for k, r in grid.rows.items() if r["status"] == "ok"
                and r["peak_memory_bytes"] <= 4 * GIB)
    assert grid.true(fits) == grid.rows[fits]["samples_per_sec"] <= grid.optimum
    over = next(k for k, r in grid.rows.items() if r["peak_memory_bytes"] > 4 * GIB)
    assert grid.true(over) == 0.0
    assert grid.evaluate(over, random.Random(0)).status == Status.OOM
    # The measurer draws as the grid's own evaluations do, seed for seed.
    config = Config.from_dict(grid.rows[fits]["config"])
    m = grid.measurer(3)(config, Path("t"), 60.0, SETTINGS)
    assert m == grid.evaluate(fits, random.Random(3))


def test_a_crafted_study_is_written_and_read_as_a_run_writes_and_reads_it() -> None:
    crafted = CraftedStudy()
    base = crafted.measured(Config(micro_batch_size=8), ok(8.0, wall_s=40.0), baseline=True)
    best = crafted.measured(Config(micro_batch_size=16), ok(12.0))
    oom = crafted.measured(Config(micro_batch_size=64),
                           Measurement(Status.OOM, "out of memory", peak_memory_bytes=30 * GIB))
    step = StepTimeModel(crafted.snapshot().observations).predict(Config(micro_batch_size=128))
    slow = crafted.predicted(Config(micro_batch_size=128), record.Prediction(
        record.Predicted.TOO_SLOW, "predicted-too-slow: ~", step=step, samples_per_step=128))
    crafted.not_run(Config(micro_batch_size=32), "5s of --timeout are left")
    snap = crafted.snapshot()
    assert [r.number for r in snap.records] == [base, best, oom, slow]  # not run: no record
    assert snap.baseline is not None and snap.baseline.number == base
    assert snap.best is not None and snap.best.number == best
    assert snap.trial(base).startup_s == pytest.approx(40.0 * 0.5)
    assert snap.trial(oom).state == TrialState.COMPLETE
    assert not snap.trial(oom).fits(crafted.limit)
    forecast = snap.trial(slow).forecast.step
    assert snap.trial(slow).predicted and forecast is not None and step is not None
    assert forecast.step_s == pytest.approx(step.step_s) and forecast.basis == step.basis
    assert snap.facts.workload["spec"] == "mlp" and snap.facts.memory_limit_bytes == crafted.limit
    assert [r.config.micro_batch_size for r in snap.records] == [8, 16, 64, 128]


def test_a_crafted_study_in_a_storage_url_is_the_study_a_run_would_resume(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    crafted = CraftedStudy(url=url, name="kept")
    crafted.measured(Config(), ok(5.0), baseline=True)
    import optuna

    (stored,) = optuna.load_study(study_name="kept", storage=url).trials
    assert stored.state == TrialState.COMPLETE and stored.value == 5.0
    assert [v for _, v in sorted(stored.intermediate_values.items())] == [5.0] * 3
