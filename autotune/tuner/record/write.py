"""What is written on a trial, in one place: the marks a trial gets as it goes (its config, a
reused twin, its forecast, its measuring budget, the worker that claimed it), and when it ends a
``Record`` built from a Measurement or from a ``Prediction`` (nothing ran), which ``tell``
writes. Nothing outside ``tuner/record/`` (and ``tuner/storage.py``) writes a trial's or a
study's user attributes (tests/test_layout.py).

What the sampler sees, by outcome:
  ok        COMPLETE with the median samples/sec, each window's rate as an intermediate value;
  oom       COMPLETE with 0 and the memory constraint violated (whatever peak was sampled);
  pruned    PRUNED after its windows (stopped for being clearly slower than the best);
  timeout   PRUNED, with the rough rate of its first step as the only hint;
  diverged  PRUNED (the loss went NaN or infinite: it never wins, whatever its speed);
  error     FAIL;
  predicted PRUNED, nothing ran (a rule, the memory model or the step-time model ruled it out);
  not a result (Ctrl-C, the run's --timeout): FAIL, marked interrupted, and queued again;
  not run   (no room left in the run's --timeout to measure it): FAIL, marked not_run, not
            queued again.
A peak over the memory limit makes an ok or pruned trial infeasible (constraint > 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, TypedDict

import optuna
from optuna.trial import TrialState

from autotune.config.knobs import Config
from autotune.trial.measurement import BUDGET, Measurement, Status
from autotune.trial.protocol import WindowStats
from autotune.trial.spec import MeasureSettings
from autotune.tuner.budget import PredictionForm, StepPrediction


class Outcome(StrEnum):
    """What a trial was: measured by a process of its own, a twin's measurement reused, ruled
    out by a prediction with nothing run, or not run for want of time (no record)."""

    MEASURED = "measured"
    REUSED = "reused"
    PREDICTED = "predicted"
    NOT_RUN = "not-run"  # also its stored status: never read back as a record


class Predicted(StrEnum):
    """Why a config was ruled out without running; the stored spelling (old studies too)."""

    OOM = "oom"  # the memory model
    TOO_SLOW = "too_slow"  # the step-time model: too slow for any measuring budget
    OVERSUBSCRIBED = "oversubscribed"  # a rule of the space: more threads and workers than cores


# What a predicted trial's status reads as (the sampler's view: pruned; too slow: timeout).
PREDICTED_STATUS = {Predicted.OOM: Status.PRUNED, Predicted.TOO_SLOW: Status.TIMEOUT,
                    Predicted.OVERSUBSCRIBED: Status.PRUNED}


class ForecastDoc(TypedDict):
    """A forecast as the trial stores it."""

    step: PredictionForm | None
    peak_memory_bytes: int | None
    max_seconds: float | None


@dataclass(frozen=True)
class Forecast:
    """What the models predicted before a trial ran, kept beside what it measured."""

    step: StepPrediction | None = None
    peak_memory_bytes: int | None = None
    max_seconds: float | None = None  # its measuring budget

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Forecast:
        s = d.get("step")
        step = StepPrediction(float(s["step_s"]), float(s.get("error") or 0.0),
                              str(s.get("basis") or ""), bool(s.get("fitted"))) if s else None
        peak = d.get("peak_memory_bytes")
        return cls(step, None if peak is None else int(peak), d.get("max_seconds"))

    def to_dict(self) -> ForecastDoc:
        return {"step": None if self.step is None else self.step.to_dict(),
                "peak_memory_bytes": self.peak_memory_bytes,
                "max_seconds": None if self.max_seconds is None else round(self.max_seconds, 2)}


@dataclass(frozen=True)
class Prediction:
    """A config ruled out without running, and what the model that ruled it out predicted
    (kept as the trial's forecast: nothing was measured)."""

    kind: Predicted
    reason: str
    peak_memory_bytes: float | None = None  # the memory model's
    step: StepPrediction | None = None  # the step-time model's
    samples_per_step: int = 0


class DevicesHeld(TypedDict, total=False):
    """Which devices a trial held, and when (wall clock): the device lock's span."""

    devices: list[str]
    waited_s: float
    start: float
    end: float


class Retry(TypedDict):
    """What a trial that was no result is queued again with: which trial it retries, whether it
    is the baseline, and whether the run's --timeout cut it short already (a second cut is a
    real timeout)."""

    retry_of: int
    baseline: bool
    budget_cut: bool


@dataclass(frozen=True)
class Record:
    """What to write on a trial: user attributes (in order), its memory constraint, the
    intermediate values to report, how to end it, and what to queue again when it was no
    result."""

    attrs: dict[str, Any]
    state: TrialState
    value: float | None = None  # with COMPLETE
    constraint: float | None = None  # "memory": peak - limit; <= 0 is feasible
    intermediate: tuple[float, ...] = ()
    retry_attrs: Retry | None = None  # queue the trial's params again, with these


def of_measurement(m: Measurement, limit: int, *, number: int, baseline: bool,
                   devices: DevicesHeld | None = None) -> Record:
    """The record of a trial that ran (or reused a twin's measurement)."""
    if m.ok:
        m = replace(m, stderr_tail="")  # keep the storage small; failures keep theirs
    attrs: dict[str, Any] = {"status": m.status.value, "reason": m.reason,
                             "measurement": m.to_dict(), "memory_limit_bytes": limit,
                             "overhead_share": m.overhead_share()}
    if devices:
        attrs["devices"] = dict(devices)  # which, and when (wall clock): the device lock
    if not m.is_result:
        # Not a result: not counted, and measured again by the next run.
        attrs["interrupted"] = True
        return Record(attrs, TrialState.FAIL, retry_attrs={
            "retry_of": number, "baseline": baseline, "budget_cut": m.ended_by == BUDGET})
    constraint = None
    if m.status in (Status.OK, Status.OOM, Status.PRUNED):
        # An OOM is infeasible whatever peak was sampled before it died.
        over = float(m.peak_memory_bytes - limit)
        constraint = max(over, 1.0) if m.status == Status.OOM else over
    rates = tuple(WindowStats(m.windows).rates)
    if m.status == Status.PRUNED:
        # Stopped for being clearly slower than the best: its windows tell the sampler how
        # much slower.
        return Record(attrs, TrialState.PRUNED, constraint=constraint, intermediate=rates)
    if m.ok:
        return Record(attrs, TrialState.COMPLETE, value=m.samples_per_sec,
                      constraint=constraint, intermediate=rates)
    if m.status == Status.OOM:
        return Record(attrs, TrialState.COMPLETE, value=0.0, constraint=constraint)
    if m.status == Status.DIVERGED:
        # Its windows' rates are not a result: a config that does not train has no speed.
        return Record(attrs, TrialState.PRUNED, constraint=constraint)
    if m.status == Status.TIMEOUT:
        # Too slow to measure: pruned, with the rough rate as the sampler's only hint.
        rough = (m.rough_samples_per_sec,) if m.rough_samples_per_sec else ()
        return Record(attrs, TrialState.PRUNED, intermediate=rough)
    return Record(attrs, TrialState.FAIL)


def of_prediction(p: Prediction, limit: int) -> Record:
    """The record of a config ruled out without running. The memory model's is infeasible for
    the sampler, like an OOM (its constraint is the predicted excess); the step-time model's is
    pruned like a measured too-slow trial, with the predicted rate as the sampler's hint (memory
    unknown: no constraint); a rule's says nothing of speed or memory."""
    status = PREDICTED_STATUS[p.kind].value
    nothing: dict[str, object] = {"status": status, "reason": p.reason}  # nothing measured
    constraint: float | None = None
    hint: tuple[float, ...] = ()
    peak = None if p.peak_memory_bytes is None else int(p.peak_memory_bytes)
    if p.kind == Predicted.OOM:
        constraint = max(1.0, (p.peak_memory_bytes or 0.0) - limit)
    elif p.kind == Predicted.TOO_SLOW and p.step is not None:
        rate = p.samples_per_step / p.step.step_s if p.step.step_s > 0 else 0.0
        nothing["rough_samples_per_sec"] = round(rate, 6)  # the sampler's hint, as a timeout's
        hint = (rate,) if rate else ()
    attrs = {"status": status, "reason": p.reason, "predicted": True,
             "predicted_kind": p.kind.value, "measurement": nothing,
             "forecast": Forecast(p.step, peak).to_dict(), "memory_limit_bytes": limit}
    return Record(attrs, TrialState.PRUNED, constraint=constraint, intermediate=hint)


def of_no_room(reason: str, limit: int) -> Record:
    """The record of a config not started because what is left of the run's --timeout cannot
    measure it: not a result and not a failure of the config. FAIL for the sampler (which
    ignores it), marked ``not_run``; never queued again: the search proposes it again on a
    later run if it is still worth measuring then."""
    said = f"not run: no room left: {reason}"
    return Record({"status": Outcome.NOT_RUN.value, "reason": said, "not_run": True,
                   "memory_limit_bytes": limit}, TrialState.FAIL)




def tell(study: optuna.Study, trial: optuna.Trial, rec: Record) -> None:
    """Write ``rec`` on ``trial`` and end it; queue its params again when it was no result."""
    for key, value in rec.attrs.items():
        trial.set_user_attr(key, value)
    if rec.constraint is not None:
        trial.set_constraint("memory", rec.constraint)
    for i, value in enumerate(rec.intermediate):
        trial.report(value, i)
    if rec.state == TrialState.COMPLETE:
        study.tell(trial, rec.value)
    else:
        study.tell(trial, state=rec.state)
    if rec.retry_attrs is not None:
        study.enqueue_trial(trial.params, user_attrs=dict(rec.retry_attrs))


# -- marks on a trial as it goes ---------------------------------------------------------------

def mark_config(trial: optuna.Trial, config: Config) -> None:
    """The config a trial measures, written as soon as it is known (a fleet's workers read it
    from running trials)."""
    trial.set_user_attr("config", config.to_dict())


def mark_reused(trial: optuna.Trial, twin: int) -> None:
    trial.set_user_attr("reused_from", twin)


def mark_interrupted(trial: optuna.Trial) -> None:
    """A trial that ended before its record was written: not a result, measured again."""
    trial.set_user_attr("interrupted", True)


def mark_forecast(trial: optuna.Trial, forecast: Forecast) -> None:
    trial.set_user_attr("forecast", forecast.to_dict())


def mark_measuring(trial: optuna.Trial, search: MeasureSettings,
                   used: MeasureSettings) -> None:
    """How the trial is measured: the search's settings (twins match on them) and, where its
    steps need a longer budget, what differs from them."""
    trial.set_user_attr("measure_settings", search.to_dict())
    if used != search:
        trial.set_user_attr("budget", {k: v for k, v in used.to_dict().items()
                                       if v != search.to_dict()[k]})


def mark_claimed(trial: optuna.Trial, worker: Mapping[str, Any], *, alive_at: float | None,
                 retry_of: int | None) -> None:
    """A trial just asked, marked as this worker's: its identity, a first sign of life where
    the storage keeps no heartbeat, and, for a retried trial, which one it retries (it arrives
    with its dead worker's attributes)."""
    trial.set_user_attr("worker", dict(worker))
    if alive_at is not None:
        trial.set_user_attr("alive_at", alive_at)
    if retry_of is not None:
        trial.set_user_attr("interrupted", False)
        trial.set_user_attr("retry_of", retry_of)


def queue_baseline(study: optuna.Study, params: Mapping[str, object]) -> None:
    study.enqueue_trial(dict(params), user_attrs={"baseline": True})


def queue_staged(study: optuna.Study, params: Mapping[str, object], stage: str,
                 reread_of: int | None = None) -> None:
    """A config the staged search proposes next, with why (``TrialRecord.stage``); with
    ``reread_of``, a measured trial's config measured again (``TrialRecord.reread_of``)."""
    attrs: dict[str, object] = {"stage": stage}
    if reread_of is not None:
        attrs["reread_of"] = reread_of
    study.enqueue_trial(dict(params), user_attrs=attrs)
