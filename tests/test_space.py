from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from autotune.config.knobs import Config
from autotune.config.space import (
    Choices,
    IntRange,
    baseline_for_global_batch,
    builtin_spaces,
    load_space,
    narrow,
)
from autotune.errors import SpaceError, UsageError
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
    assert "micro_batch_size: must be an integer from 1 to 16777216, got 0" in text
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
                                      "ddp_bucket_cap_mb", "ddp_gradient_as_bucket_view",
                                      "ddp_static_graph", "nccl_algo", "nccl_proto",
                                      "num_workers", "pin_memory", "prefetch_factor",
                                      "matmul_precision", "cpu_threads", "sharding",
                                      "fsdp_reduce_dtype", "cpu_offload"}
    assert "hybrid-shard" not in narrowed.searched["sharding"].values  # type: ignore[union-attr]
    old = narrow(load_space("default"), fake_gpus(1, compute_capability=(7, 0)), 1, Config())
    assert "bf16" not in old.searched["amp"].values  # type: ignore[union-attr]
    assert "ddp_bucket_cap_mb" in old.fixed and "sharding" in old.fixed


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
        assert config.micro_batch_size in [2**k for k in range(2, 17)]
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


def test_two_ranks_on_cpu_search_ddp_but_not_nccl_and_share_the_cores() -> None:
    narrowed = narrow(load_space("default"), fake_cpu(cores=2), 2, Config(world_size=2))
    for knob in ("ddp_bucket_cap_mb", "ddp_gradient_as_bucket_view", "ddp_static_graph"):
        assert knob in narrowed.searched
    for knob in ("nccl_algo", "nccl_proto"):
        assert narrowed.fixed[knob] == ("default", "NCCL knobs need the nccl backend "
                                                   "(no CUDA GPU here)")
    # Loader workers are per rank: 2 ranks x 1 worker fill the 2 cores.
    assert narrowed.searched["num_workers"] == Choices((0, 1))
    assert (2, "2 workers x 2 rank(s) exceed the 2 CPU cores") in narrowed.removed["num_workers"]


def test_nccl_values_this_nccl_lacks_are_dropped_with_the_reason(tmp_path: Path) -> None:
    space = load_space(write(tmp_path, "knobs:\n  nccl_algo: {choices: [default, Ring, PAT]}\n"))
    old = replace(fake_gpus(2), nccl_version="2.21.5")
    narrowed = narrow(space, old, 2, Config(world_size=2))
    assert narrowed.searched["nccl_algo"] == Choices(("default", "Ring"))
    assert narrowed.removed["nccl_algo"] == [
        ("PAT", "NCCL_ALGO=PAT needs NCCL >= 2.23; this torch has NCCL 2.21.5")]


def test_global_batch_keeps_micro_x_accum_x_ranks_fixed() -> None:
    baseline = baseline_for_global_batch(8, 64, 2)
    assert (baseline.micro_batch_size, baseline.grad_accum_steps) == (8, 4)
    narrowed = narrow(load_space("default"), fake_cpu(), 2, baseline, global_batch=64)
    assert narrowed.searched["micro_batch_size"] == Choices((4, 8, 16, 32))
    assert [v for v, _ in narrowed.removed["micro_batch_size"]] == ["64..65536"]
    assert "grad_accum_steps" not in narrowed.searched
    assert "grad_accum_steps" not in narrowed.fixed
    assert "grad_accum_steps   derived: --global-batch 64 / (micro_batch_size x 2 rank(s))" in \
        "\n".join(narrowed.describe())
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(30):
        trial = study.ask()
        config = narrowed.suggest(trial, baseline)
        assert config.samples_per_step == 64
        seen.add(config.micro_batch_size)
        study.tell(trial, 1.0)
    assert seen == {4, 8, 16, 32}
    study = optuna.create_study()
    study.enqueue_trial(narrowed.params_for(baseline))
    assert narrowed.suggest(study.ask(), baseline) == baseline


def test_global_batch_turns_a_range_into_its_divisors_and_rejects_the_impossible(
        tmp_path: Path) -> None:
    space = load_space(write(tmp_path, "knobs:\n  micro_batch_size: {low: 1, high: 64}\n"))
    baseline = baseline_for_global_batch(8, 24, 1)
    narrowed = narrow(space, fake_cpu(), 1, baseline, global_batch=24)
    assert narrowed.searched["micro_batch_size"] == Choices((1, 2, 3, 4, 6, 8, 12, 24))
    # An odd per-rank batch: the baseline takes the largest divisor below the default.
    assert baseline_for_global_batch(8, 30, 2).micro_batch_size == 5
    with pytest.raises(UsageError, match="--global-batch 30 is not divisible by the 4 ranks"):
        baseline_for_global_batch(8, 30, 4)
    only_big = load_space(write(tmp_path, "knobs:\n  micro_batch_size: {choices: [64]}\n"))
    with pytest.raises(UsageError, match="no micro_batch_size in the search space divides"):
        narrow(only_big, fake_cpu(), 2, Config(micro_batch_size=64), global_batch=20)


def test_static_graph_is_only_tried_without_accumulation() -> None:
    # DDP's static_graph crashes under no_sync accumulation (pytorch PR 187732).
    narrowed = narrow(load_space("default"), fake_cpu(cores=2), 2, Config(world_size=2))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen = set()
    for _ in range(60):
        trial = study.ask()
        config = narrowed.suggest(trial, Config(world_size=2))
        if config.grad_accum_steps > 1:
            assert config.ddp_static_graph is False and "ddp_static_graph" not in trial.params
        else:
            seen.add(config.ddp_static_graph)
        study.tell(trial, 1.0)
    assert seen == {False, True}
