"""One read of a study, and what follows from it, on crafted records (pure: no trial runs here):
the best trial within the limit, the baseline, the confirmation that covers the study, the
winner and the kind of its speedup; and the record read back from hand-made stored trials,
old-format trials included."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autotune.config.knobs import Config
from autotune.trial.measurement import Measurement
from autotune.tuner import record, snapshot
from autotune.tuner.budget import StepPrediction
from autotune.tuner.confirmation import NO_WIN, Candidate, Confirmation, decide
from autotune.tuner.diagnosis import TriedConfig
from autotune.tuner.record import (
    Forecast,
    Predicted,
    Prediction,
    StudyFacts,
    TrialRecord,
    read_trial,
    read_trials,
)
from autotune.tuner.snapshot import CONFIRMED, SEARCH, Speedup, StudySnapshot, best_of

GIB = 2**30
LIMIT = 10 * GIB

SLOW = StepPrediction(40.0, 0.1, "fitted on trials 0, 1", True)

def rec(number: int, micro: int, rate: float | None = None, *, status: str = "ok",
        peak: int = GIB, cv: float | None = 0.01, baseline: bool = False,
        reused_from: int | None = None, predicted_kind: str | None = None,
        **measured: Any) -> TrialRecord:
    """A finished trial as the record reader would give it."""
    state = TrialState.COMPLETE if status in ("ok", "oom") else TrialState.PRUNED
    return TrialRecord(
        number=number, state=state, config=Config(micro_batch_size=micro), status=status,
        reason=None, is_baseline=baseline, reused_from=reused_from,
        predicted_kind=predicted_kind,
        measurement=Measurement(status, samples_per_sec=rate, spread_cv=cv,
                                peak_memory_bytes=peak, **measured))


def study(*records: TrialRecord, confirmation: Confirmation | None = None) -> StudySnapshot:
    return StudySnapshot(StudyFacts("s", confirmation=confirmation), records, LIMIT)


def cand(r: TrialRecord, rates: list[float], failures: tuple[str, ...] = ()) -> Candidate:
    return Candidate(r.number, r.config, rates=rates, peaks=[GIB] * len(rates),
                     is_baseline=r.is_baseline, failures=list(failures))


def confirmed(measured_trials: int, *cands: Candidate) -> Confirmation:
    """The confirmation as the run stores it: the candidates' rounds and the decision."""
    return Confirmation.from_dict({
        "measured_trials": measured_trials, "rounds": 2, "planned_rounds": 2,
        "measure": {"min_window_s": 0.2}, "candidates": [c.to_dict() for c in cands],
        "decision": decide(cands, LIMIT).to_dict(), "created": "2026-01-01T00:00:00+00:00"})


# The base, a config faster in its search trial (210) and one faster in the confirmation.
BASE = rec(0, 8, 100.0, baseline=True)
FAST_IN_SEARCH = rec(1, 16, 210.0)
FAST_CONFIRMED = rec(2, 32, 200.0)


# -- best, baseline, what ran ---------------------------------------------------------------


def test_best_is_the_fastest_ok_trial_within_the_limit() -> None:
    records = (BASE, rec(1, 64, 300.0, peak=12 * GIB),  # fastest, but over the limit
               rec(2, 32, 200.0, peak=5 * GIB), rec(3, 128, status="oom", peak=0),
               rec(4, 16, 250.0, status="pruned"),  # stopped early: its rate is no result
               rec(5, 32, 200.0, peak=5 * GIB, reused_from=2))
    snap = study(*records)
    assert snap.best is not None and snap.best.number == 2
    assert best_of(records, 12 * GIB) == records[1]  # a larger limit: the 300 fits
    # The limit is inclusive, and a trial's peak above it is never the best.
    assert best_of(records, 5 * GIB) == records[2]
    assert best_of(records, 5 * GIB - 1) == BASE
    assert best_of([rec(0, 8, status="oom", peak=0)], LIMIT) is None


