"""The measuring protocol, once: when warm-up ends, how many steps a window takes, when
measuring stops, when a config is too slow to measure at all, and what the timed windows say.

Pure rules, composed once by a state machine (``Measuring``) that whoever times the steps
feeds: the built-in loop (``trial.bench.loop``), a script's driver (``trial.driver``). The
tuner's budget (``tuner.budget``) sizes a trial's measuring time by the same rules. The windows'
statistics (rates, median, spread, where the time went) are derived here only, from the raw
window times, as ``torch.utils.benchmark``'s ``Measurement`` derives its median and IQR.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import cast

from autotune.trial.result import WarmUpInfo, Window
from autotune.trial.spec import MeasureSettings

# Past its minimum steps, warm-up ends once it has used this share of the measuring budget:
# long steps that never quite agree must leave time for the windows.
WARMUP_TIME_SHARE = 0.4
# The first step carries one-time costs (lazy init, loader start-up, autotuning): it measures up
# to ~1.6x a steady step here.
FIRST_STEP_FACTOR = 1.6
# How far past the measuring budget warm-up and one window may be foreseen to end before the
# config is too slow to measure: twice the budget while only the first step is known (its
# one-time costs inflate the estimate), a quarter more once a steady step is.
FIRST_STEP_ALLOWANCE = 2.0
STEADY_ALLOWANCE = 1.25
# What a trial needs after its last step to write its result and exit, before its timeout.
END_MARGIN_S = 3.0
# The fewest windows that give a spread: one window's rate has no spread.
SPREAD_WINDOWS = 2
# Where one step fills a window (steps of ``min_window_s`` or more: BERT-base on a 2-core CPU
# takes 3-30 s a step), each window costs a whole step: two windows give the spread, and a
# third is timed only when they disagree by more than ``target_cv``.
LONG_STEP_MAX_WINDOWS = 3
# How closely warm-up's last two steps must agree for the last to count as a window.
SHARED_STEP_TOLERANCE = 0.05
# A step time below this is no basis for sizing a window (a clock that did not advance).
_MIN_STEP_S = 1e-6

# Why warm-up ended (``WarmUpInfo.ended_by``).
STABLE, TIME, MAX_STEPS = "stable", "time", "max_steps"


class Stop(StrEnum):
    """Why measuring stopped (``Answer.why``)."""

    SETTLED = "settled"  # the fewest windows agree within ``target_cv``
    MAX_WINDOWS = "max_windows"
    BUDGET_SPENT = "budget"  # another window would end past the budget or the trial timeout
    TOO_SLOW = "too_slow"  # warm-up and a window do not fit the measuring budget
    TOO_LATE = "too_late"  # warm-up and a window would not end before the trial timeout
    STUCK = "stuck"  # a step had not ended by the longest a trial measures


@dataclass
class WarmUp:
    """Warm-up so far: each step's seconds, why it ended (None while it runs), and when it
    started on the caller's clock (the measuring budget counts from there)."""

    step_times: list[float] = field(default_factory=list)
    ended_by: str | None = None
    started: float = 0.0
    # The last step as this rank timed it (its own seconds, data and all-reduce waits): the
    # first window when ``first_window_from_warmup``.
    last: dict[str, float] = field(default_factory=dict)

    def record(self, seconds: float) -> WarmUpInfo:
        """Its form in the result, ``seconds`` long in all."""
        return {"steps": len(self.step_times), "seconds": seconds, "ended_by": self.ended_by,
                "step_times_s": self.step_times}


