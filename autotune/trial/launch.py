"""Starting trial processes: ``plan`` builds the launch as data, ``execute`` is the only subprocess.

``plan`` is pure (tests assert on it without starting anything). A one-rank trial is one process
(``python -m autotune.trial.bench``); a trial of N ranks is torchrun with a standalone rendezvous (a
c10d store on a free port) starting N such processes, nccl on CUDA and gloo on CPU. ``execute``
starts the trial in its own session, enforces the hard timeout and the memory limit, samples the
tree's memory, tails the progress file, and always leaves no process behind: torchrun starts each
rank in a session of its own, so the trial's processes are found by a token in their environment,
which every descendant inherits, not by their process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypedDict

from autotune.config.knobs import env_for
from autotune.paths import import_root
from autotune.trial.command import Command, clear, command_env
from autotune.trial.driver import StepDriver
from autotune.trial.measurement import RawResult
from autotune.trial.memory import TreeMemory
from autotune.trial.merge import first_failure
from autotune.trial.output import CappedLog
from autotune.trial.processes import TRIAL_TOKEN, Tree, kill_group, new_token, reap
from autotune.trial.progress import forward, measured_span, read_events, read_windows
from autotune.trial.result import TrialResultDoc
from autotune.trial.spec import TrialSpec

STDERR_TAIL_BYTES = 8000
# Which node's ranks write the result and progress files in a trial across machines: "1" on the
# tuner's node, "0" on the others (started by `autotune agent`); unset, global rank 0 does.
REPORTING_NODE = "AUTOTUNE_REPORTING_NODE"


class Monitor(Protocol):
    """What watches the devices while a trial runs (``machine.monitor.GpuMonitor``)."""

    def start(self) -> object: ...
    def stop(self) -> list[dict[str, Any]]: ...
    def summary(self, span: tuple[float, float] | None) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Nodes:
    """A trial across machines: ``count`` nodes meet at the c10d rendezvous ``endpoint``.

    Without a ``template`` the tuner starts its own node's torchrun agent and the other nodes'
    agents are started by ``autotune agent`` processes there, which read the trial from the
    study. With one, the template (a cluster launcher such as ``srun ... {cmd}``) starts the
    torchrun agent on every node; the trial's files must then be on a file system all nodes
    share, since global rank 0 writes the result wherever it runs."""

    count: int
    endpoint: str
    template: str | None = None


@dataclass(frozen=True)
class TrialPlan:
    argv: tuple[str, ...]
    env: dict[str, str]  # set on top of the tuner's environment
    timeout_s: float
    spec: dict[str, Any]  # TrialSpec.to_json(), written to spec_path before the start
    spec_path: str
    result_path: str
    progress_path: str
    stderr_path: str
    memory_limit_bytes: int | None = None  # enforced by the launcher on CPU (tree memory)
    address_space_bytes: int | None = None  # RLIMIT_AS for the trial process, if set
    device: str = "cpu"
    torchrun: tuple[str, ...] = ()  # torchrun's flags, for a multi-rank trial
    rdzv_id: str | None = None  # the rendezvous of a trial across machines
    script: str | None = None  # the user's script a command trial runs (``trial.command``)
    profile: str | None = None  # the candidate profile's YAML, for a command trial to load


class Published(TypedDict):
    """What another node's agent reads of a trial across machines (``published``)."""

    id: str | None
    spec: dict[str, Any]  # TrialSpec.to_json()
    torchrun: list[str]
    env: dict[str, str]
    timeout_s: float
    memory_limit_bytes: int | None
    device: str


def _files(workdir: Path) -> dict[str, str]:
    """Where a trial's spec, result, progress events and output go."""
    return {k: str(workdir / f"{k}.{ext}") for k, ext in
            (("spec", "json"), ("result", "json"), ("progress", "jsonl"), ("stderr", "log"))}