def test_the_baseline_is_its_latest_ok_trial() -> None:
    oom = rec(0, 8, status="oom", peak=0, baseline=True)
    other = rec(1, 4, 50.0)
    assert study(oom, other).baseline is None  # an OOM is no baseline to beat
    assert study(other).baseline is None  # the fastest trial is not the baseline
    first, again = rec(2, 8, 100.0, baseline=True), rec(3, 8, 110.0, baseline=True)
    assert study(oom, other, first, again).baseline == again
    assert study(oom, other, first, rec(4, 8, status="oom", peak=0, baseline=True)
                 ).baseline == first


def test_measured_and_observations_leave_out_what_did_not_run() -> None:
    twin = rec(3, 16, 210.0, reused_from=1)
    ruled_out = rec(4, 512, status="pruned", peak=0, cv=None, predicted_kind=Predicted.OOM)
    snap = study(BASE, FAST_IN_SEARCH, FAST_CONFIRMED, twin, ruled_out)
    assert [r.number for r in snap.measured] == [0, 1, 2]
    # The search sees the ruled-out config (it does not fit), not the repeat.
    assert [o.number for o in snap.observations] == [0, 1, 2, 4]
    assert snap.observations[-1].predicted and not snap.observations[0].predicted
    # What ran, by config: the first trial of each; ruled-out configs did not run.
    assert snap.tried() == {BASE.config: TriedConfig(0, "ok", 100.0),
                            FAST_IN_SEARCH.config: TriedConfig(1, "ok", 210.0),
                            FAST_CONFIRMED.config: TriedConfig(2, "ok", 200.0)}
    assert ruled_out.config not in snap.tried()
    assert snap.trial(4) == ruled_out and snap.trial(9) is None


def test_start_up_compile_costs_and_the_shortest_useful_trial_read_what_ran() -> None:
    timed = rec(0, 8, 100.0, baseline=True, wall_s=10.0,
                timings={"warmup_s": 1.0, "measure_s": 5.0, "compile_step_s": 2.5})
    untimed = rec(1, 16, 150.0, wall_s=30.0)  # said nothing of its timings
    twin = rec(2, 8, 100.0, reused_from=0, wall_s=10.0,
               timings={"warmup_s": 1.0, "measure_s": 5.0, "compile_step_s": 2.5})
    failed = rec(3, 64, status="oom", peak=0, wall_s=3.0, timings={"measure_s": 1.0})
    snap = study(timed, untimed, twin, failed)
    assert timed.startup_s == pytest.approx(1.5) and untimed.startup_s is None
    assert snap.startup_costs() == [pytest.approx(1.5)]  # ok trials that ran, and said
    assert snap.compile_costs() == [2.5]  # the repeat compiled nothing
    assert snap.shortest_useful_trial() == pytest.approx(15.0)  # half the median ok wall time
    assert study().shortest_useful_trial() == 5.0


# -- the confirmation, the winner and the speedup -----------------------------------------


def bare(speedup: Speedup | None) -> Speedup | None:
    """The speedup without its interval (tests/test_interval.py checks those)."""
    return None if speedup is None else replace(speedup, interval=None)


def test_the_confirmation_covers_the_study_and_names_the_winner() -> None:
    conf = confirmed(3, cand(BASE, [99.0, 101.0]), cand(FAST_IN_SEARCH, [180.0, 181.0]),
                     cand(FAST_CONFIRMED, [198.0, 202.0]))
    assert conf.decision.winner_trial == 2 and conf.decision.decided_by == "median"
    snap = study(BASE, FAST_IN_SEARCH, FAST_CONFIRMED, confirmation=conf)
    assert snap.confirmation == conf
    assert snap.best == FAST_IN_SEARCH  # the search's figure ...
    assert snap.winner == FAST_CONFIRMED  # ... is not what the confirmation decided
    # 200 / 100, side by side; each round's ratio: 198 / 99 and 202 / 101.
    assert bare(snap.speedup) == Speedup(2.0, CONFIRMED, (2.0, 2.0))
    # Two rounds that agree: the prior's noise alone (tuner.interval), for a re-check of two.
    assert snap.speedup.words() == ("2.00x (1.79-2.23x, 90% interval; confirmed side by side; "
                                    "per round 2.00x, 2.00x)")
    # Repeats and ruled-out configs add no measured trial: the confirmation still covers it.
    more = study(BASE, FAST_IN_SEARCH, FAST_CONFIRMED, rec(3, 16, 210.0, reused_from=1),
                 rec(4, 512, status="pruned", peak=0, predicted_kind=Predicted.OOM),
                 confirmation=conf)
    assert more.confirmation == conf and more.winner == FAST_CONFIRMED