def warmup_ended(step_times: Sequence[float], elapsed: float,
                 settings: MeasureSettings) -> str | None:
    """Why warm-up ends after these steps, or None to time another: from ``warmup_min_steps``
    on, the last two agree within ``warmup_tolerance``, neither of them the first
    (``STABLE``), or ``elapsed`` seconds since warm-up started passed ``WARMUP_TIME_SHARE`` of
    the budget (``TIME``; before the minimum never: the first step is no measure of steady
    state); at ``warmup_max_steps``, ``MAX_STEPS``."""
    n = len(step_times)
    # The pair that agrees never includes the first step: its one-time costs can make it match
    # the second by chance (a BERT trial here: 8.97 s, 7.93 s, then steady steps of 6.7 s).
    if n >= max(settings.warmup_min_steps, 3):
        a, b = step_times[-2], step_times[-1]
        if abs(a - b) / max(a, b, 1e-12) <= settings.warmup_tolerance:
            return STABLE
    if n >= settings.warmup_min_steps and elapsed > WARMUP_TIME_SHARE * settings.max_seconds:
        return TIME
    return MAX_STEPS if n >= settings.warmup_max_steps else None


def first_window_from_warmup(warm: WarmUp, settings: MeasureSettings) -> bool:
    """Whether warm-up's last step is also the first timed window: warm-up ended because its
    last two steps agree, neither of them the first (which carries one-time costs), within
    ``SHARED_STEP_TOLERANCE`` (so the last is a steady step, timed whole, data loading
    included, synchronised at both edges, as a window is), and one step fills a window. Where
    steps take seconds this saves a whole step per trial; elsewhere windows are sized from
    warm-up's last step and start after it. (A second step is no steady one: see
    ``warmup_ended``.)"""
    times = warm.step_times
    if warm.ended_by != STABLE or len(times) < 3:
        return False
    a, b = times[-2], times[-1]
    return abs(a - b) / max(a, b, 1e-12) <= SHARED_STEP_TOLERANCE \
        and steps_per_window(b, settings) == 1


def too_slow(step_s: float, steps_done: int, elapsed: float, settings: MeasureSettings) -> bool:
    """Whether warm-up and one window cannot fit the measuring budget, judged while warm-up is
    below its minimum (``steps_done`` steps timed, ``elapsed`` seconds since it started, steps
    of ``step_s``): the rest of warm-up's minimum and a one-step window, against
    ``FIRST_STEP_ALLOWANCE`` times the budget while only the first step is known, else
    ``STEADY_ALLOWANCE`` times. Judging this early, rather than burning the trial timeout,
    is what makes a too-slow config cheap."""
    still = max(settings.warmup_min_steps - steps_done, 0) + 1
    allowance = FIRST_STEP_ALLOWANCE if steps_done <= 1 else STEADY_ALLOWANCE
    return elapsed + still * step_s > allowance * settings.max_seconds


def ends_too_late(step_s: float, steps_done: int, left_s: float, settings: MeasureSettings,
                  warmed_up: bool = False) -> bool:
    """Whether the trial's hard end (its timeout, ``left_s`` seconds away) would come before
    one window is timed, at steady steps (the first one's over ``FIRST_STEP_FACTOR`` while
    only it is known): the fewest steps left are a one-step window once warm-up ended
    (``warmed_up``), else one more warm-up step (its minimum's rest, if more) and the window.
    Judged after every warm-up step, not only below the minimum: the measuring budget's
    allowances above may reach past the trial timeout (a budget of 0.8 of it, allowed twice
    over), and a trial the timeout kills has spent all of it for no result. (A 64 x 1 fp32
    BERT trial here, ~43 s a step in a 144 s budget, ran into its 180 s timeout.)"""
    if steps_done < 1 or not math.isfinite(left_s):
        return False
    steady = step_s / FIRST_STEP_FACTOR if steps_done == 1 else step_s
    still = 1 if warmed_up else max(settings.warmup_min_steps - steps_done, 1) + 1
    return still * steady + END_MARGIN_S > left_s


def steps_per_window(step_s: float, settings: MeasureSettings) -> int:
    """Whole optimizer steps per window, so a window lasts ``min_window_s`` at steps of
    ``step_s`` (warm-up's last): at least one."""
    return max(1, math.ceil(settings.min_window_s / max(step_s, _MIN_STEP_S)))


