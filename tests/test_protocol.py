"""The measuring protocol's rules on crafted numbers: when warm-up ends, how many steps a window
takes, when measuring stops, what is too slow, what the windows say. Its state machine
(``Measuring``) fed step ends on a fake clock. And that the built-in loop and a script's driver,
given the same steps, decide alike (the loop on a fake clock: these tests check decisions, never
measured speed)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from autotune.config.knobs import Config
from autotune.trial import protocol
from autotune.trial.bench import loop
from autotune.trial.driver import StepDriver
from autotune.trial.protocol import (
    MAX_STEPS,
    STABLE,
    TIME,
    Measuring,
    Next,
    Stop,
    WarmUp,
    WindowStats,
    ends_too_late,
    measuring_seconds,
    steps_per_window,
    stop_reason,
    too_slow,
    warmup_ended,
    window_counts,
    windows_done,
)
from autotune.trial.result import Window
from autotune.trial.spec import MeasureSettings

S = MeasureSettings()  # the defaults: warm-up 2 to 8 steps within 15%, 1 s windows, 60 s budget
SETTLED, MAX_WINDOWS, BUDGET_SPENT = Stop.SETTLED, Stop.MAX_WINDOWS, Stop.BUDGET_SPENT


# -- warm-up --------------------------------------------------------------------------------------

def test_warm_up_ends_when_two_steps_in_a_row_agree() -> None:
    assert warmup_ended([1.6, 1.0], 2.6, S) is None  # the first step carries start-up costs
    assert warmup_ended([1.6, 1.0, 1.1], 3.7, S) == STABLE  # within 15%
    assert warmup_ended([1.6, 1.0, 1.2], 3.8, S) is None  # 17% apart


def test_warm_up_never_ends_before_its_minimum() -> None:
    # One step agrees with nothing, and has used more than the time share: still not steady.
    assert warmup_ended([30.0], 30.0, S) is None
    at_least_four = replace(S, warmup_min_steps=4)
    assert warmup_ended([1.0, 1.0, 1.0], 3.0, at_least_four) is None
    assert warmup_ended([1.0, 1.0, 1.0, 1.0], 4.0, at_least_four) == STABLE
    # A minimum of one compares nothing until there are two steps after the first.
    assert warmup_ended([1.0], 1.0, replace(S, warmup_min_steps=1)) is None
    assert warmup_ended([1.0, 1.0], 2.0, replace(S, warmup_min_steps=1)) is None


def test_long_unsteady_steps_end_warm_up_on_time_to_leave_room_for_windows() -> None:
    share = protocol.WARMUP_TIME_SHARE * S.max_seconds  # 24 s of the 60 s budget
    assert warmup_ended([20.0, 12.0], share, S) is None  # not past it yet
    assert warmup_ended([20.0, 12.0], share + 0.1, S) == TIME
    # Steady wins over time: a warm-up that ends both ways is stable.
    assert warmup_ended([20.0, 12.0, 12.0], share + 0.1, S) == STABLE
    # The first step never counts towards steady: it agreeing with the second is chance.
    assert warmup_ended([12.0, 12.0], share + 0.1, S) == TIME
    assert warmup_ended([8.97, 7.93], 16.9, S) is None


def test_warm_up_that_never_settles_ends_at_its_step_cap() -> None:
    times = [1.0, 2.0] * 4  # eight steps, each 50% off the last
    assert warmup_ended(times[:7], 10.5, S) is None
    assert warmup_ended(times, 12.0, S) == MAX_STEPS


def test_the_warm_up_record_is_its_stored_form() -> None:
    warm = WarmUp(step_times=[1.5, 1.0, 1.05], ended_by=STABLE)
    assert warm.record(3.6) == {"steps": 3, "seconds": 3.6, "ended_by": "stable",
                                "step_times_s": [1.5, 1.0, 1.05]}


# -- too slow -------------------------------------------------------------------------------------

def test_the_first_step_is_judged_against_twice_the_budget() -> None:
    # 17 s steps after one: warm-up needs one more and a window one: 17 + 34 s.
    assert not too_slow(17.0, 1, 17.0, replace(S, max_seconds=40.0))  # 51 <= 80
    assert too_slow(17.0, 1, 17.0, replace(S, max_seconds=20.0))  # 51 > 40


def test_later_steps_are_judged_against_a_quarter_more_than_the_budget() -> None:
    three = replace(S, warmup_min_steps=3)
    # Two steps of 12 s done: one more and a one-step window, 24 + 24 = 48 s.
    assert not too_slow(12.0, 2, 24.0, replace(three, max_seconds=40.0))  # <= 1.25 x 40
    assert too_slow(12.0, 2, 24.0, replace(three, max_seconds=38.0))  # > 1.25 x 38 = 47.5
    # The same clock after one step: two more to come, against twice the budget.
    assert not too_slow(12.0, 1, 24.0, replace(three, max_seconds=38.0))  # 60 <= 76


def test_a_first_step_still_running_is_judged_from_its_micro_steps() -> None:
    # No step done: all of warm-up's minimum and a window are still to come.
    assert not too_slow(10.0, 0, 5.0, replace(S, max_seconds=20.0))  # 5 + 30 <= 40
    assert too_slow(10.0, 0, 15.0, replace(S, max_seconds=20.0))  # 15 + 30 > 40


# -- windows --------------------------------------------------------------------------------------

@pytest.mark.parametrize("step_s,steps", [(0.3, 4), (0.25, 4), (1.0, 1), (2.5, 1), (0.0, 10**6)])
def test_a_window_is_whole_steps_lasting_at_least_min_window_s(step_s: float, steps: int) -> None:
    assert steps_per_window(step_s, S) == steps


def test_measuring_stops_once_enough_windows_agree() -> None:
    assert windows_done([100.0, 100.0], 10.0, 1.0, S) is None  # fewer than min_windows (3)
    assert windows_done([100.0, 101.0, 99.0], 10.0, 1.0, S) == SETTLED  # CV 1% <= 3%
    assert windows_done([100.0, 120.0, 80.0], 10.0, 1.0, S) is None  # CV 20%


def test_measuring_stops_at_the_window_cap_or_the_budget() -> None:
    noisy = [100.0, 150.0] * 5
    assert windows_done(noisy[:9], 20.0, 1.0, S) is None
    assert windows_done(noisy, 20.0, 1.0, S) == MAX_WINDOWS
    # Another window like the last would run past the budget, warm-up included.
    assert windows_done([100.0], 50.0, 10.0, S) is None  # 60 s: still within
    assert windows_done([100.0], 50.0, 10.1, S) == BUDGET_SPENT


def test_where_a_step_fills_a_window_two_windows_settle_and_three_at_most() -> None:
    """BERT-base on a 2-core CPU takes seconds a step: each window costs a whole step."""
    assert window_counts(steps_per_window(0.3, S), S) == (3, 10)  # short steps: the settings'
    assert steps_per_window(1.0, S) == steps_per_window(12.0, S) == 1
    assert window_counts(1, S) == (2, 3)
    assert windows_done([2.40, 2.42], 30.0, 10.0, S, per_window=1) == SETTLED
    assert windows_done([2.40, 2.70], 30.0, 10.0, S, per_window=1) is None  # they disagree
    assert windows_done([2.40, 2.70, 2.50], 40.0, 10.0, S, per_window=1) == MAX_WINDOWS
    # Windows of two short steps keep the settings' counts, even where the steps slow down
    # past a window's length later (the windows were sized once, from warm-up's last step).
    assert windows_done([2.40, 2.70, 2.50], 40.0, 10.0, S, per_window=2) is None
    # The settings' own caps still hold: one window where one is all they allow.
    assert window_counts(1, replace(S, min_windows=1, max_windows=1)) == (1, 1)


def test_a_single_window_can_settle_when_one_is_enough() -> None:
    assert windows_done([100.0], 1.0, 1.0, replace(S, min_windows=1)) == SETTLED


# -- the budget's time model ----------------------------------------------------------------------

def test_measuring_time_is_warm_up_and_windows_at_most() -> None:
    # Short steps: warm-up's minimum plus the first step's extra, then windows a step longer
    # than min_window_s at most.
    assert measuring_seconds(0.3, S) == pytest.approx((2 + 1.6) * 0.3 + 3 * (1.0 + 0.3))
    # Long steps: a window is one step, two windows are the fewest, and warm-up's last, steady
    # step is the first of them.
    assert measuring_seconds(5.0, S) == pytest.approx((2 + 1.6) * 5.0 + 1 * 5.0)
    assert measuring_seconds(5.0, S, windows=3) == pytest.approx((2 + 1.6) * 5.0 + 2 * 5.0)


@pytest.mark.parametrize("step_s", [0.01, 0.07, 0.3, 0.33, 0.5, 0.99, 1.0, 1.01, 7.0])
def test_the_budget_model_holds_every_window_the_loop_would_time(step_s: float) -> None:
    window = steps_per_window(step_s, S) * step_s
    one_more = measuring_seconds(step_s, S, windows=3) - measuring_seconds(step_s, S, 2)
    assert S.min_window_s <= window + 1e-12 and window <= one_more + 1e-12


def test_warm_ups_last_steady_step_is_the_first_window_where_a_step_fills_one() -> None:
    stable = WarmUp(step_times=[16.0, 10.0, 10.2], ended_by=STABLE)
    assert protocol.first_window_from_warmup(stable, S)
    short = WarmUp(step_times=[0.5, 0.3, 0.31], ended_by=STABLE)
    assert not protocol.first_window_from_warmup(short, S)  # windows of several steps
    unsettled = WarmUp(step_times=[16.0, 10.0, 13.0], ended_by=protocol.TIME)
    assert not protocol.first_window_from_warmup(unsettled, S)  # no steady step proven
    # Steps 1 and 2 agreed within warm-up's 15%, but a second step is still warming (seen:
    # 8.97 s, 7.93 s, then 6.7 s steps): not a window.
    second = WarmUp(step_times=[8.97, 7.93], ended_by=STABLE)
    assert not protocol.first_window_from_warmup(second, S)
    loose = WarmUp(step_times=[16.0, 11.0, 10.0], ended_by=STABLE)  # 9% apart: not steady enough
    assert not protocol.first_window_from_warmup(loose, S)


# -- what the windows say -------------------------------------------------------------------------

def _windows(*pairs: tuple[int, float], **waits: float) -> list[Window]:
    out: list[Window] = []
    for samples, seconds in pairs:
        w: Window = {"samples": samples, "seconds": seconds, "steps": 2}
        if "data" in waits:
            w["data_wait_s"] = waits["data"]
        out.append(w)
    return out


def test_window_stats_derive_rates_median_spread_and_step_time() -> None:
    stats = WindowStats(_windows((100, 1.0), (100, 0.5), (100, 0.8)))
    assert stats.rates == [100.0, 200.0, 125.0]
    assert stats.median == 125.0
    assert stats.spread == pytest.approx(protocol.median_and_cv([100.0, 200.0, 125.0])[1])
    assert stats.step_time_s == pytest.approx(2.3 / 6)


def test_one_window_has_no_spread_and_an_unmeasured_wait_is_absent() -> None:
    one = WindowStats(_windows((100, 2.0)))
    assert one.median == 50.0 and one.spread is None
    assert one.breakdown == {"compute": 1.0}  # no data wait reported: unknown, not zero
    waited = WindowStats(_windows((100, 1.0), (100, 1.0), data=0.5))
    assert waited.breakdown == {"data_wait": 0.5, "compute": 0.5}


# -- one protocol: the loop and the driver decide alike -------------------------------------------

@dataclass
class _Clock:
    now: float = 1000.0

    def time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


class _Ranks:
    def agree(self, *values: float) -> list[float]:
        return list(values)


@dataclass
class _Trainer:
    """Steps that take the given seconds on the clock, one after another."""

    clock: _Clock
    steps: list[float]
    config: Config = field(default_factory=lambda: Config(micro_batch_size=8))
    ranks: _Ranks = field(default_factory=_Ranks)
    comm: None = None
    taken: int = 0

    def sync(self) -> None:
        pass

    def step(self, after_micro: Any = None) -> float:
        self.clock.now += self.steps[self.taken]
        self.taken += 1
        return 0.0

    def nonfinite_steps(self) -> int:
        return 0


class _Progress:
    def emit(self, event: str, **data: Any) -> None:
        pass


def _loop(steps: list[float], settings: MeasureSettings, monkeypatch: pytest.MonkeyPatch,
          ends_after: float = math.inf) -> tuple[WarmUp, int, list[Window]]:
    """The bench's loop over ``steps``, its trial timeout ``ends_after`` seconds after
    warm-up starts."""
    clock = _Clock()
    monkeypatch.setattr(loop, "time", clock)  # the loop times its steps on it too
    trainer: Any = _Trainer(clock, steps)
    m = Measuring(settings, clock.now + ends_after, clock.time, trainer.ranks.agree)
    warm = loop.warm_up(trainer, m, _Progress())  # type: ignore[arg-type]
    per = loop.measure_windows(trainer, m, _Progress())  # type: ignore[arg-type]
    return warm, per, m.windows


def _driver(tmp_path: Path, steps: list[float], settings: MeasureSettings,
            timeout_s: float = math.inf) -> StepDriver:
    # Step 1 is the script's start-up (its start is not reported); steps 2, ... are the loop's.
    tmp_path.mkdir(exist_ok=True)
    ends = [time.time() - sum(steps) - 1.0]
    for s in steps:
        ends.append(ends[-1] + s)
    with open(tmp_path / "steps.rank0.jsonl", "w") as f:
        for i, t in enumerate(ends):
            f.write(json.dumps({"s": i + 1, "t": t, "n": 8}) + "\n")
    d = StepDriver(tmp_path, 1, settings, "train.py", str(tmp_path / "progress.jsonl"),
                   str(tmp_path / "result.json"), started=ends[0] - 5.0, timeout_s=timeout_s)
    d.poll()
    return d


@pytest.mark.parametrize("steps,settings,expected", [
    # Settles at once; three windows of 4 steps agree.
    ([0.5, 0.3, 0.3] + [0.25] * 60, replace(S, min_window_s=1.0), (STABLE, 4, 3)),
    # Never steady within the tolerance: warm-up ends at its cap, windows stop at theirs.
    ([0.2, 0.1] * 4 + [0.1, 0.2] * 40, replace(S, min_window_s=0.25, max_windows=4),
     (MAX_STEPS, 3, 4)),
    # Long steady steps: warm-up's last step is the first window; two agree and settle.
    ([8.0, 5.0, 5.1, 5.05, 5.0, 5.0], S, (STABLE, 1, 2)),
    # Long steps that disagree: a third window, then the cap for long steps.
    ([8.0, 5.0, 5.1, 6.0, 5.0, 5.0, 5.0], S, (STABLE, 1, 3)),
    # Long unsteady steps: warm-up ends on time, one window, then the budget is spent.
    ([3.0, 4.5, 3.0, 6.0] + [4.0] * 10, replace(S, max_seconds=20.0), (TIME, 1, 1)),
])
def test_the_loop_and_the_driver_decide_alike_on_the_same_steps(
        steps: list[float], settings: MeasureSettings, expected: tuple[str, int, int],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    warm, per, windows = _loop(steps, settings, monkeypatch)
    assert (warm.ended_by, per, len(windows)) == expected
    d = _driver(tmp_path, steps, settings)
    assert d.done and json.loads((tmp_path / "result.json").read_text())["status"] == "ok"
    # (The step files' clock is the wall clock's: its end times are good to a microsecond.)
    assert d.warmup.ended_by == warm.ended_by
    assert d.warmup.step_times == pytest.approx(warm.step_times, abs=1e-5)
    assert d.per_window == per
    assert [w["seconds"] for w in d.windows] == pytest.approx([w["seconds"] for w in windows],
                                                              abs=1e-5)


def test_the_loop_and_the_driver_give_up_alike_on_steps_the_budget_cannot_measure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One 30 s step: another and a one-step window would end at 90 s, past twice 40 s.
    settings = replace(S, max_seconds=40.0)
    with pytest.raises(loop.TooSlow) as slow:
        _loop([30.0, 30.0, 30.0], settings, monkeypatch)
    assert slow.value.step_s == 30.0 and slow.value.rate == pytest.approx(8 / 30.0)
    d = _driver(tmp_path, [30.0], settings)
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["status"], d.give_up) == ("timeout", True)
    assert result["reason"].startswith("one optimizer step of train.py takes ~30.0s")
    # With a budget that holds them, neither gives up.
    assert not _driver(tmp_path / "more", [30.0], replace(S, max_seconds=46.0)).done


def test_a_trial_stops_itself_when_it_cannot_be_measured_before_its_timeout() -> None:
    # 64 x 1 fp32 BERT: a 144 s budget (0.8 of a 180 s timeout) that the allowances above
    # let reach past the timeout. After one 55 s step (one-time costs included), 110 s left:
    # one more warm-up step and a window at a steady ~34 s fit; 60 s left, they do not.
    assert not too_slow(55.0, 1, 55.0, replace(S, max_seconds=144.0))  # the budget's rule
    assert not ends_too_late(55.0, 1, 110.0, S)  # 2 x 55 / 1.6 + 3 = 71.75 <= 110
    assert ends_too_late(55.0, 1, 60.0, S)
    # Judged past warm-up's minimum too: after two steady 43 s steps, 80 s left hold one
    # more step and a window (89 s) no longer.
    assert ends_too_late(43.0, 2, 80.0, S) and not ends_too_late(43.0, 2, 90.0, S)
    # Where this step ended warm-up, only a window is left to time.
    assert not ends_too_late(43.0, 2, 80.0, S, warmed_up=True)
    assert ends_too_late(43.0, 2, 45.0, S, warmed_up=True)
    # No step done (the first is judged from its micro-steps), or no timeout known: never.
    assert not ends_too_late(55.0, 0, 1.0, S) and not ends_too_late(55.0, 3, math.inf, S)


def test_the_loop_stops_before_its_timeout_rather_than_be_killed_by_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    long = replace(S, max_seconds=144.0)
    # 65 s, then 50 s steps with 155 s left at warm-up's start: warm-up ends on time after
    # step 2, and its window would end past the timeout. It stops there, as too slow.
    with pytest.raises(loop.TooSlow) as slow:
        _loop([65.0, 50.0, 50.0, 50.0], long, monkeypatch, ends_after=155.0)
    assert slow.value.late and slow.value.step_s == 50.0
    # 55 s then 43 s steps with 165 s left: the window fits, and is the result.
    warm, _, windows = _loop([55.0, 43.0, 43.0, 43.0], long, monkeypatch, ends_after=165.0)
    assert (warm.ended_by, len(windows)) == (TIME, 1)
    # Steady steps that disagree would take a third window; with 40 s left at warm-up's
    # start the second window's end leaves no room for one, and the two are the result.
    steps = [10.0, 8.0, 8.0, 9.5, 8.0, 8.0]
    assert len(_loop(steps, replace(S, max_seconds=1000.0), monkeypatch)[2]) == 3
    assert len(_loop(steps, replace(S, max_seconds=1000.0), monkeypatch, 40.0)[2]) == 2


def test_the_driver_gives_up_on_a_script_that_cannot_be_measured_before_its_timeout(
        tmp_path: Path) -> None:
    # Two 40 s steps after a 5 s start-up: warm-up ends on time, and a window would end past
    # a 120 s timeout (35 s left); a 200 s timeout holds it.
    long = replace(S, max_seconds=144.0)
    d = _driver(tmp_path, [40.0, 40.0], long, timeout_s=120.0)
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["status"], d.give_up) == ("timeout", True)
    assert "would not end before the trial timeout (120s)" in result["reason"]
    assert result["ended_by"] == "trial_timeout"
    assert not _driver(tmp_path / "more", [40.0, 40.0], long, timeout_s=200.0).done


# -- the state machine, fed step ends on a fake clock ---------------------------------------------

def _fed(m: Measuring, clock: _Clock, steps: list[float], **waits: float) -> list[Next]:
    """Warm-up steps of these seconds, one after another on ``clock``; what each answered."""
    answers = []
    for seconds in steps:
        clock.now += seconds
        answers.append(m.warmup_step(seconds, **waits).next)
    return answers


def test_warm_up_then_windows_until_enough_of_them_agree() -> None:
    clock = _Clock(0.0)
    m = Measuring(S, clock=clock.time)
    m.start()
    assert _fed(m, clock, [0.5, 0.3, 0.3]) == [Next.STEP, Next.STEP, Next.WARMED_UP]
    assert (m.warm.ended_by, m.per_window, m.shared) == (STABLE, 4, False)  # 4 x 0.3 s >= 1 s
    assert m.first_window(32) is None and m.next_window() == (3, 7)
    answers = []
    for seconds in [1.2, 1.21, 1.19]:
        clock.now += seconds
        answers.append(m.window(seconds, 32, data_wait_s=0.1))
    assert [a.next for a in answers] == [Next.WINDOW, Next.WINDOW, Next.STOP]
    assert answers[-1].why is Stop.SETTLED  # three windows within 3%
    assert answers[0].rate == pytest.approx(32 / 1.2)
    assert m.windows[0] == {"steps": 4, "seconds": 1.2, "samples": 32, "data_wait_s": 0.1}
    assert m.next_window() == (15, 19)


def test_measuring_stops_at_the_window_cap_and_on_the_budget() -> None:
    clock = _Clock(0.0)
    m = Measuring(replace(S, max_windows=4), clock=clock.time)
    m.start()
    _fed(m, clock, [0.5, 0.3, 0.3])
    answers = []
    for seconds in [1.2, 1.8, 1.2, 1.8]:  # never within 3% of each other
        clock.now += seconds
        answers.append(m.window(seconds, 32))
    assert [a.why for a in answers] == [None, None, None, Stop.MAX_WINDOWS]
    m = Measuring(replace(S, max_seconds=5.0), clock=clock.time)
    m.start()
    _fed(m, clock, [0.5, 0.3, 0.3])
    clock.now += 3.0  # 4.1 s in: another 3 s window would end past the 5 s budget
    assert m.window(3.0, 32).why is Stop.BUDGET_SPENT


def test_where_a_step_fills_a_window_warm_ups_last_step_is_the_first() -> None:
    clock = _Clock(0.0)
    m = Measuring(S, clock=clock.time)
    m.start()
    assert _fed(m, clock, [8.0, 5.0, 5.1], data_wait_s=0.2)[-1] is Next.WARMED_UP
    assert (m.per_window, m.shared) == (1, True)
    first = m.first_window(8)
    assert first is not None and first.next is Next.WINDOW  # two windows give the spread
    assert m.windows == [{"steps": 1, "seconds": 5.1, "samples": 8, "data_wait_s": 0.2,
                          "from_warmup": True}]
    assert m.first_window(8) is None  # once
    assert m.next_window() == (3, 4)  # the step after warm-up's last
    clock.now += 5.05
    assert m.window(5.05, 8).why is Stop.SETTLED


def test_a_step_too_slow_for_the_budget_stops_warm_up_with_the_rule_it_breaks() -> None:
    clock, tight = _Clock(0.0), replace(S, max_seconds=40.0)
    m = Measuring(tight, clock=clock.time)
    m.start()
    clock.now = 30.0  # another step and a one-step window end at 90 s, past twice 40 s
    answer = m.warmup_step(30.0)
    assert (answer.next, answer.why, answer.seconds) == (Next.STOP, Stop.TOO_SLOW, 30.0)
    assert stop_reason(answer, tight) == ("one optimizer step takes ~30.0s; warm-up and a "
                                          "window do not fit the 40s measuring budget")
    assert stop_reason(answer, tight, " of train.py").startswith(
        "one optimizer step of train.py takes ~30.0s;")
    # A budget that holds them goes on; so do the steps of a script that exited (all it ran).
    roomy = Measuring(replace(S, max_seconds=46.0), clock=clock.time)
    roomy.start(0.0)
    assert roomy.warmup_step(30.0).next is Next.STEP
    done = Measuring(tight, clock=clock.time, more_to_come=False)
    done.start(0.0)
    assert done.warmup_step(30.0).next is Next.STEP


def test_the_first_step_is_judged_from_its_micro_steps_while_it_runs() -> None:
    clock = _Clock(0.0)
    m = Measuring(replace(S, max_seconds=20.0), clock=clock.time)
    m.start()
    clock.now = 4.0  # micro-step 0 carries the start-up: with 4, it is not the estimate
    assert m.first_step_so_far(1, 4).next is Next.STEP
    clock.now = 5.0  # 1 s a micro-step: 4 s steps, 5 + 3 x 4 s <= 40 s
    assert m.first_step_so_far(2, 4).next is Next.STEP
    clock.now = 15.0  # 5.5 s a micro-step after the first: 22 s steps, 15 + 66 s > 40 s
    answer = m.first_step_so_far(3, 4)
    assert (answer.why, answer.seconds) == (Stop.TOO_SLOW, pytest.approx(22.0))


def test_warm_up_that_would_not_end_before_the_timeout_stops_as_the_timeout_would() -> None:
    clock, long = _Clock(0.0), replace(S, max_seconds=144.0)
    m = Measuring(long, ends_by=155.0, clock=clock.time)
    m.start()
    # 65 s (one-time costs included), then 50 s: warm-up ends on time, and its window would
    # end past the timeout. Warm-up's record is kept as it ended.
    assert _fed(m, clock, [65.0]) == [Next.STEP]
    clock.now += 50.0
    answer = m.warmup_step(50.0)
    assert (answer.why, answer.seconds, m.warm.ended_by) == (Stop.TOO_LATE, 50.0, TIME)
    assert stop_reason(answer, long, timeout=" (180s)") == (
        "one optimizer step takes ~50.0s; warm-up and a window would not end before the "
        "trial timeout (180s)")


def test_a_window_that_would_not_end_before_the_timeout_is_not_started() -> None:
    clock = _Clock(0.0)
    m = Measuring(replace(S, max_seconds=1000.0), ends_by=40.0, clock=clock.time)
    m.start()
    assert _fed(m, clock, [10.0, 8.0, 8.0])[-1] is Next.WARMED_UP
    first = m.first_window(8)
    assert first is not None and first.next is Next.WINDOW  # 14 s left: 8 s and the margin fit
    clock.now += 9.5  # they disagree, but 4.5 s are left: no room for a third
    assert m.window(9.5, 8).why is Stop.BUDGET_SPENT
    # A script that exited ran what it ran: its windows are taken as they come.
    m = Measuring(replace(S, max_seconds=1000.0), ends_by=40.0, clock=clock.time)
    m.start(0.0)
    clock.now = 0.0
    _fed(m, clock, [10.0, 8.0, 8.0])
    m.more_to_come = False
    m.first_window(8)
    clock.now += 9.5
    assert m.window(9.5, 8).next is Next.WINDOW


def test_a_driver_waiting_on_a_step_gives_up_before_the_timeout_or_past_twice_the_budget() -> None:
    clock = _Clock(0.0)
    m = Measuring(S, ends_by=30.0, clock=clock.time)
    m.start()
    _fed(m, clock, [0.5, 0.3, 0.3])  # windows of 4 steps from here
    # Steps inside the first window: after the one at 20 s there is room for another.
    assert m.waited(last=20.0, now=20.1).next is Next.STEP
    answer = m.waited(last=26.8, now=26.9)  # 3.2 s left: not a 0.3 s step and the margin
    assert (answer.why, answer.seconds) == (Stop.TOO_LATE, 0.3)
    # Without a timeout: a step that has not ended by twice the budget, the longest a trial
    # measures, is given up on (with the windows so far, where there are any).
    m = Measuring(S, clock=clock.time)
    m.start(0.0)
    clock.now = 1.0
    m.warmup_step(1.0)
    assert m.waited(last=1.0, now=2 * S.max_seconds).next is Next.STEP
    answer = m.waited(last=1.0, now=2 * S.max_seconds + 0.1)
    assert (answer.next, answer.why, answer.seconds) == (Next.STOP, Stop.STUCK, 1.0)
    clock.now = 121.0
    assert m.waited(last=1.0).why is Stop.STUCK  # now: the clock's
    m.more_to_come = False  # a script that exited is waited on no longer
    assert m.waited(last=1.0).next is Next.STEP


def test_every_rank_decides_on_the_slowest_rank_s_numbers_and_keeps_its_own() -> None:
    clock = _Clock(0.0)

    def slower_peer(*values: float) -> list[float]:  # a peer 0.5 s behind in everything
        return [v + 0.5 for v in values]

    m = Measuring(S, clock=clock.time, agree=slower_peer, ranks=2)
    m.start()
    assert _fed(m, clock, [1.0, 1.0, 1.0], data_wait_s=0.1)[-1] is Next.WARMED_UP
    assert m.warm.step_times == [1.5, 1.5, 1.5]  # the slowest rank's
    assert m.warm.last == {"seconds": 1.0, "data_wait_s": 0.1}  # this rank's own
    first = m.first_window(8)
    assert first is not None and first.seconds == 1.5
    assert first.rate == pytest.approx(2 * 8 / 1.5)  # both ranks' samples at the slowest pace
    assert m.windows[0]["seconds"] == 1.0 and m.windows[0]["samples"] == 8


def test_the_loop_and_the_driver_stop_alike_before_the_timeout_with_their_windows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Steady steps that disagree would take a third window; 40 s after warm-up started, the
    # second window's end leaves no room for one. (The driver's trial started 5 s before
    # step 1 ended: its 45 s timeout ends 40 s after warm-up started.)
    steps, long = [10.0, 8.0, 8.0, 9.5, 8.0, 8.0], replace(S, max_seconds=1000.0)
    assert len(_loop(steps, long, monkeypatch, 40.0)[2]) == 2
    d = _driver(tmp_path, steps, long, timeout_s=45.0)
    result = json.loads((tmp_path / "result.json").read_text())
    assert (d.done, result["status"], len(result["windows"])) == (True, "ok", 2)
    assert len(_driver(tmp_path / "more", steps, long).windows) == 3
