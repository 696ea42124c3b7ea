"""The launcher with real trial processes: timeouts, crashes, OOM, and nothing left behind."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from autotune.config.knobs import Config
from autotune.trial.launch import Nodes, execute, plan
from autotune.trial.measurement import TRIAL_TIMEOUT, classify
from autotune.trial.result import check_result
from autotune.trial.spec import MeasureSettings, TrialSpec
from autotune.workloads import WorkloadSpec

FAST = {"min_window_s": 0.05, "max_seconds": 5}


def test_plan_is_pure_data(tmp_path: Path) -> None:
    config = Config(nccl_algo="Ring", world_size=2, num_workers=2, prefetch_factor=4)
    p = plan(TrialSpec(WorkloadSpec("mlp", {"hidden": 8}), config, device="cuda",
                       memory_limit_bytes=10**9, measure=MeasureSettings.from_dict(FAST)),
             workdir=tmp_path / "t", timeout_s=30)
    assert not (tmp_path / "t").exists()  # planning starts and writes nothing
    assert p.argv[-5:-3] == ("-m", "autotune.trial.bench")
    assert p.env["NCCL_ALGO"] == "Ring" and p.env["TOKENIZERS_PARALLELISM"] == "false"
    assert p.spec["config"] == config.to_dict() and p.spec["workload"]["params"] == {"hidden": 8}
    assert p.memory_limit_bytes is None  # on CUDA the allocator enforces the limit in the trial
    assert p.spec["memory_limit_bytes"] == 10**9
    cpu = plan(TrialSpec(WorkloadSpec("mlp", {}), Config(), device="cpu", memory_limit_bytes=10**9),
               workdir=tmp_path, timeout_s=30)
    assert cpu.memory_limit_bytes == 10**9 and "NCCL_ALGO" not in cpu.env


def test_plan_starts_ranks_through_torchrun_with_the_nccl_environment(tmp_path: Path) -> None:
    config = Config(world_size=4, nccl_algo="Tree", nccl_proto="LL128")
    p = plan(TrialSpec(WorkloadSpec("bert", {}), config, device="cuda"),
             workdir=tmp_path, timeout_s=60)
    assert p.argv[:6] == (sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=4", "--max-restarts=0")
    assert p.argv[6:9] == ("-m", "autotune.trial.bench", p.spec_path)
    # Set before any rank starts, so NCCL reads them when its communicator is created.
    assert p.env["NCCL_ALGO"] == "Tree" and p.env["NCCL_PROTO"] == "LL128"
    # How execute finds every rank at the end: the result's path and a part no other trial has.
    assert p.env["AUTOTUNE_TRIAL"].startswith(os.path.abspath(p.result_path) + "#")
    single = plan(TrialSpec(WorkloadSpec("bert", {}), Config(nccl_algo="Tree"), device="cuda"),
                  workdir=tmp_path, timeout_s=60)
    assert "torch.distributed.run" not in single.argv and "NCCL_ALGO" not in single.env


def test_plan_across_nodes_runs_torchrun_under_the_launcher_template(tmp_path: Path) -> None:
    config = Config(world_size=8, nccl_algo="Ring")
    launcher = "mpirun -np 2 --map-by node {cmd}"
    p = plan(TrialSpec(WorkloadSpec("bert", {}), config, device="cuda"),
             workdir=tmp_path, timeout_s=60, rdzv_id="study-trials-0003",
             nodes=Nodes(2, "node0:29400", launcher))
    assert p.argv[:2] == ("/bin/sh", "-c")
    inner = shlex.split(p.argv[2])
    assert inner[:5] == ["mpirun", "-np", "2", "--map-by", "node"]
    assert inner[5:14] == [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                           "--nproc-per-node=4", "--rdzv-backend=c10d",
                           "--rdzv-endpoint=node0:29400", "--rdzv-id=study-trials-0003",
                           "--max-restarts=0"]
    assert p.env["NCCL_ALGO"] == "Ring" and p.engine is None  # rank 0 writes, on a shared FS
    with pytest.raises(ValueError, match="8 ranks do not split over 3 nodes"):
        plan(TrialSpec(WorkloadSpec("bert", {}), config, device="cuda"),
             workdir=tmp_path, timeout_s=60, nodes=Nodes(3, "node0:29400", launcher))


def _run(tmp_path: Path, spec: str, timeout: float = 60, config: Config | None = None,
         params: dict | None = None, **limits: int):
    p = plan(TrialSpec(WorkloadSpec(spec, params or {}), config or Config(micro_batch_size=4),
                       device="cpu", measure=MeasureSettings.from_dict(FAST), **limits),
             workdir=tmp_path, timeout_s=timeout)
    return execute(p)


def test_mlp_trial_reports_a_valid_result(tmp_path: Path) -> None:
    events: list[dict] = []
    p = plan(TrialSpec(WorkloadSpec("mlp", {}), Config(micro_batch_size=32), device="cpu",
                       measure=MeasureSettings.from_dict(FAST), sentinel=("fp32", "bf16")),
             workdir=tmp_path, timeout_s=60)
    raw = execute(p, on_event=events.append)
    assert raw.returncode == 0 and check_result(raw.result) == []
    m = classify(raw)
    assert m.ok and m.samples_per_sec and m.samples_per_sec > 0
    # The sentinel read the machine before the warm-up: each precision asked, and the copy.
    assert {"matmul_fp32_gflops", "matmul_bf16_gflops", "copy_gbs"} <= set(m.sentinel)
    assert m.sentinel["world_size"] == 1 and m.sentinel["threads"] >= 1
    assert len(m.windows) >= 3 and m.warmup["steps"] >= 2
    assert m.peak_memory_bytes > 50 * 2**20  # a torch process: tens of MiB at least
    assert {"built", "warmup_step", "window"} <= {e["event"] for e in events}


def test_a_hanging_trial_is_killed_at_its_timeout_with_no_child_left(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    p = plan(TrialSpec(WorkloadSpec("autotune.testing.workloads:hang", {}), Config(), device="cpu",
                       measure=MeasureSettings.from_dict(FAST)),
             workdir=tmp_path, timeout_s=6,
             extra_env={"AUTOTUNE_TEST_CHILD_PID_FILE": str(pid_file)})
    start = time.monotonic()
    raw = execute(p)
    assert 6 <= time.monotonic() - start < 15
    m = classify(raw)
    assert m.status == "timeout" and "killed at the 6s trial timeout" in (m.reason or "")
    child = int(pid_file.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"
    leftovers = [q for q in psutil.process_iter(["cmdline"])
                 if str(p.spec_path) in " ".join(q.info["cmdline"] or [])]
    assert leftovers == []


def test_a_crash_is_an_error_with_its_reason(tmp_path: Path) -> None:
    m = classify(_run(tmp_path, "autotune.testing.workloads:crash"))
    assert m.status == "error"
    assert m.reason == "ValueError: this workload always fails in its training step"
    assert "Traceback" in m.stderr_tail


def test_a_segfault_is_an_error_naming_the_signal(tmp_path: Path) -> None:
    raw = _run(tmp_path, "autotune.testing.workloads:crash", params={"how": "segfault"})
    m = classify(raw)
    assert m.status == "error" and "SIGSEGV" in (m.reason or "")


def test_exceeding_an_address_space_limit_is_a_real_oom(tmp_path: Path) -> None:
    # 2 GiB per sample x 4 samples cannot fit in a 6 GiB address space: the allocator fails.
    raw = _run(tmp_path, "autotune.testing.workloads:memhog", params={"mib_per_sample": 2048},
               address_space_bytes=6 * 2**30)
    m = classify(raw)
    assert m.status == "oom", (m.reason, raw.stderr_tail[-500:])
    assert "can't allocate memory" in (m.reason or "")


def test_passing_the_memory_limit_ends_the_trial_as_oom(tmp_path: Path) -> None:
    raw = _run(tmp_path, "autotune.testing.workloads:memhog", params={"mib_per_sample": 256},
               memory_limit_bytes=600 * 2**20)  # 4 x 256 MiB = 1 GiB held
    m = classify(raw)
    assert raw.killed_for_memory and m.status == "oom"
    assert m.peak_memory_bytes > 600 * 2**20


def test_the_trial_dies_with_the_tuner(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG and the trial's parent watch: a killed tuner leaves no trial running."""
    pid_file = tmp_path / "child.pid"
    code = (
        "import sys; from pathlib import Path; from autotune.config.knobs import Config;"
        "from autotune.trial.launch import plan, execute;"
        "from autotune.trial.spec import TrialSpec; from autotune.workloads import WorkloadSpec;"
        "p = plan(TrialSpec(WorkloadSpec('autotune.testing.workloads:hang', {}), Config()),"
        f" workdir=Path({str(tmp_path)!r}), timeout_s=120,"
        f" extra_env={{'AUTOTUNE_TEST_CHILD_PID_FILE': {str(pid_file)!r}}}); execute(p)"
    )

    tuner = subprocess.Popen([sys.executable, "-c", code],
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text().strip()) \
            and time.monotonic() < deadline:  # written, not only created
        time.sleep(0.1)
    assert pid_file.read_text().strip()
    trial = psutil.Process(tuner.pid).children()
    assert trial
    tuner.kill()
    tuner.wait()
    gone, alive = psutil.wait_procs(trial, timeout=10)
    assert not alive
    child = int(pid_file.read_text())
    # The grandchild goes with the trial's process group (SIGTERM handler or parent watch).
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != "zombie" \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