def window_counts(per_window: int, settings: MeasureSettings) -> tuple[int, int]:
    """The fewest and the most timed windows of ``per_window`` steps each: the settings', or,
    where one step fills a window (``per_window`` 1: ``steps_per_window`` of a step of
    ``min_window_s`` or more), ``SPREAD_WINDOWS`` and ``LONG_STEP_MAX_WINDOWS`` (never more
    than the settings'). Decided once, from warm-up's last step: a trial whose steps slow
    down later keeps the windows it started with."""
    if per_window != 1:
        return settings.min_windows, settings.max_windows
    least = min(settings.min_windows, SPREAD_WINDOWS)
    return least, max(least, min(settings.max_windows, LONG_STEP_MAX_WINDOWS))


def windows_done(rates: Sequence[float], elapsed: float, last_s: float,
                 settings: MeasureSettings, per_window: int = 0) -> Stop | None:
    """Why measuring stops after windows of these ``rates`` (the last ``last_s`` seconds long,
    ``elapsed`` since warm-up started, ``per_window`` steps each; 0: not known), or None to
    time another: the fewest windows (``window_counts``) agree within ``target_cv``
    (``SETTLED``), the most (``MAX_WINDOWS``), or another window like the last would run past
    the budget, warm-up included (``BUDGET_SPENT``; never before the first window)."""
    least, most = window_counts(per_window, settings)
    if len(rates) >= least and median_and_cv(rates)[1] <= settings.target_cv:
        return Stop.SETTLED
    if len(rates) >= most:
        return Stop.MAX_WINDOWS
    return Stop.BUDGET_SPENT if elapsed + last_s > settings.max_seconds else None


def measuring_seconds(step_s: float, settings: MeasureSettings,
                      windows: int | None = None) -> float:
    """How long warm-up and ``windows`` timed windows (default ``min_windows``) take at steps
    of ``step_s``, at most: the first step carries start-up costs (``FIRST_STEP_FACTOR``), so
    it rarely agrees with the second and warm-up takes one step more than its minimum; a window
    is at least ``min_window_s`` and one step, and at most a step more (``steps_per_window``
    rounds up). Where one step fills a window, the fewest windows are ``window_counts``', and
    warm-up's last step is the first of them (``first_window_from_warmup``)."""
    warm = (settings.warmup_min_steps + FIRST_STEP_FACTOR) * step_s
    per_window = steps_per_window(step_s, settings)
    long = per_window == 1
    window = max(settings.min_window_s, step_s) + (0.0 if long else step_s)
    count = window_counts(per_window, settings)[0] if windows is None else windows
    return warm + max(count - (1 if long else 0), 0) * window


# -- what the windows say -------------------------------------------------------------------------


def median_and_cv(values: Sequence[float]) -> tuple[float, float]:
    """Median and coefficient of variation (sample stdev / mean; 0 for fewer than 2 values)."""
    if not values:
        raise ValueError("no values")
    med = statistics.median(values)
    if len(values) < 2:
        return med, 0.0
    mean = statistics.fmean(values)
    return med, statistics.stdev(values) / mean if mean > 0 else math.inf


@dataclass(frozen=True)
class WindowStats:
    """Timed windows and every figure derived from them: the one place rates, their median and
    spread, the wait shares and the step time are computed."""

    windows: Sequence[Window]

    @property
    def rates(self) -> list[float]:
        """Samples per second of each window."""
        return [w["samples"] / w["seconds"] for w in self.windows]

    @property
    def median(self) -> float:
        """The median window's rate: the trial's samples per second."""
        return median_and_cv(self.rates)[0]

    @property
    def spread(self) -> float | None:
        """The rates' coefficient of variation; None from a single window (unknown, not
        zero)."""
        rates = self.rates
        return median_and_cv(rates)[1] if len(rates) >= SPREAD_WINDOWS else None

    @property
    def step_time_s(self) -> float:
        """Seconds per optimizer step over all the windows."""
        return sum(w["seconds"] for w in self.windows) / sum(w["steps"] for w in self.windows)

    @property
    def breakdown(self) -> dict[str, float]:
        """Shares of the timed wall time: waiting for data, waiting for the gradient all-reduce
        (multi-rank trials only), and the rest (compute, optimizer, launch overheads). A wait
        no window measured (a script that does not report it) is absent: unknown, not zero."""
        windows = self.windows
        total = sum(w["seconds"] for w in windows)
        if total <= 0:
            return {}
        shares = {}
        if any("data_wait_s" in w for w in windows):
            shares["data_wait"] = sum(w.get("data_wait_s", 0.0) for w in windows) / total
        if any("comm_wait_s" in w for w in windows):
            shares["comm_wait"] = sum(w.get("comm_wait_s", 0.0) for w in windows) / total
        shares["compute"] = max(0.0, 1.0 - sum(shares.values()))
        return shares


