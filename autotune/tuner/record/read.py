"""What is read back from a finished trial: a ``TrialRecord``, parsed once (its Config, a typed
Measurement, the Forecast, its outcome and why it ran or was ruled out), and what a fleet's
workers need of trials not finished yet."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config.knobs import Config
from autotune.trial.measurement import Measurement, Status
from autotune.trial.spec import MeasureSettings
from autotune.tuner.record.write import Forecast, Outcome, Predicted
from autotune.tuner.search import Observation

# Allowed for loading compiled graphs from the cache, as a share of what compiling them took
# (BERT-base 8x1 fp32 here: a 74.1 s first step, 58.3 s of it in the backend, 15.9 s from the
# cache, estimated 21.6 s; a 2-layer BERT: 23.3 s, 22.4 s, 2.3 s, estimated 3.2 s).
CACHE_LOAD_SHARE = 0.1


@dataclass(frozen=True)
class TrialRecord:
    """One finished trial, read once from the study: its config, outcome, measurement, what
    the models predicted, and why it ran. Every reader of a trial reads this."""

    number: int
    state: TrialState
    config: Config
    status: Status
    reason: str | None
    measurement: Measurement
    is_baseline: bool = False
    reused_from: int | None = None  # a repeat of a measured config: its outcome, reused
    predicted_kind: Predicted | None = None  # ruled out without running: by which model
    stage: str | None = None  # why the search proposed it, when it was not the sampler
    reread_of: int | None = None  # an unsteady trial it measured again (``tuner.rereads``)
    forecast: Forecast = field(default_factory=Forecast)
    overhead_share: float | None = None
    measure_settings: Mapping[str, Any] = field(default_factory=dict)
    budget: Mapping[str, Any] = field(default_factory=dict)  # a longer measuring budget
    params: Mapping[str, Any] = field(default_factory=dict)  # the sampler's, to queue it again
    started: datetime | None = None
    completed: datetime | None = None

    @property
    def outcome(self) -> Outcome:
        """What the trial was: ruled out by a prediction, a twin's outcome reused, or measured
        by a process of its own."""
        if self.predicted_kind is not None:
            return Outcome.PREDICTED
        return Outcome.MEASURED if self.reused_from is None else Outcome.REUSED

    @property
    def predicted(self) -> bool:
        return self.outcome == Outcome.PREDICTED

    @property
    def ran(self) -> bool:
        """It ran a process of its own (not a reused twin, not ruled out)."""
        return self.outcome == Outcome.MEASURED

    @property
    def source(self) -> int:
        """The trial whose process measured this outcome."""
        return self.number if self.reused_from is None else self.reused_from

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    def fits(self, limit: int) -> bool:
        """Measured ok, and its peak stayed within ``limit``."""
        return self.ok and self.state == TrialState.COMPLETE \
            and self.measurement.peak_memory_bytes <= limit

    @property
    def samples_per_sec(self) -> float | None:
        return self.measurement.samples_per_sec

    @property
    def spread_cv(self) -> float | None:
        return self.measurement.spread_cv

    @property
    def peak_memory_bytes(self) -> int:
        return int(self.measurement.peak_memory_bytes or 0)

    @property
    def breakdown(self) -> dict[str, float]:
        return self.measurement.breakdown or {}

    @property
    def wall_s(self) -> float:
        return float(self.measurement.wall_s or 0.0)

    @property
    def tflops(self) -> float | None:
        return self.measurement.tflops

    @property
    def mfu(self) -> float | None:
        return self.measurement.mfu

    @property
    def gpu_util(self) -> float | None:
        return (self.measurement.gpu or {}).get("gpu_util_mean")

    @property
    def compile_s(self) -> float | None:
        """A compiled trial's compiling, beyond a steady step."""
        return (self.measurement.compile or {}).get("seconds")

    @property
    def step_s(self) -> float | None:
        """Seconds per optimizer step it measured (or, ruled out, was predicted to take)."""
        if self.predicted and self.forecast.step is not None:
            return self.forecast.step.step_s
        rate = self.samples_per_sec
        return self.config.samples_per_step / rate if rate else None

    @property
    def startup_s(self) -> float | None:
        """What it cost besides its warm-up and windows (process start, imports, build, FLOPs
        counting, exit): its wall time less its measuring time; None when it did not say.
        Compiling is not start-up: only compiled configs pay it."""
        timings = self.measurement.timings or {}
        if "measure_s" not in timings:
            return None
        measuring = float(timings.get("warmup_s", 0.0)) + float(timings["measure_s"]) + float(
            timings.get("compile_step_s", 0.0))
        return max(self.wall_s - measuring, 0.0)

    @property
    def compile_step_s(self) -> float | None:
        found = (self.measurement.timings or {}).get("compile_step_s")
        return float(found) if isinstance(found, int | float) else None

    @property
    def recompile_s(self) -> float | None:
        """What compiling costs a fresh process of its config (a confirmation round) that finds
        its graphs in the study's compile cache: its compiling step less the compiler backend's
        seconds, which the cache skips but for ``CACHE_LOAD_SHARE`` of them (loading), where
        every graph went into the cache; else its compiling step. None when it compiled
        nothing."""
        step = self.compile_step_s
        info = self.measurement.compile or {}
        backend = info.get("backend_s")
        if step is None or info.get("cached") is not True or isinstance(backend, bool) \
                or not isinstance(backend, int | float) or not 0.0 <= backend < math.inf:
            return step
        return step - (1.0 - CACHE_LOAD_SHARE) * min(float(backend), step)

    def observation(self) -> Observation:
        """What the search reads of it."""
        return Observation(config=self.config, status=self.status,
                           samples_per_sec=self.samples_per_sec,
                           peak_memory_bytes=self.peak_memory_bytes, spread_cv=self.spread_cv,
                           predicted=self.predicted, number=self.number,
                           mfu=self.measurement.mfu, peak_tflops=self.measurement.peak_tflops,
                           model_state=_model_state(self.measurement.applied),
                           trend=_trend(self.measurement.windows))