def test_a_confirmed_speedup_says_each_rounds_ratio_where_the_rounds_pair_up() -> None:
    """Each round's winner reading over the baseline's in that round: three rounds listed, one
    round none (a single ratio is the value itself), and none where the readings do not pair
    up by round (a stored confirmation of a shared study may hold anything)."""
    three = confirmed(2, cand(BASE, [100.0, 80.0, 125.0]),
                      cand(FAST_CONFIRMED, [250.0, 160.0, 200.0]))
    speedup = study(BASE, FAST_CONFIRMED, confirmation=three).speedup
    assert bare(speedup) == Speedup(2.0, CONFIRMED, (2.5, 2.0, 1.6))  # medians 200 / 100
    assert speedup.words().endswith("confirmed side by side; per round 2.50x, 2.00x, 1.60x)")
    assert speedup.interval is not None and speedup.interval.wide  # rounds that disagree
    one = confirmed(2, cand(BASE, [100.0]), cand(FAST_CONFIRMED, [250.0]))
    alone = study(BASE, FAST_CONFIRMED, confirmation=one).speedup
    assert bare(alone) == Speedup(2.5, CONFIRMED, (2.5,)) and alone.per_round() == ""
    assert alone.interval is not None and alone.interval.rounds == 1
    many = Speedup(2.0, CONFIRMED, (2.1, 1.9, 2.0, 2.2, 1.8))
    assert many.words() == "2.00x (confirmed side by side; per round 1.80-2.20x)"
    uneven = confirmed(2, cand(BASE, [100.0, 100.0]), cand(FAST_CONFIRMED, [200.0, 210.0, 190.0]))
    assert study(BASE, FAST_CONFIRMED, confirmation=uneven).speedup == Speedup(2.0, CONFIRMED)
    # The baseline the winner (ahead within the margin, peaks alike): 1.00x, not its own rounds
    # over themselves ("per round 1.00x, 1.00x").
    tie = confirmed(2, cand(BASE, [101.0, 102.0]), cand(FAST_CONFIRMED, [100.0, 101.0]))
    assert tie.decision.winner_trial == BASE.number and not tie.no_win
    kept = study(BASE, FAST_CONFIRMED, confirmation=tie).speedup
    assert kept == Speedup(1.0, CONFIRMED) and kept.words() == "1.00x (confirmed side by side)"


def test_a_resumed_study_with_more_measured_trials_has_no_confirmation() -> None:
    conf = confirmed(3, cand(BASE, [99.0, 101.0]), cand(FAST_IN_SEARCH, [180.0, 181.0]),
                     cand(FAST_CONFIRMED, [198.0, 202.0]))
    resumed = study(BASE, FAST_IN_SEARCH, FAST_CONFIRMED, rec(3, 64, 150.0), confirmation=conf)
    assert resumed.facts.confirmation == conf  # still stored ...
    assert resumed.confirmation is None  # ... but it does not cover trial 3: confirm again
    assert resumed.winner == FAST_IN_SEARCH  # the fastest trial within the limit
    assert resumed.speedup == Speedup(2.1, SEARCH)


