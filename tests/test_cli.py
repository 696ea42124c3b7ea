"""Bad input: one line naming the rule, the value and the fix; exit 2 (usage) or 1; no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app, parse_duration
from autotune.errors import UsageError, WorkloadError

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def one_error_line(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("autotune: error:")]
    assert len(errors) == 1, result.output
    assert "Traceback" not in result.output
    return errors[0]


def test_list_shows_workloads_and_spaces() -> None:
    result = run("list")
    assert result.exit_code == 0
    for word in ("bert", "gpt2", "mlp", "default", "precision", "pkg.module:function"):
        assert word in result.output


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["--model", "resnet"], 2, "unknown model 'resnet'; built-in workloads: bert, gpt2, mlp"),
    (["--model", "mlp", "--param", "depth=3"], 2, "has no parameter depth"),
    (["--model", "mlp", "--space", "nope"], 2, "unknown search space 'nope'"),
    (["--model", "mlp", "--trials", "0"], 2, "--trials must be >= 1, got 0"),
    (["--model", "mlp", "--timeout", "soon"], 2, "--timeout must be a duration like 90s"),
    (["--model", "mlp", "--memory-limit", "9000GiB"], 2, "above this machine's"),
    (["--model", "mlp", "--storage", "nosuchdb://x"], 2, "cannot open storage 'nosuchdb://x'"),
    (["--model", "mlp", "--storage", "postgresql://nobody@127.0.0.1:1/x"], 2,
     "cannot open storage"),
    (["--model", "mlp", "--nproc", "0"], 2, "--nproc must be >= 1, got 0"),
    (["--model", "mlp", "--nproc", "4096"], 2, "--nproc 4096 asks for more ranks than the"),
    (["--model", "mlp", "--nproc", "1", "--global-batch", "0"], 2,
     "--global-batch must be >= 1, got 0"),
    (["--model", "mlp", "--nproc", "2", "--global-batch", "33"], 2,
     "--global-batch 33 is not divisible by the 2 ranks (--nproc); pass a multiple of 2"),
    (["--model", "mlp", "--trial-seconds", "150"], 2,
     "--trial-seconds (150s) must be at most 2/3 of --trial-timeout (180s)"),
])
def test_usage_errors(workdir: Path, args: list[str], code: int, needle: str) -> None:
    result = run("run", *args)
    assert result.exit_code == code, result.output
    assert needle in one_error_line(result)


def test_malformed_space_and_unknown_knob(workdir: Path) -> None:
    (workdir / "bad.yaml").write_text("knobs:\n  amp: {choices: [off]\n")
    assert "not valid YAML" in one_error_line(run("run", "-m", "mlp", "--space", "bad.yaml"))
    (workdir / "knob.yaml").write_text("knobs:\n  warp_speed: {choices: [1, 2]}\n")
    result = run("run", "-m", "mlp", "--space", "knob.yaml")
    assert result.exit_code == 2
    assert "unknown knob 'warp_speed'" in one_error_line(result)


def test_unwritable_out_dir(workdir: Path) -> None:
    (workdir / "file").write_text("")  # a file where a directory should be: unwritable for all
    result = run("run", "-m", "mlp", "--out", str(workdir / "file" / "out"))
    assert result.exit_code == 2
    assert "output directory" in one_error_line(result) and "--out DIR" in result.output


def test_debug_shows_the_traceback(workdir: Path) -> None:
    result = run("run", "--model", "resnet", "--debug")
    assert isinstance(result.exception, WorkloadError)  # raised, not turned into one line
    plain = run("run", "--model", "resnet")
    assert isinstance(plain.exception, SystemExit) and plain.exit_code == 2


def test_nothing_is_created_for_rejected_input(workdir: Path) -> None:
    run("run", "--model", "resnet")
    assert not (workdir / "studies").exists()


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("10m", 600),
                                               ("1h30m", 5400), ("1.5m", 90)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "--timeout") == seconds
    with pytest.raises(UsageError):
        parse_duration("0s", "--timeout")
