"""The measured loop: warm-up until step time settles, then timed windows until the spread is
small enough or the budget is spent. nanoGPT's bench.py is the model: synchronise, burn in,
measure, report.

The rules (when warm-up ends, how many steps a window takes, when to stop, what is too slow)
are ``trial.protocol``'s; this loop times the steps. Every decision is taken on numbers all
ranks agree on (the slowest rank's), so no rank leaves a collective the others still wait in.
"""

from __future__ import annotations

import math
import time

from autotune.trial import protocol
from autotune.trial.bench.build import Trainer
from autotune.trial.progress import Progress
from autotune.trial.protocol import WarmUp
from autotune.trial.result import Window
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
    """Warm-up and one window cannot fit the measuring budget, or cannot end before the
    trial's timeout (``late``): the step takes ``step_s``."""

    def __init__(self, step_s: float, rate: float, late: bool = False) -> None:
        super().__init__(step_s)
        self.step_s, self.rate, self.late = step_s, rate, late


def _check_fits(trainer: Trainer, settings: MeasureSettings, step_s: float, steps_done: int,
                elapsed: float, left: float = math.inf, warmed_up: bool = False) -> None:
    """Raise TooSlow as soon as warm-up and one window cannot fit the measuring budget
    (``protocol.too_slow``, below warm-up's minimum steps) or end before the trial's timeout,
    ``left`` seconds away (``protocol.ends_too_late``), instead of burning the whole trial
    timeout."""
    rate = trainer.config.samples_per_step / step_s
    if steps_done < settings.warmup_min_steps and \
            protocol.too_slow(step_s, steps_done, elapsed, settings):
        raise TooSlow(step_s, rate)
    if protocol.ends_too_late(step_s, steps_done, left, settings, warmed_up):
        raise TooSlow(step_s, rate, late=True)


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


def warm_up(trainer: Trainer, settings: MeasureSettings, progress: Progress,
            ends_by: float = math.inf) -> WarmUp:
    """Whole steps, each synchronised, until ``protocol.warmup_ended`` says so; raises TooSlow
    for a config the budget cannot measure, or that cannot be measured before ``ends_by``
    (the trial timeout, on the wall clock). The budget counts from warm-up's start."""
    warm = WarmUp(started=time.time())
    first = _FirstStep(trainer, settings, warm.started)
    times = warm.step_times
    while warm.ended_by is None:
        if trainer.comm is not None:
            trainer.comm.take_wait()  # only this step's all-reduce wait is kept
        trainer.sync()
        t = time.perf_counter()
        wait = trainer.step(first if not times else None)
        trainer.sync()
        own = time.perf_counter() - t
        now = time.time()
        # The most pessimistic rank's view of the time left: every rank decides alike.
        step_s, elapsed, late = trainer.ranks.agree(own, now - warm.started, now - ends_by)
        warm.last = {"seconds": own, "data_wait_s": wait}
        if trainer.comm is not None:
            warm.last["comm_wait_s"] = trainer.comm.take_wait()
        times.append(step_s)
        progress.emit("warmup_step", seconds=step_s)
        ended = protocol.warmup_ended(times, elapsed, settings)
        _check_fits(trainer, settings, step_s, len(times), elapsed, -late, ended is not None)
        warm.ended_by = ended
    return warm


def measure_windows(trainer: Trainer, settings: MeasureSettings, progress: Progress,
                    warm: WarmUp, windows: list[Window], ends_by: float = math.inf) -> int:
    """Timed windows, end to end (data loading included), synchronised only at their edges,
    appended to ``windows`` as they end; returns the steps per window. Each rank keeps its own
    windows; the stop rule reads the slowest rank's. No window is started that would not end
    before ``ends_by`` (the trial timeout): the windows so far are the result."""
    config = trainer.config
    steps = protocol.steps_per_window(warm.step_times[-1], settings)
    rates: list[float] = []
    done = None
    if protocol.first_window_from_warmup(warm, settings):
        # Warm-up's last step agreed with the one before: a steady step, timed whole.
        last = warm.last
        window: Window = {"steps": 1, "seconds": last["seconds"],
                          "data_wait_s": last["data_wait_s"],
                          "samples": config.samples_per_rank_step, "from_warmup": True}
        if "comm_wait_s" in last:
            window["comm_wait_s"] = last["comm_wait_s"]
        done = _ended(trainer, settings, progress, warm, windows, window, rates, ends_by)
    while done is None:
        trainer.sync()
        t = time.perf_counter()
        wait = sum(trainer.step() for _ in range(steps))
        trainer.sync()
        seconds = time.perf_counter() - t
        window = {"steps": steps, "seconds": seconds, "data_wait_s": wait,
                  "samples": steps * config.samples_per_rank_step}
        if trainer.comm is not None:
            window["comm_wait_s"] = trainer.comm.take_wait()
        done = _ended(trainer, settings, progress, warm, windows, window, rates, ends_by)
    return steps


def _ended(trainer: Trainer, settings: MeasureSettings, progress: Progress, warm: WarmUp,
           windows: list[Window], window: Window, rates: list[float],
           ends_by: float = math.inf) -> str | None:
    """Keep a timed ``window``, say it, and whether measuring stops after it (on the slowest
    rank's time, which every rank agrees on): by the protocol's rule, or because another
    window like it would not end before ``ends_by``."""
    windows.append(window)
    steps = window["steps"]
    now = time.time()
    slowest, elapsed, late = trainer.ranks.agree(window["seconds"], now - warm.started,
                                                 now - ends_by)
    samples = steps * trainer.config.samples_per_step
    rates.append(samples / slowest)
    progress.emit("window", index=len(windows) - 1, samples=samples, seconds=slowest,
                  data_wait_s=window["data_wait_s"], comm_wait_s=window.get("comm_wait_s", 0.0),
                  samples_per_sec=rates[-1])
    check_finite(trainer, f"window {len(windows)}")
    done = protocol.windows_done(rates, elapsed, slowest, settings, steps)
    return done or (protocol.BUDGET_SPENT if protocol.window_ends_too_late(slowest, -late)
                    else None)
