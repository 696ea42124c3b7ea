"""The measuring protocol's rules on crafted numbers: when warm-up ends, how many steps a window
takes, when measuring stops, what is too slow, what the windows say. And that the built-in loop
and a script's driver, given the same steps, decide alike (the loop on a fake clock: these tests
check decisions, never measured speed)."""

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
    BUDGET_SPENT,
    MAX_STEPS,
    MAX_WINDOWS,
    SETTLED,
    STABLE,
    TIME,
    WarmUp,
    WindowStats,
    ends_too_late,
    measuring_seconds,
    past_allowance,
    steps_per_window,
    too_slow,
    warmup_ended,
    window_counts,
    window_ends_too_late,
    windows_done,
)
from autotune.trial.result import Window
from autotune.trial.spec import MeasureSettings

S = MeasureSettings()  # the defaults: warm-up 2 to 8 steps within 15%, 1 s windows, 60 s budget


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


def test_past_the_longest_allowance_a_stuck_step_is_given_up_on() -> None:
    assert not past_allowance(2 * S.max_seconds, S)
    assert past_allowance(2 * S.max_seconds + 0.1, S)


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
    monkeypatch.setattr(loop, "time", clock)
    trainer: Any = _Trainer(clock, steps)
    ends_by = clock.now + ends_after
    warm = loop.warm_up(trainer, settings, _Progress(), ends_by)  # type: ignore[arg-type]
    windows: list[Window] = []
    per = loop.measure_windows(trainer, settings, _Progress(), warm,  # type: ignore[arg-type]
                               windows, ends_by)
    return warm, per, windows


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


def test_no_window_is_started_that_would_not_end_before_the_timeout() -> None:
    assert window_ends_too_late(43.0, 45.0) and not window_ends_too_late(43.0, 47.0)


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
