"""A losing reading whose windows spread wide is measured again before it counts
(``tuner.rereads``), and the second reading stands in its place (``StudySnapshot``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.config.knobs import Config
from autotune.trial.measurement import Measurement, Status
from autotune.trial.spec import MeasureSettings
from autotune.tuner import claims, rereads
from autotune.tuner.record import StudyFacts, TrialRecord
from autotune.tuner.search import Observation
from autotune.tuner.snapshot import StudySnapshot

BASE = Config(amp="bf16", micro_batch_size=32)
FUSED = Config(amp="bf16", micro_batch_size=32, optimizer_impl="fused")
EAGER = Config(amp="bf16", micro_batch_size=32, optimizer_impl="fused", attention="eager")


def ob(number: int, config: Config, rate: float, trend: float = 0.0,
       reread: bool = False) -> Observation:
    return Observation(config, Status.OK, rate, spread_cv=0.02, number=number, reread=reread,
                       trend=trend)


def never(config: Config) -> bool:
    return False


# Run 3 on a Xeon: eager on the fused line read 5.33 with windows 5.09, 5.33, 6.08 (+19% from
# first to last) against 7.08 for fused alone, the best; the trials' spreads are 2% here.
STEADY = [ob(0, BASE, 6.3), ob(1, BASE.__class__(amp="bf16", micro_batch_size=16), 6.0),
          ob(2, FUSED, 7.08)]


def test_an_unsteady_losing_change_is_measured_again_once() -> None:
    found = rereads.unsteady_loser([*STEADY, ob(3, EAGER, 5.33, trend=0.19)], 7.08, never)
    assert found is not None and found.config == EAGER and found.reread_of == 3
    assert found.stage.startswith("re-read: trial 3 (attention eager) read 5.33 against 7.08 "
                                  "samples/s, its windows moving +19% from first to last (the "
                                  "search's noise 4%)")
    # Once its second reading stands in its place, it is not measured a third time.
    assert rereads.unsteady_loser([*STEADY, ob(3, EAGER, 5.4, trend=0.19, reread=True)], 7.08,
                                  never) is None


@pytest.mark.parametrize("why, trial, best", [
    ("windows that went up and down: the reading is the config's", ob(3, EAGER, 5.33), 7.08),
    ("windows that moved one way within twice the noise", ob(3, EAGER, 5.33, trend=0.07),
     7.08),
    ("behind within the noise of one reading each: a tie, the combination's",
     ob(3, EAGER, 6.6, trend=0.19), 7.08),
    ("its parent far behind the best: even at its parent's rate it would not matter",
     ob(3, EAGER, 5.33, trend=0.19), 9.0),
    ("a batch that read behind ends its line", ob(3, Config(amp="bf16", micro_batch_size=64,
                                                            optimizer_impl="fused"), 5.33,
                                                     trend=0.19), 7.08),
])
def test_what_is_not_measured_again(why: str, trial: Observation, best: float) -> None:
    assert rereads.unsteady_loser([*STEADY, trial], best, never) is None, why


def test_a_study_spends_at_most_two_rereads_and_none_on_what_is_ruled_out() -> None:
    loser = ob(3, EAGER, 5.33, trend=0.19)
    assert rereads.unsteady_loser([*STEADY, loser], 7.08, lambda c: c == EAGER) is None
    spent = [ob(4, Config(amp="bf16", micro_batch_size=32, malloc_retain=True), 5.0,
                reread=True), ob(5, Config(amp="bf16", micro_batch_size=32, cpu_threads=1),
                                 4.0, reread=True)]
    assert rereads.unsteady_loser([*STEADY, loser, *spent[:1]], 7.08, never) is not None
    assert rereads.unsteady_loser([*STEADY, loser, *spent], 7.08, never) is None


def rec(number: int, config: Config, rate: float, reread_of: int | None = None,
        status: Status = Status.OK) -> TrialRecord:
    from optuna.trial import TrialState

    return TrialRecord(number=number, state=TrialState.COMPLETE, config=config, status=status,
                       reason=None, reread_of=reread_of,
                       measurement=Measurement(status, samples_per_sec=rate, spread_cv=0.02,
                                               peak_memory_bytes=2**30))


def test_the_second_reading_stands_in_the_place_of_the_first() -> None:
    snap = StudySnapshot(StudyFacts("s"), (rec(0, BASE, 6.3), rec(1, FUSED, 7.08),
                                           rec(2, EAGER, 5.33), rec(3, Config(), 2.0),
                                           rec(4, EAGER, 7.4, reread_of=2)), 2**34)
    assert [(o.number, o.samples_per_sec, o.reread) for o in snap.observations] == [
        (0, 6.3, False), (1, 7.08, False), (2, 7.4, True), (3, 2.0, False)]
    assert snap.best is not None and snap.best.number == 4
    assert [r.number for r in snap.ok_within_limit()] == [4, 1, 0, 3]
    assert snap.tried()[EAGER].trial == 4 and len(snap.measured) == 5
    twin = claims.measured_twin(snap, EAGER, MeasureSettings())
    assert twin is not None and twin.number == 4  # a repeat reuses the reading that stands
    # A re-read that failed replaces nothing: the first reading stands.
    failed = StudySnapshot(StudyFacts("s"), (rec(0, BASE, 6.3), rec(2, EAGER, 5.33),
                                             rec(4, EAGER, 0.0, 2, Status.ERROR)), 2**34)
    assert [(o.number, o.status) for o in failed.observations] == [
        (0, Status.OK), (2, Status.OK), (4, Status.ERROR)]
    assert failed.best is not None and failed.best.number == 0
    # A mark naming another config's trial, or a later one, replaces nothing.
    for marks in ((rec(0, BASE, 6.3), rec(2, EAGER, 5.33), rec(4, FUSED, 7.4, reread_of=2)),
                  (rec(0, BASE, 6.3), rec(2, EAGER, 5.33, reread_of=4), rec(4, EAGER, 7.4))):
        odd = StudySnapshot(StudyFacts("s"), marks, 2**34)
        assert not odd.rereads and [o.number for o in odd.observations] == [0, 2, 4]


def test_a_study_measures_an_unsteady_loser_again_and_goes_on_from_its_second_reading(
        memdir: Path) -> None:
    """The real tuner, in-process, its trials replayed: an input-bound baseline (made up: one
    CPU thread is its remedy here); one thread reads behind it the first time, its windows
    rising through a slow stretch, and well ahead the second time: the re-read is queued,
    measured fresh (not a twin's outcome reused) and becomes the best."""
    from autotune.testing.replay import Asked, ReplayMeasurer, Row
    from autotune.trial.result import Window
    from autotune.tuner.record import read_trial
    from tests.conftest import JOURNAL, load_study, replayed

    def answer(asked: Asked) -> Row | Measurement:
        waits = asked.config.cpu_threads == 0
        breakdown = {"data_wait": 0.72 if waits else 0.05, "compute": 0.28 if waits else 0.95}
        if asked.config.cpu_threads == 1 and asked.nth == 0:
            rates = [50.0, 60.0, 90.0]
            windows = [Window(samples=r, seconds=1.0) for r in rates]
            return Measurement(Status.OK, samples_per_sec=60.0, spread_cv=0.25,
                               windows=windows, peak_memory_bytes=2**30, wall_s=1.0,
                               breakdown=breakdown)
        return Row(100.0 if waits else 300.0, extra={"breakdown": breakdown})

    (memdir / "space.yaml").write_text(
        "knobs:\n  cpu_threads: {choices: [0, 1]}\n")
    measure = ReplayMeasurer(answer)
    summary, out = replayed(measure, model="autotune.testing.workloads:slowdata",
                            space="space.yaml", trials=3, study_name="again", patience=None,
                            storage=JOURNAL)
    trials = [read_trial(t) for t in load_study(JOURNAL, "again").trials[:3]]
    assert [a.config.cpu_threads for a in measure.asked[:3]] == [0, 1, 1]
    again = trials[2]
    assert again is not None and again.reread_of == 1 and again.reused_from is None
    assert (again.stage or "").startswith("re-read: trial 1 (cpu_threads 1) read 60 against "
                                          "100 samples/s, its windows moving +80% from first "
                                          "to last (the search's noise 2%)")
    assert again.samples_per_sec == 300.0
    assert summary.best is not None and summary.best.number == 2
    assert "re-read: trial 1" in out


@pytest.mark.parametrize("rates, trend", [
    ([5.09, 5.33, 6.08], 6.08 / 5.09 - 1), ([6.0, 5.0, 4.5, 3.0], -0.5),
    ([5.0, 6.0, 5.5], 0.0), ([5.0, 6.0], None)])
def test_a_trials_trend_is_its_windows_move_where_they_moved_one_way(
        rates: list[float], trend: float | None) -> None:
    windows = [{"samples": 2 * r, "seconds": 2.0} for r in rates]
    found = rec(0, BASE, 5.0)
    m = Measurement(Status.OK, samples_per_sec=5.0, windows=windows)  # type: ignore[arg-type]
    seen = TrialRecord(**{**found.__dict__, "measurement": m}).observation().trend
    assert seen == (None if trend is None else pytest.approx(trend))


def test_windows_that_are_not_numbers_give_no_trend() -> None:
    m = Measurement(Status.OK, samples_per_sec=5.0, windows=[  # type: ignore[list-item]
        {"samples": "1e9", "seconds": 1.0}, {"samples": 5.0, "seconds": 0.0}, "x",
        {"samples": 5.0, "seconds": 1.0}, {"samples": float("inf"), "seconds": 1.0}])
    found = rec(0, BASE, 5.0)
    assert TrialRecord(**{**found.__dict__, "measurement": m}).observation().trend is None
