"""What happens to a proposed config before anything runs, as data: measured already (its twin's
outcome is reused), being measured by another worker now (wait, then reuse), ruled out by a rule
of the space, predicted out of memory, predicted too slow for any budget, no room left in this
run's --timeout, or run. Pure: the runner gathers the facts, ``decide`` rules, and the runner
writes the record and reports the trial once.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from autotune.config.knobs import Config
from autotune.tuner import record
from autotune.tuner.budget import TrialBudget
from autotune.tuner.record import Predicted, Prediction, Record, TrialRecord


class Kind(StrEnum):
    """What happens to a proposed config."""

    RUN = "run"
    TWIN = "twin"  # measured already with the same settings: its outcome is reused
    TWIN_RUNNING = "twin running"  # another worker measures it now: wait, then reuse
    PREDICTED = "predicted"  # ruled out without running (``Verdict.predicted`` says by what)
    NO_ROOM = "no room"  # fits the trial timeout, not what is left of the run's --timeout


@dataclass(frozen=True)
class Facts:
    """What the runner found about a proposed config, each check's answer (None: clear)."""

    config: Config
    number: int
    is_baseline: bool
    limit: int
    twin: TrialRecord | None = None
    running_twins: tuple[int, ...] = ()
    rule: str | None = None  # oversubscribed: why
    memory: tuple[str, float | None] | None = None  # the memory model's (why, predicted peak)
    # The baseline's strategy cannot fit by the memory model of sharding, and the space
    # searches sharding: the baseline moves to the next strategy (``tuner.memory_binds``).
    strategy_out: bool = False
    plan: TrialBudget | None = None


@dataclass(frozen=True)
class Verdict:
    """What to do with the config; ``record``: what to write on the trial when nothing runs."""

    kind: Kind
    record: Record | None = None
    plan: TrialBudget | None = None
    twin: TrialRecord | None = None
    predicted: Predicted | None = None  # with PREDICTED: which rule or model ruled it out

    @property
    def runs(self) -> bool:
        return self.kind == Kind.RUN

    @property
    def reported(self) -> bool:
        """Whether the console shows it as a trial (no room is said once, as the stop
        reason; a twin is reported when its reused outcome is recorded)."""
        return self.kind == Kind.PREDICTED


def decide(f: Facts) -> Verdict:
    """The verdict on ``f.config``. The baseline is never a twin nor ruled out by a rule or
    the memory model (the speedup is measured against it), but by the memory model of sharding
    when sharding is searched (``strategy_out``: it is measured under the next strategy
    instead); only its measuring budget can keep it from running otherwise."""
    if f.is_baseline and not f.strategy_out:
        return _budget(f)
    if f.running_twins:
        return Verdict(Kind.TWIN_RUNNING)
    if f.twin is not None:
        return Verdict(Kind.TWIN, twin=f.twin)
    if f.rule is not None:
        return _predicted(Prediction(Predicted.OVERSUBSCRIBED, f.rule), f.limit)
    if f.memory is not None:
        return _predicted(Prediction(Predicted.OOM, f.memory[0], f.memory[1]), f.limit)
    return _budget(f)


def _predicted(p: Prediction, limit: int, plan: TrialBudget | None = None) -> Verdict:
    return Verdict(Kind.PREDICTED, record.of_prediction(p, limit), plan=plan, predicted=p.kind)


def _budget(f: Facts) -> Verdict:
    """Too slow for any budget, no room in this run, or run with the planned budget."""
    plan = f.plan
    assert plan is not None, "a config that may run needs its measuring budget"
    if plan.too_slow:
        assert plan.prediction is not None
        return _predicted(Prediction(Predicted.TOO_SLOW, plan.too_slow, step=plan.prediction,
                                     samples_per_step=f.config.samples_per_step), f.limit, plan)
    if plan.no_room:
        return Verdict(Kind.NO_ROOM, record.of_no_room(plan.no_room, f.limit), plan=plan)
    return Verdict(Kind.RUN, plan=plan)
