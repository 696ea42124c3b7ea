"""The trial process's plumbing: its tie to the tuner, so that no trial outlives the tuner or its
parent and a stopped rank exits in a way its launcher reads right, and its result file."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import threading
from pathlib import Path

from autotune.trial.result import TrialResultDoc


def tie_to_tuner() -> None:
    """End this trial's process group if the tuner or this process's parent dies, so no orphan
    holds a device.

    A single-rank trial's parent is the tuner; a rank's parent is torchrun's agent, which starts
    each rank in a session of its own. Three ways in: SIGTERM, which Linux sends when the parent
    exits (PR_SET_PDEATHSIG, set here rather than in a preexec_fn, which is unsafe in a tuner with
    threads) and which torchrun's agent sends to tear the ranks down; and, for a main thread stuck
    in native code, a thread that notices the parent change or the tuner's end.
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: _stopped())
    # A Python handler runs only when the main thread runs Python; one blocked in native code (a
    # collective whose peer is gone) would ignore torchrun's SIGTERM until its SIGKILL 30 s later.
    # The C-level handler writes every signal to the wakeup fd at once: the watch thread acts on it.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    parent = os.getppid()
    tuner = int(os.environ.get("AUTOTUNE_TUNER_PID", parent))
    # On another node of a trial across machines the tuner's pid means nothing: the parent
    # (that node's torchrun agent) is watched alone.
    here = os.environ.get("AUTOTUNE_TUNER_HOST", socket.gethostname()) == socket.gethostname()

    def orphaned() -> bool:
        return os.getppid() != parent or (here and not _alive(tuner))

    if orphaned():  # the tuner died before the tie was made
        os.killpg(os.getpgrp(), signal.SIGKILL)

    def watch() -> None:
        while True:
            ready, _, _ = select.select([wake_r], [], [], 0.5)
            if ready and int(signal.SIGTERM) in os.read(wake_r, 256):
                _stopped()
            if orphaned():
                os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="autotune-parent-watch").start()


def _stopped() -> None:
    """End this process and its loader workers now, on a SIGTERM: the workers by SIGKILL, this
    process with exit code 143 (128 + SIGTERM). Not by SIGKILL: torchrun would report this rank
    as killed (-9), which reads as the kernel's OOM killer, and when it stops this rank because
    a peer failed, the trial would be blamed on memory instead of the peer's own error."""
    import psutil

    me, group = os.getpid(), os.getpgrp()
    with contextlib.suppress(Exception):
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(Exception):
                proc.kill()
        for proc in psutil.process_iter():  # the group's others, reparented ones too
            with contextlib.suppress(Exception):
                if proc.pid != me and os.getpgid(proc.pid) == group:
                    proc.kill()
    os._exit(128 + signal.SIGTERM)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: only its exit status is left)."""
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def write_json(path: str, doc: TrialResultDoc) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)  # atomic: the tuner never reads half a result