def test_a_confirmation_without_a_winner_is_none() -> None:
    conf = confirmed(2, cand(BASE, [], ("round 1: error: boom",)),
                     cand(FAST_IN_SEARCH, [], ("round 1: oom: out of memory",)))
    assert conf.decision.winner_trial is None
    snap = study(BASE, FAST_IN_SEARCH, confirmation=conf)
    assert snap.confirmation is None and snap.winner == FAST_IN_SEARCH


def test_no_win_beyond_the_noise_keeps_the_baseline_at_1x() -> None:
    conf = confirmed(2, cand(BASE, [100.0, 101.0]), cand(FAST_IN_SEARCH, [101.0, 102.0]))
    assert conf.no_win and conf.decision.decided_by == NO_WIN
    snap = study(BASE, FAST_IN_SEARCH, confirmation=conf)
    assert snap.winner == BASE  # the search's 2.1x was not confirmed side by side
    assert snap.speedup == Speedup(1.0, CONFIRMED)


def test_a_confirmation_the_baseline_failed_in_claims_only_the_search_figures() -> None:
    conf = confirmed(3, cand(BASE, [], ("round 1: error: boom",)),
                     cand(FAST_IN_SEARCH, [180.0, 181.0]), cand(FAST_CONFIRMED, [198.0, 202.0]))
    snap = study(BASE, FAST_IN_SEARCH, FAST_CONFIRMED, confirmation=conf)
    assert snap.confirmation == conf and not conf.side_by_side
    assert snap.winner == FAST_CONFIRMED
    assert snap.speedup == Speedup(2.0, SEARCH)  # its search trial's 200 over the base's 100


def test_a_search_speedup_needs_both_spreads() -> None:
    assert study(BASE, FAST_IN_SEARCH).speedup == Speedup(2.1, SEARCH)
    # A single timed window has no spread: no speedup is claimed from it.
    single = rec(1, 16, 210.0, cv=None)
    assert study(BASE, single).speedup is None
    assert study(rec(0, 8, 100.0, cv=None, baseline=True), FAST_IN_SEARCH).speedup is None
    assert study(FAST_IN_SEARCH).speedup is None  # no baseline measured
    assert study().speedup is None and study().winner is None


# -- reading stored trials -----------------------------------------------------------------


def frozen(number: int, attrs: dict[str, Any], state: TrialState = TrialState.COMPLETE,
           value: float | None = 1.0, **kw: Any) -> optuna.trial.FrozenTrial:
    t = optuna.trial.create_trial(state=state, value=value if state == TrialState.COMPLETE
                                  else None, user_attrs=attrs, **kw)
    t.number = number
    return t


def test_read_trial_parses_what_a_run_writes() -> None:
    m = Measurement("ok", samples_per_sec=150.0, spread_cv=0.02, peak_memory_bytes=600,
                    windows=[{"samples": 100, "seconds": 1.0}], wall_s=4.0,
                    timings={"warmup_s": 0.5, "measure_s": 3.0})
    written = record.of_measurement(m, LIMIT, number=3, baseline=True)
    config = Config(micro_batch_size=8, num_workers=1)
    forecast = Forecast(StepPrediction(0.05, 0.2, "scaled from trial 0", False), 700, 6.0)
    t = frozen(3, {**written.attrs, "config": config.to_dict(), "baseline": True,
                   "stage": "staged: largest micro-batch that fits",
                   "forecast": forecast.to_dict(), "measure_settings": {"max_seconds": 5.0},
                   "budget": {"max_seconds": 6.0}},
               value=written.value, params={"micro_batch_size": 8},
               distributions={"micro_batch_size": CategoricalDistribution([4, 8])})
    r = read_trial(t)
    assert r is not None
    assert r.number == 3 and r.state == TrialState.COMPLETE and r.config == config
    assert r.status == "ok" and r.ok and r.reason is None and r.is_baseline
    assert r.measurement == m
    assert r.samples_per_sec == 150.0 and r.spread_cv == 0.02 and r.peak_memory_bytes == 600
    assert r.fits(LIMIT) and not r.fits(599)
    assert r.forecast == forecast and r.stage == "staged: largest micro-batch that fits"
    assert r.overhead_share == pytest.approx(0.25) and r.startup_s == pytest.approx(0.5)
    assert r.measure_settings == {"max_seconds": 5.0} and r.budget == {"max_seconds": 6.0}
    assert r.params == {"micro_batch_size": 8}
    assert r.ran and r.source == 3 and not r.predicted and r.predicted_kind is None
    assert r.step_s == pytest.approx(8 / 150.0)
    # A repeat of a measured config: its twin's outcome, not a run of its own.
    twin = read_trial(frozen(5, {**written.attrs, "config": config.to_dict(),
                                 "reused_from": 3}))
    assert twin is not None and not twin.ran and twin.source == 3 and twin.reused_from == 3