def plan(spec: TrialSpec, *, workdir: Path, timeout_s: float, python: str = sys.executable,
         extra_env: Mapping[str, str] | None = None, nodes: Nodes | None = None,
         rdzv_id: str | None = None) -> TrialPlan:
    """The trial launch as data: argv, environment and files. Starts nothing.

    ``spec.config.world_size`` > 1 starts that many ranks through torchrun on this machine, or,
    with ``nodes``, ``world_size / nodes.count`` on each of the nodes (rendezvous ``rdzv_id``).
    """
    # The trial applies the address-space limit and its tie to the tuner itself, first thing
    # in trial.bench.main: a preexec_fn is unsafe once the tuner has threads (Optuna's heartbeat).
    config, device = spec.config, spec.device
    workdir = Path(os.path.abspath(workdir))  # a trial that changes directory still finds it
    env = {
        # Set before torch is imported in the trial: knob env (NCCL_*) and quiet, honest defaults.
        **env_for(config),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",  # tokenizers' own threads would fight loader workers
        **dict(extra_env or {}),
    }
    files = _files(workdir)
    # Every process of the trial inherits this: how execute finds them all at the end.
    env[TRIAL_TOKEN] = new_token(files["result"])
    bench = ("-m", "autotune.trial.bench", files["spec"], files["result"], files["progress"])
    torchrun: tuple[str, ...] = ()
    if nodes is not None:
        if config.world_size % nodes.count:
            raise ValueError(f"{config.world_size} ranks do not split over {nodes.count} nodes")
        # c10d: the node at the endpoint hosts the store; a fixed node count (min = max)
        # starts the trial as soon as every node has joined. No restarts: a failed rank or a
        # lost node ends the trial.
        torchrun = (f"--nnodes={nodes.count}",
                    f"--nproc-per-node={config.world_size // nodes.count}",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.endpoint}",
                    f"--rdzv-id={rdzv_id or 'autotune'}", "--max-restarts=0")
        if nodes.template is None:
            env[REPORTING_NODE] = "1"
    elif config.world_size == 1:
        # A tuner started inside a distributed job (torchrun, a Kubeflow pod) must not hand its
        # own rank variables to a one-rank trial: it would join that job's process group.
        env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    else:
        # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT for each rank, and
        # OMP_NUM_THREADS=1 unless it is set (as a torchrun training run would get it). No
        # restarts: a failed rank ends the trial, and torchrun stops the other ranks.
        torchrun = ("--standalone", f"--nproc-per-node={config.world_size}", "--max-restarts=0")
    argv: tuple[str, ...] = (python, *(("-m", "torch.distributed.run", *torchrun)
                                       if torchrun else ()), *bench)
    if nodes is not None and nodes.template is not None:
        # The launcher gets the trial's environment; srun passes it on to every node's task.
        argv = ("/bin/sh", "-c", nodes.template.replace("{cmd}", shlex.join(argv)))
    return TrialPlan(argv=argv, env=env, timeout_s=timeout_s, spec=spec.to_json(),
                     spec_path=files["spec"], result_path=files["result"],
                     progress_path=files["progress"], stderr_path=files["stderr"],
                     memory_limit_bytes=spec.memory_limit_bytes if device == "cpu" else None,
                     address_space_bytes=spec.address_space_bytes, device=device,
                     torchrun=torchrun, rdzv_id=rdzv_id if nodes is not None else None)


def plan_command(spec: TrialSpec, command: Command, *, workdir: Path, timeout_s: float,
                 profile: str, extra_env: Mapping[str, str] | None = None) -> TrialPlan:
    """A trial that runs the user's command as typed (its own launcher starts its ranks), with
    ``profile`` (a profile's YAML: the candidate config) written as ``workdir/profile.yaml`` for
    it to load, and ``workdir`` the step protocol's folder. The spec is written beside it for
    the record; the command does not read it."""
    config = spec.config
    # Absolute: a script that changes directory (os.chdir before loading its profile, or after)
    # still finds its profile, its step files and the stop request.
    workdir = Path(os.path.abspath(workdir))
    env = {**env_for(config), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           **command_env(workdir, workdir / "profile.yaml", config.samples_per_rank_step),
           **dict(extra_env or {})}
    files = _files(workdir)
    env[TRIAL_TOKEN] = new_token(files["result"])
    return TrialPlan(argv=command.argv, env=env, timeout_s=timeout_s, spec=spec.to_json(),
                     spec_path=files["spec"], result_path=files["result"],
                     progress_path=files["progress"], stderr_path=files["stderr"],
                     memory_limit_bytes=spec.memory_limit_bytes if spec.device == "cpu" else None,
                     device=spec.device, script=command.name, profile=profile)


