"""--executor slurm against a real Slurm: a one-host cluster of four nodes (``scripts/
slurm_cluster.sh``; `.ci/run` starts it, or this module does), studies submitted with
``sbatch --wait``, two tasks on this machine standing in for two machines.

Each test checks what Slurm and the study record: every trial a step that met at its rendezvous
and measured, a hanging rank ended at the step's limit, a failing rank named, two trials as
concurrent steps, exactly --trials trials, nothing of any trial left afterwards, and a killed
driver's study resumed by the same command.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from autotune.tuner.record import read_trials
from tests.conftest import ROOT, trial_processes_under

# Serial: beside the parallel pass their trials took the CPU other tests' trial budgets count on
# (a fresh-clone CI saw one of those time out), and the pass grew by more than they saved.
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.slurm]

SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
FAST = ("--no-probe", "--no-prune", "--window-seconds", "0.1", "--trial-seconds", "4",
        "--trial-timeout", "60s", "--confirm-top", "0")


def _answers(env: dict[str, str]) -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%D"], env=env, capture_output=True,
                             text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip().isdigit() and int(out.stdout) >= 4


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment that reaches a running four-node cluster: CI's, else one started here
    (as root, where Debian's packages install); CI fails rather than skips without one."""
    env = dict(os.environ)
    if env.get("SLURM_CONF") and _answers(env):
        yield env
        return
    if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("CI"):
        pytest.skip("under pytest -n, start one cluster first (scripts/slurm_cluster.sh start DIR; "
                    "export SLURM_CONF=DIR/slurm.conf): each worker would start its own")
    folder = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(SCRIPT), "start", str(folder)], capture_output=True,
                             text=True, timeout=600, check=False) \
        if os.geteuid() == 0 and shutil.which("bash") else None
    env["SLURM_CONF"] = str(folder / "slurm.conf")
    if started is None or started.returncode or not _answers(env):
        why = started.stderr[-1500:] if started is not None else "not root"
        if os.environ.get("CI"):
            raise AssertionError(f"CI must run the Slurm tests, but no cluster started: {why}")
        pytest.skip(f"no Slurm cluster: {why}")
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(folder)], timeout=120, check=False)


def job(folder: Path, nodes: int, *runs: list[str]) -> Path:
    """An sbatch script that runs each ``autotune run`` ARGS of ``runs`` in ``folder``, one
    after the other; the first one's pid goes to ``driver.pid``."""
    lines = ["#!/bin/bash", f"#SBATCH --nodes={nodes}", f"#SBATCH --output={folder}/job.out",
             f"cd {folder}", f"export PYTHONPATH={ROOT}",
             f"export AUTOTUNE_TEST_CHILD_PID_FILE={folder}/child.pid"]  # the hang workload's
    for i, args in enumerate(runs):
        cmd = " ".join([sys.executable, "-m", "autotune", "run", *(f"'{a}'" for a in args)])
        lines += [f"{cmd} > run{i}.out 2>&1 &", f"echo $! > driver{i}.pid", "wait $!",
                  f"echo $? > run{i}.rc"]
    path = folder / "job.sh"
    path.write_text("\n".join(lines) + "\n")
    return path


def submit(script: Path, env: dict[str, str]) -> str:
    """The job id of ``script``, submitted."""
    out = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().split(";")[0]


def wait_job(job: str, script: Path, env: dict[str, str], timeout: float = 600) -> None:
    """Until the job ended, asserting it completed with exit code 0. Polled every quarter
    second: ``sbatch --wait`` polls at growing intervals (up to 10 s), seconds per test."""
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=env,
                               capture_output=True, text=True, timeout=60, check=False).stdout
        fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
        state = fields.get("JobState", "")
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            break
        assert time.monotonic() < deadline, f"job {job} still {state}"
        time.sleep(0.25)
    assert (state, fields.get("ExitCode")) == ("COMPLETED", "0:0"), \
        shown + _read(script.parent / "job.out")


def sbatch(script: Path, env: dict[str, str], timeout: float = 600) -> None:
    wait_job(submit(script, env), script, env, timeout)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def run_output(folder: Path, i: int = 0) -> tuple[int, str]:
    return int(_read(folder / f"run{i}.rc") or -1), _read(folder / f"run{i}.out")


