"""The step-time model, each trial's measuring budget, the cheaper confirmation and the
diagnosis, on crafted studies: among them the trials of a default `autotune run --model bert` on
a 2-core Zen 3 (fp32 only) that spent half its budget on configs that timed out, exported a
one-window winner and called a compute-bound run memory-bound."""

from __future__ import annotations

from typing import Any

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState

from autotune.config.knobs import Config
from autotune.config.space import load_space, narrow
from autotune.testing.hardware import fake_cpu
from autotune.testing.records import CraftedStudy
from autotune.trial.measurement import Measurement
from autotune.trial.protocol import SPREAD_WINDOWS
from autotune.trial.spec import MeasureSettings
from autotune.tuner.budget import (
    ASSUMED_ERROR,
    MAX_BUDGET_SHARE,
    StepTimeModel,
    confirm_settings,
    measuring_seconds,
    plan_trial,
    startup_seconds,
)
from autotune.tuner.confirm_rounds import END_OF_SEARCH_S, SPREAD_ROUNDS, candidates, costs, reserve
from autotune.tuner.confirmation import NO_WIN, Candidate, confirmation_seconds, decide, settled
from autotune.tuner.diagnosis import MemoryWall, diagnose
from autotune.tuner.options import CONFIRM_MAX_SHARE, CONFIRM_SHARE
from autotune.tuner.record import Predicted, Prediction, of_prediction, read_trial
from autotune.tuner.search import MemoryModel, Observation, staged_next
from autotune.tuner.snapshot import StudySnapshot, larger_over_limit, read
from autotune.workloads import WorkloadSpec

GIB = 2**30
SETTINGS = MeasureSettings()  # the defaults: 60 s of measuring, three windows of >= 1 s


def ok(micro: int, rate: float, number: int, accum: int = 1, workers: int = 0) -> Observation:
    return Observation(Config(micro_batch_size=micro, grad_accum_steps=accum,
                              num_workers=workers), "ok", samples_per_sec=rate,
                       peak_memory_bytes=int((3 + micro / 8) * GIB), spread_cv=0.01,
                       number=number)


# The Zen 3 run: 8 samples/step took 10.4 s, 16 took 19.7 s.
ZEN3 = [ok(8, 8 / 10.4, 0), ok(16, 16 / 19.7, 1, workers=1)]


def test_steps_are_fitted_on_samples_per_step_from_the_studys_trials() -> None:
    p = StepTimeModel(ZEN3).predict(Config(micro_batch_size=32))
    assert p is not None and p.fitted
    # 10.4 s + (19.7 - 10.4) / 8 per extra sample: 38.3 s at 32.
    assert p.step_s == pytest.approx(10.4 + 24 * (19.7 - 10.4) / 8)
    # Two batch sizes fit any line: the error is assumed until a third has run, and says so.
    assert p.error == ASSUMED_ERROR and "assumed until three batch sizes" in p.basis
    assert "fitted on trials 0, 1" in p.basis
    # Accumulation counts: 8 x 4 is 32 samples per step too.
    acc = StepTimeModel(ZEN3).predict(Config(micro_batch_size=8, grad_accum_steps=4))
    assert acc is not None and acc.step_s == pytest.approx(p.step_s)


def test_below_the_smallest_batch_a_noisy_fit_is_no_less_than_scaled_steps() -> None:
    # A default run on a drifting machine: bf16 8 x 1 in 4.04 s, 16 x 1 in 15.2 s. The line
    # through them is below zero at 4 samples; the smallest batch's step scaled is the floor.
    noisy = [ok(8, 8 / 4.04, 0), ok(16, 16 / 15.2, 1)]
    p = StepTimeModel(noisy).predict(Config(micro_batch_size=4))
    assert p is not None and p.step_s == pytest.approx(4.04 / 2)
    # Where the fit is above it (a positive intercept), the fit stands.
    q = StepTimeModel(ZEN3).predict(Config(micro_batch_size=4))
    assert q is not None and q.step_s == pytest.approx(10.4 - 4 * (19.7 - 10.4) / 8)


def test_the_error_is_the_largest_leave_one_out_miss() -> None:
    # Steps of 1 + 0.5 x samples, except 16, measured 10% slow.
    obs = [ok(4, 4 / 3.0, 0), ok(8, 8 / 5.0, 1), ok(16, 16 / (9.0 * 1.1), 2)]
    p = StepTimeModel(obs).predict(Config(micro_batch_size=32))
    assert p is not None and p.fitted and "leave-one-out" in p.basis
    assert 0.05 < p.error < 0.5 and p.error != ASSUMED_ERROR


