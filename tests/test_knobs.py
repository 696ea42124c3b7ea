from __future__ import annotations

import json
from dataclasses import FrozenInstanceError, replace

import pytest

from autotune.config.knobs import KNOBS, Config, env_for, torch_takes
from autotune.testing.hardware import fake_gpus
from autotune.trial.apply import ddp_accepts, ddp_kwargs


def test_config_round_trip_and_samples_per_step() -> None:
    config = Config(micro_batch_size=16, grad_accum_steps=4, amp="bf16", world_size=2)
    assert Config.from_dict(config.to_dict()) == config
    assert config.samples_per_step == 16 * 4 * 2


def test_a_config_is_its_own_key() -> None:
    """Equal configs are one key, however they were built: directly, from the dict form (also
    after JSON), from a dict that leaves the defaults out or spells a value another way
    (``from_dict`` fills the defaults and gives each value its canonical spelling)."""
    config = Config(micro_batch_size=16, amp="bf16", nccl_algo="Tree,Ring", world_size=2)
    same = [
        Config(micro_batch_size=16, amp="bf16", nccl_algo="Tree,Ring", world_size=2),
        Config.from_dict(config.to_dict()),
        Config.from_dict(json.loads(json.dumps(config.to_dict()))),
        Config.from_dict({"world_size": 2, "amp": "BF16", "micro_batch_size": 16,
                          "nccl_algo": "tree,ring"}),
        Config.from_dict({**Config().to_dict(), "micro_batch_size": 16, "amp": "bf16",
                          "nccl_algo": "Tree,Ring", "world_size": 2}),
    ]
    for other in same:
        assert other == config and hash(other) == hash(config)
    assert len({config, *same}) == 1
    assert {config: "measured"}[same[-2]] == "measured"
    assert Config.from_dict({}) == Config() and hash(Config.from_dict({})) == hash(Config())
    # A config that differs in any one knob is another key.
    others = {replace(config, **{name: value}) for name, value in [
        ("micro_batch_size", 32), ("amp", "off"), ("nccl_algo", "Ring"), ("world_size", 4),
        ("prefetch_factor", 2), ("pin_memory", True)]}
    assert len(others) == 6 and config not in others
    with pytest.raises(FrozenInstanceError):
        config.amp = "off"  # type: ignore[misc]


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
    ("micro_batch_size", 0, "from 1 to 16777216, got 0"),
    ("micro_batch_size", 2**62, "from 1 to 16777216, got 4611686018427387904"),
    ("cpu_threads", 10**9, "from 0 to 4096"),
    ("micro_batch_size", True, "integer"),
    ("amp", "fp8", "one of"),
    ("nccl_algo", "Butterfly", "comma-separated list of .*Tree.*got .Butterfly."),
    ("pin_memory", "yes", "true or false"),
])
def test_parse_rejects_with_the_rule_and_value(knob: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KNOBS[knob].parse(value)


def test_env_sets_nccl_only_with_ranks() -> None:
    assert env_for(Config(nccl_algo="Tree", world_size=2)) == {"NCCL_ALGO": "Tree"}
    assert env_for(Config(nccl_algo="Tree", world_size=1)) == {}
    assert env_for(Config(world_size=2)) == {}


def test_nccl_values_are_case_insensitive_and_canonical() -> None:
    assert KNOBS["nccl_proto"].parse("ll128") == "LL128"
    assert KNOBS["nccl_algo"].parse("nvlstree,RING") == "NVLSTree,Ring"
    with pytest.raises(ValueError, match="NCCL_PROTO must be 'default' or"):
        KNOBS["nccl_proto"].parse("LL256")


def test_nccl_values_are_checked_against_the_nccl_in_use() -> None:
    old = replace(fake_gpus(2), nccl_version="2.21.5")
    assert KNOBS["nccl_algo"].value_ok("PAT", old, 2) == \
        "NCCL_ALGO=PAT needs NCCL >= 2.23; this torch has NCCL 2.21.5"
    assert KNOBS["nccl_algo"].value_ok("Tree,NVLS", old, 2) is None
    assert KNOBS["nccl_algo"].value_ok("default", old, 2) is None
    assert KNOBS["nccl_proto"].value_ok("LL128", replace(old, nccl_version="2.4.8"), 2) == \
        "NCCL_PROTO=LL128 needs NCCL >= 2.5; this torch has NCCL 2.4.8"


def test_env_sets_nccl_proto_and_ddp_kwargs_follow_the_config() -> None:
    config = Config(nccl_algo="Ring", nccl_proto="Simple", world_size=4, ddp_bucket_cap_mb=100,
                    ddp_static_graph=True)
    assert env_for(config) == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
    # Only what differs from DDP's defaults, and only what this torch accepts (it takes all).
    assert ddp_kwargs(config) == {"bucket_cap_mb": 100, "static_graph": True}
    assert ddp_accepts("bucket_cap_mb") and not ddp_accepts("no_such_argument")


def test_ddp_arguments_are_narrowed_by_the_torch_version_without_importing_torch() -> None:
    # The installed torch takes both, as its version says; a torch older than the argument's
    # first release gets the DDP knob fixed, with the reason.
    for argument in ("gradient_as_bucket_view", "static_graph"):
        assert ddp_accepts(argument) and torch_takes(argument, "2.13.0+cpu")
    assert not torch_takes("static_graph", "1.10.2")
    old = replace(fake_gpus(2), torch_version="1.10.2")
    assert KNOBS["ddp_static_graph"].applies(old, 2) == \
        "this torch's DistributedDataParallel has no static_graph argument"
    assert KNOBS["ddp_gradient_as_bucket_view"].applies(old, 2) is None
