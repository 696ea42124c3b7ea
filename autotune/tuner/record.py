"""A trial's record in the study, both ways: what is written on a trial when it ends
(``Record``, built from a Measurement), and what is read back (``TrialRecord``, parsed once).
With ``storage.py``, the only code that reads Optuna's ``user_attrs``: everything else reads
typed records (``tuner.snapshot`` gathers them per read of the study).

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

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config.knobs import Config
from autotune.trial.measurement import BUDGET, Measurement
from autotune.trial.spec import MeasureSettings
from autotune.tuner.confirmation import Confirmation
from autotune.tuner.search import Observation

# The study attributes through which a trial across machines is published (tuner.fleet).
NODE_TRIAL, NODE_REPORT = "node_trial", "node_report"
# Why a config was ruled out without running (TrialRecord.predicted_kind).
PREDICTED_OOM, TOO_SLOW, OVERSUBSCRIBED = "oom", "too_slow", "oversubscribed"

# -- writing ------------------------------------------------------------------------------------


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


def of_no_room(reason: str, limit: int, *, number: int, baseline: bool) -> Record:
    """The record of a config not started because what is left of the run's --timeout cannot
    measure it: no result, queued for the next run (which has its own budget)."""
    return Record({"status": "error", "reason": reason, "interrupted": True,
                   "measurement": {"status": "error", "reason": reason, "wall_s": 0.0,
                                   "peak_memory_bytes": 0, "windows": []},
                   "memory_limit_bytes": limit},
                  TrialState.FAIL, retry_attrs={"retry_of": number, "baseline": baseline,
                                                "budget_cut": False})


# -- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepForecast:
    """The step-time model's prediction for a trial (``budget.StepPrediction`` as stored)."""

    step_s: float
    error: float
    basis: str
    fitted: bool


@dataclass(frozen=True)
class Forecast:
    """What the models predicted before a trial ran, kept beside what it measured."""

    step: StepForecast | None = None
    peak_memory_bytes: int | None = None
    max_seconds: float | None = None  # its measuring budget

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Forecast:
        s = d.get("step")
        step = StepForecast(float(s["step_s"]), float(s.get("error") or 0.0),
                            str(s.get("basis") or ""), bool(s.get("fitted"))) if s else None
        peak = d.get("peak_memory_bytes")
        return cls(step, None if peak is None else int(peak), d.get("max_seconds"))

    def to_dict(self) -> dict[str, Any]:
        step = None if self.step is None else {
            "step_s": self.step.step_s, "error": self.step.error, "basis": self.step.basis,
            "fitted": self.step.fitted}
        return {"step": step, "peak_memory_bytes": self.peak_memory_bytes,
                "max_seconds": self.max_seconds}


@dataclass(frozen=True)
class TrialRecord:
    """One finished trial, read once from the study: its config, outcome, measurement, what
    the models predicted, and why it ran. Every reader of a trial reads this."""

    number: int
    state: TrialState
    config: Config
    status: str
    reason: str | None
    measurement: Measurement
    is_baseline: bool = False
    reused_from: int | None = None  # a repeat of a measured config: its outcome, reused
    predicted_kind: str | None = None  # ruled out without running (PREDICTED_OOM, ...)
    stage: str | None = None  # why the search proposed it, when it was not the sampler
    forecast: Forecast = field(default_factory=Forecast)
    overhead_share: float | None = None
    measure_settings: Mapping[str, Any] = field(default_factory=dict)
    budget: Mapping[str, Any] = field(default_factory=dict)  # a longer measuring budget
    params: Mapping[str, Any] = field(default_factory=dict)  # the sampler's, to queue it again
    started: datetime | None = None
    completed: datetime | None = None

    @property
    def predicted(self) -> bool:
        return self.predicted_kind is not None

    @property
    def ran(self) -> bool:
        """It ran a process of its own (not a reused twin, not ruled out)."""
        return self.reused_from is None and not self.predicted

    @property
    def source(self) -> int:
        """The trial whose process measured this outcome."""
        return self.number if self.reused_from is None else self.reused_from

    @property
    def ok(self) -> bool:
        return self.status == "ok"

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
        if self.measurement.predicted_step_s:
            return float(self.measurement.predicted_step_s)
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

    def observation(self) -> Observation:
        """What the search reads of it."""
        return Observation(config=self.config, status=self.status,
                           samples_per_sec=self.samples_per_sec,
                           peak_memory_bytes=self.peak_memory_bytes, spread_cv=self.spread_cv,
                           predicted=self.predicted, number=self.number)


