"""Untrusted input: study names, stored studies, what a trial's processes and the disk do behind
the tuner's back, a loss that goes NaN, bad flags and files. Hostile profiles:
test_hostile_profiles."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import yaml

from tests.conftest import ROOT, autotune, cli
from tests.test_profile import make


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


@pytest.mark.parametrize("name", ["../escaped", "a/b", "/tmp/abs", "..", ".hidden"])
def test_a_study_name_cannot_put_outputs_outside_studies(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         name: str) -> None:
    from autotune.console import QuietReporter
    from autotune.errors import UsageError
    from autotune.testing.hardware import fake_cpu
    from autotune.tuner.runner import Runner, RunOptions

    monkeypatch.chdir(tmp_path)
    opts = RunOptions(model="mlp", trials=1, study_name=name, storage="sqlite:///s.db",
                      hardware=fake_cpu(), probe=False)
    with pytest.raises(UsageError, match="cannot name a folder under studies") as refused:
        Runner(opts, QuietReporter())
    assert refused.value.exit_code == 2
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "studies").exists()
    assert not (tmp_path / "s.db").exists()  # refused before the storage was opened


def test_the_real_cli_refuses_a_study_name_outside_studies_in_one_line(tmp_path: Path) -> None:
    out = autotune("run", "--model", "mlp", "--trials", "1", "--study", "../escaped",
                   "--storage", "sqlite:///s.db", cwd=tmp_path)
    assert out.returncode == 2, out.stdout
    assert "cannot name a folder under studies" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "studies").exists()


def test_a_stored_study_name_cannot_steer_the_dashboard_outside_studies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared database may hold any study name: writing its dashboard by default must not
    follow it out of studies/."""
    import optuna

    optuna.create_study(study_name="../../escaped", storage=f"sqlite:///{tmp_path}/s.db")
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    out = cli("dashboard", "--storage", f"sqlite:///{tmp_path}/s.db")
    assert out.exit_code == 2 and "cannot name a folder under studies" in out.stderr
    assert not (tmp_path / "escaped").exists()


def test_default_study_names_are_folder_names_whatever_the_workload_calls_itself() -> None:
    from autotune.config.space import load_space, narrow
    from autotune.testing.hardware import fake_cpu
    from autotune.tuner.identity import default_name
    from autotune.workloads import WorkloadSpec

    hw = fake_cpu()
    space = narrow(load_space("default"), hw, 1, make().config)
    name = default_name("My Model/v2", WorkloadSpec("x.py", {}), space, hw)
    assert name.startswith("My_Model_v2-default-") and "/" not in name
    assert default_name("bert", WorkloadSpec("bert", {}), space, hw).startswith("bert-default-")


def _live(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[str], int]:
    import re
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "autotune", "dashboard", "--live", *flags],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline() if proc.stdout else ""
    match = re.search(r"http://127\.0\.0\.1:(\d+)/dashboard/", line)
    assert match, line + (proc.stderr.read() if proc.stderr else "")
    return proc, int(match.group(1))


def _request(port: int, method: str, path: str, host: str) -> int:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request(method, path, headers={"Host": host})
    status = conn.getresponse().status
    conn.close()
    return status


def test_the_live_dashboard_is_read_only_and_answers_only_its_own_host(tmp_path: Path) -> None:
    import optuna

    url = f"sqlite:///{tmp_path}/studies/autotune.db"
    (tmp_path / "studies").mkdir()
    optuna.create_study(study_name="kept", storage=url)
    proc, port = _live(tmp_path)
    try:
        here = f"127.0.0.1:{port}"
        assert _request(port, "DELETE", "/api/studies/1", "attacker.example") == 403
        assert _request(port, "GET", "/api/studies", f"attacker.example:{port}") == 403
        assert _request(port, "DELETE", "/api/studies/1", here) == 405
        assert _request(port, "GET", "/api/studies", here) == 200
        assert _request(port, "GET", "/api/studies", f"localhost:{port}") == 200
        assert optuna.get_all_study_names(url) == ["kept"]
    finally:
        proc.kill()
        proc.wait()
    # Asked for, writes pass (from this server's own Host only).
    proc, port = _live(tmp_path, "--writable")
    try:
        assert _request(port, "DELETE", "/api/studies/1", "attacker.example") == 403
        assert optuna.get_all_study_names(url) == ["kept"]
        assert _request(port, "DELETE", "/api/studies/1", f"127.0.0.1:{port}") in (200, 204)
        assert optuna.get_all_study_names(url) == []
    finally:
        proc.kill()
        proc.wait()