def test_one_batch_size_or_another_precision_is_scaled_never_fitted() -> None:
    one = StepTimeModel(ZEN3[:1])
    p = one.predict(Config(micro_batch_size=16))
    assert p is not None and not p.fitted and p.step_s == pytest.approx(20.8)
    other = one.predict(Config(micro_batch_size=8, amp="bf16"))
    assert other is not None and not other.fitted and "no trial with amp bf16" in other.basis
    assert StepTimeModel([]).predict(Config()) is None


def test_a_config_the_study_knows_is_too_slow_is_recorded_without_running() -> None:
    model = StepTimeModel(ZEN3)
    # 64 samples a step: ~75.5 s (+-30%); even at 53 s, warm-up and two windows need 243 s.
    for config in (Config(micro_batch_size=64), Config(micro_batch_size=8, grad_accum_steps=8),
                   Config(micro_batch_size=16, grad_accum_steps=4, num_workers=2),
                   Config(micro_batch_size=32, grad_accum_steps=2)):
        plan = plan_trial(config, model, SETTINGS, trial_timeout_s=180.0, startup_s=15.0,
                          left_s=600.0)
        assert plan.too_slow is not None, config
        assert plan.too_slow.startswith("predicted-too-slow: ~")
        assert "--trial-timeout allows 144s" in plan.too_slow and "fitted on trials" in \
            plan.too_slow
    # 32 samples: ~38.3 s (+-30%). At the lower end (26.8 s) warm-up's 3.6 steps, its last
    # step the first window, and one more window fit 144 s: it runs, with all of them.
    thirty_two = plan_trial(Config(micro_batch_size=32), model, SETTINGS, trial_timeout_s=180.0,
                            startup_s=15.0, left_s=600.0)
    assert thirty_two.too_slow is None and thirty_two.no_room is None
    assert thirty_two.settings.max_seconds == pytest.approx(MAX_BUDGET_SHARE * 180.0)
    # What the sampler and the search see of it: nothing ran, it does not fit, no memory.
    step = StepTimeModel(ZEN3).predict(Config(micro_batch_size=32))
    assert step is not None
    rec = of_prediction(Prediction(Predicted.TOO_SLOW, "predicted-too-slow: ...", step=step,
                                   samples_per_step=32), 18 * GIB)
    assert rec.state == TrialState.PRUNED and rec.constraint is None
    assert rec.attrs["predicted"] and rec.attrs["predicted_kind"] == "too_slow"
    assert rec.intermediate == (pytest.approx(32 / step.step_s),)
    assert step.step_s == pytest.approx(38.3, abs=0.05)


def test_a_slow_config_gets_the_measuring_budget_its_steps_need() -> None:
    # 16 samples predicted from the baseline alone: ~20.8 s a step. Warm-up and three windows
    # need far more than the default 60 s: it gets them, within the trial timeout.
    plan = plan_trial(Config(micro_batch_size=16), StepTimeModel(ZEN3[:1]), SETTINGS,
                      trial_timeout_s=180.0, startup_s=15.0, left_s=600.0)
    assert plan.too_slow is None and plan.no_room is None
    need = measuring_seconds(20.8 * (1 + ASSUMED_ERROR), SETTINGS)
    # Warm-up (its last step the first window) and a second window: 4.6 steps of 27 s.
    assert need == pytest.approx(4.6 * 20.8 * (1 + ASSUMED_ERROR))
    assert plan.settings.max_seconds == pytest.approx(min(need, MAX_BUDGET_SHARE * 180.0))
    assert plan.settings.max_seconds > SETTINGS.max_seconds
    # Sized for three windows, it stops at three.
    assert plan.settings.max_windows == SETTINGS.min_windows == 3
    # Fast steps keep the search's settings.
    fast = plan_trial(Config(micro_batch_size=16), StepTimeModel([ok(8, 80.0, 0)]), SETTINGS,
                      trial_timeout_s=180.0, startup_s=15.0, left_s=600.0)
    assert fast.settings == SETTINGS and fast.prediction is not None
    # ... and are not started either where what is left of --timeout cannot hold their start-up
    # and warm-up and two windows (a run started one 22 s before its search ended, to be cut).
    late = plan_trial(Config(micro_batch_size=16), StepTimeModel([ok(8, 80.0, 0)]), SETTINGS,
                      trial_timeout_s=180.0, startup_s=15.0, left_s=16.0)
    assert late.too_slow is None and late.no_room is not None
    assert "of --timeout are left" in late.no_room
    # What is left of --timeout too short: not a verdict on the config, and not started.
    short = plan_trial(Config(micro_batch_size=16), StepTimeModel(ZEN3), SETTINGS,
                       trial_timeout_s=180.0, startup_s=15.0, left_s=60.0)
    assert short.too_slow is None and short.no_room is not None
    assert "of --timeout are left" in short.no_room


