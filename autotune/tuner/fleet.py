"""What lets several tuners share one study and one machine.

Workers of a fleet (``autotune run --storage postgresql://...`` on several machines, or several
on one) coordinate only through the study's storage (the study lock is in ``storage.py``) and, on
one machine, through the **device lock**: it keeps two workers on one machine from measuring on
the same devices at the same time, which would corrupt both measurements: one ``flock`` per
device (the CPU, each GPU by its NVML index) in a directory every user of the machine shares,
taken in a fixed order. The storage is the record of the study, never a way to start processes:
trials across machines run on a cluster engine (``trial.executors``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from autotune.errors import UsageError
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
