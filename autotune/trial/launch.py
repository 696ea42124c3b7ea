"""Starting trial processes: ``plan`` builds the launch as data (``trial.plans``), ``execute`` is
the only subprocess.

``execute`` starts the trial in its own session, enforces the hard timeout and the memory limit,
samples the tree's memory, tails the progress file, and always leaves no process behind: torchrun
starts each rank in a session of its own, so the trial's processes are found by a token in their
environment, which every descendant inherits, not by their process group.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from autotune import bootstrap
from autotune.bootstrap import TRIAL
from autotune.paths import import_root
from autotune.trial import executors, processes
from autotune.trial.command import clear
from autotune.trial.driver import StepDriver
from autotune.trial.executors.relay import Relay
from autotune.trial.measurement import RawResult
from autotune.trial.memory import TreeMemory
from autotune.trial.merge import first_failure
from autotune.trial.output import CappedLog
from autotune.trial.plans import Nodes, TrialPlan, plan, plan_command
from autotune.trial.processes import TRIAL_TOKEN, Tree, kill_group, new_token, reap
from autotune.trial.progress import (
    OnEvent,
    ProgressEvent,
    Tail,
    measured_span,
    read_events,
    read_windows,
)
from autotune.trial.result import RESULT_SCHEMA, TrialResultDoc
from autotune.trial.spec import TrialSpec
from autotune.trial.untrusted import Refused, load_file

# What the tuner calls here: the plan (``trial.plans``), its execution, the probe's tools.
__all__ = ["Monitor", "Nodes", "RawResult", "TrialPlan", "execute", "measured_span", "plan",
           "plan_command", "run_tool"]

STDERR_TAIL_BYTES = 8000
# The most of a trial's result document (or a tool's) that is read: a window takes ~150 bytes.
MAX_RESULT = 4 * 1024 * 1024
# How long an engine's client (srun) may take to end once its trial was ended through the engine.
ENGINE_END_WAIT_S = 20.0


class Monitor(Protocol):
    """What watches the devices while a trial runs (``machine.monitor.GpuMonitor``). Its samples
    and their summary are the machine room's documents: here they are only passed on (to
    ``RawResult.gpu``), never read."""

    def start(self) -> object: ...
    def stop(self) -> Sequence[Mapping[str, object]]: ...
    def summary(self, span: tuple[float, float] | None) -> Mapping[str, object]: ...


@dataclass
class _Watch:
    """How a running trial is followed, and why it was ended when it did not end itself."""

    events: Tail  # the progress events, forwarded as they come
    timed_out: bool = False
    killed_for_memory: bool = False
    interrupted: bool = False
    stopped: str | None = None


def poll_interval(window_s: float) -> float:
    """How often the tuner looks at a trial whose windows last ``window_s``: half a window, so
    pruning reacts within one, and at most four times a second (each look takes a core from a
    trial that wants them all: ``benchmarks/observer.py``). Once the trial reports its steps,
    ``_Pace`` slows the looks down to their pace."""
    return max(0.02, min(0.25, window_s / 2))


# The longest the tuner waits between looks at a running trial: how late a timeout or a memory
# limit may be enforced once steps are long.
MAX_POLL_S = 1.0


@dataclass
class _Pace:
    """How long the tuner waits between looks at a trial: ``floor`` (``poll_interval``) until
    the trial reports a warm-up step or a window, then a quarter of the latest one's seconds,
    between ``floor`` and ``MAX_POLL_S``: nothing it decides on (pruning after a window, the
    timeout, memory that settled with warm-up) changes faster. Each look wakes the tuner on a
    machine whose cores the trial's threads all use, and a preempted thread stalls its peers at
    the next barrier: watched four times a second, a BERT trial of 5 s steps on 2 cores read
    3-5% below the same process with no one watching (``benchmarks/observer.py``)."""

    floor: float
    interval: float = 0.0

    def __post_init__(self) -> None:
        self.interval = self.floor

    def note(self, event: ProgressEvent) -> None:
        seconds = event.get("seconds")
        if event.get("event") in ("warmup_step", "window") and isinstance(seconds, int | float) \
                and math.isfinite(seconds):
            self.interval = min(MAX_POLL_S, max(self.floor, seconds / 4))


def execute(p: TrialPlan, on_event: OnEvent | None = None,
            poll_s: float = 0.25, should_stop: Callable[[], str | None] | None = None,
            monitor: Monitor | None = None,
            interrupt: threading.Event | None = None) -> RawResult:
    """Run a planned trial to its end, its timeout or its memory limit; returns what was seen.

    ``should_stop`` is asked after the trial's progress events are forwarded; a reason it returns
    ends the trial (pruning) and comes back as ``stopped``. KeyboardInterrupt kills the trial's
    process group and comes back as ``interrupted``, as does ``interrupt`` being set (how a
    run with trials side by side, in threads, passes Ctrl-C on). A ``monitor`` samples the GPUs
    while the trial runs; its summary over the timed windows comes back as ``gpu``.
    """
    env = _prepare(p)
    start = time.monotonic()
    watch = _Watch(Tail(p.progress_path))
    if monitor is not None:
        monitor.start()
    proc, output, relay = _start(p, env)
    # On GPUs the trial reports its device memory; the host's is not what the limit is about.
    # An engine's trial runs on its nodes: the engine bounds their memory.
    memory = TreeMemory(proc.pid, p.memory_limit_bytes) \
        if p.device == "cpu" and p.engine is None else None
    tree = Tree(proc.pid)
    driver = _driver(p)
    try:
        _follow(p, proc, start, memory, watch, on_event, should_stop, poll_s, tree, driver,
                interrupt)
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
        survivors, samples, data = _end(p, proc, tree, output, relay, monitor)
    if on_event is not None:
        watch.events.forward(on_event)
    folder = Path(p.spec_path).parent
    if p.script is not None:  # what the script's Trainer saved: not the user's, not needed
        shutil.rmtree(folder / bootstrap.TRAINER_OUTPUT, ignore_errors=True)
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
        gpu=dict(monitor.summary(measured_span(read_events(p.progress_path))))
        if monitor is not None and samples else {},
    )


def _end(p: TrialPlan, proc: subprocess.Popen[bytes], tree: Tree, output: CappedLog,
         relay: Relay | None, monitor: Monitor | None
         ) -> tuple[list[int], Sequence[Mapping[str, object]], bytes]:
    """End every process of the trial, whatever ended it; returns the processes that survived
    SIGKILL, the monitor's samples and the trial's output (its tail)."""
    tree.look()  # before the kill: parent links are lost once the leader dies
    if p.engine is not None:
        _end_engine(p, proc)
    kill_group(proc.pid)  # the trial's own group: its loader workers, torchrun's agent
    # Reap before wait(): until then the leader's pid (the group id) cannot be reused
    # by an unrelated process that the group match would then kill.
    survivors = reap(p.env.get(TRIAL_TOKEN), proc.pid)
    # What left the group and dropped the token (setsid, a cleared environment).
    tree.kill()
    proc.wait()
    processes.finished(proc.pid)
    samples = monitor.stop() if monitor is not None else []
    data = output.close()
    if relay is not None:
        relay.close()
        if relay.refused:
            data += (f"\nautotune: {relay.refused} line(s) the trial's nodes sent back were "
                     "not well-formed records and were left out\n").encode()
    return survivors, samples, data


def _start(p: TrialPlan, env: dict[str, str]
           ) -> tuple[subprocess.Popen[bytes], CappedLog, Relay | None]:
    """The trial's process, in a session of its own, its output (stdout and stderr together)
    going to its log through a ``CappedLog``: kept in memory as well as in the file (the trial's
    folder may be deleted under it), and within a size. An engine's client keeps its stdout
    for what the trial's nodes send back (``Relay``)."""
    output = CappedLog(p.stderr_path)
    try:
        with processes.launching():
            proc = subprocess.Popen(p.argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE if p.engine else output.fd,
                                    stderr=output.fd, start_new_session=True)
            processes.started(proc.pid)
    except BaseException:
        output.started()
        output.close()
        raise
    output.started()  # the trial holds the write end now
    relay = Relay(proc.stdout, p.result_path, p.progress_path) \
        if p.engine and proc.stdout is not None else None
    return proc, output, relay


