"""The measuring protocol, once: when warm-up ends, how many steps a window takes, when
measuring stops, when a config is too slow to measure at all, and what the timed windows say.

Pure rules over numbers the caller measured with its own clock. The built-in workloads' loop
(``trial.bench.loop``) times steps inside the trial process; a script's driver
(``trial.driver``) reads them from the script's step reports; the tuner's budget
(``tuner.budget``) sizes a trial's measuring time by the same rules before it runs. The
statistics of the windows (rates, median, spread, where the time went) are derived here only,
from the raw window times, as ``torch.utils.benchmark``'s ``Measurement`` derives its median and
IQR from the raw times it keeps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

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
# Why measuring stopped.
SETTLED, MAX_WINDOWS, BUDGET_SPENT = "settled", "max_windows", "budget"


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
    warm-up's last step and start after it. (A BERT trial here ended warm-up on steps 1 and 2,
    8.97 s and 7.93 s, within 15%; its steady steps took 6.7 s: a second step is no steady
    one.)"""
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


def window_ends_too_late(last_s: float, left_s: float) -> bool:
    """Whether another window like the last (``last_s`` long) would not end, the result
    written, before the trial's timeout (``left_s`` seconds away): measuring stops with the
    windows it has."""
    return last_s + END_MARGIN_S > left_s


def past_allowance(elapsed: float, settings: MeasureSettings) -> bool:
    """Whether ``elapsed`` seconds since warm-up started are past the longest a trial may
    measure (``FIRST_STEP_ALLOWANCE`` times the budget): for a caller that can see a step that
    never ends (a script's driver), where it stops waiting."""
    return elapsed > FIRST_STEP_ALLOWANCE * settings.max_seconds


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
                 settings: MeasureSettings, per_window: int = 0) -> str | None:
    """Why measuring stops after windows of these ``rates`` (the last ``last_s`` seconds long,
    ``elapsed`` since warm-up started, ``per_window`` steps each; 0: not known), or None to
    time another: the fewest windows (``window_counts``) agree within ``target_cv``
    (``SETTLED``), the most (``MAX_WINDOWS``), or another window like the last would run past
    the budget, warm-up included (``BUDGET_SPENT``; never before the first window)."""
    least, most = window_counts(per_window, settings)
    if len(rates) >= least and median_and_cv(rates)[1] <= settings.target_cv:
        return SETTLED
    if len(rates) >= most:
        return MAX_WINDOWS
    return BUDGET_SPENT if elapsed + last_s > settings.max_seconds else None


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
