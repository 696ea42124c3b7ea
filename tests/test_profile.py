from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from autotune.errors import ProfileError
from autotune.hardware import detect
from autotune.knobs import Config
from autotune.profile import SCHEMA, FingerprintWarning, Profile, load_profile

FIXTURE = Path(__file__).parent / "data" / "profile_v1.yaml"


def make(fingerprint: dict | None = None) -> Profile:
    return Profile(
        workload={"name": "mlp", "spec": "mlp", "params": {}},
        config=Config(micro_batch_size=64, grad_accum_steps=2, amp="bf16"), env={},
        result={"samples_per_sec": 120.5, "spread_cv": 0.01, "peak_memory_bytes": 10,
                "memory_limit_bytes": 100},
        baseline={"config": Config().to_dict(), "samples_per_sec": 60.0}, speedup=2.008,
        fingerprint=fingerprint if fingerprint is not None else detect().fingerprint(),
        provenance={"study": "s", "storage": "sqlite:///x.db", "trials": 5})


def test_round_trip(tmp_path: Path) -> None:
    path = make().save(tmp_path / "p" / "profile.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same machine: no fingerprint warning
        loaded = load_profile(path)
    assert loaded == make()
    assert loaded.micro_batch_size == 64 and loaded.accumulation_steps == 2
    assert yaml.safe_load(path.read_text())["schema"] == SCHEMA


def test_example_profiles_load() -> None:
    examples = sorted((Path(__file__).parents[1] / "studies" / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        profile = load_profile(path, check_fingerprint=False)
        assert profile.samples_per_sec > 0 and profile.speedup and profile.speedup > 1


def test_v1_fixture_still_loads() -> None:
    profile = load_profile(FIXTURE, check_fingerprint=False)
    assert profile.config.amp == "bf16" and profile.speedup == pytest.approx(2.41)


def test_unknown_schema_names_both_versions(tmp_path: Path) -> None:
    data = make().to_dict() | {"schema": "autotune.profile/v9"}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match="'autotune.profile/v9'.*'autotune.profile/v1'"):
        load_profile(tmp_path / "p.yaml")


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    text = make().save(tmp_path / "p.yaml").read_text()
    (tmp_path / "cut.yaml").write_text(text[: len(text) // 3])
    with pytest.raises(ProfileError, match="damaged|truncated"):
        load_profile(tmp_path / "cut.yaml")


def test_python_tags_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "evil.yaml").write_text(
        f"schema: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(tmp_path / "evil.yaml")
    assert not marker.exists()


def test_fingerprint_mismatch_warns_naming_fields(tmp_path: Path) -> None:
    fp = detect().fingerprint() | {"cpu_model": "Other CPU", "gpu_count": 8}
    path = make(fp).save(tmp_path / "p.yaml")
    with pytest.warns(FingerprintWarning, match="cpu_model: 'Other CPU'.*gpu_count: 8"):
        load_profile(path)