def _end_engine(p: TrialPlan, proc: subprocess.Popen[bytes]) -> None:
    """End an engine's trial through the engine (``executors.end``: a Slurm step is
    cancelled), and its client with SIGTERM, which it passes on to the trial's nodes; wait for
    the client to see its nodes' parts end before anything is killed here."""
    if proc.poll() is not None:
        return
    executors.end(p)
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(ENGINE_END_WAIT_S)


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
    # When the timeout will end it, on the wall clock every rank shares: a trial that cannot
    # measure by then stops itself (``protocol.ends_too_late``).
    Path(p.spec_path).write_text(json.dumps({**p.spec, "ends_by": time.time() + p.timeout_s}))
    for path in (p.result_path, p.progress_path, *_rank_files(p.result_path)):
        Path(path).unlink(missing_ok=True)
    env = {**os.environ, **p.env, "AUTOTUNE_TUNER_PID": str(os.getpid()),
           # A rank on another node (a cluster launcher passes the environment on) must not
           # look for this pid there.
           "AUTOTUNE_TUNER_HOST": socket.gethostname()}
    # The trial imports autotune from wherever the tuner did (source checkout or installed);
    # a script's trial gets the bootstrap first (``autotune.bootstrap``).
    env["PYTHONPATH"] = _with_package(env.get("PYTHONPATH"))
    if p.script is not None:
        env.update(bootstrap.environment(TRIAL, env))
    return env


