"""What happens to a proposed config before anything runs (``tuner.verdict``), as data: each
verdict, the record written when nothing runs, and the baseline, which is never a twin nor ruled
out by a rule or the memory model (pure: crafted facts, no trial runs here)."""

from __future__ import annotations

from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from autotune.config.knobs import Config
from autotune.trial.measurement import Measurement
from autotune.trial.spec import MeasureSettings
from autotune.tuner import record, verdict
from autotune.tuner.budget import StepPrediction, TrialBudget
from autotune.tuner.record import (
    Predicted,
    Record,
    TrialRecord,
    read_trial,
)
from autotune.tuner.verdict import Facts, decide

GIB = 2**30
LIMIT = 2 * GIB
CONFIG = Config(micro_batch_size=16, num_workers=2, cpu_threads=1)
SETTINGS = MeasureSettings(min_window_s=0.1, max_seconds=5.0)
PLAN = TrialBudget(SETTINGS, StepPrediction(0.2, 0.1, "scaled from trial 0", False))
TOO_SLOW_PLAN = TrialBudget(SETTINGS, StepPrediction(40.0, 0.1, "fitted on trials 0, 1", True),
                            too_slow="predicted-too-slow: ~40s per step")
NO_ROOM_PLAN = TrialBudget(SETTINGS, StepPrediction(0.2, 0.1, "scaled from trial 0", False),
                           no_room="needs ~12s; 3s of --timeout are left")
TWIN = TrialRecord(number=1, state=TrialState.COMPLETE, config=CONFIG, status="ok", reason=None,
                   measurement=Measurement("ok", samples_per_sec=80.0, peak_memory_bytes=GIB))
RULE = "oversubscribed: 1 thread(s) + 2 loader worker(s) per rank x 1 rank(s) need 3 cores"
MEMORY = ("predicted-oom: peak 3.00 GiB at micro-batch 16", 3.0 * GIB)


def facts(**kw: Any) -> Facts:
    return Facts(**{"config": CONFIG, "number": 5, "is_baseline": False, "limit": LIMIT, **kw})


def read_back(rec: Record | None) -> TrialRecord:
    """The record as a later read of the study gives it."""
    assert rec is not None
    t = optuna.trial.create_trial(state=rec.state, value=rec.value, user_attrs={
        **rec.attrs, "config": CONFIG.to_dict()})
    found = read_trial(t)
    assert found is not None
    return found


def test_a_clear_config_runs_with_its_planned_budget() -> None:
    v = decide(facts(plan=PLAN))
    assert v.kind == verdict.Kind.RUN and v.runs and v.plan == PLAN
    assert v.record is None and v.twin is None  # nothing is written before it runs
    assert not v.reported  # it is reported when its measurement is recorded


def test_a_config_measured_already_reuses_its_twin() -> None:
    v = decide(facts(twin=TWIN))  # a twin needs no budget: nothing runs
    assert v.kind == verdict.Kind.TWIN and v.twin == TWIN and not v.runs
    assert v.record is None and not v.reported  # its reused outcome is recorded, and reported
    # A twin outranks the rule and the memory model: its outcome is known, not predicted.
    assert decide(facts(twin=TWIN, rule=RULE, memory=MEMORY)).kind == verdict.Kind.TWIN


def test_a_config_another_worker_measures_now_waits_for_it() -> None:
    v = decide(facts(running_twins=(4,), twin=TWIN, plan=PLAN))
    assert v.kind == verdict.Kind.TWIN_RUNNING and not v.runs
    assert v.record is None and not v.reported


def test_a_rule_of_the_space_rules_a_config_out() -> None:
    v = decide(facts(rule=RULE, memory=MEMORY, plan=PLAN))
    assert v.kind == verdict.Kind.PREDICTED and not v.runs and v.reported
    assert v.record is not None and v.record.state == TrialState.PRUNED
    assert v.record.constraint is None  # nothing about its memory is known
    assert v.record.attrs["reason"] == RULE and v.record.retry_attrs is None
    r = read_back(v.record)
    assert r.predicted_kind == Predicted.OVERSUBSCRIBED and not r.ran and r.reason == RULE