def test_a_scaled_prediction_past_the_trial_timeout_runs_where_the_run_has_room_for_it() -> None:
    # 64 samples scaled from the baseline's 8 (10.4 s): ~83 s a step, +-30% assumed. Past what
    # the trial timeout allows, but scaled, not fitted: it runs, with all the timeout allows.
    config, model = Config(micro_batch_size=64), StepTimeModel(ZEN3[:1])
    p = model.predict(config)
    assert p is not None and not p.fitted
    can = MAX_BUDGET_SHARE * 180.0
    least = measuring_seconds(p.low_s, SETTINGS, SPREAD_WINDOWS)
    assert least > can
    roomy = plan_trial(config, model, SETTINGS, trial_timeout_s=180.0, startup_s=15.0,
                       left_s=600.0)
    assert roomy.too_slow is None and roomy.no_room is None and not roomy.ruled_out
    assert roomy.settings.max_seconds == pytest.approx(can)
    # With less of --timeout left than even the prediction's low end needs, it is not started
    # (a run began one 112 s before its search ended, to be cut and queued again): no room,
    # no verdict on the config.
    late = plan_trial(config, model, SETTINGS, trial_timeout_s=180.0, startup_s=15.0,
                      left_s=15.0 + least - 1.0)
    assert late.too_slow is None and late.no_room is not None and late.ruled_out
    assert "of --timeout are left" in late.no_room
    assert plan_trial(config, model, SETTINGS, trial_timeout_s=180.0, startup_s=15.0,
                      left_s=15.0 + least + 1.0).no_room is None


def test_a_script_s_budget_leaves_the_trial_timeout_room_for_its_unmeasured_steps() -> None:
    # One trial at 20.8 s a step (scaled, +-30%): a built-in trial gets the 124 s its warm-up
    # and two windows need; a script's trial also runs its first step and the one it stops
    # after within the timeout, so its measuring budget is what is left of 144 s after them.
    kwargs = {"trial_timeout_s": 180.0, "startup_s": 15.0, "left_s": 600.0}
    builtin = plan_trial(Config(micro_batch_size=16), StepTimeModel(ZEN3[:1]), SETTINGS,
                         **kwargs)
    script = plan_trial(Config(micro_batch_size=16), StepTimeModel(ZEN3[:1]), SETTINGS,
                        unmeasured_steps=2, **kwargs)
    outside = 2 * script.prediction.step_s * (1 + ASSUMED_ERROR)
    assert builtin.settings.max_seconds < MAX_BUDGET_SHARE * 180.0
    assert script.settings.max_seconds == pytest.approx(MAX_BUDGET_SHARE * 180.0 - outside)


def test_startup_is_measured_from_trials_with_a_safety_margin() -> None:
    assert startup_seconds([], 180.0) == pytest.approx(60.0)
    assert startup_seconds([8.0, 10.0, 9.0], 180.0) == \
        pytest.approx(1.5 * 9.0 + 2.0)


# These runs' lines ran with glibc's default (the knob came later): their staged start did not
# measure the baseline with host memory retained first.
_BEFORE_RETAIN = {"malloc_retain": "measured before the knob"}


def test_the_staged_start_stops_doubling_at_a_predicted_too_slow_batch() -> None:
    hw = fake_cpu(bf16=False)
    space = narrow(load_space("default"), hw, 1, Config()).fix(_BEFORE_RETAIN, Config())
    # 8, 16 and 32 took 10.4, 19.7 and 33 s a step: 64 would take ~63 s.
    obs = ZEN3[:1] + [ok(16, 16 / 19.7, 1), ok(32, 32 / 33.0, 2)]
    model = StepTimeModel(obs)

    def too_slow(c: Config) -> bool:
        return plan_trial(c, model, SETTINGS, trial_timeout_s=180.0, startup_s=15.0,
                          left_s=None).too_slow is not None

    memory = MemoryModel(obs, "cpu", 18 * GIB)
    # Without the step-time model, the next doubling (64) would be started.
    nxt = staged_next(space, Config(), obs, memory)
    assert nxt is not None and nxt.config.micro_batch_size == 64
    # With it, 64 and everything above count as not fitting: the staged start is done.
    assert staged_next(space, Config(), obs, memory, too_slow=too_slow) is None


