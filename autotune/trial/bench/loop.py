"""The measured loop: warm-up until step time settles, then timed windows until the spread is
small enough or the budget is spent. nanoGPT's bench.py is the model: synchronise, burn in,
measure, report.

The protocol (when warm-up ends, how many steps a window takes, when to stop, what is too slow)
is ``trial.protocol.Measuring``'s; this loop times the steps and feeds it their ends. Every
decision is taken on numbers all ranks agree on (the slowest rank's: the protocol agrees them
through ``Ranks.agree``), so no rank leaves a collective the others still wait in.
"""

from __future__ import annotations

import time

from autotune.trial.bench.build import Trainer
from autotune.trial.progress import Progress
from autotune.trial.protocol import Answer, Measuring, Next, Stop, WarmUp
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
    trial's timeout (``late``): the step takes ``step_s``, ``rate`` samples/s."""

    def __init__(self, answer: Answer, rate: float) -> None:
        super().__init__(answer.seconds)
        self.answer, self.step_s, self.rate = answer, answer.seconds, rate
        self.late = answer.why is Stop.TOO_LATE


def _fits(trainer: Trainer, answer: Answer) -> None:
    """Raise TooSlow where the protocol stopped a config too slow to measure."""
    if answer.stop:
        raise TooSlow(answer, trainer.config.samples_per_step / answer.seconds)


def protocol_for(trainer: Trainer, settings: MeasureSettings, ends_by: float,
                 windows: list[Window]) -> Measuring:
    """The protocol this rank feeds, its windows kept in ``windows`` as they end (a trial that
    diverges keeps those): the ranks agree on every number it decides on, and each window's
    samples count once per rank. ``ends_by`` is the trial timeout, on the wall clock."""
    return Measuring(settings, ends_by, time.time, trainer.ranks.agree, trainer.ranks.world,
                     windows=windows)


def warm_up(trainer: Trainer, protocol: Measuring, progress: Progress) -> WarmUp:
    """Whole steps, each synchronised, until the protocol ends warm-up; raises TooSlow for a
    config it cannot measure (the first step judged from its micro-steps while it runs)."""
    protocol.start()
    accum = trainer.config.grad_accum_steps

    def first_step(micro: int) -> None:  # before micro-step ``micro`` > 0 of the first step
        trainer.sync()
        _fits(trainer, protocol.first_step_so_far(micro, accum))

    answer = Answer(Next.STEP)
    while answer.next is Next.STEP:
        if trainer.comm is not None:
            trainer.comm.take_wait()  # only this step's all-reduce wait is kept
        trainer.sync()
        t = time.perf_counter()
        wait = trainer.step(None if protocol.warm.step_times else first_step)
        trainer.sync()
        own = time.perf_counter() - t
        comm = {} if trainer.comm is None else {"comm_wait_s": trainer.comm.take_wait()}
        answer = protocol.warmup_step(own, data_wait_s=wait, **comm)
        progress.emit("warmup_step", seconds=answer.seconds)
        _fits(trainer, answer)
    return protocol.warm


def measure_windows(trainer: Trainer, protocol: Measuring, progress: Progress) -> int:
    """Timed windows, end to end (data loading included), synchronised only at their edges,
    until the protocol stops (its ``windows`` keep them); returns the steps per window. Each
    rank keeps its own windows; the protocol decides on the slowest rank's."""
    config = trainer.config
    answer = protocol.first_window(config.samples_per_rank_step)
    if answer is not None:  # warm-up's last step agreed with the one before: steady, timed whole
        _said(trainer, protocol, progress, answer)
    while answer is None or not answer.stop:
        steps = protocol.per_window
        trainer.sync()
        t = time.perf_counter()
        wait = sum(trainer.step() for _ in range(steps))
        trainer.sync()
        seconds = time.perf_counter() - t
        comm = {} if trainer.comm is None else {"comm_wait_s": trainer.comm.take_wait()}
        answer = protocol.window(seconds, steps * config.samples_per_rank_step,
                                 data_wait_s=wait, **comm)
        _said(trainer, protocol, progress, answer)
    return protocol.per_window


def _said(trainer: Trainer, protocol: Measuring, progress: Progress, answer: Answer) -> None:
    """Say the window that just ended (on the slowest rank's time, which every rank agrees
    on), and stop on a loss that was not finite in it."""
    windows = protocol.windows
    window = windows[-1]
    progress.emit("window", index=len(windows) - 1,
                  samples=window["steps"] * trainer.config.samples_per_step,
                  seconds=answer.seconds, data_wait_s=window["data_wait_s"],
                  comm_wait_s=window.get("comm_wait_s", 0.0), samples_per_sec=answer.rate)
    check_finite(trainer, f"window {len(windows)}")
