"""How long a config's steps take, before it runs, and the measuring budget that follows.

The **step-time model** sits beside the memory model (``search.MemoryModel``): seconds per
optimizer step as a function of samples per step, fitted per precision and rank count from the
study's own trials (``step = a + b x samples``: the optimizer step and per-step overheads, then
the forward and backward per sample). Its error comes from the same trials: the largest
leave-one-out miss once three or more distinct batch sizes ran, else an assumed ``ASSUMED_ERROR``,
said so.

It is used before a trial starts: a trial gets the measuring budget its warm-up and its windows
need (more than ``--trial-seconds`` when its steps are long, within ``--trial-timeout`` and what is
left of ``--timeout``), and a config whose steps cannot fit even that, by a fitted prediction
that allows for its error, is recorded as predicted-too-slow without running (as predicted OOMs
are). Pure functions over ``search.Observation``; the runner applies them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypedDict

from autotune.config.knobs import Config
from autotune.trial.measurement import Status
from autotune.trial.protocol import SPREAD_WINDOWS, measuring_seconds
from autotune.trial.spec import MeasureSettings
from autotune.tuner.search import Observation, fit_affine

ASSUMED_ERROR = 0.3  # the relative error assumed until three batch sizes of a line have run
# The longest measuring budget a trial gets, as a share of --trial-timeout (and never more than
# the timeout less the trial's start-up): the rest is slack for a step longer than predicted.
# Where steps take 20-30 s (BERT-base on a 2-core CPU) warm-up and two windows need ~4.6 steps:
# at 2/3 of the default 180 s, a 27 s step could not be measured at all.
MAX_BUDGET_SHARE = 0.8
# A trial's start-up (imports, model build, FLOPs counting, process start and end) when no
# trial has measured it yet: a third of the trial timeout, as the --trial-seconds rule leaves.
STARTUP_SHARE = 1 / 3


def speed_key(config: Config) -> tuple[Any, ...]:
    """The knobs that change seconds per sample the most: precision and ranks. Everything else
    (the micro-batch/accumulation split, the loader) is inside the model's error."""
    return config.amp, config.world_size


def _key_words(config: Config) -> str:
    return f"amp {config.amp}, {config.world_size} rank(s)"


class PredictionForm(TypedDict):
    """A step-time prediction as it is stored beside what the trial measured."""

    step_s: float
    error: float
    basis: str
    fitted: bool