def published(p: TrialPlan) -> Published:
    """What another node's ``autotune agent`` needs to start its part of a trial across
    machines: the trial's spec, its environment and torchrun's flags (no paths: the agent
    writes its own files)."""
    local = (TRIAL_TOKEN, REPORTING_NODE, "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    return {"id": p.rdzv_id, "spec": p.spec, "torchrun": list(p.torchrun),
            "env": {k: v for k, v in p.env.items() if k not in local},
            "timeout_s": p.timeout_s, "memory_limit_bytes": p.memory_limit_bytes,
            "device": p.device}


def from_published(doc: Mapping[str, Any], workdir: Path, python: str = sys.executable,
                   extra_env: Mapping[str, str] | None = None) -> TrialPlan:
    """This node's part of a published trial: the same ranks' command, files in ``workdir``,
    and not the reporting node."""
    files = _files(workdir)
    env = {**doc["env"], **dict(extra_env or {}), REPORTING_NODE: "0",
           TRIAL_TOKEN: new_token(files["result"])}
    argv = (python, "-m", "torch.distributed.run", *doc["torchrun"], "-m", "autotune.trial.bench",
            files["spec"], files["result"], files["progress"])
    return TrialPlan(argv=argv, env=env, timeout_s=float(doc["timeout_s"]), spec=doc["spec"],
                     spec_path=files["spec"], result_path=files["result"],
                     progress_path=files["progress"], stderr_path=files["stderr"],
                     memory_limit_bytes=doc.get("memory_limit_bytes"),
                     device=doc.get("device", "cpu"), torchrun=tuple(doc["torchrun"]),
                     rdzv_id=doc["id"])


@dataclass
class _Watch:
    """How a running trial is followed, and why it was ended when it did not end itself."""

    seen: int = 0  # progress events forwarded so far
    timed_out: bool = False
    killed_for_memory: bool = False
    interrupted: bool = False
    stopped: str | None = None


