"""A profile is data that may have been edited or downloaded: every value it holds is checked
against the knob registry when it is loaded, by every command and by ``load_profile``, and
nothing outside the registry reaches torch or transformers."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from autotune.cli import app
from autotune.config.knobs import Config
from autotune.errors import ProfileError
from autotune.profile import load_profile
from tests.test_profile import make

runner = CliRunner()

# (key, value, what the one-line error must name): each of these once went into training.
BAD = [
    ("attention", "kernels-community/flash-attn", "'kernels-community/flash-attn'"),
    ("attention", "../x", "'../x'"),
    ("cpu_threads", 1_000_000_000, "1000000000"),
    ("optimizer_impl", "turbo", "'turbo'"),
    ("amp", "fp8", "'fp8'"),
    ("matmul_precision", "bogus", "'bogus'"),
    ("micro_batch_size", 0, "got 0"),
    ("micro_batch_size", -1, "got -1"),
    ("micro_batch_size", 2**62, str(2**62)),
    ("micro_batch_size", "8", "'8'"),
    ("world_size", 0, "got 0"),
    ("compile", "max-autotune; rm -rf /", "'max-autotune; rm -rf /'"),
    ("nccl_algo", "Ring;touch x", "'Ring;touch x'"),
    ("pin_memory", "yes", "'yes'"),
]


def _write(tmp_path: Path, data: dict[str, Any], name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _with(key: str, value: Any, where: str = "config") -> dict[str, Any]:
    data = make().to_dict()
    data[where] = {**data[where], key: value} if where == "config" else \
        {**data[where], "config": {**data[where]["config"], key: value}}
    return data


@pytest.mark.parametrize(("key", "value", "shown"), BAD)
def test_a_value_outside_the_registry_is_refused_by_every_command(
        tmp_path: Path, key: str, value: Any, shown: str) -> None:
    path = _write(tmp_path, _with(key, value))
    with pytest.raises(ProfileError) as raised:
        load_profile(path)
    message = str(raised.value)
    assert f"config.{key}" in message and shown in message and "\n" not in message
    marker = tmp_path / "ran"
    for args in (["profile", "show", str(path)], ["profile", "env", str(path)],
                 ["profile", "check", str(path), "--rounds", "1"],
                 ["launch", str(path), "--", "touch", str(marker)]):
        result = runner.invoke(app, args)
        errors = [ln for ln in result.output.splitlines() if ln.startswith("autotune: error:")]
        assert result.exit_code == 2, (args, result.output)
        assert len(errors) == 1 and f"config.{key}" in errors[0] and shown in errors[0]
        assert "Traceback" not in result.output and "round 1" not in result.output
    assert not marker.exists()


def test_the_allowed_values_are_named() -> None:
    with pytest.raises(ValueError, match=r"attention must be one of \['default', 'eager', "
                                         r"'sdpa', 'flash_attention_2'\], got 'x/y'"):
        Config.from_dict({"attention": "x/y"})
    with pytest.raises(ValueError, match="cpu_threads must be an integer from 0 to 4096"):
        Config.from_dict({"cpu_threads": 10**9})


def test_the_baseline_s_config_and_the_numbers_are_checked_too(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"baseline\.config\.amp must be one of"):
        load_profile(_write(tmp_path, _with("amp", "fp8", where="baseline")))
    data = make().to_dict()
    for key, value in (("speedup", math.nan), ("speedup", -2.0)):
        with pytest.raises(ProfileError, match="speedup that is not a positive number"):
            load_profile(_write(tmp_path, {**data, key: value}))
    data["result"] = {**data["result"], "samples_per_sec": math.inf}
    with pytest.raises(ProfileError, match="no result.samples_per_sec"):
        load_profile(_write(tmp_path, data))


def test_the_blocks_hold_what_their_types_say(tmp_path: Path) -> None:
    """The figures readers compute with (the summary's, ``profile check``'s) are checked as
    the file loads against their types (``profile.documents``), every mismatch named at once;
    keys a later autotune may add pass."""
    data = make().to_dict()
    data["result"] = {**data["result"], "spread_cv": "low", "ranks": [{"rank": 1.5}],
                      "from_a_later_version": {"x": [1]}}
    data["diagnosis"] = [{"kind": "low-mfu", "text": 3}, "not a finding"]
    data["probe"] = {"peak_tflops": {"bf16": "fast"}}
    with pytest.raises(ProfileError) as raised:
        load_profile(_write(tmp_path, data))
    text = str(raised.value)
    for where in ("result.spread_cv = 'low', not a number or null",
                  "result.ranks[0].rank = 1.5, not an integer",
                  "diagnosis[0].text = 3, not a string", "diagnosis[1] that is not a mapping",
                  "probe.peak_tflops.bf16 = 'fast', not a number"):
        assert where in text, text
    assert "from_a_later_version" not in text and "damaged" in text
    data = make().to_dict()
    data["result"] = {**data["result"], "from_a_later_version": {"x": [1]}, "windows": 3}
    assert load_profile(_write(tmp_path, data)).result["windows"] == 3


def test_every_bad_value_is_named_at_once(tmp_path: Path) -> None:
    data = make().to_dict()
    data["config"] |= {"amp": "fp8", "world_size": 0, "turbo": True}
    with pytest.raises(ProfileError) as raised:
        load_profile(_write(tmp_path, data))
    text = str(raised.value)
    assert "'turbo'" in text and "config.amp" in text and "config.world_size" in text


def test_an_env_value_is_checked_as_its_knob(tmp_path: Path) -> None:
    data = make().to_dict() | {"env": {"NCCL_ALGO": "Ring$(touch x)"}}
    with pytest.raises(ProfileError, match=r"env\.NCCL_ALGO must be"):
        load_profile(_write(tmp_path, data))


def test_registry_values_load_in_their_canonical_spelling(tmp_path: Path) -> None:
    data = make().to_dict()
    data["config"] |= {"amp": "BF16", "nccl_algo": "ring,tree"}
    loaded = load_profile(_write(tmp_path, data))
    assert (loaded.config.amp, loaded.config.nccl_algo) == ("bf16", "Ring,Tree")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                    reason="flash-attn is installed here: flash_attention_2 is allowed")
def test_flash_attention_without_flash_attn_never_reaches_transformers(tmp_path: Path) -> None:
    """transformers 5 replaces a missing flash-attn by a kernel downloaded from the Hub: the
    registry value is refused on this machine, with the reason, before transformers sees it."""
    transformers = pytest.importorskip("transformers")
    data = make().to_dict()
    data["config"] |= {"attention": "flash_attention_2"}
    profile = load_profile(_write(tmp_path, data))  # a registry value: the profile loads
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64))
    calls: list[Any] = []
    model.set_attn_implementation = lambda *a, **k: calls.append(a)  # type: ignore[method-assign]
    with pytest.raises(ProfileError, match="needs the flash-attn package.*Hub"):
        profile.prepare_model(model)
    with pytest.raises(ProfileError, match="needs the flash-attn package"):
        _ = profile.attn_implementation
    assert calls == []
    result = runner.invoke(app, ["profile", "show", str(tmp_path / "p.yaml")])
    assert result.exit_code == 0 and "flash-attn package" in result.output
    result = runner.invoke(app, ["profile", "check", str(tmp_path / "p.yaml"), "--rounds", "1"])
    assert result.exit_code == 2 and "flash-attn package" in result.output
    assert "round 1" not in result.output
    marker = tmp_path / "ran"
    result = runner.invoke(app, ["launch", str(tmp_path / "p.yaml"), "--", "touch", str(marker)])
    assert result.exit_code == 2 and "flash-attn package" in result.output
    assert not marker.exists()


def test_what_a_profile_names_is_shown_escaped_never_raw(tmp_path: Path) -> None:
    data = make().to_dict()
    data["workload"] = {**data["workload"], "name": "mlp\x1b]0;owned\x07"}
    data["notes"] = ["fine\x1b[2J"]
    path, plain = _write(tmp_path, data), _write(tmp_path, make().to_dict(), "plain.yaml")
    for args in (["profile", "show", str(path)], ["profile", "diff", str(plain), str(path)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0 and "\x1b" not in result.output and "\x07" not in \
            result.output
    for args in (["profile", "show", str(path)], ["profile", "diff", str(plain), str(path)]):
        assert "mlp\\x1b]0;owned\\x07" in runner.invoke(app, args).output