def _trend(windows: Any) -> float | None:
    """The windows' move from first to last where every step went the same way (0.0 where
    they went up and down); None with fewer than three windows that hold numbers (a shared
    study's record is others' data)."""
    rates = []
    for w in windows if isinstance(windows, list) else ():
        samples, seconds = (w.get("samples"), w.get("seconds")) if isinstance(w, Mapping) \
            else (None, None)
        if isinstance(samples, int | float) and isinstance(seconds, int | float) \
                and seconds > 0 and samples > 0 and math.isfinite(samples / seconds):
            rates.append(samples / seconds)
    if len(rates) < 3:
        return None
    steps = [b - a for a, b in zip(rates, rates[1:], strict=False)]
    one_way = all(s > 0 for s in steps) or all(s < 0 for s in steps)
    return rates[-1] / rates[0] - 1.0 if one_way else 0.0


def _model_state(applied: Mapping[str, Any]) -> dict[str, int] | None:
    """A trial's ``model_state``, when it is whole non-negative numbers (a trial's report)."""
    state = applied.get("model_state")
    keys = ("params", "param_bytes", "grad_bytes", "optimizer_bytes")
    if not isinstance(state, Mapping) or not all(
            isinstance(state.get(k), int) and not isinstance(state.get(k), bool)
            and state[k] >= 0 for k in keys):
        return None
    return {k: int(state[k]) for k in keys}


# What a malformed stored value raises when it is parsed (a shared study is data from others).
MALFORMED = (ValueError, TypeError, KeyError, AttributeError)


class StudyFormatWarning(UserWarning):
    """A stored record that autotune did not write: it is left out, said once per record."""


def left_out(what: str, exc: Exception) -> None:
    """Say (once per record and process) that a stored record could not be read, and that it
    is left out; what it held is shown escaped and cut short, never run or followed."""
    detail = ascii(str(exc))[1:-1][:120]
    warnings.warn(f"{what} is not a record autotune wrote ({type(exc).__name__}: {detail}); "
                  "it is left out", StudyFormatWarning, stacklevel=2)


def read_trial(t: FrozenTrial) -> TrialRecord | None:
    """The record of a finished trial; None for one that has none (waiting, running,
    interrupted, not run for want of time, or ended before its config was written) and for
    one whose stored record is malformed (said once: a study shared through a database is
    others' data)."""
    a = t.user_attrs
    if not t.state.is_finished() or "status" not in a or a.get("interrupted") \
            or a.get("not_run") or "config" not in a:
        return None
    try:
        return _parse(t, a)
    except MALFORMED as exc:
        left_out(f"trial {t.number}", exc)
        return None


def _parse(t: FrozenTrial, a: Mapping[str, Any]) -> TrialRecord:
    measured = dict(a.get("measurement") or {})
    measured.setdefault("status", a["status"])
    budget = dict(a.get("budget") or {})
    if not budget and a.get("remeasured"):
        # Studies of autotune 0.x measured a too-slow config again with a longer budget.
        budget = {"max_seconds": a["remeasured"]["max_seconds"]}
    # Studies from before the step-time model stored no kind: the memory model's.
    predicted = Predicted(a.get("predicted_kind", Predicted.OOM)) if a.get("predicted") \
        else None
    forecast = a.get("forecast") or (_old_prediction(measured) if predicted else {})
    return TrialRecord(
        number=t.number, state=t.state, config=Config.from_dict(a["config"]),
        status=Status(a["status"]), reason=a.get("reason"),
        measurement=Measurement.from_dict(measured),
        is_baseline=bool(a.get("baseline")),
        reused_from=a.get("reused_from"), predicted_kind=predicted, stage=a.get("stage"),
        reread_of=reread_of(t),
        forecast=Forecast.from_dict(forecast), overhead_share=a.get("overhead_share"),
        measure_settings=dict(a.get("measure_settings") or {}), budget=budget,
        params=dict(t.params), started=t.datetime_start, completed=t.datetime_complete)


