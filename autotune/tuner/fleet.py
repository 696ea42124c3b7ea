"""What lets several tuners share one study and one machine: the study lock and the device lock.

Workers of a fleet (``autotune run --storage postgresql://...`` on several machines, or several
on one) coordinate only through the study's storage and, on one machine, through lock files:

- The **study lock** serialises the few decisions that read the study and then write it: creating
  the study and its attributes, queueing the baseline or a staged config, claiming a trial under
  ``--trials``. On PostgreSQL it is a session advisory lock (the server drops it when a worker's
  connection dies); on SQLite and journal files a ``flock`` on a file next to the storage's (the
  kernel drops it when the process dies). Other databases get no lock: workers may then
  overshoot ``--trials``.
- The **device lock** keeps two workers on one machine from measuring on the same devices at the
  same time, which would corrupt both measurements: one ``flock`` per device (the CPU, each GPU by
  its NVML index) in a directory every user of the machine shares, taken in a fixed order.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy import text

LOCK_POLL_S = 0.2
_ENGINES: dict[str, Any] = {}


def _engine(url: str) -> Any:
    """One small connection pool per URL for the advisory lock, kept for the process."""
    if url not in _ENGINES:
        _ENGINES[url] = sqlalchemy.create_engine(url, pool_size=1, max_overflow=1,
                                                 pool_pre_ping=True)
    return _ENGINES[url]


def lock_dir() -> Path:
    """``$AUTOTUNE_LOCK_DIR``, else ``autotune-locks`` in the system's temporary directory: one
    per machine, shared by every worker on it."""
    path = Path(os.environ.get("AUTOTUNE_LOCK_DIR")
                or Path(tempfile.gettempdir()) / "autotune-locks")
    path.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        path.chmod(0o1777)  # other users' workers lock the same GPUs
    return path


def _open_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)
    return fd


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


def _lock_key(study_name: str) -> int:
    """A signed 64-bit advisory-lock key for the study."""
    digest = hashlib.sha256(f"autotune:{study_name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@contextlib.contextmanager
def study_lock(url: str, study_name: str) -> Iterator[None]:
    """Hold the study lock (see the module's docstring) for the duration of the block."""
    if url.startswith("postgresql"):
        key = _lock_key(study_name)
        engine = _engine(url)
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()
    elif url.startswith(("sqlite:///", "journal:///")) and url != "sqlite:///:memory:":
        path = Path(url.split(":///", 1)[1])
        key = _lock_key(study_name) & 0xFFFFFFFF
        fd = _open_lock(path.with_name(f"{path.name}.{key:08x}.lock"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    else:
        yield
