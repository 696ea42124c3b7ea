"""Bad input: one line naming the rule, the value and the fix; exit 2 (usage) or 1; no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app, parse_duration
from autotune.errors import UsageError, WorkloadError

runner = CliRunner()


def run(*args: str, **kwargs):
    return runner.invoke(app, list(args), **kwargs)


def one_error_line(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("autotune: error:")]
    assert len(errors) == 1, result.output
    assert "Traceback" not in result.output
    return errors[0]


def test_run_lists_every_flag_of_the_options() -> None:
    from autotune.tuner.options import run_flags

    result = run("run", "--help", env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    for flag in run_flags():
        for name in flag.flag.names:
            assert all(part in result.output for part in name.split("/")), name
        assert flag.flag.help[:40] in result.output
    assert "--json" in result.output and "--debug" in result.output
    assert "[default: 180s]" in result.output and "[default: 60.0]" in result.output


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


DATA = Path(__file__).parent / "data"


def test_profile_show_env_and_diff() -> None:
    ddp, nccl = str(DATA / "profile_v1_ddp.yaml"), str(DATA / "profile_v1_nccl.yaml")
    shown = run("profile", "show", nccl)
    assert shown.exit_code == 0, shown.output
    assert "NCCL_ALGO=Tree" in shown.output and "9,000.00 samples/s" in shown.output
    # Tuned elsewhere: one warning line naming the fields, not a traceback.
    assert "autotune: warning: profile" in shown.output and "cpu_model: 'Fake CPU'" in shown.output
    env = run("profile", "env", nccl)
    exports = [ln for ln in env.output.splitlines() if ln.startswith("export ")]
    assert exports[:2] == ["export NCCL_ALGO=Tree", "export NCCL_PROTO=Simple"]
    assert exports[2] == f"export AUTOTUNE_PROFILE={DATA.resolve() / 'profile_v1_nccl.yaml'}"
    diff = run("profile", "diff", ddp, nccl)
    assert diff.exit_code == 0 and "config.nccl_algo: 'default' -> 'Tree'" in diff.output
    same = run("profile", "diff", ddp, ddp)
    assert "no differences" in same.output


def test_profile_env_lines_work_in_a_shell(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = (f'eval "$({sys.executable} -m autotune profile env '
              f'{DATA / "profile_v1_nccl.yaml"} 2>/dev/null)" && echo "$NCCL_ALGO $NCCL_PROTO"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path.cwd())})
    assert out.stdout.strip() == "Tree Simple", out.stderr


@pytest.mark.parametrize("args, code, needle", [
    (["profile", "show", "nope.yaml"], 2, "cannot read profile nope.yaml"),
    (["profile", "check", str(DATA / "profile_v1_nccl.yaml")], 2,
     "tuned on cuda and this machine runs trials on cpu"),
    (["profile", "check", str(DATA / "profile_v1_ddp.yaml"), "--rounds", "0"], 2,
     "--rounds must be >= 1, got 0"),
    (["launch", str(DATA / "profile_v1_ddp.yaml"), "--"], 2, "no command to launch"),
    (["profile", "show", str(DATA / "profile_v1.yaml"), "--price-per-hour", "2"], 2,
     "--price-per-hour prices a run: give --train-samples N"),
    (["profile", "show", str(DATA / "profile_v1.yaml"), "--train-tokens", "1e9"], 2,
     "the profile records no tokens per sample"),
    (["compare", str(DATA / "profile_v1.yaml"), str(DATA / "profile_v1_ddp.yaml"),
      "--train-samples", "10", "--price-per-hour", "1", "--price-per-hour", "2",
      "--price-per-hour", "3"], 2, "one --price-per-hour for all profiles or one per profile"),
    (["launch", str(DATA / "profile_v1_ddp.yaml"), "--", "no-such-command-here"], 2,
     "cannot run 'no-such-command-here'"),
])
def test_profile_command_errors(args: list[str], code: int, needle: str) -> None:
    result = run(*args)
    assert result.exit_code == code, result.output
    assert needle in one_error_line(result)


def test_the_time_and_cost_to_train_and_profiles_side_by_side() -> None:
    """`profile show --train-samples --price-per-hour` and `compare` from the command line
    (their figures: tests/test_claims.py)."""
    import json

    shown = run("profile", "show", str(DATA / "profile_v1.yaml"), "--train-samples", "1e6",
                "--price-per-hour", "2.5")
    assert shown.exit_code == 0, shown.output
    assert "to train   1,000,000 samples at 3.11 samples/s (" in shown.output
    assert "costs      " in shown.output and "at 2.50 per hour" in shown.output
    assert "on the machine it was measured on: CPU Fake CPU, 2 cores" in shown.output
    both = run("compare", str(DATA / "profile_v1.yaml"), str(DATA / "profile_v1_ddp.yaml"),
               str(DATA / "profile_v1_nccl.yaml"), "--train-samples", "1e6", "--json")
    assert both.exit_code == 0, both.output
    rows = json.loads(both.output)["profiles"]
    assert [r["fingerprint_label"] for r in rows] == ["A", "A", "B"]  # the last on GPUs
    assert rows[0]["train"]["seconds"] == round(1e6 / 3.11, 1)


def test_a_damaged_profile_is_one_line(tmp_path: Path) -> None:
    text = (DATA / "profile_v1_ddp.yaml").read_text()
    (tmp_path / "cut.yaml").write_text(text[: len(text) // 2])
    result = run("profile", "show", str(tmp_path / "cut.yaml"))
    assert result.exit_code == 2 and "damaged" in one_error_line(result)


def test_launch_sets_the_environment_and_passes_the_exit_code(tmp_path: Path) -> None:
    import subprocess
    import sys

    profile = DATA / "profile_v1_nccl.yaml"
    code = ("import os, sys; print(os.environ['NCCL_ALGO'], os.environ['AUTOTUNE_PROFILE']); "
            "sys.exit(7)")
    out = subprocess.run([sys.executable, "-m", "autotune", "launch", str(profile), "--",
                          sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env={**__import__("os").environ,
                                            "PYTHONPATH": str(Path.cwd())})
    assert out.returncode == 7, out.stderr
    assert out.stdout.split() == ["Tree", str(profile.resolve())]
    assert "launching with NCCL_ALGO=Tree NCCL_PROTO=Simple AUTOTUNE_PROFILE=" in out.stderr
