"""What is written on a trial for each outcome, without a study: state, value, memory
constraint, intermediate values, attributes, and what is queued again."""

from __future__ import annotations

import pytest
from optuna.trial import TrialState

from autotune.trial.measurement import BUDGET, INTERRUPTED, TOO_SLOW, Measurement
from autotune.tuner import record
from autotune.tuner.record import Predicted, Prediction

LIMIT = 1000
WINDOWS = [{"samples": 100, "seconds": 1.0}, {"samples": 100, "seconds": 0.5}]


def test_an_ok_trial_completes_with_its_rate_and_window_rates() -> None:
    m = Measurement("ok", samples_per_sec=150.0, spread_cv=0.01, peak_memory_bytes=600,
                    windows=WINDOWS, stderr_tail="noise", timings={"measure_s": 3.0},
                    wall_s=4.0)
    rec = record.of_measurement(m, LIMIT, number=3, baseline=False,
                                devices={"devices": ["cpu"]})
    assert rec.state == TrialState.COMPLETE and rec.value == 150.0
    assert rec.intermediate == (100.0, 200.0)
    assert rec.constraint == 600 - LIMIT  # feasible: <= 0
    assert rec.retry_attrs is None
    a = rec.attrs
    assert a["status"] == "ok" and a["reason"] is None and a["memory_limit_bytes"] == LIMIT
    assert a["measurement"]["stderr_tail"] == ""  # an ok trial's stderr is not kept
    assert a["measurement"]["samples_per_sec"] == 150.0
    assert a["overhead_share"] == pytest.approx(0.25)
    assert a["devices"] == {"devices": ["cpu"]}
    assert list(a) == ["status", "reason", "measurement", "memory_limit_bytes",
                       "overhead_share", "devices"]


def test_an_ok_trial_over_the_limit_is_infeasible() -> None:
    m = Measurement("ok", samples_per_sec=150.0, peak_memory_bytes=1500, windows=WINDOWS)
    rec = record.of_measurement(m, LIMIT, number=0, baseline=False)
    assert rec.state == TrialState.COMPLETE and rec.constraint == 500
    assert "devices" not in rec.attrs


def test_an_oom_completes_at_zero_and_is_infeasible_whatever_its_peak() -> None:
    m = Measurement("oom", reason="CUDA out of memory", peak_memory_bytes=10,
                    stderr_tail="Traceback ...")
    rec = record.of_measurement(m, LIMIT, number=1, baseline=False)
    assert rec.state == TrialState.COMPLETE and rec.value == 0.0
    assert rec.constraint == 1.0 and rec.intermediate == ()
    assert rec.attrs["measurement"]["stderr_tail"] == "Traceback ..."  # failures keep theirs


def test_a_pruned_trial_reports_its_windows() -> None:
    m = Measurement("pruned", reason="below the best", peak_memory_bytes=200, windows=WINDOWS)
    rec = record.of_measurement(m, LIMIT, number=2, baseline=False)
    assert rec.state == TrialState.PRUNED and rec.value is None
    assert rec.intermediate == (100.0, 200.0) and rec.constraint == 200 - LIMIT


def test_a_too_slow_trial_is_pruned_with_its_rough_rate_only() -> None:
    slow = Measurement("timeout", reason="one optimizer step takes ~40s", ended_by=TOO_SLOW,
                       rough_samples_per_sec=0.4)
    rec = record.of_measurement(slow, LIMIT, number=4, baseline=False)
    assert rec.state == TrialState.PRUNED and rec.intermediate == (0.4,)
    assert rec.constraint is None
    bare = record.of_measurement(Measurement("timeout", reason="killed"), LIMIT, number=4,
                                 baseline=False)
    assert bare.state == TrialState.PRUNED and bare.intermediate == ()


def test_an_error_fails() -> None:
    rec = record.of_measurement(Measurement("error", reason="ValueError: boom"), LIMIT,
                                number=5, baseline=False)
    assert rec.state == TrialState.FAIL and rec.constraint is None and rec.retry_attrs is None
    assert rec.attrs["reason"] == "ValueError: boom"


@pytest.mark.parametrize(("ended_by", "budget_cut"), [(INTERRUPTED, False), (BUDGET, True)])
def test_no_result_fails_and_is_queued_again(ended_by: str, budget_cut: bool) -> None:
    m = Measurement("error", reason="stopped", ended_by=ended_by)
    rec = record.of_measurement(m, LIMIT, number=7, baseline=True)
    assert rec.state == TrialState.FAIL and rec.attrs["interrupted"] is True
    assert rec.retry_attrs == {"retry_of": 7, "baseline": True, "budget_cut": budget_cut}
    assert rec.constraint is None and rec.intermediate == ()


def test_a_prediction_is_pruned_and_infeasible_by_the_predicted_excess() -> None:
    rec = record.of_prediction(Prediction(Predicted.OOM, "predicted 2.0 GiB", 1800.0), LIMIT)
    assert rec.state == TrialState.PRUNED and rec.constraint == 800.0
    assert rec.attrs["predicted"] is True and rec.attrs["status"] == "pruned"
    # Nothing was measured: the prediction is kept as the trial's forecast, not as figures of
    # a measurement.
    assert rec.attrs["forecast"]["peak_memory_bytes"] == 1800
    assert rec.attrs["measurement"] == {"status": "pruned", "reason": "predicted 2.0 GiB"}
    unknown = record.of_prediction(Prediction(Predicted.OOM, "above an OOM", None), LIMIT)
    assert unknown.constraint == 1.0
    assert unknown.attrs["forecast"]["peak_memory_bytes"] is None
