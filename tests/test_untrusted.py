"""A profile is data: what it carries into a process is only what autotune tunes. The attacks are
run for real (a shell evaluates the output, a command is launched) and the marker file they
would create must not appear."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.errors import ProfileError
from tests.conftest import autotune
from tests.test_profile import make


def hostile(tmp_path: Path, env: dict[str, str]) -> Path:
    path = tmp_path / "hostile.yaml"
    replace(make(), env=env).save(path)
    return path


@pytest.mark.parametrize("name", ["X=1;touch {marker};Y", "$(touch {marker})",
                                  "`touch {marker}`"])
def test_profile_env_never_prints_a_name_a_shell_would_run(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "ran"
    path = hostile(tmp_path, {name.format(marker=marker): "1"})
    out = autotune("profile", "env", str(path), cwd=tmp_path)
    assert out.returncode != 0 and "export" not in out.stdout
    assert "autotune applies only the variables it tunes" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    # What the README shows, evaluated by a real shell: nothing runs.
    subprocess.run(["bash", "-c", f'eval "$({_cli()} profile env {path})"'], cwd=tmp_path,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(_root())})
    assert not marker.exists()


def test_launch_refuses_variables_that_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    script = tmp_path / "evil.sh"
    script.write_text(f"touch {marker}\n")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    torchrun = fake_bin / "torchrun"
    torchrun.write_text(f"#!/bin/sh\ntouch {marker}\n")
    torchrun.chmod(0o755)
    for env in ({"BASH_ENV": str(script)}, {"PATH": f"{fake_bin}:/usr/bin:/bin"},
                {"PYTHONPATH": str(tmp_path)}, {"LD_PRELOAD": str(tmp_path / "x.so")},
                {"NCCL_ALGO": "Tree", "BASH_ENV": str(script)}):
        (tmp_path / "sitecustomize.py").write_text(
            f"open({str(marker)!r}, 'w').close()\n")
        path = hostile(tmp_path, env)
        for command in (["bash", "-c", "true"], ["torchrun"], ["python3", "-c", "pass"]):
            out = autotune("launch", str(path), "--", *command, cwd=tmp_path)
            assert out.returncode != 0, (env, command, out.stdout)
            assert "autotune applies only the variables it tunes" in out.stderr
            assert not marker.exists(), (env, command)


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
    out = autotune("profile", "show", str(path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("env ")]
    assert lines[0] == "env        NCCL_PROTO=LL"
    assert lines[1].startswith("env        NOT APPLIED") and "LD_PRELOAD=/tmp/x.so" in lines[1]


def _root() -> Path:
    return Path(__file__).resolve().parent.parent


def _cli() -> str:
    import shlex
    import sys

    return f"{shlex.quote(sys.executable)} -m autotune"


def test_a_password_in_the_query_is_redacted_like_one_in_the_credentials() -> None:
    from autotune.tuner.storage import redact

    for url in ("postgresql://tuner@db/autotune?password=s3cret",
                "postgresql://tuner@db/autotune?sslmode=require&PASSWORD=s3cret&x=1",
                "postgresql://tuner:s3cret@db/autotune"):
        assert "s3cret" not in redact(url), url
    assert redact("postgresql://tuner@db/autotune?password=s3cret&x=1").endswith(
        "?password=***&x=1")
    assert redact("sqlite:///studies/autotune.db") == "sqlite:///studies/autotune.db"


@pytest.mark.postgres
def test_the_readmes_postgresql_url_form_opens_the_real_server(postgres_url: str,
                                                               tmp_path: Path) -> None:
    """docs/clusters.md shows `postgresql://user@host:port/db` (no driver): SQLAlchemy 2.1 reads
    that as psycopg 3, which the postgres extra does not install. It must work as shown, and
    the run must not print the password."""
    import uuid

    import optuna

    plain = "postgresql://" + postgres_url.split("://", 1)[1]
    name = f"readme-form-{uuid.uuid4().hex[:8]}"
    out = autotune("run", "--model", "mlp", "--trials", "1", "--trial-seconds", "2",
                   "--window-seconds", "0.2", "--confirm-top", "0", "--storage",
                   plain + "?password=s3cret" if "?" not in plain else plain,
                   "--study", name, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "s3cret" not in out.stdout + out.stderr
    profile = next(tmp_path.glob("studies/*/profile.yaml")).read_text()
    assert "s3cret" not in profile and "password=***" in profile
    assert name in optuna.get_all_study_names(postgres_url)
    optuna.delete_study(study_name=name, storage=postgres_url)
