"""How a trial's outcome is written into the study. Pure: a Measurement (or the memory model's
verdict) becomes a ``Record``, the runner writes it; nothing here touches a study.

What the sampler sees, by outcome:
  ok        COMPLETE with the median samples/sec, each window's rate as an intermediate value;
  oom       COMPLETE with 0 and the memory constraint violated (whatever peak was sampled);
  pruned    PRUNED after its windows (stopped for being clearly slower than the best);
  timeout   PRUNED, with the rough rate of its first step as the only hint;
  diverged  PRUNED (the loss went NaN or infinite: it never wins, whatever its speed);
  error     FAIL;
  not a result (Ctrl-C, the run's --timeout): FAIL, marked interrupted, and queued again.
A peak over the memory limit makes an ok or pruned trial infeasible (constraint > 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optuna.trial import TrialState

from autotune.trial.measurement import BUDGET, Measurement


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
    retry_attrs: dict[str, Any] | None = None  # queue the trial's params again, with these


def of_measurement(m: Measurement, limit: int, *, number: int, baseline: bool,
                   devices: dict[str, Any] | None = None) -> Record:
    """The record of a trial that ran (or reused a twin's measurement)."""
    data = m.to_dict()
    if m.ok:
        data["stderr_tail"] = ""  # keep the storage small; failures keep theirs
    attrs: dict[str, Any] = {"status": m.status, "reason": m.reason, "measurement": data,
                             "memory_limit_bytes": limit, "overhead_share": m.overhead_share()}
    if devices:
        attrs["devices"] = devices  # which, and when (wall clock): the device lock
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


def of_prediction(reason: str, peak: float | None, limit: int) -> Record:
    """The record of a config the memory model ruled out: nothing ran. Infeasible for the
    sampler, like an OOM: its constraint is the predicted excess."""
    return Record(
        {"status": "pruned", "reason": reason, "predicted": True, "predicted_kind": "oom",
         "measurement": {"status": "pruned", "reason": reason, "peak_memory_bytes": 0,
                         "wall_s": 0.0, "windows": [],
                         "predicted_peak_memory_bytes": None if peak is None else int(peak)},
         "memory_limit_bytes": limit},
        TrialState.PRUNED, constraint=max(1.0, (peak or 0.0) - limit))


def of_rule(reason: str, limit: int) -> Record:
    """The record of a config a rule of the space ruled out (more threads and loader workers
    than cores): nothing ran, nothing about its speed or memory is known."""
    return Record(
        {"status": "pruned", "reason": reason, "predicted": True,
         "predicted_kind": "oversubscribed",
         "measurement": {"status": "pruned", "reason": reason, "peak_memory_bytes": 0,
                         "wall_s": 0.0, "windows": []},
         "memory_limit_bytes": limit},
        TrialState.PRUNED)


def of_slow_prediction(reason: str, step_s: float, samples_per_step: int,
                       limit: int) -> Record:
    """The record of a config the step-time model ruled out: its steps are predicted too long
    to measure within --trial-timeout, and nothing ran. Pruned, like a measured too-slow
    trial, with the predicted rate as the sampler's hint; memory is unknown, so no
    constraint."""
    rate = samples_per_step / step_s if step_s > 0 else 0.0
    return Record(
        {"status": "timeout", "reason": reason, "predicted": True,
         "predicted_kind": "too_slow",
         "measurement": {"status": "timeout", "reason": reason, "peak_memory_bytes": 0,
                         "wall_s": 0.0, "windows": [], "predicted_step_s": round(step_s, 4),
                         "rough_samples_per_sec": round(rate, 6)},
         "memory_limit_bytes": limit},
        TrialState.PRUNED, intermediate=(rate,) if rate else ())


def of_no_room(reason: str, limit: int, *, number: int, baseline: bool) -> Record:
    """The record of a config not started because what is left of the run's --timeout cannot
    measure it: no result, queued for the next run (which has its own budget)."""
    return Record({"status": "error", "reason": reason, "interrupted": True,
                   "measurement": {"status": "error", "reason": reason, "wall_s": 0.0,
                                   "peak_memory_bytes": 0, "windows": []},
                   "memory_limit_bytes": limit},
                  TrialState.FAIL, retry_attrs={"retry_of": number, "baseline": baseline,
                                                "budget_cut": False})