class BudgetForm(TypedDict):
    """A trial's measuring budget as it is stored."""

    max_seconds: float
    prediction: PredictionForm | None


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds per optimizer step, its relative error and what it rests on."""

    step_s: float
    error: float  # relative: the step is expected within step_s x (1 +- error)
    basis: str  # one line: which trials, which fit, where the error came from
    fitted: bool  # an affine fit on two or more batch sizes (else scaled from one trial)
    # No shorter than a step the study measured with fewer or as many samples (same speed
    # key): a step does not get faster with more samples.
    floor_s: float = 0.0

    @property
    def low_s(self) -> float:
        """The prediction's lower end: ``step_s x (1 - error)``, no less than ``floor_s`` (an
        error above 100%, from a noisy fit, would put it at or below zero)."""
        return max(self.step_s * (1.0 - self.error), self.floor_s)

    def to_dict(self) -> PredictionForm:
        return {"step_s": round(self.step_s, 4), "error": round(self.error, 4),
                "basis": self.basis, "fitted": self.fitted}

    @property
    def short_basis(self) -> str:
        """The basis without the fitted line: which trials, and where the error came from."""
        return self.basis.split(", ", 1)[-1] if self.fitted else self.basis


def step_seconds(o: Observation) -> float | None:
    """Seconds per optimizer step an observation measured: ok and pruned trials (pruned ones
    from their windows); None for anything else."""
    if o.predicted or o.status not in (Status.OK, Status.PRUNED) or not o.samples_per_sec:
        return None
    return o.config.samples_per_step / o.samples_per_sec


class StepTimeModel:
    """Seconds per optimizer step per speed key, from the trials that measured one."""

    def __init__(self, observations: Sequence[Observation]) -> None:
        self._points: dict[tuple[Any, ...], list[tuple[int, float, int]]] = {}
        for o in observations:
            step = step_seconds(o)
            if step is not None:
                self._points.setdefault(speed_key(o.config), []).append(
                    (o.config.samples_per_step, step, o.number))

    def predict(self, config: Config) -> StepPrediction | None:
        """The step time of ``config``; None before any trial measured a step. A precision or
        rank count no trial ran yet is scaled from the others (never fitted: a budget, never
        a reason not to run)."""
        points = self._points.get(speed_key(config), [])
        if not points:
            others = [p for ps in self._points.values() for p in ps]
            if not others:
                return None
            s0 = statistics.fmean(s for s, _, _ in others)
            t0 = statistics.fmean(t for _, t, _ in others)
            trials = ", ".join(str(n) for _, _, n in others)
            return StepPrediction(
                t0 * config.samples_per_step / s0, ASSUMED_ERROR,
                f"scaled from trials {trials} (no trial with {_key_words(config)} yet); error "
                f"{100 * ASSUMED_ERROR:.0f}% assumed", False)
        samples = config.samples_per_step
        sizes = {s for s, _, _ in points}
        below = [s for s in sizes if s <= samples]
        floor = statistics.fmean(t for s, t, _ in points if s == max(below)) if below else 0.0
        trials = ", ".join(str(n) for _, _, n in points)
        if len(sizes) < 2:
            # One batch size: steps scaled with the samples (compute-bound, which is where
            # steps are long); only used to size a budget, never to rule a config out.
            s0, t0 = statistics.fmean(s for s, _, _ in points), \
                statistics.fmean(t for _, t, _ in points)
            return StepPrediction(
                t0 * samples / s0, ASSUMED_ERROR,
                f"scaled from {s0:g} samples/step ({_fmt(t0)}; trial {trials}) with the same "
                f"{_key_words(config)}; error {100 * ASSUMED_ERROR:.0f}% assumed", False, floor)
        fit = fit_affine([(s, t) for s, t, _ in points])
        assert fit is not None
        step = max(fit.at(samples), 1e-6)
        smallest = min(sizes)
        if samples < smallest:
            # Below the line's smallest batch a noisy fit (a negative intercept: 8 samples in
            # 4.0 s, 16 in 15.2 s on a drifting machine) can predict no time at all; no less
            # than the smallest batch's step scaled down with the samples.
            t_small = statistics.fmean(t for s, t, _ in points if s == smallest)
            step = max(step, t_small * samples / smallest)
        error, source = _loo_error(points), "leave-one-out over those trials"
        if error is None:
            error, source = ASSUMED_ERROR, "assumed until three batch sizes have run"
        return StepPrediction(
            step, error,
            f"step = {_fmt(fit.intercept)} + {_fmt(fit.slope)} x samples, fitted on trials "
            f"{trials} with the same {_key_words(config)}; error {100 * error:.0f}% ({source})",
            True, floor)

    def fastest(self, config: Config) -> float | None:
        """The samples/sec at the fast end of ``config``'s prediction (``low_s``), where it is
        fitted on three or more batch sizes of its speed key (its error measured, leave-one-out
        over them); None otherwise: an assumed error never rules a config out."""
        if len({s for s, _, _ in self._points.get(speed_key(config), [])}) < 3:
            return None
        p = self.predict(config)
        return None if p is None else config.samples_per_step / p.low_s


def _loo_error(points: list[tuple[int, float, int]]) -> float | None:
    """The largest relative miss predicting each point from the others; None with fewer than
    three distinct batch sizes (two points fit any line exactly)."""
    if len({s for s, _, _ in points}) < 3:
        return None
    misses = []
    for i, (s, t, _) in enumerate(points):
        rest = [(x, y) for j, (x, y, _) in enumerate(points) if j != i]
        fit = fit_affine(rest)
        if fit is not None:
            misses.append(abs(fit.at(s) - t) / t)
    return max(misses, default=None)


def _fmt(seconds: float) -> str:
    return f"{seconds:.3g}s"


# -- the measuring budget -------------------------------------------------------------------------
# How long warm-up and a trial's windows take at a given step time is the measuring protocol's
# (``trial.protocol.measuring_seconds``): the budget sizes trials by the rules they measure by.


def startup_seconds(startups: Sequence[float], trial_timeout_s: float) -> float:
    """What a trial costs besides its measuring: the median of the trials' start-ups
    (``results.startup_costs``) with half again for safety; a third of the trial timeout
    before any trial ran."""
    if not startups:
        return STARTUP_SHARE * trial_timeout_s
    return 1.5 * statistics.median(startups) + 2.0


def hard_timeout(config: Config, trial_timeout_s: float, max_compile_s: float) -> float:
    """Where a trial of ``config`` is killed: --trial-timeout, plus the compile limit for a
    config that compiles (its compile step comes before, and outside, the measuring)."""
    return trial_timeout_s + (max_compile_s if config.compile != "off" else 0.0)


def compile_seconds(costs: Sequence[float], limit_s: float) -> float:
    """What compiling a config will cost: a fifth more than the longest compile the study saw
    (a cached graph compiles faster, a new one not), never above the compile limit; the limit
    itself before any config compiled."""
    return min(1.2 * max(costs), limit_s) if costs else limit_s


@dataclass(frozen=True)
class TrialBudget:
    """What a trial gets: its measuring settings (``max_seconds`` raised and ``max_windows``
    cut to ``min_windows`` when its steps need it), the step-time prediction it rests on, and,
    when it must not run, why."""

    settings: MeasureSettings
    prediction: StepPrediction | None = None
    too_slow: str | None = None  # the config cannot be measured within --trial-timeout
    no_room: str | None = None  # it could be, but not in what is left of --timeout

    @property
    def ruled_out(self) -> bool:
        """Whether the config does not run: too slow for any budget, or no room left."""
        return self.too_slow is not None or self.no_room is not None

    def to_dict(self) -> BudgetForm:
        return {"max_seconds": round(self.settings.max_seconds, 2),
                "prediction": self.prediction.to_dict() if self.prediction else None}


def plan_trial(config: Config, model: StepTimeModel, settings: MeasureSettings, *,
               trial_timeout_s: float, startup_s: float, left_s: float | None,
               unmeasured_steps: int = 0) -> TrialBudget:
    """The budget for ``config``: the search's settings when its predicted steps fit them;
    a longer measuring budget (warm-up and ``min_windows`` windows at the prediction's upper
    end) when they need it, up to ``MAX_BUDGET_SHARE`` of the trial timeout; too slow when even
    the prediction's lower end cannot fit warm-up and two windows there; no room when
    --timeout's rest (``left_s``, less the trial's start-up) cannot hold that, whatever the
    step's length. ``unmeasured_steps``: steps the trial runs outside its measuring
    budget (a script's: its first step, and the one it stops after), which the trial timeout
    must hold too."""
    p = model.predict(config)
    if p is None:
        return TrialBudget(settings)
    need = measuring_seconds(p.step_s * (1.0 + p.error), settings)
    least = measuring_seconds(p.low_s, settings, SPREAD_WINDOWS)
    if need <= settings.max_seconds:
        # Short steps: the search's settings, if what is left of --timeout holds the trial.
        if left_s is not None and least > left_s - startup_s:
            return TrialBudget(settings, p, no_room=_no_room(p, least + startup_s, left_s))
        return TrialBudget(settings, p)
    outside = unmeasured_steps * p.step_s * (1.0 + p.error)
    can = min(trial_timeout_s - startup_s, MAX_BUDGET_SHARE * trial_timeout_s) - outside
    if least > can and p.fitted:
        return TrialBudget(settings, p, too_slow=(
            f"predicted-too-slow: ~{_fmt(p.step_s)} per step (+-{100 * p.error:.0f}%) at "
            f"{config.samples_per_step} samples/step; warm-up and {SPREAD_WINDOWS} windows "
            f"need >= {_fmt(least)} and --trial-timeout allows {_fmt(max(can, 0.0))} "
            f"({p.short_basis})"))
    if left_s is not None and least > left_s - startup_s:
        # Not a verdict on the config, fitted or scaled: this run has no time left for it.
        return TrialBudget(settings, p, no_room=_no_room(p, least + startup_s, left_s))
    # A scaled prediction past the trial timeout is never a reason not to run: the trial gets
    # all the trial timeout allows (need > least > can), and its own first steps judge
    # (trial.protocol.too_slow).
    room = can if left_s is None else min(can, left_s - startup_s)
    return TrialBudget(_longer(settings, min(need, room)), p)


def _no_room(p: StepPrediction, need_s: float, left_s: float | None) -> str:
    return (f"the next config (~{_fmt(p.step_s)} per step) needs >= {_fmt(need_s)} and "
            f"{_fmt(max(left_s or 0.0, 0.0))} of --timeout are left")


def _longer(settings: MeasureSettings, seconds: float) -> MeasureSettings:
    """A measuring budget of ``seconds`` for long steps, sized for ``min_windows`` windows: the
    trial stops there (``max_windows``) instead of spending the rest of a long budget on more
    windows of a noisy config."""
    return replace(settings, max_seconds=max(settings.max_seconds, seconds),
                   max_windows=settings.min_windows)


CONFIRM_WINDOWS = 2  # timed windows per confirmation round: the rounds give the spread


def confirm_settings(settings: MeasureSettings, step_s: float | None) -> MeasureSettings:
    """A confirmation round's settings for a config whose steps take ``step_s``: windows twice
    the search's, and a measuring budget sized to warm-up and ``CONFIRM_WINDOWS`` windows (a
    tenth more for drift) rather than the search's. The spread a decision needs comes from the
    interleaved rounds, not from windows within one, so each round is as short as a fair
    measurement of one config allows."""
    longer = replace(settings.with_longer_windows(),
                     min_windows=min(settings.min_windows, CONFIRM_WINDOWS))
    if not step_s or not math.isfinite(step_s):
        return longer
    need = 1.1 * measuring_seconds(step_s, longer) + longer.min_window_s
    return replace(longer, max_seconds=round(need, 2))