def execute(p: TrialPlan, on_event: Callable[[dict[str, Any]], None] | None = None,
            poll_s: float = 0.1, should_stop: Callable[[], str | None] | None = None,
            monitor: Monitor | None = None) -> RawResult:
    """Run a planned trial to its end, its timeout or its memory limit; returns what was seen.

    ``should_stop`` is asked after the trial's progress events are forwarded; a reason it returns
    ends the trial (pruning) and comes back as ``stopped``. KeyboardInterrupt kills the trial's
    process group and comes back as ``interrupted``. A ``monitor`` samples the GPUs while the
    trial runs; its summary over the timed windows comes back as ``gpu``.
    """
    env = _prepare(p)
    start = time.monotonic()
    watch = _Watch()
    if monitor is not None:
        monitor.start()
    proc, output = _start(p, env)
    # On GPUs the trial reports its device memory; the host's is not what the limit is about.
    memory = TreeMemory(proc.pid, p.memory_limit_bytes) if p.device == "cpu" else None
    tree = Tree(proc.pid)
    driver = _driver(p)
    try:
        _follow(p, proc, start, memory, watch, on_event, should_stop, poll_s, tree, driver)
        if driver is not None and watch.timed_out and driver.stopping:
            # Measured, and stopping when the trial timeout came: the result stands.
            watch.timed_out = False
            driver.note_timeout(p.timeout_s)
        if driver is not None and not (watch.timed_out or watch.stopped
                                       or watch.killed_for_memory):
            driver.at_exit(proc.returncode)
    except KeyboardInterrupt:
        watch.interrupted = True
    finally:
        tree.look()  # before the kill: parent links are lost once the leader dies
        kill_group(proc.pid)  # the trial's own group: its loader workers, torchrun's agent
        # Reap before wait(): until then the leader's pid (the group id) cannot be reused
        # by an unrelated process that the group match would then kill.
        survivors = reap(p.env.get(TRIAL_TOKEN), proc.pid)
        # What left the group and dropped the token (setsid, a cleared environment).
        tree.kill()
        proc.wait()
        samples = monitor.stop() if monitor is not None else []
        data = output.close()
    if on_event is not None:
        forward(p.progress_path, watch.seen, on_event)
    folder = Path(p.spec_path).parent
    if not folder.is_dir():
        data += (f"\nautotune: the trial's folder {folder} was removed while it ran\n").encode()
    if survivors:
        # A process stuck in the kernel (a GPU driver call) ignores SIGKILL for a while: say so,
        # since the next trial would share the device with it.
        data += (f"\nautotune: processes {survivors} of this trial survived SIGKILL\n").encode()
    cut = watch.timed_out or watch.stopped
    return RawResult(
        returncode=proc.returncode, timed_out=watch.timed_out,
        # A script's result is the driver's, never a file in the folder the script can write.
        result=_result(p) if driver is None else driver.result,
        stderr_tail=data[-STDERR_TAIL_BYTES:].decode(errors="replace"),
        wall_s=time.monotonic() - start, tree_peak_bytes=memory.peak if memory else 0,
        killed_for_memory=watch.killed_for_memory, memory_limit_bytes=p.memory_limit_bytes,
        interrupted=watch.interrupted, timeout_s=p.timeout_s,
        partial_windows=read_windows(p.progress_path) if cut else [], stopped=watch.stopped,
        gpu=monitor.summary(measured_span(read_events(p.progress_path)))
        if monitor is not None and samples else {},
    )


def _start(p: TrialPlan, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], CappedLog]:
    """The trial's process, in a session of its own, its output (stdout and stderr together)
    going to its log through a ``CappedLog``: kept in memory as well as in the file (the trial's
    folder may be deleted under it), and within a size."""
    output = CappedLog(p.stderr_path)
    try:
        proc = subprocess.Popen(p.argv, env=env, stdin=subprocess.DEVNULL, stdout=output.fd,
                                stderr=output.fd, start_new_session=True)
    except BaseException:
        output.started()
        output.close()
        raise
    output.started()  # the trial holds the write end now
    return proc, output


def _driver(p: TrialPlan) -> StepDriver | None:
    """The step protocol's tuner side, for a trial of the user's command."""
    if p.script is None:
        return None
    spec = TrialSpec.from_json(p.spec)
    return StepDriver(Path(p.spec_path).parent, spec.config.world_size, spec.measure, p.script,
                      p.progress_path, p.result_path, device=p.device, timeout_s=p.timeout_s,
                      expected_samples=spec.config.samples_per_rank_step)


def _prepare(p: TrialPlan) -> dict[str, str]:
    """Write the spec, clear an earlier run's files; the trial's whole environment."""
    Path(p.spec_path).parent.mkdir(parents=True, exist_ok=True)
    if p.script is not None:
        clear(Path(p.spec_path).parent)
    if p.profile is not None:
        Path(p.spec_path).with_name("profile.yaml").write_text(p.profile)
    Path(p.spec_path).write_text(json.dumps(p.spec))
    for path in (p.result_path, p.progress_path, *_rank_files(p.result_path)):
        Path(path).unlink(missing_ok=True)
    env = {**os.environ, **p.env, "AUTOTUNE_TUNER_PID": str(os.getpid()),
           # A rank on another node (a cluster launcher passes the environment on) must not
           # look for this pid there.
           "AUTOTUNE_TUNER_HOST": socket.gethostname()}
    # The trial imports autotune from wherever the tuner did (source checkout or installed).
    env["PYTHONPATH"] = _with_package(env.get("PYTHONPATH"))
    return env


