"""The executors' pure parts: a trial planned as a Slurm step, what the allocation says, and the
relay that brings a trial's files back over the engine's stdout (the trial's word: untrusted)."""

from __future__ import annotations

import io
import json
import os
import shlex
import socket
import sys
from pathlib import Path

import pytest

from autotune.config.knobs import Config
from autotune.errors import UsageError
from autotune.trial.executors import SPEC_ENV, relay, slurm
from autotune.trial.launch import plan
from autotune.trial.spec import TrialSpec
from autotune.workloads import WorkloadSpec
from tests.conftest import autotune


def test_what_the_allocation_says() -> None:
    assert slurm.cpus_per_node("72(x2),36") == 36
    assert slurm.cpus_per_node("2(x4)") == 2 and slurm.cpus_per_node("") == 0
    assert slurm.gpus_per_node({"SLURM_GPUS_ON_NODE": "8"}) == 8
    assert slurm.gpus_per_node({"SLURM_GPUS_PER_NODE": "h100:4"}) == 4
    assert slurm.gpus_per_node({}) == 0


def test_a_trial_is_a_step_on_its_slots_whole_nodes(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm, "node_address", lambda node: f"10.0.0.{node[-1]}")
    alloc = slurm.Allocation("77", ("n1", "n2", "n3", "n4"), cpus_per_node=32, gpus_per_node=8)
    executor = slurm.Slurm(2, 8, None, "bert study", allocation=alloc)
    assert executor.slots == 2 and executor.nodes_of(1) == ("n3", "n4")
    config = Config(world_size=16, nccl_algo="Ring")
    local = plan(TrialSpec(WorkloadSpec("bert", {}), config, device="cuda"), workdir=tmp_path,
                 timeout_s=90)
    p = executor.plan(local, 1, "trials-0003", port_seed=5)
    srun = p.argv[:p.argv.index(sys.executable)]
    assert srun == ("srun", "--nodes=2", "--ntasks-per-node=1", "--nodelist=n3,n4", "--exact",
                    "--kill-on-bad-exit=1", "--time=2:30",
                    "--job-name=autotune.bert_study.trials-0003", "--jobid=77",
                    "--cpus-per-task=32", "--gpus-per-node=8")
    node = p.argv[len(srun):]
    assert node[:3] == (sys.executable, "-m", "autotune.trial.executors.node")
    assert node[3:] == ("--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=10.0.0.3:{20000 + 5 * 37}",
                        "--rdzv-id=autotune.bert_study.trials-0003", "--max-restarts=0")
    # The nodes get the spec in the environment (no shared file system), and the knobs' env.
    assert json.loads(p.env[SPEC_ENV]) == local.spec and p.env["NCCL_ALGO"] == "Ring"
    assert p.engine == "slurm" and p.step == "autotune.bert_study.trials-0003"
    assert p.result_path == local.result_path  # written here, from what the nodes relay
    assert shlex.join(p.argv)  # every part is a plain string
    with pytest.raises(UsageError, match="--parallel 3: 2 trial"):
        slurm.Slurm(2, 8, 3, "s", allocation=alloc)
    with pytest.raises(UsageError, match="--nnodes 8: the allocation has 4 node"):
        slurm.Slurm(8, 8, None, "s", allocation=alloc)
    with pytest.raises(UsageError, match="--nproc 16: the allocation has 8 GPU"):
        slurm.Slurm(2, 16, None, "s", allocation=alloc)


def test_the_relay_writes_only_well_formed_records_to_fixed_names(tmp_path: Path) -> None:
    """What a trial's nodes send is parsed as JSON within a size and written to the result,
    the progress file or a rank's report: a name in it never becomes a path."""
    good = [relay.line("progress", doc={"event": "window", "samples_per_sec": 3.0}),
            relay.line("rank", rank="rank1", doc={"rank": 1, "failed_at": 2.0}),
            relay.line("result", doc={"status": "ok"})]
    bad = [relay.line("rank", rank="../../escaped", doc={"x": 1}),
           relay.line("rank", rank="rank1/../../x", doc={"x": 1}),
           relay.line("result", doc=["not", "a", "document"]),
           relay.line("shell", doc={"cmd": "touch owned"}),
           relay.MARK + "{not json\n",
           relay.MARK + json.dumps({"kind": "result", "doc": {"x": "y" * relay.MAX_LINE}}) + "\n",
           "plain output of a rank\n"]
    stream = io.BytesIO("".join(bad[:3] + good[:1] + bad[3:] + good[1:]).encode())
    trial = tmp_path / "trial"
    trial.mkdir()
    r = relay.Relay(stream, str(trial / "result.json"), str(trial / "progress.jsonl"))
    r.close()
    assert sorted(f.name for f in trial.iterdir()) == ["progress.jsonl", "result.json",
                                                       "result.json.rank1"]
    assert json.loads((trial / "result.json").read_text()) == {"status": "ok"}
    assert json.loads((trial / "progress.jsonl").read_text())["samples_per_sec"] == 3.0
    assert r.refused == 6  # the plain line is the log's, not a refused record
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trial"]


