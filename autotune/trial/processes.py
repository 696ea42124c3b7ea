"""Finding and ending every process of a trial. torchrun starts each rank in a session of its
own, so a trial's processes are found by a token in their environment (which every descendant
inherits, loader workers included) as well as by the trial's process group."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator

import psutil

TRIAL_TOKEN = "AUTOTUNE_TRIAL"


def new_token(result_path: str | os.PathLike[str]) -> str:
    """A token no other trial on this machine carries: the result file's absolute path and a
    random part. Two tuners in different directories with the same relative trial folders (the
    same study name) must never find, and kill, each other's processes."""
    return f"{os.path.abspath(result_path)}#{secrets.token_hex(8)}"


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def trial_processes(token: str | None, pgid: int) -> list[int]:
    """Live processes of a trial: those whose environment carries the trial's token (ranks in
    sessions of their own, their loader workers, anything they started), and those in the
    trial's process group. Zombies do not count: they hold no device and no memory."""
    found = []
    needle = f"{TRIAL_TOKEN}={token}".encode() if token else None
    for q in psutil.process_iter(["pid", "status"]):
        if q.info["status"] == psutil.STATUS_ZOMBIE or q.pid == os.getpid():
            continue
        if _pgid(q.pid) == pgid or (needle is not None and _environ_has(q.pid, needle)):
            found.append(q.pid)
    return found


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


def reap(token: str | None, pgid: int, wait_s: float = 30.0) -> list[int]:
    """Kill every process of the trial until none is left; returns any that outlived
    ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = trial_processes(token, pgid)
        if not alive or time.monotonic() > deadline:
            return alive
        kill_group(pgid)
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans(on: bool = True) -> bool:
    """While on, Linux re-parents this process's orphaned descendants to it instead of to init
    (PR_SET_CHILD_SUBREAPER): a trial's process whose parent exits before the tree was looked
    at stays findable, as a child of this process. Whether the call took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# The trial roots this process started and has not yet waited for: with trials side by side (a
# cluster engine's slots, in threads) another trial's root is a new child here too, and must not
# be taken for this trial's adopted orphan. The lock is held from a root's fork to its note
# (``launching``), so no look falls between the two.
_ROOTS: set[int] = set()
_ROOTS_LOCK = threading.RLock()


@contextlib.contextmanager
def launching() -> Iterator[None]:
    """Hold while a trial's root is started and noted (``started``): a look at another trial's
    tree in between would take the new child for an orphan of that trial, and kill it at that
    trial's end (a trial beside it ended by SIGKILL, read as the OOM killer's)."""
    with _ROOTS_LOCK:
        yield


def started(pid: int) -> None:
    """Note a trial's root process, started by this process."""
    with _ROOTS_LOCK:
        _ROOTS.add(pid)


def finished(pid: int) -> None:
    with _ROOTS_LOCK:
        _ROOTS.discard(pid)


# Whether this kernel keeps per-thread children lists (CONFIG_PROC_CHILDREN; Linux 3.5+).
_CHILDREN_LISTS = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def children_of(pid: int) -> list[int]:
    """The children of ``pid`` now, from the kernel's per-thread lists
    (``/proc/PID/task/TID/children``): a read of that process alone, where psutil's
    ``children()`` reads every process on the machine (~3 ms a look here, four looks a second
    beside a trial that wants both cores). psutil where the kernel keeps no such list."""
    if not _CHILDREN_LISTS:
        return _psutil_children(pid)
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError), \
                open(f"/proc/{pid}/task/{tid}/children") as f:  # a thread may end meanwhile
            found.extend(int(x) for x in f.read().split())
    return found


def _psutil_children(pid: int) -> list[int]:
    with contextlib.suppress(psutil.Error):
        return [q.pid for q in psutil.Process(pid).children()]
    return []


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now, by parent links, walking its tree alone."""
    out: list[int] = []
    todo = children_of(pid)
    while todo:
        child = todo.pop()
        if child not in out:
            out.append(child)
            todo.extend(children_of(child))
    return out


def _start_time(pid: int) -> float | None:
    with contextlib.suppress(psutil.Error):
        return float(psutil.Process(pid).create_time())
    return None


def _children() -> dict[int, float]:
    """This process's children now (pid -> start time) that may be a trial's: not another
    trial's root, and not in this process's own group (a tool it ran, ``squeue`` say: a
    trial's processes live in sessions of their own and can never join it)."""
    out = {}
    with _ROOTS_LOCK:
        roots = set(_ROOTS)
        pids = children_of(os.getpid())
    group = os.getpgrp()
    for pid in pids:
        if pid not in roots and _pgid(pid) not in (group, None) \
                and (started := _start_time(pid)) is not None:
            out[pid] = started
    return out


class Tree:
    """Every process seen below a trial's root by parent links (pid -> start time), looked at
    while the trial runs: a grandchild that left the trial's session (setsid) and dropped its
    environment carries neither the group nor the token, and once its parent dies it is
    re-parented away; this finds it still. Where Linux allows, this process adopts the trial's
    orphans, so one whose parent exited between two looks is found too: a new child here that
    this process did not start itself."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, float] = {}
        self.adopting = adopt_orphans()
        self.own = _children()  # started by this process itself (the root among them)
        self.root_start = _start_time(root)

    def processes(self) -> dict[int, float]:
        """The root and every process seen below it (pid -> start time)."""
        root = {self.root: self.root_start} if self.root_start is not None else {}
        return {**root, **self.seen}

    def look(self) -> None:
        roots = [self.root]
        if self.adopting:
            roots += [pid for pid, started in _children().items()
                      if self.own.get(pid) != started]
        for root in roots:
            for pid in ([root] if root != self.root else []) + descendants(root):
                if (started := _start_time(pid)) is not None:
                    self.seen[pid] = started

    def alive(self) -> list[psutil.Process]:
        """The seen processes still running (the same process: its start time matches, so a
        reused pid is never taken for it)."""
        out = []
        for pid, started in self.seen.items():
            with contextlib.suppress(psutil.Error):
                q = psutil.Process(pid)
                if q.create_time() == started and q.status() != psutil.STATUS_ZOMBIE:
                    out.append(q)
        return out

    def kill(self) -> list[int]:
        """SIGKILL every seen process still alive; returns those that were. Adopted ones are
        then reaped here, as their parent now, and adopting ends: only a trial's orphans are
        taken in (others, a browser's helpers say, would stay as zombies here)."""
        self.look()
        found = self.alive()
        for q in found:
            with contextlib.suppress(psutil.Error):
                q.kill()
        adopted = [pid for pid, started in _children().items()
                   if pid in self.seen and self.own.get(pid) != started]
        for pid in adopted:
            with contextlib.suppress(ChildProcessError):
                _reap(pid)
        if self.adopting:
            adopt_orphans(False)
        return [q.pid for q in found]


def _reap(pid: int, wait_s: float = 2.0) -> None:
    """Collect the exit of a child of this process, killed just before (a zombie otherwise)."""
    deadline = time.monotonic() + wait_s
    while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
