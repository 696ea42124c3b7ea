"""A trial's progress file: one JSON object per line, one per event (``built``,
``warmup_step``, ``window``, ...), appended by the trial process (``trial.bench``) or, for a
script's trial, by its driver, and tailed by the tuner (``trial.launch``), which forwards the
events as they come and keeps a killed trial's windows from them.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from typing import Any

from autotune.trial.result import Window
from autotune.trial.untrusted import Refused, loads

# The trial's process writes this file (a user's workload runs there): what is read of it is
# bounded, a line that is not a small JSON object is skipped. An event is a few hundred bytes.
MAX_EVENT = 64 * 1024
MAX_FILE = 16 * 1024 * 1024
# The numbers an event may carry, which the tuner formats and computes with: an event where one
# is not a finite number (a string, NaN, a bool) is not autotune's, and is skipped.
_NUMBERS = ("t", "index", "samples", "seconds", "samples_per_sec", "build_s", "data_wait_s",
            "comm_wait_s")


def _line(event: str, data: dict[str, Any]) -> str:
    return json.dumps({"event": event, "t": time.time(), **data}) + "\n"


class Progress:
    """Appends one JSON line per event; the tuner tails the file."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115

    def emit(self, event: str, **data: Any) -> None:
        if self._file is not None:
            self._file.write(_line(event, data))


def append(path: str, event: str, **data: Any) -> None:
    """One event, the file opened for it alone; a file that cannot be written (a script
    removed its folder) loses the event, never the caller."""
    with contextlib.suppress(OSError), open(path, "a") as f:
        f.write(_line(event, data))


def read_events(path: str) -> list[dict[str, Any]]:
    """The trial's progress events so far: whole lines only (the last may be half written), the
    file's first ``MAX_FILE`` bytes, objects only."""
    try:
        with open(path, "rb") as f:
            lines = f.read(MAX_FILE).split(b"\n")[:-1]
    except OSError:
        return []
    events = []
    for line in lines:
        with contextlib.suppress(Refused):
            event = loads(line, max_bytes=MAX_EVENT)
            if _well_formed(event):
                events.append(event)
    return events


def _well_formed(event: Any) -> bool:
    """An object whose kind is a string and whose numbers are finite numbers."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return False
    return all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
               for v in (event[k] for k in _NUMBERS if k in event))


def measured_span(events: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Wall-clock start and end of a trial's timed windows, from its progress events (each
    window's event is written at its end, with its length)."""
    windows = [e for e in events if e.get("event") == "window" and "t" in e]
    if not windows:
        return None
    return float(windows[0]["t"]) - float(windows[0].get("seconds", 0.0)), float(windows[-1]["t"])


def read_windows(path: str) -> list[Window]:
    """The windows a trial reported so far (a killed trial's partial measurement). An event
    without its samples and seconds, or with either not above 0, is no window (the folder is
    writable by a script)."""
    windows: list[Window] = []
    for e in read_events(path):
        if e.get("event") == "window" and e.get("samples", 0) > 0 and e.get("seconds", 0) > 0:
            window: Window = {"samples": e["samples"], "seconds": e["seconds"]}
            for key in ("data_wait_s", "comm_wait_s"):
                if key in e:
                    window[key] = e[key]
            windows.append(window)
    return windows


def forward(path: str, seen: int, on_event: Callable[[dict[str, Any]], None]) -> int:
    """Hand the events after the first ``seen`` to ``on_event``; how many were seen now."""
    events = read_events(path)
    for event in events[seen:]:
        on_event(event)
    return max(seen, len(events))
