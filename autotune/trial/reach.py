"""Whether autotune's bootstrap reached every Python process of a script's trial.

Unhooked, a Trainer trains as the user's own run would: into their output directory, with
their checkpoints, hub pushes and trackers, under a config nobody set. The bootstrap marks each
process it reaches before any of the script runs (a file named for its pid in the trial's
``reached/`` folder: ``ok``, ``worker`` for a process that never trains, or why it cannot hook;
a forked child is marked by the fork), so the tuner can tell a Python process it did not reach:
one started with ``-I``, ``-E`` or ``-S``, with a cleared environment, or by an interpreter that
cannot import autotune. Such a process that reported steps ends the trial at once (it trains);
any other, once it has run ``GRACE_S`` since it was first seen as Python: a helper that ends
sooner (a system tool's ``#!/usr/bin/python3 -Es``) is let be. ``Reach.check`` names the first
such process; the trial is ended on it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil

from autotune.trial.command import INTERPRETER, REACHED, skipping_flag
from autotune.trial.untrusted import open_file

# How long a Python process may run unmarked: the bootstrap marks it as it starts, before
# importing anything of autotune's, so this is the machine's load, not a choice.
GRACE_S = 2.0
REACHED_MARKS = ("ok", "worker")
_PID = re.compile(r"[0-9]{1,10}")
_MARK_BYTES = 300
# psutil's start times come from the boot time in whole seconds: a mark written more than this
# before a process's start time was written by an earlier process of the same pid.
_CLOCK_SLACK_S = 1.0


class Reach:
    """The bootstrap's marks in a trial's folder, against the trial's processes as seen."""

    def __init__(self, folder: Path, grace_s: float = GRACE_S) -> None:
        self.folder = folder / REACHED
        self.grace_s = grace_s
        self.marks: dict[int, tuple[str, float]] = {}  # pid -> (what it says, when written)
        self.first_python: dict[tuple[int, float], float] = {}  # (pid, start) -> when seen
        self.ended: set[tuple[int, float]] = set()

    @property
    def reached(self) -> int:
        """Python processes of the trial the bootstrap reached and hooked."""
        return sum(1 for said, _ in self.marks.values() if said == "ok")

    def check(self, seen: Mapping[int, float], reporters: Iterable[int] = (),
              now: float | None = None) -> str | None:
        """Why the trial must end (a Python process of it that the bootstrap did not reach),
        or None. ``seen``: the trial's processes, pid -> start time (``processes.Tree``);
        ``reporters``: the processes that reported steps (their start lines, read before this
        look: a process is marked before it runs any of the script, so one that reported and
        has no mark was not reached, however short it lived)."""
        now = time.monotonic() if now is None else now
        self._read_marks()
        for pid in reporters:
            said = self.marks.get(pid, ("", 0.0))[0]
            if said not in REACHED_MARKS:
                argv: list[str] = []
                with contextlib.suppress(psutil.Error):
                    argv = psutil.Process(pid).cmdline()  # when it still runs
                shown = f" ({' '.join(argv)[:120]})" if argv else ""
                return (f"process {pid}{shown}, which reported steps, "
                        + _said(said or None, skipping_flag(argv[1:])))
        for pid, started in seen.items():
            key = (pid, started)
            if key not in self.ended and self._mark_of(pid, started) not in REACHED_MARKS:
                why = self._unreached(pid, key, now)
                if why is not None:
                    return why
        return None

    def _mark_of(self, pid: int, started: float) -> str | None:
        """What ``pid``'s mark says, if it was written by this process (not an earlier one
        with the same pid)."""
        said, written = self.marks.get(pid, (None, 0.0))
        return said if written >= started - _CLOCK_SLACK_S else None

    def _unreached(self, pid: int, key: tuple[int, float], now: float) -> str | None:
        try:
            proc = psutil.Process(pid)
            if proc.create_time() != key[1] or proc.status() == psutil.STATUS_ZOMBIE:
                self.ended.add(key)  # its pid may be another process's now
                return None
            if not INTERPRETER.fullmatch(os.path.basename(proc.exe())):
                return None  # not Python (yet: a shell may exec it; looked at again)
            argv = proc.cmdline()
        except psutil.NoSuchProcess:
            self.ended.add(key)
            return None
        except psutil.Error:
            return None
        first = self.first_python.setdefault(key, now)
        if now - first < self.grace_s or self._forked_from_reached(proc, argv):
            return None
        return f"process {pid} of the trial ({' '.join(argv)[:120]}) " + \
            _said(self._mark_of(pid, key[1]), skipping_flag(argv[1:]))

    def _forked_from_reached(self, proc: psutil.Process, argv: list[str]) -> bool:
        """A child forked without Python's fork hooks (by C code): its parent's copy, with
        its parent's command line."""
        with contextlib.suppress(psutil.Error):
            parent = proc.parent()
            return parent is not None and parent.cmdline() == argv and \
                self._mark_of(parent.pid, parent.create_time()) in REACHED_MARKS
        return False

    def _read_marks(self) -> None:
        """The marks written or rewritten since the last look. The folder is the trial's to
        write: names are pids, marks regular files, what one says short printable text."""
        with contextlib.suppress(OSError), os.scandir(self.folder) as entries:
            for entry in entries:  # the bootstrap writes NAME.tmp, then renames it NAME
                if not _PID.fullmatch(entry.name):
                    continue
                with contextlib.suppress(OSError):
                    written = entry.stat(follow_symlinks=False).st_mtime
                    if self.marks.get(int(entry.name), ("", None))[1] == written:
                        continue
                    with open_file(entry.path) as f:
                        text = f.read(_MARK_BYTES).decode(errors="replace")
                    said = text if text in REACHED_MARKS else \
                        "".join(c if c.isprintable() else "?" for c in text) or "no reason given"
                    self.marks[int(entry.name)] = (said, written)


def _said(mark: str | None, flag: str | None) -> str:
    """What a process the bootstrap did not reach is, and what to do."""
    if mark is not None:
        return f"is a Python that autotune's bootstrap could not hook: {mark}"
    why = f"its {flag} keeps it out" if flag else "no mark from it"
    return (f"is a Python that autotune's bootstrap did not reach ({why}): unhooked, a Trainer "
            "in it would write your outputs, checkpoints and trackers, and the config would "
            "not be applied; run the script with the python autotune runs in, without -I, -E "
            "or -S, and keep PYTHONPATH in its environment")