def test_a_doubling_without_room_left_is_passed_over_like_one_too_slow() -> None:
    """The fp32-only run: 8x1, 16x1 and 32x1 took 6.7, 13.0 and 21.6 s a step; 64x1 (~41 s)
    fits the trial timeout but not the 106 s left of the search. The staged start passes over
    it (the runner then takes the incumbent's diagnosis) instead of ending the search there."""
    space = narrow(load_space("default"), fake_cpu(bf16=False), 1, Config()).fix(
        _BEFORE_RETAIN, Config())
    obs = [ok(8, 8 / 6.7, 0), ok(16, 16 / 13.0, 1), ok(32, 32 / 21.6, 2)]
    model = StepTimeModel(obs)
    memory = MemoryModel(obs, "cpu", 18 * GIB)

    def ruled_out(left_s: float | None) -> Any:
        return lambda c: plan_trial(c, model, SETTINGS, trial_timeout_s=180.0, startup_s=15.0,
                                    left_s=left_s).ruled_out

    roomy = staged_next(space, Config(), obs, memory, too_slow=ruled_out(600.0))
    assert roomy is not None and roomy.config.micro_batch_size == 64
    plan = plan_trial(roomy.config, model, SETTINGS, trial_timeout_s=180.0, startup_s=15.0,
                      left_s=106.0)
    assert plan.too_slow is None and plan.no_room is not None and plan.ruled_out
    assert staged_next(space, Config(), obs, memory, too_slow=ruled_out(106.0)) is None


def cand(number: int, rates: list[float], baseline: bool = False) -> Candidate:
    return Candidate(number, Config(micro_batch_size=8 * (number + 1)), rates=rates,
                     peaks=[GIB] * len(rates), is_baseline=baseline)


def test_a_lead_within_the_noise_keeps_the_baseline() -> None:
    base = cand(0, [0.77, 0.80, 0.78], baseline=True)
    best = cand(1, [0.81, 0.79, 0.80])  # ~1.3% ahead, rounds spread ~1.5%
    d = decide([best, base], 18 * GIB)
    assert d.decided_by == NO_WIN and d.winner is base and d.runner_up is best
    clear = cand(2, [1.03, 1.02, 1.04])
    d = decide([clear, best, base], 18 * GIB)
    assert d.winner is clear and d.decided_by == "median"


def test_rounds_stop_as_soon_as_the_decision_is_clear_or_out_of_reach() -> None:
    base = cand(0, [0.80, 0.81], baseline=True)
    assert settled([cand(1, [1.00, 1.01]), base], 18 * GIB) is not None  # a clear win
    # Even the best pairing (0.815 vs 0.80) is within the 2% floor: more rounds cannot help.
    assert settled([cand(1, [0.812, 0.815]), base], 18 * GIB) is not None
    # 4% ahead with a 3% spread: undecided, another round is worth it.
    assert settled([cand(1, [0.86, 0.82]), base], 18 * GIB) is None
    # One round is no spread.
    assert settled([cand(1, [1.0]), cand(0, [0.8], baseline=True)], 18 * GIB) is None


def _trial(number: int, attrs: dict[str, Any], state: TrialState = TrialState.COMPLETE,
           value: float | None = 1.0) -> FrozenTrial:
    t = optuna.trial.create_trial(state=state, value=value if state == TrialState.COMPLETE
                                  else None, user_attrs=attrs)
    t.number = number
    return t


def _ok_trial(number: int, micro: int, rate: float, wall: float, baseline: bool = False,
              workers: int = 0) -> FrozenTrial:
    return _trial(number, {
        "config": Config(micro_batch_size=micro, num_workers=workers).to_dict(), "status": "ok",
        "baseline": baseline, "measurement": {
            "samples_per_sec": rate, "peak_memory_bytes": 5 * GIB, "wall_s": wall,
            "windows": [{"samples": 8, "seconds": 8 / rate}] * 3,
            "spread_cv": 0.01, "timings": {"warmup_s": 0.3 * wall, "measure_s": 0.5 * wall}}})


