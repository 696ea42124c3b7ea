"""The contract between tuner and trial: its JSON form round-trips, measuring settings are
checked when read, and settings recorded by earlier versions still compare equal."""

from __future__ import annotations

import json

import pytest

from autotune.config.knobs import Config
from autotune.trial.spec import COUNTED, MeasureSettings, TrialSpec
from autotune.workloads import WorkloadSpec


def test_a_trial_spec_survives_its_json_form() -> None:
    spec = TrialSpec(WorkloadSpec("mlp", {"hidden": 8}), Config(micro_batch_size=16, amp="bf16"),
                     "cuda", MeasureSettings(min_window_s=0.5, max_seconds=20),
                     memory_limit_bytes=2**30, address_space_bytes=None,
                     flops_per_sample=1e6, flops_source=COUNTED, sentinel=("fp32", "bf16"))
    assert TrialSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    counting = TrialSpec(WorkloadSpec("mlp", {}), Config(), count_flops=True)
    assert counting.to_json()["flops"] == {}
    assert TrialSpec.from_json(counting.to_json()) == counting


def test_measure_settings_are_checked_when_read() -> None:
    assert MeasureSettings.from_dict(None) == MeasureSettings()
    assert MeasureSettings.from_dict({"max_seconds": 5, "min_window_s": 1}) == \
        MeasureSettings(max_seconds=5.0, min_window_s=1.0)
    with pytest.raises(ValueError, match=r"unknown measure settings \['warp'\]"):
        MeasureSettings.from_dict({"warp": 1})
    assert MeasureSettings.from_dict({"warp": 1}, strict=False) == MeasureSettings()
    with pytest.raises(ValueError, match="measure setting max_seconds must be float, got 'x'"):
        MeasureSettings.from_dict({"max_seconds": "x"})
    with pytest.raises(ValueError, match="measure setting min_windows must be int, got 2.5"):
        MeasureSettings.from_dict({"min_windows": 2.5})
    with pytest.raises(ValueError, match="measure setting time_comm must be bool"):
        MeasureSettings.from_dict({"time_comm": 1})


def test_settings_recorded_in_either_form_compare_equal() -> None:
    """Trials record their measuring settings in full now; studies made before recorded only
    the flags given (trial and window seconds). Both name the same settings, so a config
    measured then is still reused as a twin."""
    settings = MeasureSettings(max_seconds=60.0, min_window_s=1.0)
    assert MeasureSettings.same({"max_seconds": 60.0, "min_window_s": 1.0}, settings)
    assert MeasureSettings.same(settings.to_dict(), settings)
    assert not MeasureSettings.same({"max_seconds": 30.0, "min_window_s": 1.0}, settings)
    assert not MeasureSettings.same(None, settings)
    assert settings.with_longer_windows().min_window_s == 2.0


def test_when_the_trial_timeout_ends_a_trial_is_read_as_a_finite_time_or_none() -> None:
    doc = TrialSpec(WorkloadSpec("mlp", {}), Config()).to_json()
    assert "ends_by" not in doc and TrialSpec.from_json(doc).ends_by is None
    assert TrialSpec.from_json({**doc, "ends_by": 1.5e9}).ends_by == 1.5e9
    for bad in (float("inf"), float("nan"), "soon", True, None):
        assert TrialSpec.from_json({**doc, "ends_by": bad}).ends_by is None