def test_a_too_slow_config_ends_early_with_a_rough_rate(tmp_path: Path) -> None:
    # Each micro-batch sleeps 1 s; with accumulation 4 a step takes ~4 s, and warm-up plus one
    # window cannot fit a 1 s measuring budget: the trial says so after its second micro-batch
    # (the first carries start-up costs) instead of running its steps to the hard timeout.
    p = plan(TrialSpec(WorkloadSpec("autotune.testing.workloads:slow", {"step_s": 1.0}),
                       Config(micro_batch_size=4, grad_accum_steps=4), device="cpu",
                       measure=MeasureSettings(max_seconds=1, min_window_s=0.05)),
             workdir=tmp_path, timeout_s=60)
    events: list[dict] = []
    m = classify(execute(p, on_event=events.append))
    # It ended inside its first optimizer step: not one warm-up step was completed.
    assert [e["event"] for e in events] == ["built"]
    assert m.status == "timeout" and "one optimizer step takes ~" in (m.reason or "")
    # Its rough rate comes from the micro-steps it ran; each sleeps 1 s, so a step of 4 takes at
    # least 4 s: never faster than 16 samples / 4 s.
    assert m.rough_samples_per_sec is not None and 0 < m.rough_samples_per_sec <= 16 / 4 * 1.02