def _old_prediction(measured: Mapping[str, Any]) -> dict[str, object]:
    """What a study written before predictions were kept as forecasts stored in the ruled-out
    trial's measurement: the predicted peak, and the predicted step."""
    step = measured.get("predicted_step_s")
    return {"peak_memory_bytes": measured.get("predicted_peak_memory_bytes"),
            "step": None if step is None else {"step_s": step, "error": 0.0,
                                               "basis": "the step-time model", "fitted": False}}


def read_trials(study: optuna.Study) -> list[TrialRecord]:
    """The records of the study's trials that ran to an outcome, in trial order."""
    found = (read_trial(t) for t in study.get_trials(deepcopy=False))
    return [r for r in found if r is not None]


@dataclass(frozen=True)
class Pending:
    """Trials not finished yet: what staging and a fleet's workers need to know of them."""

    running: tuple[Config, ...] = ()  # configs other workers (or this one) measure now
    running_count: int = 0
    waiting: int = 0
    waiting_staged: bool = False  # a waiting trial was queued by the staged search


def config_of(t: FrozenTrial) -> Config | None:
    """The config a trial stores, None where it has none or a malformed one (said once)."""
    stored = t.user_attrs.get("config")
    if not stored:
        return None
    try:
        return Config.from_dict(stored)
    except MALFORMED as exc:
        left_out(f"the config of trial {t.number}", exc)
        return None


def read_pending(study: optuna.Study) -> Pending:
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    configs = (config_of(t) for t in running)
    return Pending(
        running=tuple(c for c in configs if c is not None),
        running_count=len(running), waiting=len(waiting),
        waiting_staged=any(t.user_attrs.get("stage") or t.user_attrs.get("baseline")
                           for t in waiting))


def running_twins(study: optuna.Study, number: int, config: Config,
                  settings: MeasureSettings) -> list[int]:
    """Trials other than ``number`` measuring exactly ``config`` with ``settings`` now (on
    other workers of a fleet)."""
    return [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if t.number != number and t.user_attrs.get("reused_from") is None
            and t.user_attrs.get("config") == config.to_dict()
            and MeasureSettings.same(t.user_attrs.get("measure_settings"), settings)]


def is_baseline(trial: optuna.Trial | FrozenTrial) -> bool:
    """Whether a trial (asked, or stored) is the baseline's."""
    return bool(trial.user_attrs.get("baseline"))


def reread_of(trial: optuna.Trial | FrozenTrial) -> int | None:
    """The trial a queued re-read measures again (a whole number, else None: a shared study's
    attributes are others' data)."""
    found = trial.user_attrs.get("reread_of")
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def was_queued(trial: optuna.Trial | FrozenTrial) -> bool:
    """Whether a trial's config was queued (the baseline, a staged or diagnosis step), not
    sampled."""
    return bool(trial.user_attrs.get("baseline") or trial.user_attrs.get("stage"))


def baseline_pending(study: optuna.Study) -> bool:
    """Whether the baseline is queued, running, or ran (even to an OOM); one not run for want
    of time is queued again by the next run."""
    return any(t.user_attrs.get("baseline") and (
        t.state in (TrialState.WAITING, TrialState.RUNNING)
        or (t.state.is_finished() and "status" in t.user_attrs
            and not t.user_attrs.get("interrupted") and not t.user_attrs.get("not_run")))
        for t in study.get_trials(deepcopy=False))


def budget_cut_before(trial: optuna.Trial) -> bool:
    """Whether this trial retries one the run's --timeout cut short already."""
    return bool(trial.user_attrs.get("budget_cut"))


def was_interrupted(trial: optuna.Trial) -> bool:
    return bool(trial.user_attrs.get("interrupted"))


@dataclass(frozen=True)
class Worker:
    """Who runs a trial: the tuner process that claimed it, and its last sign of life."""

    owner: dict[str, object]
    alive_at: float | None


def worker_of(t: FrozenTrial) -> Worker:
    alive = t.user_attrs.get("alive_at")
    return Worker(dict(t.user_attrs.get("worker") or {}), None if alive is None
                  else float(alive))