def test_read_trial_gives_no_record_for_what_has_no_outcome() -> None:
    config = {"config": Config().to_dict()}
    ok = {"status": "ok", "measurement": {"samples_per_sec": 1.0}, **config}
    assert read_trial(frozen(0, ok)) is not None
    assert read_trial(frozen(1, {**ok, "interrupted": True}, TrialState.FAIL)) is None
    assert read_trial(frozen(2, config, TrialState.FAIL)) is None  # ended before its outcome
    assert read_trial(frozen(3, {"status": "error"}, TrialState.FAIL)) is None  # no config
    assert read_trial(frozen(4, ok, TrialState.RUNNING)) is None
    assert read_trial(frozen(5, {}, TrialState.WAITING)) is None
    # A measurement stored without its status reads the trial's.
    bare = read_trial(frozen(6, {"status": "timeout", "measurement": {}, **config},
                             TrialState.PRUNED))
    assert bare is not None and bare.measurement.status == "timeout"


def test_read_trial_reads_what_autotune_0x_stored() -> None:
    """Studies of autotune 0.x: a too-slow config measured again with a longer budget
    ("remeasured"), and a config the memory model ruled out marked only "predicted", its
    predicted peak in its measurement (no "predicted_kind", no "forecast")."""
    config = Config(micro_batch_size=64).to_dict()
    again = read_trial(frozen(2, {
        "status": "ok", "config": config, "remeasured": {"max_seconds": 30.0, "of": 1},
        "measurement": {"samples_per_sec": 4.0, "peak_memory_bytes": GIB, "wall_s": 40.0}}))
    assert again is not None and again.ok and again.budget == {"max_seconds": 30.0}
    assert again.forecast == Forecast()  # it ran with no forecast stored
    ruled_out = read_trial(frozen(3, {
        "status": "pruned", "reason": "predicted-oom: peak 40.00 GiB", "predicted": True,
        "config": Config(micro_batch_size=512).to_dict(),
        "measurement": {"status": "pruned", "predicted_peak_memory_bytes": 40 * GIB,
                        "windows": [], "peak_memory_bytes": 0, "wall_s": 0.0}},
        TrialState.PRUNED))
    assert ruled_out is not None
    assert ruled_out.predicted and ruled_out.predicted_kind == Predicted.OOM
    assert not ruled_out.ran and ruled_out.budget == {}
    assert ruled_out.forecast == Forecast(peak_memory_bytes=40 * GIB)
    assert ruled_out.measurement.peak_memory_bytes == 0 and ruled_out.step_s is None
    slow_0x = read_trial(frozen(3, {
        "status": "timeout", "reason": "predicted-too-slow: ~38s a step", "predicted": True,
        "predicted_kind": "too_slow", "config": Config(micro_batch_size=512).to_dict(),
        "measurement": {"status": "timeout", "predicted_step_s": 38.3,
                        "rough_samples_per_sec": 13.4}}, TrialState.PRUNED))
    assert slow_0x is not None and slow_0x.predicted_kind == Predicted.TOO_SLOW
    assert slow_0x.step_s == 38.3 and slow_0x.measurement.rough_samples_per_sec == 13.4
    # ... and what this version writes for each kind of ruling out reads back as that kind.
    for written, kind in ((record.of_prediction(
                               Prediction(Predicted.OOM, "predicted-oom", 3.0 * GIB), LIMIT),
                           Predicted.OOM),
                          (record.of_prediction(Prediction(
                              Predicted.OVERSUBSCRIBED, "oversubscribed: 3 cores"), LIMIT),
                           Predicted.OVERSUBSCRIBED),
                          (record.of_prediction(Prediction(
                              Predicted.TOO_SLOW, "predicted-too-slow", step=SLOW,
                              samples_per_step=64), LIMIT),
                           Predicted.TOO_SLOW)):
        r = read_trial(frozen(4, {**written.attrs, "config": config}, written.state))
        assert r is not None and r.predicted_kind == kind and not r.ran, kind
    slow_rec = record.of_prediction(Prediction(Predicted.TOO_SLOW, "predicted-too-slow",
                                               step=SLOW, samples_per_step=64), LIMIT)
    slow = read_trial(frozen(4, {**slow_rec.attrs, "config": config}, TrialState.PRUNED))
    assert slow is not None and slow.step_s == 40.0  # predicted, as nothing was measured
    assert slow.forecast.step == SLOW and slow.measurement.rough_samples_per_sec == 1.6
    oom_rec = record.of_prediction(Prediction(Predicted.OOM, "predicted-oom", 3.0 * GIB), LIMIT)
    oom = read_trial(frozen(4, {**oom_rec.attrs, "config": config}, TrialState.PRUNED))
    assert oom is not None and oom.forecast.peak_memory_bytes == 3 * GIB