def test_a_config_that_cannot_be_measured_before_its_timeout_stops_itself(
        tmp_path: Path) -> None:
    # 3 s steps, a long measuring budget, a 16 s trial timeout: whatever its start-up took
    # (1 to 13 s), after its first or second step the rest of warm-up and a window would end
    # past the timeout. The trial says so and ends, rather than being killed with nothing.
    p = plan(TrialSpec(WorkloadSpec("autotune.testing.workloads:slow", {"step_s": 3.0}),
                       Config(micro_batch_size=4), device="cpu",
                       measure=MeasureSettings(max_seconds=60, min_window_s=0.05)),
             workdir=tmp_path, timeout_s=16)
    raw = execute(p)
    assert not raw.timed_out and raw.wall_s < 16
    assert json.loads(Path(p.spec_path).read_text())["ends_by"] > time.time() - raw.wall_s
    m = classify(raw)
    assert m.status == "timeout" and "would not end before the trial timeout" in (m.reason or "")
    # Read as the timeout would have ended it: where the run's --timeout set that timeout,
    # the tuner takes it for no verdict on the config (``tuner.trial_steps``,
    # ``tuner.confirm_rounds``).
    assert m.ended_by == TRIAL_TIMEOUT
    assert m.rough_samples_per_sec is not None and 0 < m.rough_samples_per_sec <= 4 / 3 * 1.02


def test_knobs_reach_the_trial(tmp_path: Path) -> None:
    """Accumulation, workers and prefetch are applied in the trial process, not only recorded."""
    config = Config(micro_batch_size=16, grad_accum_steps=3, amp="bf16", num_workers=2,
                    prefetch_factor=4)
    # No spread target: the trial times windows until its budget, so it is still running when
    # its first window's event reaches the callback, however busy the machine.
    p = plan(TrialSpec(WorkloadSpec("mlp", {}), config, device="cpu",
                       measure=MeasureSettings(min_window_s=0.2, max_seconds=5, target_cv=0.0)),
             workdir=tmp_path, timeout_s=60)
    workers: list[int] = []

    def count_workers(event: dict) -> None:
        if event["event"] != "window" or workers:
            return
        for proc in psutil.process_iter(["cmdline"]):
            if p.spec_path in " ".join(proc.info["cmdline"] or []):
                with contextlib.suppress(psutil.Error):  # a process just ending: not the trial
                    workers.append(len(proc.children()))

    raw = execute(p, on_event=count_workers)
    m = classify(raw)
    assert m.ok, raw.stderr_tail[-1000:]
    assert all(w["samples"] == w["steps"] * 16 * 3 for w in m.windows)
    assert workers and workers[0] >= 2  # the loader's worker processes
    assert raw.result is not None and raw.result["steps_per_window"] >= 1