# -- the protocol, fed with step ends -------------------------------------------------------------


class Next(StrEnum):
    """What the caller does after a step end it fed the protocol."""

    STEP = "step"  # time (or wait for) another step
    WARMED_UP = "warmed_up"  # warm-up ended: windows of ``per_window`` steps follow
    WINDOW = "window"  # a window closed: time the next
    STOP = "stop"  # measuring is over, for ``Answer.why``


@dataclass(frozen=True)
class Answer:
    """What comes next, why it stops, and what ended (``seconds``) as every rank agrees (the
    slowest rank's); a window's rate is ``WindowStats``', over all ranks' samples."""

    next: Next
    why: Stop | None = None
    seconds: float = 0.0
    rate: float = 0.0

    @property
    def stop(self) -> bool:
        return self.next is Next.STOP


@dataclass
class Measuring:
    """Warm-up, windows, a stop: fed each step end (warm-up's, then each window's) by whoever
    times the steps, on its ``clock`` (tests pass a fake one), against the trial's hard end on
    it (``ends_by``); it keeps the windows fed, for the result, and answers what comes next."""

    settings: MeasureSettings
    ends_by: float = math.inf
    clock: Callable[[], float] = time.time
    # Each value's maximum over the ranks (``Ranks.agree``): each rank of a built-in trial feeds
    # its own steps, all decide alike (none leaves a collective its peers wait in), and its
    # samples count ``ranks`` times. A script's driver feeds all ranks' steps at once.
    agree: Callable[..., Sequence[float]] = lambda *values: values
    ranks: int = 1
    # Cleared for what a script that exited reported: the stops that spare waiting for its
    # steps (too slow, too late, stuck) have nothing left to spare.
    more_to_come: bool = True
    windows: list[Window] = field(default_factory=list)
    warm: WarmUp = field(default_factory=WarmUp)
    per_window: int = 0
    shared: bool = False  # warm-up's last step is the first window (first_window_from_warmup)
    _decided: list[Window] = field(default_factory=list, init=False)  # as the ranks agree
    _micro0_s: float = field(default=0.0, init=False)

    def start(self, at: float | None = None) -> None:
        """Warm-up starts, ``at`` (default: now): the budget counts from here."""
        self.warm.started = self.clock() if at is None else at

    def first_step_so_far(self, micro: int, accum: int) -> Answer:
        """The first step runs, ``micro`` of ``accum`` micro-steps done (the built-in loop sees
        them): too slow already? Micro-step 0 carries the start-up costs: with 3+, the estimate
        uses the later ones (or a long accumulation multiplies those costs by its count)."""
        (elapsed,) = self.agree(self.clock() - self.warm.started)
        if micro == 1:
            self._micro0_s = elapsed
            if accum > 2:
                return Answer(Next.STEP)
            step_s = elapsed * accum
        else:
            step_s = (elapsed - self._micro0_s) / (micro - 1) * accum
        return self._judged(Answer(Next.STEP, seconds=step_s), 0, elapsed, math.inf)

    def warmup_step(self, seconds: float, at: float | None = None, **waits: float) -> Answer:
        """Warm-up's next step ended, ``at`` (default: now), ``seconds`` long as this caller
        timed it, with its ``waits`` (the first window's, where it is one)."""
        now = self.clock() if at is None else at
        warm, s = self.warm, self.settings
        step_s, elapsed, late = self.agree(seconds, now - warm.started, now - self.ends_by)
        warm.last = {"seconds": seconds, **waits}
        warm.step_times.append(step_s)
        warm.ended_by = warmup_ended(warm.step_times, elapsed, s)
        if warm.ended_by is not None:  # decided even where it stops here: its record says so
            self.per_window = steps_per_window(step_s, s)
            self.shared = first_window_from_warmup(warm, s)
        answer = Answer(Next.STEP if warm.ended_by is None else Next.WARMED_UP, seconds=step_s)
        return self._judged(answer, len(warm.step_times), elapsed, -late)

    def first_window(self, samples: int) -> Answer | None:
        """Warm-up's last step as the first window, where it is one (``samples``: its own)."""
        last = dict(self.warm.last)
        return self.window(last.pop("seconds"), samples, from_warmup=True, **last) \
            if self.shared and not self.windows else None

    def window(self, seconds: float, samples: int, at: float | None = None,
               **measured: float) -> Answer:
        """The next window ended, ``at`` (default: now), as this caller counted it (with what
        else it ``measured``: waits, its slowest rank): stop by ``windows_done``, or where
        another like it would not end (the result written) before the trial's timeout."""
        now = self.clock() if at is None else at
        slowest, elapsed, late = self.agree(seconds, now - self.warm.started, now - self.ends_by)
        steps = self.per_window  # 1 where the first window is warm-up's last step
        self.windows.append(cast(Window, {"steps": steps, "seconds": seconds, "samples": samples,
                                          **measured}))
        self._decided.append({"steps": steps, "seconds": slowest, "samples": samples * self.ranks})
        rates = WindowStats(self._decided).rates
        why = windows_done(rates, elapsed, slowest, self.settings, self.per_window)
        if why is None and self.more_to_come and slowest + END_MARGIN_S > -late:
            why = Stop.BUDGET_SPENT
        return Answer(Next.STOP if why else Next.WINDOW, why, slowest, rates[-1])

    def waited(self, last: float, now: float | None = None) -> Answer:
        """No step ended since ``last``, and it is ``now``: for a caller that sees time pass in a
        step, a script's driver (the built-in loop is inside it; the trial timeout ends a step
        that never does). Before a window, the latest step is judged at ``last`` (steps inside
        the first one too); past twice the budget, the longest a trial measures, ``STUCK``."""
        times, now = self.warm.step_times, self.clock() if now is None else now
        answer = Answer(Next.STEP, seconds=times[-1] if times else 0.0)
        if times and not self.windows:
            answer = self._judged(answer, len(times), last - self.warm.started,
                                  self.ends_by - last)
        if answer.stop or not self.more_to_come:
            return answer
        stuck = now - self.warm.started > FIRST_STEP_ALLOWANCE * self.settings.max_seconds
        return Answer(Next.STOP, Stop.STUCK, answer.seconds) if stuck else answer

    def next_window(self) -> tuple[int, int]:
        """The steps, counted from warm-up's start, the next window starts after and ends with."""
        a = len(self.warm.step_times) - self.shared + len(self.windows) * self.per_window
        return a, a + self.per_window

    def _judged(self, answer: Answer, done: int, elapsed: float, left: float) -> Answer:
        """``answer``, unless warm-up and a window, ``done`` steps in, cannot fit the budget
        (``too_slow``) or end before the trial's timeout ``left`` s away (``ends_too_late``)."""
        s, step_s = self.settings, answer.seconds
        if not self.more_to_come:
            return answer
        if done < s.warmup_min_steps and too_slow(step_s, done, elapsed, s):
            return Answer(Next.STOP, Stop.TOO_SLOW, step_s)
        if ends_too_late(step_s, done, left, s, self.warm.ended_by is not None):
            return Answer(Next.STOP, Stop.TOO_LATE, step_s)
        return answer


def stop_reason(answer: Answer, settings: MeasureSettings, of: str = "", timeout: str = "") -> str:
    """A too-slow config's reason: its step (``of``: whose) and the rule it breaks."""
    return f"one optimizer step{of} takes ~{answer.seconds:.1f}s; warm-up and a window " + (
        f"would not end before the trial timeout{timeout}" if answer.why is Stop.TOO_LATE
        else f"do not fit the {settings.max_seconds:.0f}s measuring budget")