def _follow(p: TrialPlan, proc: subprocess.Popen[bytes], start: float,
            memory: TreeMemory | None, watch: _Watch,
            on_event: OnEvent | None,
            should_stop: Callable[[], str | None] | None, poll_s: float,
            tree: Tree | None = None, driver: StepDriver | None = None,
            interrupt: threading.Event | None = None) -> None:
    """Until the trial ends: enforce the timeout and the memory limit, forward its progress
    events, note its process tree (at most four times a second, at the trial's ``_Pace``), and
    end it when ``should_stop`` gives a reason, or, for a script, when its ``driver`` is done
    with it."""
    next_sample = next_look = 0.0
    pace = _Pace(poll_s)

    def seen(event: ProgressEvent) -> None:
        pace.note(event)
        if on_event is not None:
            on_event(event)

    while proc.poll() is None:
        if interrupt is not None and interrupt.is_set():
            raise KeyboardInterrupt
        now = time.monotonic()
        if tree is not None and now >= next_look:
            next_look = now + 0.25
            tree.look()
            if driver is not None:
                driver.look(tree.processes())
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
        watch.events.forward(seen)
        if should_stop is not None:
            watch.stopped = should_stop()
            if watch.stopped:
                return
        # Woken by the trial's end, else after the pace's interval: every wake-up takes a core
        # from a trial that wants them all (benchmarks/observer.py measures what that costs).
        # A script's driver decides when its steps stop from what it reads: it keeps poll_s.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(pace.interval if driver is None else poll_s)


def _result(p: TrialPlan) -> TrialResultDoc | None:
    """The trial's result document, or, when there is none, the first failure a rank reported
    on its own (its report sits next to where the result would be). The trial's process wrote
    them (a user's workload runs there): read within a size and a depth, and a result that is
    not a document ends the trial as an error saying so."""
    try:
        doc = load_file(p.result_path, max_bytes=MAX_RESULT)
    except FileNotFoundError:
        doc = None
    except (OSError, Refused) as exc:
        return _unreadable(f"is {exc}" if isinstance(exc, Refused) else f"cannot be read ({exc})")
    if doc is not None:
        # Checked further by classify (``check_result``): a document, not yet a valid one.
        return cast(TrialResultDoc, doc) if isinstance(doc, dict) else \
            _unreadable("is not a JSON object")
    docs: list[TrialResultDoc] = []
    for path in _rank_files(p.result_path):
        with contextlib.suppress(OSError, Refused):
            if isinstance(rank := load_file(path, max_bytes=MAX_RESULT), dict):
                docs.append(cast(TrialResultDoc, rank))
    return first_failure(docs)


def _unreadable(why: str) -> TrialResultDoc:
    return {"schema": RESULT_SCHEMA, "status": "error",
            "reason": f"the trial's result file {why}: not a result autotune's trial writes"}


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
    with contextlib.suppress(OSError, Refused):
        if isinstance(doc := load_file(out_path, max_bytes=MAX_RESULT), dict):
            return doc, ""
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