def test_a_config_whose_loss_goes_nan_is_diverged_and_never_wins(memdir: Path) -> None:
    """Micro-batch 8 is twice as fast as 4 and its loss is NaN: it must not be the winner. The
    real tuner in-process, the trials replayed (the diverged one as its process reports it:
    the next test runs that process)."""
    from autotune.testing.replay import Asked, ReplayMeasurer, Row
    from autotune.trial.measurement import Measurement, Status
    from autotune.tuner.record import read_trial
    from tests.conftest import JOURNAL, load_study, replayed

    nan = "the loss was NaN or infinite in 2 micro-step(s) by the end of window 1"

    def diverge(asked: Asked) -> Row | Measurement:
        if asked.config.micro_batch_size < 8:
            return Row(100.0)
        return Measurement(Status.DIVERGED, nan, samples_per_sec=200.0,
                           windows=[{"samples": 200, "seconds": 1.0}])

    (memdir / "space.yaml").write_text("knobs:\n  micro_batch_size: {choices: [4, 8]}\n")
    _, out = replayed(ReplayMeasurer(diverge), model="autotune.testing.workloads:diverge",
                      space="space.yaml", trials=2, window_s=0.2, trial_s=3.0, storage=JOURNAL)
    study = load_study(JOURNAL)
    by_micro = {t.params["micro_batch_size"]: t for t in study.trials}
    bad = read_trial(by_micro[8])
    assert bad is not None and bad.status == "diverged" and "NaN or infinite" in (bad.reason or "")
    assert by_micro[8].state == optuna.trial.TrialState.PRUNED
    profile = yaml.safe_load(next(memdir.glob("studies/*/profile.yaml")).read_text())
    assert profile["config"]["micro_batch_size"] == 4
    assert "diverged: the loss was NaN or infinite" in out


def test_a_trial_whose_loss_goes_nan_ends_diverged(tmp_path: Path) -> None:
    """The trial's own process: a loss that goes NaN ends it as diverged, with why."""
    from autotune.config.knobs import Config
    from autotune.trial.launch import execute, plan
    from autotune.trial.measurement import classify
    from autotune.trial.spec import MeasureSettings, TrialSpec
    from autotune.workloads import WorkloadSpec

    spec = TrialSpec(WorkloadSpec("autotune.testing.workloads:diverge", {}),
                     Config(micro_batch_size=8), "cpu",
                     MeasureSettings(min_window_s=0.2, max_seconds=3.0))
    m = classify(execute(plan(spec, workdir=tmp_path / "t", timeout_s=120)))
    assert m.status == "diverged" and "NaN or infinite" in (m.reason or ""), m.stderr_tail