def _snap(trials: list[FrozenTrial], limit: int = 18 * GIB) -> StudySnapshot:
    return StudySnapshot(read_facts_of_nothing(), tuple(_records(trials)), limit)


def test_the_confirmation_reserve_is_kept_from_the_start() -> None:
    # Before any trial the baseline runs, whatever the budget; from the first trial on, the
    # share is kept until the trials say what the plan costs.
    assert reserve(_snap([]), 3, 3, 720.0, SETTINGS) == 0.0
    base_only = [_ok_trial(0, 8, 8.0, 30.0, baseline=True)]
    assert reserve(_snap(base_only), 3, 3, 720.0, SETTINGS) == pytest.approx(
        CONFIRM_SHARE * 720.0)
    assert reserve(_snap(base_only), 0, 3, 720.0, SETTINGS) == 0.0  # --confirm-top 0
    # Steps of ~1 s: once two configs ran, what two rounds of the plan cost, well within the
    # share; a third of the three rounds runs only in time the search leaves (a run kept three
    # and its rounds stopped after two, 3.4 minutes of the budget unused).
    fast = [_ok_trial(0, 8, 8.0, 30.0, baseline=True), _ok_trial(1, 16, 8.6, 30.0)]
    cost = costs(_snap(fast), candidates(_snap(fast), 3), SETTINGS)
    assert cost[0] == pytest.approx(0.2 * 30.0 + confirm_settings(SETTINGS, 1.0).max_seconds)
    assert reserve(_snap(fast), 3, 3, 720.0, SETTINGS) == pytest.approx(
        SPREAD_ROUNDS * (cost[0] + 2 + cost[1] + 2) + END_OF_SEARCH_S)
    assert SPREAD_ROUNDS == 2
    # A lead many times the noise (75% over a 2% noise): one round of the two is kept.
    decisive = [_ok_trial(0, 8, 8.0, 30.0, baseline=True), _ok_trial(1, 16, 14.0, 30.0)]
    one = costs(_snap(decisive), candidates(_snap(decisive), 3), SETTINGS)
    assert reserve(_snap(decisive), 3, 3, 720.0, SETTINGS) == pytest.approx(
        one[0] + 2 + one[1] + 2 + END_OF_SEARCH_S)
    # ... unless a runner-up within the margin of the best joins: then rounds tell them apart.
    close = [*decisive, _ok_trial(2, 32, 13.9, 30.0)]
    assert [c.number for c in candidates(_snap(close), 3)] == [1, 2, 0]
    assert reserve(_snap(close), 3, 3, 720.0, SETTINGS) > 2 * 3 * (cost[0] + 2)
    # A config far behind the best does not join.
    behind = [*decisive, _ok_trial(2, 32, 11.0, 30.0)]
    assert [c.number for c in candidates(_snap(behind), 3)] == [1, 0]
    # Zen 3's steps (10 s and 20 s): the smallest plan, the best and the baseline twice,
    # needs more than the share; it is kept when within CONFIRM_MAX_SHARE, else nothing is.
    slow = [_ok_trial(0, 8, 8 / 10.4, 80.0, baseline=True), _ok_trial(1, 16, 16 / 19.7, 150.0)]
    cost = costs(_snap(slow), candidates(_snap(slow), 3), SETTINGS)
    need = 2 * (cost[0] + 2 + cost[1] + 2) + END_OF_SEARCH_S
    assert need > CONFIRM_SHARE * 720.0
    kept = reserve(_snap(slow), 3, 3, 720.0, SETTINGS)
    assert kept == (pytest.approx(need) if need <= CONFIRM_MAX_SHARE * 720.0 else 0.0)
    # With a longer budget two rounds of the two fit the share: that is what is kept.
    assert reserve(_snap(slow), 3, 3, 1800.0, SETTINGS) == pytest.approx(need)