def leftovers(folder: Path) -> list[int]:
    return trial_processes_under(folder)


def steps(env: dict[str, str], *studies: str) -> list[str]:
    """The running steps of these studies' trials."""
    out = subprocess.run(["squeue", "--steps", "--noheader", "--format", "%i %j"], env=env,
                         capture_output=True, text=True, check=False).stdout
    return [ln for ln in out.splitlines()
            if any(f" autotune.{study}." in ln for study in studies)]


def study_trials(folder: Path, name: str):  # noqa: ANN201 - a test helper
    return read_trials(optuna.load_study(study_name=name, storage=f"sqlite:///{folder}/s.db"))


def test_every_trial_is_a_step_on_two_nodes_and_two_run_side_by_side(
        slurm: dict[str, str], tmp_path: Path) -> None:
    # Micro-batch sizes alone: where trials run is under test, not the space, and a compiled
    # config the default space's sampler drew took half a minute of this test.
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  micro_batch_size: {choices: [16, 32, 64, 128]}\n")
    sbatch(job(tmp_path, 4, ["--model", "mlp", "--executor", "slurm", "--nnodes", "2",
                             "--nproc", "1", "--trials", "3", "--space", str(space),
                             "--storage", f"sqlite:///{tmp_path}/s.db", "--study", "steps",
                             *FAST]), slurm)
    rc, out = run_output(tmp_path)
    assert rc == 0, out[-4000:]
    assert "trials run as Slurm job" in out and "2 trial(s) at a time on 2 node(s) each" in out
    trials = study_trials(tmp_path, "steps")
    measured = [t for t in trials if t.reused_from is None]  # a repeated config is not re-run
    # Three trials: the baseline, then one per slot, side by side.
    assert len(measured) == 3, [(t.status, t.reason, t.reused_from) for t in trials]
    assert all(t.status == "ok" for t in measured), [(t.status, t.reason) for t in trials]
    for t in measured:  # both ranks met at the step's rendezvous and measured
        assert sorted(r["rank"] for r in t.measurement.ranks) == [0, 1]
        assert t.measurement.samples_per_sec and t.measurement.samples_per_sec > 0
    # Both slots ran, and at least once two steps were running at the same time.
    raw = optuna.load_study(study_name="steps", storage=f"sqlite:///{tmp_path}/s.db").trials
    holds = [raw[t.number].user_attrs["devices"] for t in measured]
    assert {h["devices"][0] for h in holds} == {"slurm slot 0", "slurm slot 1"}
    spans = sorted((h["start"], h["end"]) for h in holds)
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)), spans
    assert not leftovers(tmp_path) and not steps(slurm, "steps")


@pytest.fixture(scope="module")
def failing_ranks(slurm: dict[str, str],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, Path]]:
    """The job of a hanging rank's study and then a failing rank's (two nodes), submitted when
    first asked for and waited for by the test that checks it: the killed-driver test runs
    beside it on the other two nodes, while the hanging rank waits out its 12 s limit."""
    folder = tmp_path_factory.mktemp("failing")
    common = ("--executor", "slurm", "--nnodes", "2", "--nproc", "1", "--trials", "1",
              "--storage", f"sqlite:///{folder}/s.db", *FAST)
    script = job(folder, 2,
                 ["--model", "autotune.testing.workloads:hang", "--param", "rank=1", "--study",
                  "hang", *common, "--trial-timeout", "12s"],
                 ["--model", "autotune.testing.workloads:crash", "--param", "rank=1", "--param",
                  "after=2", "--param", "message=boom on the second node", "--study", "crash",
                  *common])
    submitted = submit(script, slurm)
    try:
        yield folder, submitted, script
    finally:  # ended already where its test ran; not left queued where it did not
        subprocess.run(["scancel", submitted], env=slurm, capture_output=True, check=False)


