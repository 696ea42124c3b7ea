"""What lets several tuners share one study and one machine, and one trial span machines.

Workers of a fleet (``autotune run --storage postgresql://...`` on several machines, or several
on one) coordinate only through the study's storage (the study lock is in ``storage.py``) and, on
one machine, through lock files:

- The **device lock** keeps two workers on one machine from measuring on the same devices at the
  same time, which would corrupt both measurements: one ``flock`` per device (the CPU, each GPU by
  its NVML index) in a directory every user of the machine shares, taken in a fixed order.
- The **node protocol** of a trial across machines without a cluster launcher: the tuner
  publishes the trial on the study (``node_trial``), each other node's ``autotune agent`` starts
  its part and says how it ended (``node_report:HOST:PID``), and the tuner reads those reports
  when its trial failed, since the rank that failed may be on another machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import optuna

from autotune.errors import UsageError
from autotune.trial import launch
from autotune.trial.launch import Nodes, TrialPlan
from autotune.trial.measurement import RawResult
from autotune.trial.merge import node_cause
from autotune.tuner import record
from autotune.tuner.record import NODE_TRIAL
from autotune.tuner.storage import open_lock_file

LOCK_POLL_S = 0.2


def lock_dir() -> Path:
    """``$AUTOTUNE_LOCK_DIR``, else ``autotune-locks`` in the system's temporary directory: one
    per machine, shared by every worker on it.

    Only the default directory, and only when this call creates it, is made sticky and
    world-writable (other users' workers lock the same GPUs); a directory that exists is used
    as it is, after a check: a real directory, not a symlink, and, when another user owns it,
    sticky (else that user, or anyone, could swap the lock files)."""
    given = os.environ.get("AUTOTUNE_LOCK_DIR")
    path = Path(given or Path(tempfile.gettempdir()) / "autotune-locks")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o777)
    except FileExistsError:
        _check_lock_dir(path)
    else:
        if not given:
            with contextlib.suppress(OSError):
                path.chmod(0o1777)
    return path


def _check_lock_dir(path: Path) -> None:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UsageError(f"lock directory {path} is a symlink or not a directory: remove it, or "
                         "set AUTOTUNE_LOCK_DIR to a directory of your own")
    if info.st_uid != os.getuid() and not info.st_mode & stat.S_ISVTX:
        raise UsageError(f"lock directory {path} belongs to another user and is not sticky "
                         f"(mode {stat.S_IMODE(info.st_mode):o}): its lock files could be "
                         "swapped; set AUTOTUNE_LOCK_DIR to a directory of your own")


def _open_lock(path: Path) -> int:
    return open_lock_file(path)


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    return ""


class DeviceLock:
    """Exclusive use of a set of devices on this machine, for as long as a trial runs.

    ``names`` are device names (``cpu``, ``gpu0``...). ``hold`` takes every one of them, in sorted
    order so two workers asking for overlapping sets cannot deadlock, and calls ``on_wait`` once
    with the holder's description when it has to wait."""

    def __init__(self, names: list[str], owner: str) -> None:
        self.names = sorted(set(names))
        self.owner = owner

    @contextlib.contextmanager
    def hold(self, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        directory = lock_dir()
        fds: list[int] = []
        try:
            for name in self.names:
                fd = _open_lock(directory / f"{name}.lock")
                fds.append(fd)
                told = False
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if not told and on_wait is not None:
                            holder = _holder(fd) or "another worker"
                            on_wait(f"waiting for {name}, held by {holder}")
                            told = True
                        time.sleep(LOCK_POLL_S)
                os.ftruncate(fd, 0)
                os.pwrite(fd, self.owner.encode(), 0)
            yield
        finally:
            for fd in reversed(fds):
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)


def gpu_blocks(indices: list[int], per_trial: int) -> list[list[int]]:
    """The device sets a worker may run a trial on: consecutive blocks of ``per_trial`` GPUs, so
    that two workers with 4-GPU trials on an 8-GPU machine each take one half."""
    blocks = [indices[i:i + per_trial] for i in range(0, len(indices) - per_trial + 1, per_trial)]
    return blocks or [indices]


def free_block(blocks: list[list[int]]) -> list[int]:
    """The first block none of whose GPUs another worker holds now (a hint: ``hold`` decides);
    the first block when every one is busy."""
    directory = lock_dir()
    for block in blocks:
        busy = False
        for index in block:
            fd = _open_lock(directory / f"gpu{index}.lock")
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                busy = True
            finally:
                os.close(fd)
            if busy:
                break
        if not busy:
            return block
    return blocks[0]


def trial_devices(device: str, visible: list[int],
                  nproc: int) -> tuple[list[str], list[int], dict[str, str]]:
    """What one trial of ``nproc`` ranks on this machine takes: the device lock's names, the
    GPUs' NVML indices and the environment the ranks need. The CPU; on GPUs the ones the user
    made visible (CUDA_VISIBLE_DEVICES set), else a free block of ``nproc``, made visible in
    NVML's order (by PCI bus, which CUDA follows only when told)."""
    if device != "cuda":
        return ["cpu"], [], {}
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        indices, env = visible[:nproc], {}
    else:
        indices = free_block(gpu_blocks(visible, nproc))
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, indices)),
               "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    return [f"gpu{i}" for i in indices], indices, env


