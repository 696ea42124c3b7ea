from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from autotune.errors import SpaceError, UsageError
from autotune.knobs import Config
from autotune.space import Choices, IntRange, builtin_spaces, load_space, narrow
from autotune.testing.hardware import fake_cpu, fake_gpus


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return str(path)


def test_builtin_spaces_load_and_open_with_their_command() -> None:
    spaces = builtin_spaces()
    assert "default" in spaces
    for name, path in spaces.items():
        assert path.read_text().startswith("# autotune run"), name
        load_space(name)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, """
knobs:
  micro_batch_size: {choices: [0, 8]}
  amp: {choices: [fp8]}
  batch_size: {choices: [1]}
  grad_accum_steps: {low: 4, high: 2}
""")
    with pytest.raises(SpaceError) as info:
        load_space(path)
    problems = info.value.problems
    assert len(problems) == 4
    text = str(info.value)
    assert "micro_batch_size: must be >= 1, got 0" in text
    assert "amp: must be one of" in text and "'fp8'" in text
    assert "unknown knob 'batch_size'" in text
    assert "low (4) must be <= high (2)" in text
    assert path in text


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(SpaceError, match="not valid YAML at line 3: found character '\\\\t'"):
        load_space(write(tmp_path, "knobs:\n  amp: {choices: [off]}\n\tx: 1\n"))


def test_unknown_name_lists_the_builtins() -> None:
    with pytest.raises(UsageError, match="built-in spaces: .*default"):
        load_space("nope")


def test_bare_off_is_read_as_the_amp_mode(tmp_path: Path) -> None:
    space = load_space(write(tmp_path, "knobs:\n  amp: {choices: [off, bf16]}\n"))
    assert space.knobs["amp"] == Choices(("off", "bf16"))


def test_narrowing_on_cpu_fixes_and_drops_with_reasons() -> None:
    narrowed = narrow(load_space("default"), fake_cpu(cores=2), 1, Config())
    assert narrowed.searched["amp"] == Choices(("off", "bf16"))
    assert ("fp16", "fp16 autocast is not a training precision on this device") in \
        narrowed.removed["amp"]
    assert narrowed.searched["num_workers"] == Choices((0, 1, 2))
    for knob in ("pin_memory", "nccl_algo", "ddp_bucket_cap_mb"):
        assert knob in narrowed.fixed and knob not in narrowed.searched
    assert narrowed.fixed["pin_memory"][0] is False
    assert "no CUDA GPU" in narrowed.fixed["nccl_algo"][1]
    text = "\n".join(narrowed.describe())
    assert "fixed to false" in text and "dropped fp16" in text


def test_cpu_without_bf16_keeps_only_fp32() -> None:
    narrowed = narrow(load_space("default"), fake_cpu(bf16=False), 1, Config())
    assert narrowed.fixed["amp"] == ("off", "only one value left")


def test_narrowing_on_gpus_keeps_everything_with_ranks() -> None:
    narrowed = narrow(load_space("default"), fake_gpus(2), 2, Config())
    assert set(narrowed.searched) == {"micro_batch_size", "grad_accum_steps", "amp",
                                      "ddp_bucket_cap_mb", "nccl_algo", "num_workers",
                                      "pin_memory", "prefetch_factor"}
    old = narrow(load_space("default"), fake_gpus(1, compute_capability=(7, 0)), 1, Config())
    assert "bf16" not in old.searched["amp"].values  # type: ignore[union-attr]
    assert "ddp_bucket_cap_mb" in old.fixed


def test_baseline_value_always_stays_in_the_space(tmp_path: Path) -> None:
    space = load_space(write(tmp_path, "knobs:\n  micro_batch_size: {choices: [16, 64]}\n"))
    narrowed = narrow(space, fake_cpu(), 1, Config(micro_batch_size=8))
    assert narrowed.searched["micro_batch_size"] == Choices((8, 16, 64))


def test_suggest_gives_valid_configs_and_prefetch_only_with_workers() -> None:
    narrowed = narrow(load_space("default"), fake_cpu(), 1, Config())
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen_prefetch = set()
    for _ in range(40):
        trial = study.ask()
        config = narrowed.suggest(trial, Config())
        assert config.micro_batch_size in (4, 8, 16, 32, 64, 128)
        assert config.amp in ("off", "bf16")
        assert config.pin_memory is False
        if config.num_workers == 0:
            assert config.prefetch_factor is None and "prefetch_factor" not in trial.params
        else:
            seen_prefetch.add(config.prefetch_factor)
        study.tell(trial, 1.0)
    assert seen_prefetch == {2, 4}


def test_enqueued_baseline_comes_back_unchanged() -> None:
    narrowed = narrow(load_space("default"), fake_cpu(), 1, Config())
    baseline = Config(micro_batch_size=8)
    study = optuna.create_study()
    study.enqueue_trial(narrowed.params_for(baseline))
    assert narrowed.suggest(study.ask(), baseline) == baseline


def test_int_ranges_are_clipped_to_the_hardware_and_hold_the_baseline(tmp_path: Path) -> None:
    space = load_space(write(tmp_path, "knobs:\n  num_workers: {low: 1, high: 16}\n"
                                       "  micro_batch_size: {low: 16, high: 64, step: 8}\n"))
    narrowed = narrow(space, fake_cpu(cores=2), 1, Config(micro_batch_size=8))
    assert narrowed.searched["num_workers"] == IntRange(0, 2)  # 3..16 dropped, baseline 0 added
    assert narrowed.removed["num_workers"][0][0] == "3..16"
    assert narrowed.searched["micro_batch_size"] == IntRange(8, 64, False, 8)
    with pytest.raises(UsageError, match="baseline value 8 is not on the range's step 5"):
        narrow(load_space(write(tmp_path, "knobs:\n  micro_batch_size: {low: 10, high: 30, "
                                           "step: 5}\n")), fake_cpu(), 1, Config())


def test_int_range(tmp_path: Path) -> None:
    text = "knobs:\n  micro_batch_size: {low: 1, high: 256, log: true}\n"
    space = load_space(write(tmp_path, text))
    assert space.knobs["micro_batch_size"] == IntRange(1, 256, True, 1)
    with pytest.raises(SpaceError, match="log ranges take no step"):
        load_space(write(tmp_path, text.replace("log: true", "log: true, step: 2")))