def test_a_tool_past_its_timeout_leaves_no_rank_behind(tmp_path: Path) -> None:
    """The probe's measurements run through `run_tool`; one that hangs under torchrun is ended
    with its ranks, which run in sessions of their own."""
    from autotune.trial.launch import run_tool

    out = tmp_path / "out.json"
    start = time.monotonic()
    doc, why = run_tool(["autotune.testing.tool", "hang"], out, timeout_s=8, nproc=2)
    assert doc is None and why == "killed at its 8s timeout"
    assert time.monotonic() - start < 40
    assert _carrying_token_of(out) == []


def _carrying_token_of(result: Path) -> list[int]:
    """Live processes whose trial token names ``result`` (whatever its random part)."""
    from autotune.trial.processes import TRIAL_TOKEN

    prefix = f"{TRIAL_TOKEN}={result.resolve()}#".encode()
    found = []
    for q in psutil.process_iter(["pid", "status"]):
        if q.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{q.pid}/environ", "rb") as f:
                if any(v.startswith(prefix) for v in f.read().split(b"\0")):
                    found.append(q.pid)
    return found


def test_two_tuners_with_the_same_trial_folders_never_reap_each_others_trials(
        tmp_path: Path) -> None:
    """Two studies of the same name in two directories have the same relative trial folders
    (studies/<name>/trials/0000): ending one trial must leave the other's processes alone."""
    from autotune.trial.processes import TRIAL_TOKEN, new_token, reap

    # The worst case: both trials' result files at the same path (one of the two tuners runs
    # in a directory the other one reused). Only the token's random part tells them apart.
    relative = "studies/s/trials/0000/result.json"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             cwd=tmp_path, start_new_session=True,
                             env={**os.environ, TRIAL_TOKEN: new_token(relative)})
    try:
        token = new_token(relative)
        assert token.startswith(os.path.abspath(relative) + "#")
        ended = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 cwd=tmp_path, start_new_session=True,
                                 env={**os.environ, TRIAL_TOKEN: token})
        assert reap(token, ended.pid) == []
        assert ended.wait(timeout=10) == -9
        assert other.poll() is None  # the other tuner's trial runs on
    finally:
        other.kill()
        other.wait()


def test_a_trial_beside_another_is_never_taken_for_its_orphan() -> None:
    """Two trials side by side (a cluster engine's slots, in threads): the second's root, a new
    child of the tuner forked while the first's tree is looked at, and a tool the tuner runs
    (squeue, in its own group) are not the first trial's orphans: ending the first trial leaves
    both alone. Before, a look between the fork and the note SIGKILLed the second trial."""
    from autotune.trial import processes

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    first = subprocess.Popen(sleep, start_new_session=True)
    processes.started(first.pid)
    tree = processes.Tree(first.pid)
    procs = [first, subprocess.Popen(sleep)]  # the second: a tool, in the tuner's own group
    looked = threading.Thread(target=tree.look)
    try:
        with processes.launching():
            procs.append(subprocess.Popen(sleep, start_new_session=True))
            looked.start()
            looked.join(0.5)
            assert looked.is_alive()  # the look waits until the new root is noted
            processes.started(procs[2].pid)
        looked.join(10)
        tree.look()
        assert tree.kill() == []  # the first trial left nothing, and the others are not its
        assert all(proc.poll() is None for proc in procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            processes.finished(proc.pid)


def test_the_tuner_looks_at_a_trial_at_the_pace_of_its_steps() -> None:
    from autotune.trial.launch import MAX_POLL_S, _Pace

    pace = _Pace(0.25)
    assert pace.interval == 0.25  # nothing reported yet: build and the first step
    pace.note({"event": "built", "seconds": 30.0})  # not a step: no pace
    assert pace.interval == 0.25
    pace.note({"event": "warmup_step", "seconds": 2.0})
    assert pace.interval == 0.5  # a quarter of a step
    pace.note({"event": "window", "seconds": 12.0})
    assert pace.interval == MAX_POLL_S  # never later than this for the timeout and the limit
    pace.note({"event": "window", "seconds": 0.1})
    assert pace.interval == 0.25  # short windows: the floor, pruning reacts within one
    for bad in (float("nan"), "5", None, float("inf")):  # a script may write the progress file
        pace.note({"event": "window", "seconds": bad})
        assert pace.interval == 0.25
