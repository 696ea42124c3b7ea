"""Several tuners, one study: workers against the real PostgreSQL server (and resuming there),
the fingerprint guard, the device lock, the journal file storage, and trials across two torchrun
agents started by a launcher template, meeting at a c10d rendezvous on loopback (the Slurm
executor's are in test_slurm.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.profile import load_profile
from autotune.tuner.record import read_trials
from tests.conftest import FAST, ROOT, autotune, poll

pytestmark = pytest.mark.slow


def start(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spans_overlap(trials: list[optuna.trial.FrozenTrial]) -> list[tuple[int, int]]:
    """Pairs of trials whose device-holding spans (wall clock) overlap."""
    spans = sorted((t.user_attrs["devices"]["start"], t.user_attrs["devices"]["end"], t.number)
                   for t in trials if "devices" in t.user_attrs)
    return [(a[2], b[2]) for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1]]


@pytest.mark.postgres
def test_three_workers_share_one_study_and_a_killed_workers_trial_is_retried(
        tmp_path: Path, postgres_url: str) -> None:
    name = f"fleet-{uuid.uuid4().hex[:8]}"
    # Micro-batch and precision alone: the fleet is under test, not the space, whose sampled
    # compiled configs took half a minute of this test.
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  micro_batch_size: {choices: [16, 32, 64, 128, 256]}\n"
                     "  amp: {choices: ['off', bf16]}\n")
    args = ("run", "--model", "mlp", "--trials", "5", "--storage", postgres_url, "--study", name,
            "--patience", "0", "--no-probe", "--space", str(space), *FAST)
    # The victim starts first and is killed while its first trial measures: started together,
    # the others could count a late trial of the victim's as running and stop short of it. Its
    # windows are long (three of 4 s at least), so that trial still measures after the others'
    # start-up: with the suite's 0.1 s windows it once completed first on a loaded machine.
    workers = [start(tmp_path, *args, "--out", "w0", "--window-seconds", "4",
                     "--trial-seconds", "40", "--trial-timeout", "120s")]
    victim = workers[0]
    try:
        def victim_trial() -> int | None:  # a trial of the victim's, its process measuring
            try:
                study = optuna.load_study(study_name=name, storage=postgres_url)
            except KeyError:
                return None
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                worker = t.user_attrs.get("worker") or {}
                progress = tmp_path / "w0" / "trials" / f"{t.number:04d}" / "progress.jsonl"
                if worker.get("pid") == victim.pid and progress.exists():
                    return t.number
            return None

        killed = poll(victim_trial)
        workers += [start(tmp_path, *args, "--out", f"w{i}", env={"PYTHONUNBUFFERED": "1"})
                    for i in (1, 2)]
        # Both past their start-up (on a busy machine one could take longer than the other
        # needs for the whole study) before the victim dies and its trial is up for retry.
        for w in workers[1:]:
            first = w.stdout.readline() if w.stdout else ""
            assert first.startswith("autotune: study"), first
        victim.send_signal(signal.SIGKILL)
        victim.communicate()
        for w in workers[1:]:
            out, err = w.communicate(timeout=400)
            assert w.returncode == 0, out[-2000:] + err[-2000:]

        study = optuna.load_study(study_name=name, storage=postgres_url)
        records = read_trials(study)
        ran_records = [r for r in records if r.ran]
        # The trials as stored, for what only Optuna's trial holds (the worker, the devices).
        ran = [study.trials[r.number] for r in ran_records]
        assert len(ran) == 5  # exactly the study's target, none lost
        numbers = [t.number for t in ran]
        assert len(set(numbers)) == len(numbers)
        configs = [r.config for r in ran_records]
        assert len(set(configs)) == len(configs)  # no config measured twice
        victim_t = study.trials[killed]
        assert victim_t.state == TrialState.FAIL and victim_t.user_attrs["interrupted"]
        retry = [t for t in study.trials if t.system_attrs.get("failed_trial") == killed]
        assert retry and retry[0].state != TrialState.RUNNING
        assert retry[0].number in {r.number for r in records}
        assert not any(t.state == TrialState.RUNNING for t in study.trials)
        # Every worker that lived ran trials, and on this one machine never two at once: the
        # device lock made them wait for each other.
        owners = {t.user_attrs["worker"]["pid"] for t in ran}
        assert {w.pid for w in workers[1:]} <= owners
        assert all(t.user_attrs["devices"]["devices"] == ["cpu"] for t in ran)
        assert not spans_overlap(ran)
        assert any(t.user_attrs["devices"]["waited_s"] > 0.1 for t in ran)
        # The baseline (the victim's, or its retry's, when the victim died measuring it) was
        # queued once and measured once.
        assert len([r for r in ran_records if r.is_baseline]) == 1
        # Each worker exported what the study held when it stopped; the last one saw all 5.
        profiles = [load_profile(tmp_path / w / "profile.yaml") for w in ("w1", "w2")]
        assert all(p.provenance["study"] == name for p in profiles)
        assert max(p.provenance["trials"] for p in profiles) == 5

        # The same command again resumes the study: one more trial for --trials 6.
        again = autotune(*args[:4], "6", *args[5:], "--out", "w1", cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        assert "resuming     5 trial(s) already measured" in again.stdout
        resumed = read_trials(optuna.load_study(study_name=name, storage=postgres_url))
        assert len([r for r in resumed if r.ran]) == 6

        # A worker on other hardware (here: a fake NVIDIA driver) is refused, and adds nothing.
        fake = tmp_path / "machine.json"
        fake.write_text(json.dumps({"driver": "580.1", "cuda_driver": 13000, "gpus": []}))
        other = autotune(*args, cwd=tmp_path, env={"AUTOTUNE_FAKE_NVML": str(fake)})
        assert other.returncode == 2
        assert f"study {name} was measured on other hardware (driver_version: None vs " \
               "'580.1' here" in other.stderr
        assert len(optuna.load_study(study_name=name, storage=postgres_url).trials) \
            == len(study.trials)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        optuna.delete_study(study_name=name, storage=postgres_url)


def test_a_cluster_launcher_starts_the_nodes_and_a_missing_node_ends_at_the_timeout(
        tmp_path: Path) -> None:
    """--launcher with a stand-in for srun that starts {cmd} twice on this machine; then the
    same trial with one node that never comes: the trial ends at its timeout, the tuner lives."""
    launcher = f"{sys.executable} -m autotune.testing.launcher 2 {{cmd}}"
    db = f"sqlite:///{tmp_path}/study.db"
    common = ("--model", "mlp", "--nnodes", "2", "--nproc", "1", "--trials", "1",
              "--storage", db, *FAST)
    ok = autotune("run", *common, "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--launcher",
                  launcher, "--study", "launched", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-3000:]
    (trial,) = read_trials(optuna.load_study(study_name="launched", storage=db))
    assert trial.status == "ok" and len(trial.measurement.ranks) == 2

    started = time.monotonic()
    one = f"{sys.executable} -m autotune.testing.launcher 1 {{cmd}}"  # the second never comes
    alone = autotune("run", *common, "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--launcher",
                     one, "--study", "alone", "--trial-timeout", "8s", "--trial-seconds", "5",
                     cwd=tmp_path)
    assert time.monotonic() - started < 90
    assert alone.returncode == 1  # nothing was measured: the one trial timed out
    (trial,) = read_trials(optuna.load_study(study_name="alone", storage=db))
    assert trial.status == "timeout", trial.reason


def test_the_device_lock_excludes_across_processes_and_gpu_blocks_spread_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autotune.tuner.fleet import DeviceLock, free_block, gpu_blocks, trial_devices

    monkeypatch.setenv("AUTOTUNE_LOCK_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from autotune.tuner.fleet import DeviceLock\n"
        "with DeviceLock(['gpu0', 'gpu1'], 'worker A').hold():\n"
        "    print('held', flush=True); time.sleep(2)")], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    assert gpu_blocks([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert gpu_blocks([0, 1, 2], 4) == [[0, 1, 2]]
    assert free_block(gpu_blocks([0, 1, 2, 3], 2)) == [2, 3]  # A holds the first block
    # What a trial takes: that free block, made visible.
    assert trial_devices("cuda", [0, 1, 2, 3], 2) == (
        ["gpu2", "gpu3"], [2, 3],
        {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert trial_devices("cpu", [], 2) == (["cpu"], [], {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the user's choice stands
    assert trial_devices("cuda", [0, 1], 2) == (["gpu0", "gpu1"], [0, 1], {})
    waits: list[str] = []
    started = time.monotonic()
    with DeviceLock(["gpu1"], "worker B").hold(on_wait=waits.append):
        waited = time.monotonic() - started
    holder.wait()
    assert waits == ["waiting for gpu1, held by worker A"] and waited > 1.0


def test_bad_multi_node_flags_are_one_line_errors(tmp_path: Path) -> None:
    from autotune.tuner.options import node_problems

    cases = {
        (2, None, None): "--nnodes 2 needs an engine to start the other nodes: --executor slurm",
        (2, None, "mpirun {cmd}"): "--nnodes 2 needs --rdzv-endpoint HOST:PORT",
        (2, "node0", "mpirun {cmd}"): "--rdzv-endpoint 'node0' is not HOST:PORT",
        (1, "node0:29400", None): "pass --nnodes N (N > 1) too",
        (2, "n:1", "srun"): "has no {cmd}",
        (0, None, None): "--nnodes must be >= 1, got 0",
    }
    for args, message in cases.items():
        (problem,) = node_problems(*args)
        assert message in problem
    assert node_problems(2, None, None, "slurm") == []  # the executor starts the nodes
    out = autotune("run", "--model", "mlp", "--trials", "1", "--nnodes", "2", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "--nnodes 2 needs an engine to start the other nodes" in out.stderr
    assert not (tmp_path / "studies").exists()  # refused before anything was created
    for args, message in {
        ("--parallel", "2"): "--parallel 2: trials on one machine share its devices",
        ("--executor", "pbs"): "--executor 'pbs' is not one of local, slurm, ray",
        ("--executor", "slurm", "--launcher", "srun {cmd}"): "drop --launcher and "
                                                             "--rdzv-endpoint",
    }.items():
        out = autotune("run", "--model", "mlp", "--trials", "1", *args, cwd=tmp_path)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_on_a_journal_file_a_worker_silent_for_a_minute_on_another_host_is_dead(
        tmp_path: Path) -> None:
    """A journal file has no heartbeat of Optuna's: autotune's own `alive_at` decides."""
    from autotune.console import QuietReporter
    from autotune.tuner.runner import Runner, RunOptions

    url = f"journal:///{tmp_path}/journal.log"
    runner = Runner(RunOptions(model="autotune.testing.workloads:tiny", storage=url,
                               study_name="j", trials=1, out_dir=tmp_path / "out"), QuietReporter())
    study = runner.study
    silent, beating = study.ask(), study.ask()
    for trial, alive_at in ((silent, time.time() - 120), (beating, time.time() - 5)):
        trial.set_user_attr("worker", {"host": "another-host", "pid": 1, "started": 0.0})
        trial.set_user_attr("alive_at", alive_at)
    runner.steps.recover_dead_trials()
    trials = study.get_trials()
    assert trials[silent.number].state == TrialState.FAIL
    assert trials[silent.number].user_attrs["reason"] == "its tuner process died"
    assert trials[beating.number].state == TrialState.RUNNING
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == silent.number]
    assert retry.state == TrialState.WAITING


def test_a_claimed_retry_is_not_taken_for_its_dead_workers_trial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A retried trial arrives with its dead worker's attributes. The worker that asks it marks
    it its own under the study lock, in the same step, so another worker recovering dead
    workers' trials leaves it running (it once failed it under the new owner's feet, and that
    tuner died of UpdateFinishedTrialError)."""
    from autotune.console import QuietReporter
    from autotune.machine.hardware import hostname
    from autotune.tuner.runner import Runner, RunOptions

    url = f"journal:///{tmp_path}/journal.log"

    def runner() -> Runner:
        return Runner(RunOptions(model="autotune.testing.workloads:tiny", storage=url,
                                 study_name="j", trials=2, out_dir=tmp_path / "out"),
                      QuietReporter())

    a, b = runner(), runner()
    dead = a.study.ask()
    dead.set_user_attr("worker", {"host": hostname(), "pid": os.getpid(), "started": 0.0})
    dead.set_user_attr("alive_at", time.time() - 120)
    b.steps.recover_dead_trials()  # its pid's start time is not this process's: dead
    with a.steps.locked():
        retry = a._claim(a._ask())
    assert retry.number != dead.number and retry.user_attrs["retry_of"] == dead.number
    b.steps.recover_dead_trials()
    trials = a.study.get_trials()
    assert trials[dead.number].state == TrialState.FAIL
    assert trials[retry.number].state == TrialState.RUNNING
    assert trials[retry.number].user_attrs["interrupted"] is False
    assert trials[retry.number].user_attrs["worker"]["pid"] == os.getpid()
    # Seen from another host, the journal's heartbeat mark decides: the claim renewed the stale
    # one the retry inherited.
    monkeypatch.setattr("autotune.tuner.claims.hostname", lambda: "another-host")
    b.steps.recover_dead_trials()
    assert a.study.get_trials()[retry.number].state == TrialState.RUNNING
