"""A profile is data: what it carries into a process is only what autotune tunes, and what it
names is run only when told. The attacks are run for real where a process is what they target (a
shell evaluates the output, a command is launched, a trial resolves the workload) and the marker
file they would create must not appear; the refusals themselves are the CLI's commands run in
this process, each error path once more through the real command."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.errors import ProfileError
from tests.conftest import ROOT, autotune, cli
from tests.test_profile import make


def hostile(tmp_path: Path, env: dict[str, str]) -> Path:
    path = tmp_path / "hostile.yaml"
    replace(make(), env=env).save(path)
    return path


# Names a shell would run if autotune printed them in an export line.
SHELL_NAMES = ["X=1;touch {marker};Y", "$(touch {marker})", "`touch {marker}`"]


@pytest.mark.parametrize("name", SHELL_NAMES)
def test_profile_env_never_prints_a_name_a_shell_would_run(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "ran"
    path = hostile(tmp_path, {name.format(marker=marker): "1"})
    out = cli("profile", "env", str(path))
    assert out.exit_code != 0 and "export" not in out.stdout
    assert "autotune applies only the variables it tunes" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    # What the README shows (`eval "$(autotune profile env ...)"`) on what it printed,
    # evaluated by a real shell: nothing runs.
    subprocess.run(["bash", "-c", 'eval "$1"', "bash", out.stdout], cwd=tmp_path,
                   capture_output=True)
    assert not marker.exists()


def test_the_real_cli_prints_no_hostile_env_and_a_shell_runs_nothing(tmp_path: Path) -> None:
    """The same through the real command in its own process, once: one line, a non-zero exit,
    and the README's eval in a real shell."""
    marker = tmp_path / "ran"
    path = hostile(tmp_path, {SHELL_NAMES[1].format(marker=marker): "1"})
    out = autotune("profile", "env", str(path), cwd=tmp_path)
    assert out.returncode != 0 and "export" not in out.stdout
    assert "autotune applies only the variables it tunes" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    cli_here = f"{shlex.quote(sys.executable)} -m autotune"
    subprocess.run(["bash", "-c", f'eval "$({cli_here} profile env {path})"'], cwd=tmp_path,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert not marker.exists()


def _evil(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A marker a hostile command would create, a script that creates it, and a folder with a
    fake torchrun that does."""
    marker = tmp_path / "ran"
    script = tmp_path / "evil.sh"
    script.write_text(f"touch {marker}\n")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    torchrun = fake_bin / "torchrun"
    torchrun.write_text(f"#!/bin/sh\ntouch {marker}\n")
    torchrun.chmod(0o755)
    (tmp_path / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return marker, script, fake_bin


def test_launch_refuses_variables_that_run_code(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variable that runs code, under every kind of command: refused before anything is
    launched (in this process, ``os.execvpe`` only records what it would have started)."""
    marker, script, fake_bin = _evil(tmp_path)
    launched: list[tuple[object, ...]] = []
    monkeypatch.setattr(os, "execvpe", lambda *a: launched.append(a))
    monkeypatch.chdir(tmp_path)
    for env in ({"BASH_ENV": str(script)}, {"PATH": f"{fake_bin}:/usr/bin:/bin"},
                {"PYTHONPATH": str(tmp_path)}, {"LD_PRELOAD": str(tmp_path / "x.so")},
                {"NCCL_ALGO": "Tree", "BASH_ENV": str(script)}):
        path = hostile(tmp_path, env)
        for command in (["bash", "-c", "true"], ["torchrun"], ["python3", "-c", "pass"]):
            out = cli("launch", str(path), "--", *command)
            assert out.exit_code != 0, (env, command, out.stdout)
            assert "autotune applies only the variables it tunes" in out.stderr
            assert launched == [] and not marker.exists(), (env, command)


def test_the_real_launch_refuses_a_variable_that_runs_code(tmp_path: Path) -> None:
    """The same through the real command in its own process, once: one line, a non-zero exit,
    and the command never ran."""
    marker, script, _ = _evil(tmp_path)
    path = hostile(tmp_path, {"NCCL_ALGO": "Tree", "BASH_ENV": str(script)})
    out = autotune("launch", str(path), "--", "bash", "-c", "true", cwd=tmp_path)
    assert out.returncode != 0, out.stdout
    assert "autotune applies only the variables it tunes" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_apply_env_refuses_and_leaves_the_environment_alone() -> None:
    environ = {"PATH": "/usr/bin"}
    profile = replace(make(), env={"NCCL_ALGO": "Tree", "LD_PRELOAD": "/tmp/x.so"})
    with pytest.raises(ProfileError, match="'LD_PRELOAD': autotune applies only"):
        profile.apply_env(environ)
    assert environ == {"PATH": "/usr/bin"}
    # What autotune tunes is applied as before.
    assert replace(make(), env={"NCCL_ALGO": "Tree"}).apply_env(environ) == {"NCCL_ALGO": "Tree"}
    assert environ["NCCL_ALGO"] == "Tree"


def test_profile_show_marks_what_would_not_be_applied(tmp_path: Path) -> None:
    path = hostile(tmp_path, {"NCCL_PROTO": "LL", "LD_PRELOAD": "/tmp/x.so"})
    out = cli("profile", "show", str(path))
    assert out.exit_code == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("env ")]
    assert lines[0] == "env        NCCL_PROTO=LL"
    assert lines[1].startswith("env        NOT APPLIED") and "LD_PRELOAD=/tmp/x.so" in lines[1]


def test_profile_check_runs_only_built_in_workloads_unless_told(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    evil = replace(make(), workload={"name": "system", "spec": "os:system",
                                     "params": {"command": f"touch {marker}"}},
                   result={**make().result, "memory_limit_bytes": 8 * 2**30})
    path = tmp_path / "evil.yaml"
    evil.save(path)
    out = cli("profile", "check", str(path), "--rounds", "1")
    assert out.exit_code == 2 and not marker.exists()
    assert "not built in" in out.stderr and "--allow-workload os:system" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    # Even when allowed by name, a spec must name a workload builder, not any callable: the
    # trial's own process refuses it (the real command, which starts it).
    out = autotune("profile", "check", str(path), "--rounds", "1", "--allow-workload",
                   "os:system", "--trial-timeout", "60s", cwd=tmp_path)
    assert out.returncode != 0 and not marker.exists()
    assert "is not a workload builder" in out.stdout + out.stderr


def test_a_workload_spec_must_name_a_builder_not_any_callable() -> None:
    from autotune.errors import WorkloadError
    from autotune.workloads import resolve

    for spec, params in (("os:system", {"command": "true"}), ("subprocess:run", {"args": "true"}),
                         ("shutil:rmtree", {"path": "/nonexistent"})):
        with pytest.raises(WorkloadError, match="is not a workload builder"):
            resolve(spec, params)
    assert resolve("autotune.testing.workloads:tiny").default_micro_batch == 4


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for i, name in enumerate("bcdefghi"):
        prev = "abcdefghi"[i]
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("schema: autotune.profile/v1\n" + "\n".join(levels) + "\n")
    assert path.stat().st_size < 1000
    out = autotune("profile", "show", str(path), cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and len(out.stdout) < 1000
    assert "expands to more than 200000 values" in out.stderr
    big = tmp_path / "big.yaml"
    big.write_text("x: " + "y" * (5 * 2**20))
    refused = cli("profile", "show", str(big))
    assert refused.exit_code == 2 and "more than a profile's" in refused.stderr
