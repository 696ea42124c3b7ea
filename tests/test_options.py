"""Run options: every problem found at once, each one line with the rule, the value and the fix;
the defaults the machine decides; the memory limit's forms."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from autotune.errors import UsageError
from autotune.testing.hardware import fake_cpu, fake_gpus
from autotune.trial.spec import MeasureSettings
from autotune.tuner import options
from autotune.tuner.options import RunOptions, from_flags, memory_limit, problems
from autotune.tuner.search import PATIENCE
from autotune.units import format_duration

CPU = fake_cpu(cores=2, memory_gib=24)


def test_good_options_have_no_problem() -> None:
    assert problems(RunOptions(model="mlp"), CPU) == []
    assert problems(RunOptions(nproc=2, global_batch=64, memory_limit="0.5"), CPU) == []


def test_every_problem_is_found_at_once() -> None:
    opts = RunOptions(trials=0, timeout_s=-1, nproc=3, memory_limit="lots",
                      measure=MeasureSettings(max_seconds=150), confirm_rounds=1,
                      nnodes=2)
    found = problems(opts, CPU)
    assert found == [
        "--trials must be >= 1, got 0",
        "--timeout must be positive, got -1s",
        "--trial-seconds (150s) must be at most 2/3 of --trial-timeout (180s); raise "
        "--trial-timeout to at least 225s",
        "--patience and --confirm-top must be >= 0 and --confirm-rounds >= 2 (a spread needs "
        "two rounds), got 10, 3 and 1",
        "--nproc 3 asks for more ranks than the 2 CPU cores; ranks would share cores and time "
        "each other: pass --nproc <= 2",
        "--nnodes 2 needs an engine to start the other nodes: --executor slurm (inside an "
        "sbatch allocation), --executor ray, or --launcher TEMPLATE with --rdzv-endpoint",
        "--memory-limit must be a size like 20GiB or a fraction like 0.8, got 'lots'",
    ]
    with pytest.raises(UsageError) as raised:
        options.check(opts, CPU)
    assert str(raised.value).startswith("7 problems with the options: --trials must be >= 1")
    assert "\n" not in str(raised.value)  # one line
    with pytest.raises(UsageError, match=r"^--trials must be >= 1, got 0$"):
        options.check(RunOptions(trials=0), CPU)


def test_rank_and_batch_rules_follow_the_machine() -> None:
    gpus = fake_gpus(2)
    assert problems(RunOptions(nproc=2), gpus) == []
    assert problems(RunOptions(nproc=4), gpus) == [
        "--nproc 4 asks for more ranks than the 2 visible GPU(s); one rank per GPU: pass "
        "--nproc <= the GPU count (CUDA_VISIBLE_DEVICES selects them)"]
    assert problems(RunOptions(nproc=0), CPU) == ["--nproc must be >= 1, got 0"]
    # Without --nproc, a GPU machine runs a rank per GPU: the global batch must split over 2.
    assert problems(RunOptions(global_batch=33), gpus) == [
        "--global-batch 33 is not divisible by the 2 ranks (--nproc); pass a multiple of 2"]
    assert problems(RunOptions(global_batch=0), CPU) == ["--global-batch must be >= 1, got 0"]


def test_flags_are_parsed_and_checked_in_one_pass(tmp_path: Path) -> None:
    opts = from_flags({"param": ["hidden=32"], "timeout": "10m", "patience": 0, "model": "mlp",
                       "trial_seconds": 30.0}, CPU)
    assert opts.params == {"hidden": 32} and opts.timeout_s == 600 and opts.patience is None
    assert opts.measure == MeasureSettings(max_seconds=30) and opts.trial_timeout_s == 180
    assert opts.hardware == CPU and opts.command == ()
    (tmp_path / "train.py").write_text("")
    script = ["python", str(tmp_path / "train.py")]
    assert from_flags({"command": ["--", *script]}, CPU).command == tuple(script)
    with pytest.raises(UsageError) as raised:
        from_flags({"timeout": "soon", "param": ["x"], "trials": 0}, CPU)
    message = str(raised.value)
    assert message.startswith("3 problems with the options: ")
    for part in ("--timeout must be a duration like 90s, 10m or 1h30m, got 'soon'",
                 "--param must look like name=value, got 'x'", "--trials must be >= 1, got 0"):
        assert part in message


def test_defaults_the_machine_and_the_budget_decide() -> None:
    opts = RunOptions().with_defaults(CPU)
    assert opts.timeout_s == options.DEFAULT_TIMEOUT_S and opts.nproc == 1 and opts.world == 1
    assert RunOptions(trials=5).with_defaults(CPU).timeout_s is None  # a trial count instead
    assert RunOptions().with_defaults(fake_gpus(4)).nproc == 4
    assert RunOptions(studies_dir=Path("x")).storage_url == "sqlite:///x/autotune.db"
    assert RunOptions().storage_url == options.DEFAULT_STORAGE
    two = replace(RunOptions(nnodes=2, rdzv_endpoint="node0:29400", launcher="mpirun {cmd}"),
                  nproc=4)
    assert two.world == 8 and two.nodes is not None and two.nodes.count == 2
    assert replace(two, launcher=None, executor="slurm").nodes is None  # the executor's own
    assert RunOptions().nodes is None


def test_the_start_line_names_the_budget_and_what_the_confirmation_takes() -> None:
    text = options.budget_text(RunOptions().with_defaults(CPU))
    wall = f"{format_duration(options.DEFAULT_TIMEOUT_S)} of wall time"
    assert wall in text and "up to 2 more, " in text
    one = options.budget_text(RunOptions(confirm_top=1).with_defaults(CPU))
    assert "more, " not in one and f"with {options.CONFIRM_SCREEN} more in the first round" in one
    assert "re-measured" not in options.budget_text(RunOptions(confirm_top=0).with_defaults(CPU))


def test_the_cli_defaults_are_the_options_defaults() -> None:
    import inspect

    from autotune import cli

    # `autotune run` takes its parameters from RunOptions' flags: given every default the
    # command line hands over, the options are RunOptions' own defaults.
    signature = inspect.signature(cli.run).parameters
    names = {flag.param for flag in options.run_flags()}
    assert names < set(signature) and set(signature) - names == {"json_", "debug"}
    given = {name: signature[name].default for name in names}
    assert from_flags(given, CPU) == RunOptions(hardware=CPU)
    assert given["trial_timeout"] == "180s" and given["patience"] == PATIENCE


def test_every_option_is_a_flag_or_set_by_code() -> None:
    from dataclasses import fields

    flagged = {flag.field for flag in options.run_flags()}
    by_code = {f.name for f in fields(RunOptions)} - flagged
    assert by_code == {"studies_dir", "headroom", "address_space_bytes", "hardware"}


def test_memory_limit_defaults() -> None:
    cpu = fake_cpu(memory_gib=24)  # 22 GiB available
    assert memory_limit(None, cpu) == int(22 * 2**30 * 0.8)
    gpu = fake_gpus(1, memory_gib=80)
    assert memory_limit(None, gpu) == int(80 * 2**30 * 0.9)


@pytest.mark.parametrize(("spec", "expected"), [
    ("20GiB", 20 * 2**30), ("512MiB", 512 * 2**20), ("16gb", 16 * 10**9), ("0.5", 11 * 2**30),
    ("1.5 GiB", int(1.5 * 2**30)),
])
def test_memory_limit_sizes_and_fractions(spec: str, expected: int) -> None:
    assert memory_limit(spec, fake_cpu(memory_gib=24)) == expected


@pytest.mark.parametrize(("spec", "message"), [
    ("100GiB", "above this machine's RAM"),
    ("lots", "a size like 20GiB"),
    ("-1", "a size like 20GiB"),
    ("12", "below 1 MiB"),
])
def test_memory_limit_errors_say_the_fix(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        memory_limit(spec, fake_cpu(memory_gib=24))


def test_a_bad_rank_count_or_hard_limit_is_one_problem_not_two() -> None:
    # --nnodes 0 with --global-batch: the rank count is the problem, not a division by it.
    assert problems(RunOptions(nnodes=0, global_batch=64), CPU) == ["--nnodes must be >= 1, got 0"]
    # An unreadable --trial-timeout is not also "too short" for --trial-seconds.
    with pytest.raises(UsageError) as raised:
        from_flags({"trial_timeout": "4min", "trial_seconds": 150.0}, CPU)
    assert str(raised.value) == ("--trial-timeout must be a duration like 90s, 10m or 1h30m, "
                                 "got '4min'")