def test_where_slow_candidates_do_not_fit_the_reserve_keeps_the_pairs_fewest_rounds() -> None:
    # BERT-base on a 2-core CPU: the best leads the baseline by 2.6x, two runners-up are within
    # the margin of it, and two rounds of all four need more than the share. The plan drops
    # the runners-up; the best and the baseline need one round (decisive), and only that is
    # kept: the search gets the rest (a run kept two rounds here and left 2.5 minutes unused).
    slow = [_ok_trial(0, 8, 8 / 6.6, 50.0, baseline=True), _ok_trial(1, 32, 2.13, 90.0),
            _ok_trial(2, 64, 2.10, 110.0), _ok_trial(3, 16, 2.09, 60.0)]
    cands = candidates(_snap(slow), 3)
    assert [c.number for c in cands] == [1, 2, 3, 0]
    cost = costs(_snap(slow), cands, SETTINGS)
    assert confirmation_seconds(cands, cost, 2) > CONFIRM_SHARE * 720.0
    pair = [cands[0], cands[-1]]
    kept = reserve(_snap(slow), 3, 3, 720.0, SETTINGS)
    assert kept == pytest.approx(confirmation_seconds(pair, cost, 1) + END_OF_SEARCH_S)
    assert kept < confirmation_seconds(pair, cost, 2) + END_OF_SEARCH_S


def test_a_confirmation_round_is_sized_to_the_steps() -> None:
    rounds = confirm_settings(SETTINGS, 19.7)
    assert rounds.min_window_s == 2 * SETTINGS.min_window_s and rounds.min_windows == 2
    assert rounds.max_seconds == pytest.approx(
        1.1 * measuring_seconds(19.7, rounds) + rounds.min_window_s, abs=0.01)
    assert confirm_settings(SETTINGS, 0.05).max_seconds < 15.0  # fast steps: a short round


def test_the_zen3_runs_diagnosis_is_compute_bound_and_names_the_prediction() -> None:
    """The run's winner (16 x 1, one worker, 63% MFU, no data wait, 5.03 GiB of 18.33) with
    trial 4 (micro-batch 128) ruled out by the memory model and 32 and 64 timed out."""
    limit = int(18.33 * GIB)
    trials = [
        _ok_trial(0, 8, 0.77, 70.0, baseline=True), _ok_trial(1, 16, 0.81, 150.0, workers=1),
        _trial(2, {"config": Config(micro_batch_size=32).to_dict(), "status": "timeout",
                   "measurement": {"peak_memory_bytes": 0}}, TrialState.PRUNED),
        _trial(3, {"config": Config(micro_batch_size=64).to_dict(), "status": "timeout",
                   "measurement": {"peak_memory_bytes": 0}}, TrialState.PRUNED),
        _trial(4, {"config": Config(micro_batch_size=128).to_dict(), "status": "pruned",
                   "predicted": True, "predicted_kind": "oom",
                   "measurement": {"peak_memory_bytes": 0,
                                   "predicted_peak_memory_bytes": 25 * GIB}}, TrialState.PRUNED),
    ]
    winner = Config(micro_batch_size=16, num_workers=1)
    records = _records(trials)
    wall = larger_over_limit(records, winner, limit)
    assert wall == MemoryWall(4, 128, measured=False)
    m = Measurement("ok", breakdown={"data_wait": 0.0, "compute": 1.0},
                    peak_memory_bytes=int(5.03 * GIB), mfu=0.63, peak_tflops=0.35)
    (finding,) = diagnose(m, winner, device="cpu", limit=limit, larger_over_limit=wall)
    assert finding.kind == "compute-bound"
    assert "MFU 63%" in finding.text and "data wait 0%" in finding.text
    assert "micro-batch 128 is predicted to pass it (trial 4, not run)" in finding.text
    assert "(test: grad_accum_steps 2 with micro-batch 16)" in finding.text
    # The timeouts say nothing about memory; the study's observations keep them as not fitting.
    assert [r.observation().fits for r in records] == [True, True, False, False, False]


def _records(trials: list[FrozenTrial]) -> list[Any]:
    found = [read_trial(t) for t in trials]
    assert all(r is not None for r in found)
    return found


def read_facts_of_nothing() -> Any:
    from autotune.tuner.record import StudyFacts

    return StudyFacts(name="crafted")


def _study(trials: list[FrozenTrial], confirmation: dict[str, Any] | None) -> optuna.Study:
    """A study as a run makes it, holding these trials' records (numbered in order), written
    through the tuner's own record path (``autotune.testing.records``)."""
    from autotune.tuner.record import write_confirmation

    crafted = CraftedStudy(workload=WorkloadSpec("bert", {}), limit=18 * GIB)
    for r in _records(trials):
        assert crafted.measured(r.config, r.measurement, baseline=r.is_baseline) == r.number
    if confirmation is not None:
        write_confirmation(crafted.study, confirmation)  # type: ignore[arg-type]
    return crafted.study