def test_the_memory_model_rules_out_a_config_predicted_out_of_memory() -> None:
    v = decide(facts(memory=MEMORY, plan=PLAN))
    assert v.kind == verdict.Kind.PREDICTED and not v.runs and v.reported
    assert v.record is not None and v.record.state == TrialState.PRUNED
    assert v.record.constraint == pytest.approx(1.0 * GIB)  # infeasible by the predicted excess
    r = read_back(v.record)
    assert r.predicted_kind == Predicted.OOM and not r.ran and r.reason == MEMORY[0]
    assert r.forecast.peak_memory_bytes == 3 * GIB
    # An OOM predicted above a measured one, with no peak: still infeasible.
    unknown = decide(facts(memory=("predicted-oom: above trial 2's OOM", None), plan=PLAN))
    assert unknown.kind == verdict.Kind.PREDICTED
    assert unknown.record is not None and unknown.record.constraint == 1.0


def test_a_config_predicted_too_slow_for_any_budget_never_starts() -> None:
    v = decide(facts(plan=TOO_SLOW_PLAN))
    assert v.kind == verdict.Kind.PREDICTED and not v.runs and v.reported
    assert v.plan == TOO_SLOW_PLAN
    assert v.record is not None and v.record.state == TrialState.PRUNED
    assert v.record.intermediate == (pytest.approx(16 / 40.0),)  # the sampler's hint
    assert v.record.constraint is None  # its memory is unknown
    r = read_back(v.record)
    assert r.predicted_kind == Predicted.TOO_SLOW and not r.ran and r.step_s == 40.0
    assert r.reason == TOO_SLOW_PLAN.too_slow


def test_no_room_in_the_run_is_not_run_and_not_queued_again() -> None:
    v = decide(facts(plan=NO_ROOM_PLAN))
    assert v.kind == verdict.Kind.NO_ROOM and not v.runs
    assert not v.reported  # said once, as the reason the run stopped
    assert v.record is not None and v.record.state == TrialState.FAIL
    assert v.record.attrs["status"] == record.Outcome.NOT_RUN and v.record.attrs["not_run"] is True
    assert v.record.attrs["reason"].startswith("not run: no room left: needs ~12s")
    assert "interrupted" not in v.record.attrs  # not a cut-short trial
    assert v.record.retry_attrs is None  # no retry left waiting in the study
    assert read_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={
        **v.record.attrs, "config": CONFIG.to_dict()})) is None  # not a record of the config


def test_the_baseline_is_never_a_twin_nor_ruled_out() -> None:
    """The speedup is measured against it: only its measuring budget keeps it from running."""
    v = decide(facts(is_baseline=True, twin=TWIN, running_twins=(4,), rule=RULE, memory=MEMORY,
                     plan=PLAN))
    assert v.kind == verdict.Kind.RUN and v.plan == PLAN and v.twin is None
    assert decide(facts(is_baseline=True, rule=RULE, plan=PLAN)).kind == verdict.Kind.RUN
    assert decide(facts(is_baseline=True, memory=MEMORY, plan=PLAN)).kind == verdict.Kind.RUN
    assert decide(facts(is_baseline=True, twin=TWIN, plan=PLAN)).kind == verdict.Kind.RUN
    assert decide(facts(is_baseline=True, running_twins=(4,), plan=PLAN)).kind == verdict.Kind.RUN
    # Its budget still rules: too slow for any budget, or no room left in this run.
    assert decide(facts(is_baseline=True, rule=RULE, plan=TOO_SLOW_PLAN)).kind == \
        verdict.Kind.PREDICTED
    queued = decide(facts(is_baseline=True, memory=MEMORY, plan=NO_ROOM_PLAN))
    assert queued.kind == verdict.Kind.NO_ROOM and queued.record is not None
    assert queued.record.retry_attrs is None and queued.record.attrs["not_run"] is True
    # A baseline not run is no baseline: the next run queues it again.
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={
        **queued.record.attrs, "config": CONFIG.to_dict(), "baseline": True}))
    assert not record.baseline_pending(study)
