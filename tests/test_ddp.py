"""Multi-rank trials for real: 2 ranks under torchrun on gloo, on the CPU.

What these check can fail: the bucket size is read back from DDP and changes how many buckets
are all-reduced; the all-reduce count per micro-step comes from a communication hook; the
slowest-rank rule is checked against each rank's own windows.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from autotune.config.knobs import Config
from autotune.trial.launch import execute, plan
from autotune.trial.measurement import Measurement, classify
from autotune.trial.processes import TRIAL_TOKEN, trial_processes
from autotune.trial.spec import MeasureSettings, TrialSpec
from autotune.workloads import WorkloadSpec

from .conftest import FAST, ROOT, autotune

pytestmark = pytest.mark.slow  # real ranks on gloo: seconds each
MEASURE = {"min_window_s": 0.05, "max_seconds": 3.0, "max_windows": 4}


def _trial(tmp_path: Path, spec: str, config: Config, params: dict[str, Any] | None = None,
           timeout: float = 90, measure: dict[str, Any] | None = None,
           extra_env: dict[str, str] | None = None) -> tuple[Measurement, float]:
    p = plan(TrialSpec(WorkloadSpec(spec, params or {}), config, device="cpu",
                       measure=MeasureSettings.from_dict({**MEASURE, **(measure or {})})),
             workdir=tmp_path, timeout_s=timeout, extra_env=extra_env)
    start = time.monotonic()
    raw = execute(p)
    wall = time.monotonic() - start
    # Whatever happened, nothing of the trial is left: no rank, no loader worker, no child.
    assert trial_processes(p.env[TRIAL_TOKEN], -1) == []
    return classify(raw), wall


def test_bucket_sizes_reach_ddp_and_change_its_buckets(tmp_path: Path) -> None:
    buckets = {}
    for cap in (1, 50):
        m, _ = _trial(tmp_path / str(cap), "mlp", Config(
            micro_batch_size=16, world_size=2, ddp_bucket_cap_mb=cap), params={"hidden": 2048})
        assert m.ok, m.reason
        assert m.ddp["bucket_cap_bytes"] == cap * 2**20
        assert [r["rank"] for r in m.ranks] == [0, 1]
        assert {r["comm"]["buckets_per_sync"] for r in m.ranks} == {
            m.ranks[0]["comm"]["buckets_per_sync"]}
        buckets[cap] = m.ranks[0]["comm"]["buckets_per_sync"]
    # ~17 MB of gradients: 1 MB buckets split them, 50 MB buckets hold them whole.
    assert buckets[1] > buckets[50] >= 1


@pytest.mark.parametrize("sync_each_micro", [False, True])
def test_accumulation_all_reduces_only_on_the_last_micro_step(tmp_path: Path,
                                                              sync_each_micro: bool) -> None:
    config = Config(micro_batch_size=8, grad_accum_steps=4, world_size=2)
    m, _ = _trial(tmp_path, "mlp", config, params={"hidden": 64},
                  measure={"sync_each_micro": sync_each_micro})
    assert m.ok, m.reason
    steps = m.warmup["steps"] + sum(w["steps"] for w in m.windows)
    for rank in m.ranks:
        calls = {int(k): v for k, v in rank["comm"]["calls_by_micro"].items()}
        per_sync = rank["comm"]["buckets_per_sync"]
        if sync_each_micro:  # the check above can fail: this is what it looks like
            assert sorted(calls) == [0, 1, 2, 3]
        else:
            assert sorted(calls) == [3]  # no_sync on micro-steps 0..2
            assert calls[3] == steps * per_sync
    # Samples per window count every rank: micro x accumulation x ranks per step.
    assert all(w["samples"] == w["steps"] * 8 * 4 * 2 for w in m.windows)
    assert "comm_wait" in m.breakdown and 0 <= m.breakdown["comm_wait"] < 1


@pytest.mark.serial  # which rank is slower: its 30 ms a step must stand out of the noise
def test_the_trial_goes_at_the_pace_of_its_slowest_rank(tmp_path: Path) -> None:
    # Without the timing hook (DDP's own all-reduce): the rule does not depend on it.
    m, _ = _trial(tmp_path, "autotune.testing.workloads:slowrank",
                  Config(micro_batch_size=4, world_size=2), params={"rank": 1, "extra_s": 0.03},
                  measure={"time_comm": False})
    assert m.ok, m.reason
    assert "comm_wait" not in m.breakdown and all("comm" not in r for r in m.ranks)
    own = {r["rank"]: r["window_seconds"] for r in m.ranks}
    assert len(own[0]) == len(own[1]) == len(m.windows)
    for i, w in enumerate(m.windows):
        assert w["seconds"] == max(own[0][i], own[1][i])
    # Rank 1 sleeps after the all-reduce, so its windows are the long ones.
    assert sum(w["slowest_rank"] == 1 for w in m.windows) > len(m.windows) / 2
    rates = [w["samples"] / w["seconds"] for w in m.windows]
    assert m.samples_per_sec == statistics.median(rates)
    fastest_rank = max(r["samples_per_sec"] for r in m.ranks) * 2  # its rate with all samples
    assert m.samples_per_sec < fastest_rank


def test_a_rank_that_crashes_ends_the_trial_with_its_own_error(tmp_path: Path) -> None:
    m, wall = _trial(tmp_path, "autotune.testing.workloads:crash",
                     Config(micro_batch_size=4, world_size=2), params={"rank": 1, "after": 3})
    assert m.status == "error"
    # The cause, not rank 0's "connection closed" that follows from it.
    assert m.reason == "rank 1: ValueError: this workload always fails in its training step"
    assert wall < 60


def test_a_rank_killed_by_a_signal_is_the_cause_not_its_peers_errors(tmp_path: Path) -> None:
    m, wall = _trial(tmp_path, "autotune.testing.workloads:crash",
                     Config(micro_batch_size=4, world_size=2),
                     params={"how": "segfault", "rank": 1, "after": 3})
    assert m.status == "error" and m.reason == "rank 1 died from SIGSEGV", m.reason
    assert wall < 60


def test_a_rank_that_runs_out_of_memory_makes_the_trial_an_oom(tmp_path: Path) -> None:
    p = plan(TrialSpec(WorkloadSpec("autotune.testing.workloads:memhog",
                                    {"mib_per_sample": 2048, "rank": 1}),
                       Config(micro_batch_size=4, world_size=2), device="cpu",
                       address_space_bytes=6 * 2**30, measure=MeasureSettings.from_dict(MEASURE)),
             workdir=tmp_path, timeout_s=90)
    m = classify(execute(p))
    assert m.status == "oom" and (m.reason or "").startswith("rank 1: "), m.reason
    assert trial_processes(p.env[TRIAL_TOKEN], -1) == []


def test_a_rank_that_hangs_is_ended_at_the_timeout_with_no_process_left(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    m, wall = _trial(tmp_path, "autotune.testing.workloads:hang",
                     Config(micro_batch_size=4, world_size=2), params={"rank": 1}, timeout=12,
                     extra_env={"AUTOTUNE_TEST_CHILD_PID_FILE": str(pid_file)})
    assert m.status == "timeout" and "12s trial timeout" in (m.reason or "")
    assert 12 <= wall < 25
    child = int(pid_file.read_text())  # started by the hanging rank, in its own session's tree
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


def test_killing_the_tuner_takes_the_ranks_with_it(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"knobs": {"micro_batch_size": {"choices": [4]}}}))
    tuner = subprocess.Popen(
        [sys.executable, "-m", "autotune", "run", "--model", "autotune.testing.workloads:slow",
         "--param", "step_s=2", "--nproc", "2", "--space", str(space), "--trials", "1",
         "--out", str(tmp_path / "out"),
         "--trial-seconds", "30", "--trial-timeout", "60s"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        ranks: list[int] = []
        while time.monotonic() < deadline and len(ranks) < 2:
            time.sleep(0.5)
            ranks = [q.pid for q in psutil.process_iter(["cmdline"])
                     if "autotune.trial.bench" in " ".join(q.info["cmdline"] or [])
                     and "torch.distributed.run" not in " ".join(q.info["cmdline"] or [])
                     and str(tmp_path) in " ".join(q.info["cmdline"] or [])]
        assert len(ranks) == 2, "the ranks did not start"
        tuner.send_signal(signal.SIGKILL)
        tuner.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_running(pid) for pid in ranks):
            time.sleep(0.2)
        assert not any(_running(pid) for pid in ranks)
    finally:
        tuner.kill()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_global_batch_keeps_the_training_semantics(workdir: Path) -> None:
    space = workdir / "space.yaml"
    space.write_text(yaml.safe_dump({"knobs": {
        "micro_batch_size": {"choices": [8, 16, 32, 48, 64]},
        "grad_accum_steps": {"choices": [1, 2, 4]},
        "ddp_bucket_cap_mb": {"choices": [1, 25]}}}))
    r = autotune("run", "--model", "mlp", "--param", "hidden=64", "--nproc", "2",
                 "--global-batch", "128", "--space", str(space), "--trials", "2", *FAST,
                 cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert "grad_accum_steps   derived: --global-batch 128 / (micro_batch_size x 2 rank(s))" \
        in r.stdout
    assert "micro_batch_size   dropped 48: does not divide" in r.stdout
    assert "ranks        2 per trial (torchrun, gloo)" in r.stdout
    assert "effective batch: unchanged at 128 samples per optimizer step" in r.stdout
    import sqlite3

    db = sqlite3.connect(workdir / "studies" / "autotune.db")
    configs = [json.loads(v) for (v,) in db.execute(
        "select value_json from trial_user_attributes where key = 'config'")]
    assert len({json.dumps(c, sort_keys=True) for c in configs}) >= 2  # two configs measured
    for c in configs:
        assert c["micro_batch_size"] * c["grad_accum_steps"] * c["world_size"] == 128
    profile = yaml.safe_load(next((workdir / "studies").glob("*/profile.yaml")).read_text())
    assert profile["result"]["samples_per_optimizer_step"] == 128
    assert any("global batch kept at 128" in n for n in profile["notes"])
    assert profile["config"]["world_size"] == 2 and len(profile["result"]["ranks"]) == 2


def test_resuming_with_other_ranks_is_refused(workdir: Path) -> None:
    from autotune.errors import UsageError
    from autotune.tuner.runner import Runner, RunOptions

    def runner(**kw: Any) -> Runner:
        return Runner(RunOptions(model="autotune.testing.workloads:tiny", study_name="s",
                                 trials=1, **kw), reporter=None)  # type: ignore[arg-type]

    runner(nproc=1)  # creates the study (no trial runs before .run())
    with pytest.raises(UsageError, match=r"was tuned with 1 rank\(s\) per trial \(--nproc x "
                                         r"--nnodes\) and --global-batch unset, not 2 rank\(s\) "
                                         "and --global-batch unset"):
        runner(nproc=2)
    with pytest.raises(UsageError, match=r"not 1 rank\(s\) and --global-batch 8"):
        runner(nproc=1, global_batch=8)
