from __future__ import annotations

import pytest

from autotune.knobs import KNOBS, Config, env_for


def test_config_round_trip_and_samples_per_step() -> None:
    config = Config(micro_batch_size=16, grad_accum_steps=4, amp="bf16", world_size=2)
    assert Config.from_dict(config.to_dict()) == config
    assert config.samples_per_step == 16 * 4 * 2


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown config keys"):
        Config.from_dict({"micro_batch_size": 8, "batch": 3})


@pytest.mark.parametrize(("knob", "value", "expected"), [
    ("amp", False, "off"),  # YAML 1.1 reads a bare `off` as False
    ("amp", "BF16", "bf16"),
    ("nccl_algo", "tree,ring", "Tree,Ring"),
    ("nccl_algo", "DEFAULT", "default"),
    ("num_workers", 0, 0),
])
def test_parse_accepts(knob: str, value: object, expected: object) -> None:
    assert KNOBS[knob].parse(value) == expected


@pytest.mark.parametrize(("knob", "value", "message"), [
    ("micro_batch_size", 0, ">= 1, got 0"),
    ("micro_batch_size", True, "integer"),
    ("amp", "fp8", "one of"),
    ("nccl_algo", "Butterfly", "one of"),
    ("pin_memory", "yes", "true or false"),
])
def test_parse_rejects_with_the_rule_and_value(knob: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KNOBS[knob].parse(value)


def test_env_sets_nccl_only_with_ranks() -> None:
    assert env_for(Config(nccl_algo="Tree", world_size=2)) == {"NCCL_ALGO": "Tree"}
    assert env_for(Config(nccl_algo="Tree", world_size=1)) == {}
    assert env_for(Config(world_size=2)) == {}
