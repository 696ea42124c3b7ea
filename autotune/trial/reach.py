"""Whether autotune's bootstrap reached every Python process of a script's trial.

Unhooked, a Trainer trains as the user's own run would: into their output directory, with
their checkpoints, hub pushes and trackers. The bootstrap marks each process it reaches (a file
named for its pid in the trial's ``reached/`` folder: ``ok``, or why it cannot hook; a forked
child is marked by the fork), so the tuner can tell a Python process it did not reach: started
with ``-I``, ``-E`` or ``-S`` (seen on its command line at once), with a cleared environment
or by an interpreter that cannot import autotune (no mark ``GRACE_S`` after it was first seen
as Python, or a mark that says why). Short-lived helpers that end within the grace are let be.
``Reach.check`` names the first such process; the trial is ended on it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil

from autotune.trial.command import skipping_flag

REACHED = "reached"  # the bootstrap's folder of marks (``site/sitecustomize.py``)
# How long a Python process may run unmarked: the bootstrap marks it before its first import
# of the script's (tens of milliseconds after it starts), so this is load, not a choice.
GRACE_S = 2.0
_PYTHON = re.compile(r"(python|pypy)[0-9.]*[a-z]?")
_MARK_BYTES = 300


class Reach:
    """The bootstrap's marks in a trial's folder, against the trial's processes as seen."""

    def __init__(self, folder: Path, grace_s: float = GRACE_S) -> None:
        self.folder = folder / REACHED
        self.grace_s = grace_s
        self.marks: dict[int, str] = {}
        self.first_python: dict[tuple[int, float], float] = {}  # (pid, start) -> when seen
        self.ended: set[tuple[int, float]] = set()

    @property
    def reached(self) -> int:
        """Python processes of the trial the bootstrap reached and hooked."""
        return sum(1 for why in self.marks.values() if why == "ok")

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
            if self.marks.get(pid) != "ok":
                return (f"process {pid}, which reported steps, "
                        + self._said(self.marks.get(pid), None))
        for pid, started in seen.items():
            key = (pid, started)
            if key in self.ended or self.marks.get(pid) == "ok":
                continue
            why = self._unreached(pid, key, now)
            if why is not None:
                return why
        return None

    def _unreached(self, pid: int, key: tuple[int, float], now: float) -> str | None:
        try:
            proc = psutil.Process(pid)
            if proc.create_time() != key[1] or proc.status() == psutil.STATUS_ZOMBIE:
                self.ended.add(key)  # its pid may be another process's now
                return None
            if not _PYTHON.fullmatch(os.path.basename(proc.exe())):
                return None  # not Python (yet: a shell may exec it; looked at again)
            argv = proc.cmdline()
        except psutil.NoSuchProcess:
            self.ended.add(key)
            return None
        except psutil.Error:
            return None
        mark = self.marks.get(pid)
        flag = skipping_flag(argv[1:])
        if mark is None and flag is None:
            first = self.first_python.setdefault(key, now)
            if now - first < self.grace_s or self._forked_from_reached(proc, argv):
                return None
        return f"process {pid} of the trial ({' '.join(argv)[:120]}) " + \
            self._said(mark, flag)

    @staticmethod
    def _said(mark: str | None, flag: str | None) -> str:
        if mark is not None:
            return f"is a Python that autotune's bootstrap could not hook: {mark}"
        why = f"its {flag} keeps it out" if flag else "no mark from it"
        return (f"is a Python that autotune's bootstrap did not reach ({why}): unhooked, a "
                "Trainer in it would write your outputs, checkpoints and trackers, and the "
                "config would not be applied; run the script with the python autotune runs "
                "in, without -I, -E or -S, and keep PYTHONPATH in its environment")

    def _forked_from_reached(self, proc: psutil.Process, argv: list[str]) -> bool:
        """A child forked without Python's fork hooks (by C code): its parent's copy, with
        its parent's command line."""
        with contextlib.suppress(psutil.Error):
            parent = proc.parent()
            return parent is not None and self.marks.get(parent.pid) == "ok" \
                and parent.cmdline() == argv
        return False

    def _read_marks(self) -> None:
        """The marks written since the last look (names are pids; what a mark says is short,
        printable text: the folder is the trial's to write)."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:  # the bootstrap writes NAME.tmp, then renames it NAME
            if not name.isdigit() or len(name) > 10 or int(name) in self.marks:
                continue
            with contextlib.suppress(OSError), open(self.folder / name, "rb") as f:
                text = f.read(_MARK_BYTES).decode(errors="replace")
                self.marks[int(name)] = text if text == "ok" else \
                    "".join(c if c.isprintable() else "?" for c in text) or "no reason given"
