"""The measured loop: warm-up until step time settles, then timed windows until the spread is
small enough or the budget is spent. nanoGPT's bench.py is the model: synchronise, burn in,
measure, report.

Every decision (when warm-up ends, when to stop) is taken on numbers all ranks agree on (the
slowest rank's), so no rank leaves a collective the others still wait in.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from autotune.trial.bench.build import Trainer
from autotune.trial.bench.process import Progress
from autotune.trial.bench.ranks import Ranks
from autotune.trial.measurement import median_and_cv
from autotune.trial.spec import MeasureSettings


class Diverged(Exception):
    """The loss became NaN or infinite: the config does not train (fp16 overflow is the usual
    cause), whatever its speed."""


def check_finite(trainer: Trainer, where: str) -> None:
    """Raise Diverged when any rank's loss was NaN or infinite so far."""
    bad = trainer.nonfinite_steps()
    if bad:
        raise Diverged(f"the loss was NaN or infinite in {bad} micro-step(s) by the end of "
                       f"{where}: this config does not train (with fp16, an overflow)")


class TooSlow(Exception):
    """Warm-up and one window cannot fit the measuring budget: the step takes ``step_s``."""

    def __init__(self, step_s: float, rate: float) -> None:
        super().__init__(step_s)
        self.step_s, self.rate = step_s, rate


@dataclass
class WarmUp:
    step_times: list[float] = field(default_factory=list)
    ended_by: str = "max_steps"
    started: float = 0.0  # time.time() at its start: the measuring budget counts from here


def _check_fits(trainer: Trainer, settings: MeasureSettings, step_s: float, steps_done: int,
                elapsed: float) -> None:
    """Raise TooSlow as soon as warm-up and one window cannot fit the measuring budget,
    instead of burning the whole trial timeout. The first step carries one-time costs (lazy
    init, worker start-up, autotuning) and is measured up to ~1.6x a steady step here, so it is
    judged against twice the budget."""
    still = max(settings.warmup_min_steps - steps_done, 0) + 1
    allowed = (2.0 if steps_done <= 1 else 1.25) * settings.max_seconds
    if elapsed + still * step_s > allowed:
        raise TooSlow(step_s, trainer.config.samples_per_step / step_s)


class _FirstStep:
    """Judges the first step from its micro-steps while it runs (called before micro-step i >
    0). Micro-step 0 carries the start-up costs, so with 3+ micro-steps the estimate uses the
    later ones (else a long accumulation would multiply those costs by the accumulation
    count)."""

    def __init__(self, trainer: Trainer, settings: MeasureSettings, started: float) -> None:
        self.trainer, self.settings, self.started = trainer, settings, started
        self.micro0_s = 0.0

    def __call__(self, micro: int) -> None:
        accum = self.trainer.config.grad_accum_steps
        self.trainer.sync()
        (elapsed,) = self.trainer.ranks.agree(time.time() - self.started)
        if micro == 1:
            self.micro0_s = elapsed
            if accum > 2:
                return
            step_s = elapsed * accum
        else:
            step_s = (elapsed - self.micro0_s) / (micro - 1) * accum
        _check_fits(self.trainer, self.settings, step_s, 0, elapsed)


def warm_up(trainer: Trainer, settings: MeasureSettings, progress: Progress) -> WarmUp:
    """Whole steps, each synchronised, until two in a row agree within the tolerance (or a
    step or time cap); raises TooSlow for a config the budget cannot measure."""
    warm = WarmUp(started=time.time())
    first = _FirstStep(trainer, settings, warm.started)
    times = warm.step_times
    while len(times) < settings.warmup_max_steps:
        trainer.sync()
        t = time.perf_counter()
        trainer.step(first if not times else None)
        trainer.sync()
        step_s, elapsed = trainer.ranks.agree(time.perf_counter() - t,
                                              time.time() - warm.started)
        times.append(step_s)
        progress.emit("warmup_step", seconds=step_s)
        if len(times) >= settings.warmup_min_steps:
            a, b = times[-2], times[-1]
            if abs(a - b) / max(a, b) <= settings.warmup_tolerance:
                warm.ended_by = "stable"
                break
        else:
            _check_fits(trainer, settings, step_s, len(times), elapsed)
        # Past the minimum, long steps end warm-up by time; before it, never: the first step
        # carries start-up costs and is no measure of steady state.
        if len(times) >= settings.warmup_min_steps and elapsed > 0.4 * settings.max_seconds:
            warm.ended_by = "time"
            break
    return warm


def measure_windows(trainer: Trainer, settings: MeasureSettings, progress: Progress,
                    warm: WarmUp, windows: list[dict[str, Any]]) -> int:
    """Timed windows, end to end (data loading included), synchronised only at their edges,
    appended to ``windows`` as they end; returns the steps per window. Each rank keeps its own
    windows; the stop rule reads the slowest rank's."""
    ranks: Ranks = trainer.ranks
    config = trainer.config
    steps = max(1, math.ceil(settings.min_window_s / max(warm.step_times[-1], 1e-6)))
    rates: list[float] = []
    while True:
        trainer.sync()
        t = time.perf_counter()
        wait = sum(trainer.step() for _ in range(steps))
        trainer.sync()
        seconds = time.perf_counter() - t
        window = {"steps": steps, "seconds": seconds, "data_wait_s": wait,
                  "samples": steps * config.samples_per_rank_step}
        if trainer.comm is not None:
            window["comm_wait_s"] = trainer.comm.take_wait()
        windows.append(window)
        slowest, elapsed = ranks.agree(seconds, time.time() - warm.started)
        samples = steps * config.samples_per_step
        rates.append(samples / slowest)
        progress.emit("window", index=len(windows) - 1, samples=samples, seconds=slowest,
                      data_wait_s=wait, comm_wait_s=window.get("comm_wait_s", 0.0),
                      samples_per_sec=rates[-1])
        check_finite(trainer, f"window {len(windows)}")
        if len(rates) >= settings.min_windows and \
                median_and_cv(rates)[1] <= settings.target_cv:
            break
        if len(rates) >= settings.max_windows:
            break
        # Stop when another window would run past the measuring budget, warm-up included
        # (but keep >= 1 window).
        if elapsed + slowest > settings.max_seconds:
            break
    return steps