# -- trials across machines ----------------------------------------------------------------------

# NODE_TRIAL: the study attribute through which other nodes' agents join trials; NODE_REPORT:
# the prefix of the attributes where agents say how their part ended.
NODE_REPORT_WAIT_S = 10.0  # how long a failed trial across machines waits for those reports


def by_agents(nodes: Nodes | None) -> bool:
    """Whether a trial's other nodes are started by ``autotune agent`` (no cluster launcher)."""
    return nodes is not None and nodes.template is None


@contextlib.contextmanager
def published(study: optuna.Study, p: TrialPlan, nodes: Nodes | None) -> Iterator[None]:
    """For a trial across machines without a cluster launcher: publish it on the study while
    it runs, for the other nodes' ``autotune agent`` to start their part (tuner.agent)."""
    if not by_agents(nodes):
        yield
        return
    study.set_user_attr(NODE_TRIAL, {**launch.published(p), "state": "running",
                                     "at": time.time()})
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            study.set_user_attr(NODE_TRIAL, {"id": p.rdzv_id, "state": "done", "at": time.time()})


def with_other_nodes(study: optuna.Study, p: TrialPlan, raw: RawResult,
                     nodes: Nodes | None) -> RawResult:
    """A failed trial across machines started by agents, with its cause found on whichever
    node it happened: this node's ranks often only see a peer close the connection, while the
    rank that failed wrote its report on another machine. Its agent publishes that on the study
    (tuner.agent); this waits up to NODE_REPORT_WAIT_S for every agent's word."""
    local = raw.result
    failed = local is None or "failed_at" in local
    if nodes is None or not by_agents(nodes) or not failed or raw.interrupted or raw.stopped \
            or raw.timed_out or raw.killed_for_memory:
        return raw
    deadline = time.monotonic() + NODE_REPORT_WAIT_S
    while True:
        reports = [v for v in record.node_reports(study)  # read anew from the storage
                   if isinstance(v, dict) and v.get("id") == p.rdzv_id]
        if len(reports) >= nodes.count - 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    cause = node_cause(local, [{**r["failure"], "host": r.get("host")} for r in reports
                               if isinstance(r.get("failure"), dict)])
    return raw if cause is local else replace(raw, result=cause)


def close_nodes(study: optuna.Study, nodes: Nodes | None) -> None:
    """Tell the other nodes' agents that this run has ended."""
    if by_agents(nodes):
        with contextlib.suppress(Exception):
            study.set_user_attr(NODE_TRIAL, {"id": None, "state": "closed", "at": time.time()})
