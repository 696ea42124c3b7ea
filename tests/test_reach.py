"""A Python process of a script's trial that autotune's bootstrap did not reach (``python -I``
behind a wrapper, a cleared environment, an interpreter that cannot hook) ends the trial before
it can train into the user's folders; a command that shows such a flag is refused before any
trial; processes the bootstrap reaches (forked and spawned children too) go on. Real trials of
tests/data/scripts/hostile.py, whose late step writes a "checkpoint" into its working folder."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.config.knobs import Config
from autotune.errors import UsageError
from autotune.machine.hardware import detect
from autotune.profile import Profile
from autotune.trial import launch
from autotune.trial.command import parse_command, skipping_flag
from autotune.trial.measurement import Measurement, classify
from autotune.trial.reach import REACHED, Reach
from autotune.trial.spec import MeasureSettings, TrialSpec
from autotune.workloads import WorkloadSpec
from tests.conftest import ROOT, autotune

HOSTILE = ROOT / "tests" / "data" / "scripts" / "hostile.py"
QUICK = MeasureSettings(min_window_s=0.2, max_seconds=4.0, no_progress_s=30.0, stop_grace_s=4.0)
CONFIG = Config(micro_batch_size=16)


def _trial(tmp_path: Path, argv: list[str]) -> Measurement:
    """One trial of ``argv`` in a real process, run from ``tmp_path`` as the tuner runs it."""
    profile = Profile(workload={"name": "hostile", "spec": "command", "params": {}},
                      config=CONFIG, env={}, result={"samples_per_sec": 0.0}, baseline={},
                      speedup=None, fingerprint=detect().fingerprint(), provenance={})
    spec = TrialSpec(WorkloadSpec("command", {}), CONFIG, "cpu", QUICK)
    p = launch.plan_command(spec, parse_command(argv), workdir=tmp_path / "trial",
                            timeout_s=60.0, profile=profile.to_yaml())
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        return classify(launch.execute(p))
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(("args", "flag"), [
    (["-I", "train.py"], "-I"), (["-E", "train.py"], "-E"), (["-S", "train.py"], "-S"),
    (["-uI", "train.py"], "-I"), (["-X", "dev", "-bE", "train.py"], "-E"),
    (["-W", "ignore", "-S", "-m", "pkg"], "-S"), (["-Wignore", "-I", "train.py"], "-I"),
    (["train.py", "-I"], None), (["-m", "pkg", "-E"], None), (["-c", "x", "-S"], None),
    (["-u", "-X", "dev", "train.py"], None), (["--check-hash-based-pycs", "always", "-I"], "-I"),
])
def test_the_flags_that_keep_the_bootstrap_out_are_found_before_the_script(
        args: list[str], flag: str | None) -> None:
    assert skipping_flag(args) == flag


def test_a_command_that_shows_such_a_flag_is_refused_before_any_trial(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('trains')\n")
    with pytest.raises(UsageError, match=r"-I: isolated mode ignores PYTHONPATH and "
                                         r"sitecustomize.*run it without -I"):
        parse_command([sys.executable, "-I", "train.py"])
    for shown in (["env", "-u", "X", "python3", "-S", "train.py"],
                  ["bash", "-c", "cd /tmp && python -uE train.py"],
                  ["sh", "-ec", "pypy3 -I train.py"]):
        with pytest.raises(UsageError, match=r"(python3?|pypy3) -[SEI]: "):
            parse_command(shown)
    # The script's own arguments are not a Python's options, even after a word like one.
    script = str(tmp_path / "train.py")
    for fine in ([sys.executable, script, "--data", "python_corpus", "-S", "512"],
                 [sys.executable, script, "--lang", "python3", "-E"]):
        assert parse_command(fine).script == script
    out = autotune("run", "--trials", "1", "--", sys.executable, "-E", "train.py", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"autotune: error: {Path(sys.executable).name} -E: it ignores "
                           "PYTHONPATH, so autotune's bootstrap never runs in the trial")
    assert not (tmp_path / "studies" / "autotune.db").exists()


def test_a_python_behind_a_wrapper_with_such_a_flag_ends_the_trial(
        tmp_path: Path) -> None:
    # The flag is in the wrapper's file, not on the command line autotune checks first.
    wrapper = tmp_path / "wrap.sh"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -I "
                       f"{shlex.quote(str(HOSTILE))} --behave late-write\n")
    wrapper.chmod(0o755)
    m = _trial(tmp_path, [str(wrapper)])
    assert m.status == "error", m.reason
    # Named by its -I, or, when found by its steps after it ended, by its missing mark.
    assert "is a Python that autotune's bootstrap did not reach (" in (m.reason or ""), m.reason
    assert "without -I, -E or -S" in (m.reason or "")
    assert m.samples_per_sec is None
    assert not (tmp_path / "checkpoint.pt").exists()  # ended before it wrote into the folder


def test_a_python_with_a_cleared_environment_ends_the_trial(tmp_path: Path) -> None:
    # Its PYTHONPATH gone (the bootstrap's folder with it), it still imports autotune from the
    # installed package and reports its steps: measured, but not as the config (nothing set it).
    argv = ["env", "-u", "PYTHONPATH", sys.executable, str(HOSTILE), "--behave", "late-write"]
    m = _trial(tmp_path, argv)
    assert m.status == "error", m.reason
    assert "did not reach (no mark from it)" in (m.reason or ""), m.reason
    assert m.samples_per_sec is None
    assert not (tmp_path / "checkpoint.pt").exists()


def test_forked_and_spawned_children_are_reached_and_the_trial_measures(tmp_path: Path) -> None:
    m = _trial(tmp_path, [sys.executable, str(HOSTILE), "--behave", "children"])
    assert m.ok, m.reason
    marks = sorted(m.read_text() for m in (tmp_path / "trial" / REACHED).iterdir())
    # The script, its forked child (a copy), its spawned child (multiprocessing's: it never
    # trains, nothing is hooked) and the spawn context's resource tracker.
    assert len(marks) == 4 and "worker" in marks and set(marks) <= {"ok", "worker"}, marks


def test_a_mark_that_says_why_ends_the_trial_with_that_reason(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        import psutil

        started = psutil.Process(child.pid).create_time()
        reach = Reach(tmp_path)
        assert reach.check({child.pid: started}, now=0.0) is None  # within its grace
        assert "no mark from it" in (reach.check({child.pid: started}, now=10.0) or "")
        (tmp_path / REACHED).mkdir()
        (tmp_path / REACHED / str(child.pid)).write_text("python3 cannot import autotune (x)")
        assert Reach(tmp_path).check({child.pid: started}, now=0.0) is None  # its grace too
        reach = Reach(tmp_path)
        reach.check({child.pid: started}, now=0.0)
        why = reach.check({child.pid: started}, now=10.0) or ""
        assert why.startswith(f"process {child.pid} of the trial ("), why
        assert why.endswith(") is a Python that autotune's bootstrap could not hook: python3 "
                            "cannot import autotune (x)"), why
        (tmp_path / REACHED / str(child.pid)).write_text("ok")
        assert Reach(tmp_path).check({child.pid: started}, now=10.0) is None
    finally:
        child.kill()
        child.wait()


def test_the_bootstrap_marks_where_the_tuner_reads() -> None:
    # sitecustomize names the folder itself: it marks before it imports anything of autotune's.
    from autotune.bootstrap import SITE

    assert f'\nREACHED = "{REACHED}"\n' in (SITE / "sitecustomize.py").read_text()


def test_marks_are_read_as_what_a_trial_could_put_there(tmp_path: Path) -> None:
    import psutil

    folder = tmp_path / REACHED
    folder.mkdir()
    (folder / "\u00b2").write_text("ok")  # a digit to str.isdigit, not to int()
    os.mkfifo(folder / "4242")  # opening it would wait for a writer
    (folder / "4243").symlink_to("/etc/hostname")
    reach = Reach(tmp_path)
    assert reach.check({}) is None and reach.marks == {} and reach.reached == 0
    # A mark older than its process is an earlier process's of the same pid: not this one's.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = psutil.Process(child.pid).create_time()
        (folder / str(child.pid)).write_text("ok")
        os.utime(folder / str(child.pid), (started - 60, started - 60))
        reach = Reach(tmp_path)
        reach.check({child.pid: started}, now=0.0)
        assert "no mark from it" in (reach.check({child.pid: started}, now=10.0) or "")
    finally:
        child.kill()
        child.wait()