def test_no_win_beyond_noise_exports_the_baselines_settings_at_speedup_one(
        tmp_path: Any) -> None:
    from autotune.tuner.export import write_profile as export

    trials = [_ok_trial(0, 8, 0.77, 70.0, baseline=True), _ok_trial(1, 16, 0.81, 150.0)]
    base, best = cand(0, [0.78, 0.80], baseline=True), cand(1, [0.80, 0.81])
    d = decide([best, base], 18 * GIB)
    assert d.decided_by == NO_WIN
    conf = {"measured_trials": 2, "rounds": 2, "measure": {}, "decision": d.to_dict(),
            "candidates": [best.to_dict(), base.to_dict()]}
    study = _study(trials, conf)
    profile = export(study, read(study, 18 * GIB), "sqlite://", None, tmp_path / "p.yaml")
    assert profile is not None and profile.speedup == 1.0
    assert profile.config == Config(micro_batch_size=8)
    assert any(n.startswith("no config beat the baseline by more than the measured noise")
               for n in profile.notes)


def test_a_single_window_figure_is_never_the_exported_speedup(tmp_path: Any) -> None:
    from autotune.tuner.export import write_profile as export

    one_window = _ok_trial(1, 16, 0.81, 150.0)
    one_window.user_attrs["measurement"]["spread_cv"] = None
    trials = [_ok_trial(0, 8, 0.77, 70.0, baseline=True), one_window]
    study = _study(trials, None)
    profile = export(study, read(study, 18 * GIB), "sqlite://", None, tmp_path / "p.yaml")
    assert profile is not None and profile.config == Config(micro_batch_size=16)
    assert profile.speedup is None
    assert any("from a single timed window" in n for n in profile.notes)
    # With a spread on both sides the trials' own ratio stands, marked as not confirmed.
    trials = [_ok_trial(0, 8, 0.77, 70.0, baseline=True), _ok_trial(1, 16, 0.81, 150.0)]
    study = _study(trials, None)
    profile = export(study, read(study, 18 * GIB), "sqlite://", None, tmp_path / "q.yaml")
    assert profile is not None and profile.speedup == pytest.approx(0.81 / 0.77, abs=1e-3)
    assert any(n.startswith("not confirmed") for n in profile.notes)


def test_a_suggested_test_the_study_already_ran_says_what_it_measured() -> None:
    """The default run on a 2-core Xeon (AMX): 32 x 1 bf16 won at 16% MFU; the low-MFU finding
    suggests micro-batch 64, which the study measured (trial 4, slower)."""
    trials = [_ok_trial(3, 32, 5.01, 90.0), _ok_trial(4, 64, 4.48, 120.0)]
    for t in trials:
        t.user_attrs["config"] = Config(micro_batch_size=t.user_attrs["config"][
            "micro_batch_size"], amp="bf16").to_dict()
    m = Measurement("ok", breakdown={"data_wait": 0.0}, peak_memory_bytes=7 * GIB, mfu=0.16,
                    peak_tflops=2.77, samples_per_sec=5.01)
    snap = StudySnapshot(read_facts_of_nothing(), tuple(_records(trials)), 18 * GIB)
    (low,) = diagnose(m, Config(micro_batch_size=32, amp="bf16"), device="cpu", limit=18 * GIB,
                      tried=snap.tried())
    assert low.kind == "low-mfu"
    assert low.evidence["test"] == ("test: micro-batch 64 with the rest unchanged; measured "
                                    "already, trial 4: 4.48 samples/s, 0.89x this config")
    # Not measured: only the suggestion.
    (fresh,) = diagnose(m, Config(micro_batch_size=32, amp="bf16"), device="cpu",
                        limit=18 * GIB, tried={})
    assert fresh.evidence["test"] == "test: micro-batch 64 with the rest unchanged"


def test_compiling_is_counted_apart_from_start_up() -> None:
    from autotune.tuner.budget import compile_seconds
    t = optuna.trial.create_trial(value=1.0, user_attrs={
        "config": Config(compile="default").to_dict(), "status": "ok",
        "measurement": {"wall_s": 100.0, "samples_per_sec": 1.0, "timings": {
            "warmup_s": 10.0, "measure_s": 20.0, "compile_step_s": 60.0}}})
    (r,) = _records([t])
    assert r.startup_s == pytest.approx(10.0)  # 100 - 10 - 20 - 60: not the compile
    snap = StudySnapshot(read_facts_of_nothing(), (r,), 0)
    assert snap.compile_costs() == [60.0]
    assert compile_seconds([60.0], 120.0) == pytest.approx(72.0)  # a fifth more
    assert compile_seconds([110.0], 120.0) == 120.0  # never above the limit
    assert compile_seconds([], 120.0) == 120.0  # before any compile: the limit



