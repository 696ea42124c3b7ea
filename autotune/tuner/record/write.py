"""What is written on a trial when it ends: a ``Record`` built from a Measurement (or from what
a model or a rule predicted: nothing ran), and ``tell``, which writes it and ends the trial.

What the sampler sees, by outcome:
  ok        COMPLETE with the median samples/sec, each window's rate as an intermediate value;
  oom       COMPLETE with 0 and the memory constraint violated (whatever peak was sampled);
  pruned    PRUNED after its windows (stopped for being clearly slower than the best);
  timeout   PRUNED, with the rough rate of its first step as the only hint;
  diverged  PRUNED (the loss went NaN or infinite: it never wins, whatever its speed);
  error     FAIL;
  not a result (Ctrl-C, the run's --timeout): FAIL, marked interrupted, and queued again;
  not run   (no room left in the run's --timeout to measure it): FAIL, marked not_run, not
            queued again.
A peak over the memory limit makes an ok or pruned trial infeasible (constraint > 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypedDict

import optuna
from optuna.trial import TrialState

from autotune.trial.measurement import BUDGET, Measurement

# Why a config was ruled out without running (TrialRecord.predicted_kind).
PREDICTED_OOM, TOO_SLOW, OVERSUBSCRIBED = "oom", "too_slow", "oversubscribed"
# The status of a trial that never started (no room left in the run's --timeout).
NOT_RUN = "not-run"


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
                   devices: Mapping[str, Any] | None = None) -> Record:
    """The record of a trial that ran (or reused a twin's measurement)."""
    if m.ok:
        m = replace(m, stderr_tail="")  # keep the storage small; failures keep theirs
    attrs: dict[str, Any] = {"status": m.status, "reason": m.reason, "measurement": m.to_dict(),
                             "memory_limit_bytes": limit, "overhead_share": m.overhead_share()}
    if devices:
        attrs["devices"] = dict(devices)  # which, and when (wall clock): the device lock
    if not m.is_result:
        # Not a result: not counted, and measured again by the next run.
        attrs["interrupted"] = True
        return Record(attrs, TrialState.FAIL, retry_attrs={
            "retry_of": number, "baseline": baseline, "budget_cut": m.ended_by == BUDGET})
    constraint = None
    if m.status in ("ok", "oom", "pruned"):
        # An OOM is infeasible whatever peak was sampled before it died.
        over = float(m.peak_memory_bytes - limit)
        constraint = max(over, 1.0) if m.status == "oom" else over
    rates = tuple(w["samples"] / w["seconds"] for w in m.windows)
    if m.status == "pruned":
        # Stopped for being clearly slower than the best: its windows tell the sampler how
        # much slower.
        return Record(attrs, TrialState.PRUNED, constraint=constraint, intermediate=rates)
    if m.ok:
        return Record(attrs, TrialState.COMPLETE, value=m.samples_per_sec,
                      constraint=constraint, intermediate=rates)
    if m.status == "oom":
        return Record(attrs, TrialState.COMPLETE, value=0.0, constraint=constraint)
    if m.status == "diverged":
        # Its windows' rates are not a result: a config that does not train has no speed.
        return Record(attrs, TrialState.PRUNED, constraint=constraint)
    if m.status == "timeout":
        # Too slow to measure: pruned, with the rough rate as the sampler's only hint.
        rough = (m.rough_samples_per_sec,) if m.rough_samples_per_sec else ()
        return Record(attrs, TrialState.PRUNED, intermediate=rough)
    return Record(attrs, TrialState.FAIL)


def _predicted(m: Measurement, kind: str, limit: int) -> dict[str, Any]:
    """The attributes of a config ruled out without running: nothing was measured."""
    return {"status": m.status, "reason": m.reason, "predicted": True, "predicted_kind": kind,
            "measurement": {k: v for k, v in m.to_dict().items() if v not in (None, {}, "")
                            or k in ("windows", "peak_memory_bytes", "wall_s")},
            "memory_limit_bytes": limit}


def of_prediction(reason: str, peak: float | None, limit: int) -> Record:
    """The record of a config the memory model ruled out: nothing ran. Infeasible for the
    sampler, like an OOM: its constraint is the predicted excess."""
    m = Measurement("pruned", reason, predicted_peak_memory_bytes=None if peak is None
                    else int(peak))
    attrs = _predicted(m, PREDICTED_OOM, limit)
    attrs["measurement"]["predicted_peak_memory_bytes"] = m.predicted_peak_memory_bytes
    return Record(attrs, TrialState.PRUNED, constraint=max(1.0, (peak or 0.0) - limit))


def of_rule(reason: str, limit: int) -> Record:
    """The record of a config a rule of the space ruled out (more threads and loader workers
    than cores): nothing ran, nothing about its speed or memory is known."""
    return Record(_predicted(Measurement("pruned", reason), OVERSUBSCRIBED, limit),
                  TrialState.PRUNED)


def of_slow_prediction(reason: str, step_s: float, samples_per_step: int,
                       limit: int) -> Record:
    """The record of a config the step-time model ruled out: its steps are predicted too long
    to measure within --trial-timeout, and nothing ran. Pruned, like a measured too-slow
    trial, with the predicted rate as the sampler's hint; memory is unknown, so no
    constraint."""
    rate = samples_per_step / step_s if step_s > 0 else 0.0
    m = Measurement("timeout", reason, predicted_step_s=round(step_s, 4),
                    rough_samples_per_sec=round(rate, 6))
    return Record(_predicted(m, TOO_SLOW, limit), TrialState.PRUNED,
                  intermediate=(rate,) if rate else ())


def of_no_room(reason: str, limit: int) -> Record:
    """The record of a config not started because what is left of the run's --timeout cannot
    measure it: not a result and not a failure of the config. FAIL for the sampler (which
    ignores it), marked ``not_run``; never queued again: the search proposes it again on a
    later run if it is still worth measuring then."""
    said = f"not run: no room left: {reason}"
    return Record({"status": NOT_RUN, "reason": said, "not_run": True,
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