def read_trial(t: FrozenTrial) -> TrialRecord | None:
    """The record of a finished trial; None for one that has none (waiting, running,
    interrupted, or ended before its config was written)."""
    a = t.user_attrs
    if not t.state.is_finished() or "status" not in a or a.get("interrupted") \
            or "config" not in a:
        return None
    measured = dict(a.get("measurement") or {})
    measured.setdefault("status", a["status"])
    budget = dict(a.get("budget") or {})
    if not budget and a.get("remeasured"):
        # Studies of autotune 0.x measured a too-slow config again with a longer budget.
        budget = {"max_seconds": a["remeasured"]["max_seconds"]}
    predicted = a.get("predicted_kind", PREDICTED_OOM) if a.get("predicted") else None
    forecast = a.get("forecast") or ({"peak_memory_bytes": measured.get(
        "predicted_peak_memory_bytes")} if predicted else {})
    return TrialRecord(
        number=t.number, state=t.state, config=Config.from_dict(a["config"]),
        status=str(a["status"]), reason=a.get("reason"),
        measurement=Measurement.from_dict(measured), is_baseline=bool(a.get("baseline")),
        reused_from=a.get("reused_from"), predicted_kind=predicted, stage=a.get("stage"),
        forecast=Forecast.from_dict(forecast), overhead_share=a.get("overhead_share"),
        measure_settings=dict(a.get("measure_settings") or {}), budget=budget,
        params=dict(t.params), started=t.datetime_start, completed=t.datetime_complete)


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


def read_pending(study: optuna.Study) -> Pending:
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    return Pending(
        running=tuple(Config.from_dict(t.user_attrs["config"]) for t in running
                      if t.user_attrs.get("config")),
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


def baseline_pending(study: optuna.Study) -> bool:
    """Whether the baseline is queued, running, or ran (even to an OOM)."""
    return any(t.user_attrs.get("baseline") and (
        t.state in (TrialState.WAITING, TrialState.RUNNING)
        or (t.state.is_finished() and "status" in t.user_attrs
            and not t.user_attrs.get("interrupted")))
        for t in study.get_trials(deepcopy=False))


def budget_cut_before(trial: optuna.Trial) -> bool:
    """Whether this trial retries one the run's --timeout cut short already."""
    return bool(trial.user_attrs.get("budget_cut"))


def was_interrupted(trial: optuna.Trial) -> bool:
    return bool(trial.user_attrs.get("interrupted"))


@dataclass(frozen=True)
class Worker:
    """Who runs a trial: the tuner process that claimed it, and its last sign of life."""

    owner: dict[str, Any]
    alive_at: float | None


def worker_of(t: FrozenTrial) -> Worker:
    alive = t.user_attrs.get("alive_at")
    return Worker(dict(t.user_attrs.get("worker") or {}), None if alive is None
                  else float(alive))


# -- the study's own attributes -------------------------------------------------------------------


@dataclass(frozen=True)
class StudyFacts:
    """What a study records of itself: where it was measured, what it tunes, its memory limit,
    the machine's probe, and what the confirmation and the export left on it."""

    name: str
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    workload: Mapping[str, Any] = field(default_factory=dict)
    space: Mapping[str, Any] = field(default_factory=dict)
    memory_limit_bytes: int | None = None
    memory_limit_spec: str | None = None
    probe: Mapping[str, Any] | None = None
    flops: Mapping[str, Any] = field(default_factory=dict)  # counted once per study
    unapplied: Mapping[str, str] | None = None  # knobs a script never applies, and why
    confirmation: Confirmation | None = None
    diagnosis: tuple[Mapping[str, Any], ...] = ()  # the exported winner's, for the dashboard

    @property
    def device(self) -> str:
        return str(self.fingerprint.get("device", "cpu"))

    @property
    def made_by_run(self) -> bool:
        """Whether `autotune run` made it (it records the fingerprint first)."""
        return isinstance(self.fingerprint, Mapping) and bool(self.fingerprint)


def read_facts(study: optuna.Study) -> StudyFacts:
    a = study.user_attrs
    conf = a.get("confirmation")
    return StudyFacts(
        name=study.study_name, fingerprint=dict(a.get("fingerprint") or {}),
        workload=dict(a.get("workload") or {}), space=dict(a.get("space") or {}),
        memory_limit_bytes=a.get("memory_limit_bytes"),
        memory_limit_spec=a.get("memory_limit_spec"), probe=a.get("probe"),
        flops=dict(a.get("flops") or {}), unapplied=a.get("unapplied"),
        confirmation=Confirmation.from_dict(conf) if conf else None,
        diagnosis=tuple(a.get("diagnosis") or ()))


def node_trial(study: optuna.Study) -> dict[str, Any]:
    """The trial across machines the tuner publishes now (read anew from the storage)."""
    return dict(study.user_attrs.get(NODE_TRIAL) or {})


def node_reports(study: optuna.Study) -> list[Mapping[str, Any]]:
    """What the agents said of how their part of a trial ended (read anew)."""
    return [v for k, v in study.user_attrs.items() if k.startswith(f"{NODE_REPORT}:")]