def test_a_trial_is_a_placement_group_on_ray(tmp_path: Path) -> None:
    from autotune.trial.executors.ray_client import FORWARD_ENV
    from autotune.trial.executors.ray_cluster import Ray

    executor = Ray(2, 4, None, "s", nodes=[{"cpus": 16, "gpus": 8}, {"cpus": 8, "gpus": 4},
                                           {"cpus": 16, "gpus": 8}])
    assert executor.slots == 1 and (executor.cpus, executor.gpus) == (8, 4)
    local = plan(TrialSpec(WorkloadSpec("bert", {}), Config(world_size=8), device="cuda"),
                 workdir=tmp_path, timeout_s=90)
    p = executor.plan(local, 0, "trials-0001", port_seed=1)
    assert p.argv[1:] == ("-m", "autotune.trial.executors.ray_client", "run", "--nodes", "2",
                          "--nproc", "4", "--cpus", "8", "--gpus", "4", "--name",
                          "autotune.s.trials-0001")
    assert json.loads(p.env[SPEC_ENV]) == local.spec and p.engine == "ray"
    assert set(p.env[FORWARD_ENV].split(",")) == set(p.env) - {FORWARD_ENV}
    with pytest.raises(UsageError, match="--nnodes 4: the Ray cluster has 3 node"):
        Ray(4, 1, None, "s", nodes=[{"cpus": 2, "gpus": 0}] * 3)


def test_a_lost_node_is_not_a_result() -> None:
    from autotune.trial.executors.ray_client import NODE_LOST as LOST_EXIT
    from autotune.trial.measurement import NODE_LOST, RawResult, classify

    lost = classify(RawResult(returncode=LOST_EXIT, timed_out=False, result=None, wall_s=9.0,
                              stderr_tail="rank output\nautotune: node lost: actor died\n"))
    assert lost.ended_by == NODE_LOST and lost.reason == "node lost: actor died"
    assert not lost.is_result
    # The same exit code without the client's line is the trial's own failure.
    other = classify(RawResult(returncode=LOST_EXIT, timed_out=False, result=None, wall_s=9.0,
                               stderr_tail="exit 75\n"))
    assert other.ended_by != NODE_LOST


@pytest.mark.slow  # Ray gives up on the address after a few seconds
def test_ray_at_a_closed_port_says_what_it_waits_for_before_it_fails(tmp_path: Path) -> None:
    if os.environ.get("CI"):
        import ray  # noqa: F401 - CI installs Ray with the dev extra: fail, never skip
    else:
        pytest.importorskip("ray")
    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    # Ray's own settings, so that it gives up on the address in seconds, not minutes.
    quick = {"RAY_gcs_server_port_wait_time_s": "1", "RAY_py_gcs_connect_timeout_s": "2",
             "RAY_gcs_rpc_server_connect_timeout_s": "1"}
    out = autotune("run", "--model", "mlp", "--executor", "ray", "--nnodes", "2",
                   "--storage", f"sqlite:///{tmp_path}/s.db", "--no-probe", cwd=tmp_path,
                   env={"RAY_ADDRESS": address, **quick}, timeout=240)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[-1] == (
        f"autotune: error: --executor ray: no Ray cluster answers at {address}: start one "
        "(`ray start --head` here, `ray start --address HEAD:6379` on each other node) or set "
        "RAY_ADDRESS"), out.stderr
    waiting = [line for line in lines[:-1] if line.startswith("autotune: asking the Ray")]
    assert waiting == [f"autotune: asking the Ray cluster at {address} for its nodes, for up "
                       "to 120s (RAY_ADDRESS sets the address; Ctrl-C stops)"], out.stderr