def test_a_study_is_read_once_into_its_records_facts_and_pending_trials() -> None:
    s = optuna.create_study(storage=optuna.storages.InMemoryStorage(), study_name="s",
                            direction="maximize")
    attrs = {"status": "ok", "measurement": {"samples_per_sec": 100.0, "spread_cv": 0.01,
                                             "peak_memory_bytes": GIB}}
    s.add_trial(frozen(0, {**attrs, "config": Config(micro_batch_size=8).to_dict(),
                           "baseline": True}, value=100.0))
    s.add_trial(frozen(0, {**attrs, "config": Config(micro_batch_size=16).to_dict(),
                           "interrupted": True}, TrialState.FAIL))
    s.add_trial(frozen(0, {"status": "ok", "config": Config(micro_batch_size=16).to_dict(),
                           "measurement": {"samples_per_sec": 150.0, "spread_cv": 0.02,
                                           "peak_memory_bytes": 2 * GIB}}, value=150.0))
    s.enqueue_trial({}, user_attrs={"stage": "diagnosis: input-bound -> num_workers 1"})
    conf = confirmed(2, cand(BASE, [99.0, 101.0]),
                     cand(rec(2, 16, 150.0), [148.0, 152.0])).to_doc()
    s.set_user_attr("memory_limit_bytes", LIMIT)
    s.set_user_attr("fingerprint", {"device": "cpu"})
    s.set_user_attr("confirmation", conf)
    assert [r.number for r in read_trials(s)] == [0, 2]  # the interrupted trial has none
    snap = snapshot.read(s)
    assert snap.limit == LIMIT and snap.name == "s" and snap.facts.device == "cpu"
    assert snap.facts.made_by_run
    assert snap.pending.waiting == 1 and snap.pending.waiting_staged
    assert snap.confirmation is not None and snap.confirmation.to_doc() == conf
    assert snap.winner is not None and snap.winner.number == 2
    assert bare(snap.speedup) == Speedup(1.5, CONFIRMED,
                                         (round(148 / 99, 3), round(152 / 101, 3)))
    # A run's own limit wins over the study's: a 1.5 GiB limit leaves the baseline.
    tight = snapshot.read(s, int(1.5 * GIB))
    assert tight.limit == int(1.5 * GIB) and tight.best is not None and tight.best.number == 0