def _follow(p: TrialPlan, proc: subprocess.Popen[bytes], start: float,
            memory: TreeMemory | None, watch: _Watch,
            on_event: Callable[[dict[str, Any]], None] | None,
            should_stop: Callable[[], str | None] | None, poll_s: float,
            tree: Tree | None = None, driver: StepDriver | None = None) -> None:
    """Until the trial ends: enforce the timeout and the memory limit, forward its progress
    events, note its process tree four times a second, and end it when ``should_stop`` gives
    a reason, or, for a script, when its ``driver`` is done with it."""
    next_sample = next_look = 0.0
    while proc.poll() is None:
        now = time.monotonic()
        if tree is not None and now >= next_look:
            next_look = now + 0.25
            tree.look()
        if now - start > p.timeout_s:
            watch.timed_out = True
            return
        if memory is not None and now >= next_sample:
            next_sample = now + 0.2
            if memory.sample():
                watch.killed_for_memory = True
                return
        if driver is not None:
            driver.poll()
            if driver.action(proc.pid):
                return
        if on_event is not None:
            watch.seen = forward(p.progress_path, watch.seen, on_event)
        if should_stop is not None:
            watch.stopped = should_stop()
            if watch.stopped:
                return
        time.sleep(poll_s)


def _result(p: TrialPlan) -> TrialResultDoc | None:
    """The trial's result document, or, when there is none, the first failure a rank reported
    on its own (its report sits next to where the result would be)."""
    if Path(p.result_path).exists():
        with contextlib.suppress(json.JSONDecodeError, OSError):
            return json.loads(Path(p.result_path).read_text())
    docs = []
    for path in _rank_files(p.result_path):
        with contextlib.suppress(json.JSONDecodeError, OSError):
            docs.append(json.loads(Path(path).read_text()))
    return first_failure(docs)


def run_tool(args: list[str], out_path: Path, timeout_s: float,
             env: Mapping[str, str] | None = None,
             nproc: int = 1) -> tuple[dict[str, Any] | None, str]:
    """``python -m ARGS... OUT`` (through torchrun with ``nproc`` > 1) in a session of its own,
    ended at ``timeout_s`` with every process it started (torchrun's ranks run in sessions of
    their own: found by a token in their environment, as a trial's are): the probe's
    measurements. Returns (the JSON it wrote, "") or (None, why not)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--max-restarts=0"] if nproc > 1 else []
    argv = [sys.executable, *launcher, "-m", *args, str(out_path)]
    token = new_token(out_path)
    full = {**os.environ, **dict(env or {}), TRIAL_TOKEN: token}
    full["PYTHONPATH"] = _with_package(full.get("PYTHONPATH"))
    out_path.unlink(missing_ok=True)
    proc = subprocess.Popen(argv, env=full, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        reap(token, proc.pid)
        proc.communicate()
        return None, f"killed at its {timeout_s:.0f}s timeout"
    finally:
        reap(token, proc.pid)
        proc.wait()
    try:
        return json.loads(out_path.read_text()), ""
    except (OSError, json.JSONDecodeError):
        tail = [ln for ln in output.decode(errors="replace").splitlines() if ln.strip()]
        return None, f"exit code {proc.returncode}: {tail[-1][:300] if tail else 'no output'}"


def _with_package(pythonpath: str | None) -> str:
    """PYTHONPATH for a child process that imports autotune from wherever this process did
    (a source checkout or an installed package)."""
    return os.pathsep.join(x for x in (str(import_root()), pythonpath) if x)


def _rank_files(result_path: str) -> list[str]:
    path = Path(result_path)
    return sorted(str(f) for f in path.parent.glob(path.name + ".rank*")) \
        if path.parent.is_dir() else []