@pytest.mark.usefixtures("failing_ranks")  # runs beside this test, on the other two nodes
def test_a_killed_driver_is_resumed_by_the_same_command(
        slurm: dict[str, str], tmp_path: Path) -> None:
    """The driver is killed (SIGKILL) while a trial's step runs; the same command, run again in
    the same allocation, ends the step it left and finishes the study at exactly --trials."""
    args = ["--model", "mlp", "--executor", "slurm", "--nnodes", "2", "--nproc", "1",
            "--trials", "2", "--storage", f"sqlite:///{tmp_path}/s.db", "--study", "resumed",
            *FAST]
    script = job(tmp_path, 2, args, args)
    submitted = submit(script, slurm)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            states = _states(tmp_path / "s.db")
            if states.count("COMPLETE") >= 1 and "RUNNING" in states:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"no second trial started: {_read(tmp_path / 'run0.out')}")
        time.sleep(1.0)  # its step is running now
        os.kill(int(_read(tmp_path / "driver0.pid")), signal.SIGKILL)
        wait_job(submitted, script, slurm)
    except BaseException:
        subprocess.run(["scancel", submitted], env=slurm, capture_output=True, check=False)
        raise
    rc, second = run_output(tmp_path, 1)
    assert rc == 0, second[-4000:]
    trials = study_trials(tmp_path, "resumed")
    assert sum(t.status == "ok" for t in trials) == 2 == len(trials), \
        [(t.status, t.reason) for t in trials]
    study = optuna.load_study(study_name="resumed", storage=f"sqlite:///{tmp_path}/s.db")
    killed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(killed) == 1 and killed[0].user_attrs["reason"] == "its tuner process died"
    assert not leftovers(tmp_path) and not steps(slurm, "resumed")


def test_a_hanging_rank_is_ended_at_the_limit_and_a_failing_rank_is_named(
        slurm: dict[str, str], failing_ranks: tuple[Path, str, Path]) -> None:
    folder, submitted, script = failing_ranks
    wait_job(submitted, script, slurm)
    (hung,) = study_trials(folder, "hang")
    assert hung.status == "timeout", (hung.status, hung.reason)
    child = int(_read(folder / "child.pid"))  # what the hanging rank started is gone too
    assert not Path(f"/proc/{child}").exists() or "Z" in _read(Path(f"/proc/{child}/stat"))
    (crashed,) = study_trials(folder, "crash")
    assert crashed.status == "error"
    assert (crashed.reason or "").startswith("rank 1: ValueError: boom on the second node"), \
        crashed.reason
    rc, out = run_output(folder, 1)
    assert rc == 1 and "internal error" not in out  # nothing measured, said in one line
    assert not leftovers(folder) and not steps(slurm, "hang", "crash")


def _states(db: Path) -> list[str]:
    if not db.exists():
        return []
    try:
        with sqlite3.connect(db, timeout=5) as conn:
            return [r[0] for r in conn.execute("SELECT state FROM trials")]
    except sqlite3.Error:
        return []


def test_a_hybrid_sharded_trial_runs_as_a_step_on_two_nodes(slurm: dict[str, str],
                                                             tmp_path: Path) -> None:
    """hybrid-shard across two nodes of two ranks each: each node a shard group, the nodes
    replicas (a 2 x 2 mesh read back from FSDP in the trial), as one Slurm step."""
    config = '{"micro_batch_size": 4, "sharding": "hybrid-shard", "world_size": 4}'
    script = tmp_path / "job.sh"
    script.write_text("\n".join([
        "#!/bin/bash", "#SBATCH --nodes=2", f"#SBATCH --output={tmp_path}/job.out",
        f"cd {tmp_path}", f"export PYTHONPATH={ROOT}",
        f"{sys.executable} -m autotune.testing.hybrid {tmp_path}/out.json '{config}'"]) + "\n")
    sbatch(script, slurm)
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["status"] == "ok", doc["reason"]
    assert doc["ranks"] == [0, 1, 2, 3]
    assert doc["sharding"]["strategy"] == "hybrid-shard" and doc["sharding"]["mesh"] == [2, 2]
    assert doc["sharding"]["units"] == 3 and doc["sharding"]["reshard_after_forward"] is True
    assert not leftovers(tmp_path) and not steps(slurm, "hybrid")


def test_outside_an_allocation_the_executor_is_a_one_line_error(tmp_path: Path) -> None:
    from tests.conftest import autotune

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    out = autotune("run", "--model", "mlp", "--executor", "slurm", "--trials", "1",
                   cwd=tmp_path, env={**env, "SLURM_JOB_ID": ""})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--executor slurm runs inside a Slurm allocation" in out.stderr
    assert not (tmp_path / "studies").exists()