@pytest.mark.parametrize("quick", [False, True])
def test_a_grandchild_that_left_the_session_is_ended_with_the_trial(tmp_path: Path,
                                                                     quick: bool) -> None:
    """setsid(), SIGTERM ignored, environment dropped: neither the process group nor the trial
    token finds it; the trial's process tree, noted while it ran, does. ``quick``: its parent
    exited within a millisecond, before any look at the tree: it is found as an orphan this
    process adopted."""
    import psutil

    from autotune.config.knobs import Config
    from autotune.trial.launch import execute, plan
    from autotune.trial.spec import MeasureSettings, TrialSpec
    from autotune.workloads import WorkloadSpec

    pid_file = tmp_path / "orphan.pid"
    spec = TrialSpec(WorkloadSpec("autotune.testing.workloads:orphan",
                                  {"pid_file": str(pid_file), "quick": quick}), Config(), "cpu",
                     MeasureSettings(max_seconds=5.0))
    # Ended from outside once the grandchild is there (the path a timeout, pruning and Ctrl-C
    # take): a deadline alone would race a slow start-up on a busy machine.
    raw = execute(plan(spec, workdir=tmp_path / "t", timeout_s=120),
                  should_stop=lambda: "the orphan is there" if pid_file.exists() else None)
    assert raw.stopped == "the orphan is there", raw.stderr_tail
    pid = int(pid_file.read_text())
    try:
        gone = not psutil.pid_exists(pid) or \
            psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert gone, f"the grandchild {pid} survived the trial"
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(pid, 9)


def test_lock_files_never_follow_a_symlink_to_someone_elses_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import stat

    from autotune.errors import UsageError
    from autotune.tuner import fleet, storage

    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o700)
    (locks / "cpu.lock").symlink_to(victim)
    monkeypatch.setenv("AUTOTUNE_LOCK_DIR", str(locks))
    with pytest.raises(UsageError, match="cannot be opened safely"):
        with fleet.DeviceLock(["cpu"], "attacker's victim").hold():
            pass
    # The study lock next to a SQLite file, the same way.
    db = tmp_path / "s.db"
    key = storage._lock_key("s") & 0xFFFFFFFF
    (tmp_path / f"s.db.{key:08x}.lock").symlink_to(victim)
    with pytest.raises(UsageError, match="cannot be opened safely"):
        with storage.locked(f"sqlite:///{db}", "s"):
            pass
    assert victim.read_text() == "secret" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    # A lock directory the user gave keeps its mode; a fresh one of theirs is not opened up.
    assert stat.S_IMODE(locks.stat().st_mode) == 0o700
    fresh = tmp_path / "fresh-locks"
    monkeypatch.setenv("AUTOTUNE_LOCK_DIR", str(fresh))
    with fleet.DeviceLock(["cpu"], "me").hold():
        pass
    assert not stat.S_IMODE(fresh.stat().st_mode) & 0o002
    # A symlinked lock directory is refused too.
    (tmp_path / "linked").symlink_to(locks)
    monkeypatch.setenv("AUTOTUNE_LOCK_DIR", str(tmp_path / "linked"))
    with pytest.raises(UsageError, match="symlink or not a directory"):
        fleet.lock_dir()


