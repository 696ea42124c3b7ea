"""This host and this process, as workers sharing a study name themselves and check on each
other (a claimed trial whose worker is gone is given back)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import TypedDict

import psutil


class ProcessIdentity(TypedDict):
    """A process on a host: a pid alone can be reused, its start time tells them apart."""

    host: str
    pid: int
    started: float


def process_identity() -> ProcessIdentity:
    """This process on this machine: host, pid and start time (a pid alone can be reused)."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": psutil.Process().create_time()}


def process_alive(identity: Mapping[str, object]) -> bool:
    """Whether the process of ``identity`` (from this host) still runs; unknown counts as alive.
    ``identity`` is read back from a study, so its fields are checked here."""
    pid, started = identity.get("pid"), identity.get("started")
    if not isinstance(pid, int):
        return True  # leave it to the heartbeat
    try:
        when = float(started) if isinstance(started, int | float | str) and started else 0.0
        return abs(psutil.Process(pid).create_time() - when) < 1.0
    except (psutil.Error, ValueError):
        return False


def hostname() -> str:
    """This machine's host name."""
    return socket.gethostname()