def test_a_confirmation_round_of_a_compiled_config_is_charged_what_the_cache_leaves() -> None:
    """Each round compiles again in a fresh process, from the study's cache where the trial
    stored its graphs there: what the backend took is skipped, all but a share for loading.
    (A default run charged a compiled candidate its trial's cold 73 s per round; from the
    cache a round compiled in 19 s.)"""
    from autotune.tuner.record.read import CACHE_LOAD_SHARE

    def compiled(number: int, compile_info: Any, baseline: bool = False) -> FrozenTrial:
        config = Config(micro_batch_size=16 if not baseline else 8,
                        compile="off" if baseline else "default")
        return _trial(number, {
            "config": config.to_dict(), "status": "ok", "baseline": baseline,
            "measurement": {"wall_s": 150.0, "samples_per_sec": 2.0 if baseline else 4.0,
                            "spread_cv": 0.01, "windows": [{"samples": 8, "seconds": 4.0}],
                            "compile": compile_info, "timings": {
                                "warmup_s": 20.0, "measure_s": 30.0,
                                **({} if baseline else {"compile_step_s": 74.0})}}})

    base = compiled(0, {}, baseline=True)
    charged = {}
    for name, info in {"stored": {"backend_s": 58.0, "cached": True},
                       "bypassed": {"backend_s": 58.0, "cached": False},
                       "unknown": {},  # an older trial, or a torch without the timers
                       "malformed": {"backend_s": "58", "cached": True},
                       "not finite": {"backend_s": float("nan"), "cached": True},
                       "a bool": {"backend_s": True, "cached": True},
                       "past the step": {"backend_s": 500.0, "cached": True}}.items():
        snap = _snap([base, compiled(1, info)])
        assert snap.trial(1).compile_step_s == 74.0
        charged[name] = snap.trial(1).recompile_s
    assert charged["stored"] == pytest.approx(74.0 - (1 - CACHE_LOAD_SHARE) * 58.0)
    for name in ("bypassed", "unknown", "malformed", "not finite", "a bool"):
        assert charged[name] == 74.0, name  # compiled cold again: the whole step
    assert charged["past the step"] == pytest.approx(CACHE_LOAD_SHARE * 74.0)
    # What a round costs: the recompile instead of the cold compile.
    stored, cold = (_snap([base, compiled(1, info)]) for info in (
        {"backend_s": 58.0, "cached": True}, {}))
    gap = costs(cold, candidates(cold, 3), SETTINGS)[1] - costs(
        stored, candidates(stored, 3), SETTINGS)[1]
    assert gap == pytest.approx((1 - CACHE_LOAD_SHARE) * 58.0)

def test_a_noisy_fits_lower_end_is_no_shorter_than_a_measured_smaller_batchs_step() -> None:
    # A default run on a drifting machine: bf16 8x1 in 6.0 s, 16x1 in 15.4 s, 32x1 in 21.3 s.
    # The fit's leave-one-out error is above 100%, so its lower end for 64x1 was below zero,
    # and 64x1 started with 65 s of the search left, to be cut by it. A step of 64 samples
    # takes no less than the 21.3 s of 32: warm-up and two windows need more than is left.
    line = [Observation(Config(micro_batch_size=m, amp="bf16"), "ok", m / t, GIB,
                        spread_cv=0.05, number=i)
            for i, (m, t) in enumerate(((8, 6.0), (16, 15.4), (32, 21.3)))]
    model = StepTimeModel(line)
    config = Config(micro_batch_size=64, amp="bf16")
    p = model.predict(config)
    assert p is not None and p.error > 1.0 and p.low_s == pytest.approx(21.3)
    plan = plan_trial(config, model, SETTINGS, trial_timeout_s=180.0, startup_s=5.0,
                      left_s=65.0)
    assert plan.no_room is not None and "needs >= " in plan.no_room
    # With room for it, it runs.
    assert plan_trial(config, model, SETTINGS, trial_timeout_s=180.0, startup_s=5.0,
                      left_s=600.0).no_room is None