def test_bad_inputs_are_one_line_errors_not_internal_ones(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bin.yaml").write_bytes(bytes(range(256)) * 2)
    bad_profile = replace(make(), confirmation=None)
    data = bad_profile.to_dict()
    data["confirmation"] = "not a mapping"
    import yaml

    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    for args, needle in (
            (("run", "--model", "mlp", "--space", "bin.yaml", "--trials", "1"), "not text"),
            (("run", "--model", "mlp", "--memory-limit", "1e400", "--trials", "1"),
             "--memory-limit must be a size"),
            (("profile", "show", "p.yaml"), "has a confirmation that is not a mapping")):
        out = cli(*args)
        assert out.exit_code == 2, (args, out.stdout, out.stderr)
        assert needle in out.stderr and "internal error" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


PARSER_ERRORS = ((("run", "--trials", "x"), "Invalid value for '--trials'"),
                 (("run", "--no-such-flag"), "No such option: --no-such-flag"))


def test_a_usage_error_from_the_parser_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The console script's entry point (``cli.main``), in this process."""
    from autotune.cli import main

    for args, needle in PARSER_ERRORS:
        monkeypatch.setattr(sys, "argv", ["autotune", *args])
        with pytest.raises(SystemExit) as ended:
            main()
        err = capsys.readouterr().err
        assert ended.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith("autotune: error: ") and needle in err
        assert "autotune run --help" in err and "╭" not in err


def test_the_real_cli_says_a_parser_error_in_one_line(tmp_path: Path) -> None:
    args, needle = PARSER_ERRORS[1]
    out = autotune(*args, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("autotune: error: ") and needle in out.stderr
    assert "autotune run --help" in out.stderr and "╭" not in out.stderr


def test_a_trial_whose_folder_is_deleted_fails_alone_and_the_run_goes_on(tmp_path: Path) -> None:
    import shutil
    import time

    from tests.conftest import FAST, ROOT

    # Each step sleeps 0.2 s, so a trial measures for seconds: the folder goes while it runs.
    run = subprocess.Popen(
        [sys.executable, "-m", "autotune", "run", "--model", "autotune.testing.workloads:slow",
         "--param", "step_s=0.2", "--study", "gone", "--trials", "3", *FAST],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    second = tmp_path / "studies" / "gone" / "trials" / "0001"
    deadline = time.monotonic() + 240
    while not second.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(second.parent)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, out + err
    assert "internal error" not in err
    failed = [ln for ln in out.splitlines() if ln.strip().startswith("#1 ")]
    assert failed and "error:" in failed[0] and "was removed while it ran" in failed[0], out
    third = [ln for ln in out.splitlines() if ln.strip().startswith("#2 ")]
    assert third and "samples/s" in third[0], out  # the next trial ran and measured
    assert (tmp_path / "studies" / "gone" / "profile.yaml").exists()


def _can_mount_tmpfs() -> bool:
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, check=False) if _has("unshare") else None
    return probe is not None and probe.returncode == 0


def _has(tool: str) -> bool:
    import shutil

    return shutil.which(tool) is not None


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare to mount a small tmpfs")
def test_a_full_disk_under_the_database_is_one_line_and_keeps_the_trials(tmp_path: Path) -> None:
    """A real full disk: the study's SQLite file sits on a 4 MiB tmpfs (in a mount namespace of
    the run's own) that is filled up while the second trial runs."""
    import optuna

    from tests.conftest import FAST, ROOT

    small, out = tmp_path / "small", tmp_path / "out"
    small.mkdir()
    script = f"""
mount -t tmpfs -o size=4m tmpfs {small} || exit 99
{sys.executable} -m autotune run --model autotune.testing.workloads:slow --param step_s=0.2 \\
  --study full --trials 4 {" ".join(FAST)} --storage sqlite:///{small}/a.db --out {out} &
run=$!
while [ ! -e {out}/trials/0001 ] && kill -0 $run 2>/dev/null; do sleep 0.05; done
dd if=/dev/zero of={small}/fill bs=64k 2>/dev/null
wait $run; rc=$?
cp {small}/a.db {tmp_path}/a.db
exit $rc
"""
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "disk full (database or disk is full)" in done.stderr
    assert "free space and run the same command to resume" in done.stderr
    study = optuna.load_study(study_name="full", storage=f"sqlite:///{tmp_path}/a.db")
    kept = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(kept) == 1 and kept[0].params["micro_batch_size"] == 4  # the baseline


def test_disk_full_is_read_through_the_storage_layers_wrapping() -> None:
    import errno

    from autotune.errors import disk_full

    class PgDiskFull(Exception):
        pgcode = "53100"

    def wrapped(cause: BaseException) -> BaseException:
        try:
            try:
                raise cause
            except BaseException as inner:
                raise RuntimeError("An exception is raised during the commit.") from inner
        except RuntimeError as outer:
            return outer

    nospace = OSError(errno.ENOSPC, "No space left on device", "studies/x/profile.yaml")
    assert disk_full(wrapped(nospace)) == "No space left on device: studies/x/profile.yaml"
    assert disk_full(wrapped(PgDiskFull("could not extend file"))) == \
        "the PostgreSQL server's disk is full"
    assert disk_full(wrapped(ValueError("exceeding max length"))) is None
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None
