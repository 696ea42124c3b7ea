"""--executor ray against a real local Ray cluster of two nodes (``ray.cluster_utils.Cluster``:
two raylets on this machine): every trial a placement group whose two actors meet at a c10d
rendezvous and measure, and a node removed in the middle of a trial fails that trial, which is
queued and measured again on a node that took its place. One study of one trial shows both: a
cluster starts and a study runs in about 20 s here, and the suite's serial pass is where they
are paid.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.tuner.record import read_trials
from tests.conftest import ROOT, trial_processes_under

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.ray]

FAST = ("--no-probe", "--no-prune", "--window-seconds", "0.1", "--trial-timeout", "90s",
        "--confirm-top", "0")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head node and one more, 2 CPUs each (CI installs Ray with the dev extra: there the
    tests fail rather than skip without it)."""
    if os.environ.get("CI"):
        import ray  # noqa: F401
    else:
        pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        c.shutdown()


def leftovers(folder: Path) -> list[int]:
    return trial_processes_under(folder)


def wait_gone(folder: Path, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := leftovers(folder)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_every_trial_is_a_placement_group_across_two_nodes_and_a_lost_node_fails_one_trial(
        cluster: Any, tmp_path: Path) -> None:
    """A study of one trial, which loses its second node while it measures, fails, and is queued
    and measured again on the node that took its place: a placement group whose two ranks met
    and measured."""
    db = f"sqlite:///{tmp_path}/s.db"
    run = subprocess.Popen(
        [sys.executable, "-m", "autotune", "run", "--model", "mlp", "--executor", "ray",
         "--nnodes", "2", "--nproc", "1", "--trials", "1", "--trial-seconds", "10",
         "--storage", db, "--study", "ray", *FAST], cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": cluster.address})
    try:
        progress = tmp_path / "studies" / "ray" / "trials" / "0000" / "progress.jsonl"
        deadline = time.monotonic() + 300
        while not (progress.exists() and '"window"' in progress.read_text()):
            assert time.monotonic() < deadline and run.poll() is None, run.stdout.read() \
                if run.stdout else ""
            time.sleep(0.2)
        other = [n for n in cluster.list_all_nodes() if n is not cluster.head_node]
        cluster.remove_node(other[0])  # the trial is measuring: its second node goes
        cluster.add_node(num_cpus=2)  # a node takes its place, for the retry
        out, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out[-4000:]
    assert "trials run as Ray placement groups: 2 node(s)" in out
    assert "node lost" in out and "queued again" in out, out[-4000:]
    study = optuna.load_study(study_name="ray", storage=db)
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(failed) == 1 and failed[0].user_attrs["reason"].startswith("node lost:"), \
        [t.user_attrs.get("reason") for t in failed]
    (measured,) = [t for t in read_trials(study) if t.reused_from is None]
    assert measured.status == "ok", (measured.status, measured.reason)
    retry = [t for t in study.trials if t.system_attrs.get("failed_trial") == failed[0].number]
    assert retry and retry[0].number == measured.number  # the lost one, run again
    # Both ranks met at the placement group's rendezvous, on two nodes, and measured.
    assert sorted(r["rank"] for r in measured.measurement.ranks) == [0, 1]
    assert not wait_gone(tmp_path)
