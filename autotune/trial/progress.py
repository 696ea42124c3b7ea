"""A trial's progress file: one JSON object per line, one per event (``built``,
``warmup_step``, ``window``, ...), appended by the trial process (``trial.bench``) or, for a
script's trial, by its driver, and tailed by the tuner (``trial.launch``), which forwards the
events as they come and keeps a killed trial's windows from them.

The trial's process can write this file (a user's workload runs there; a script's folder is the
script's): what is read of it is bounded, and an event is kept only as autotune writes it, its
kind known, its numbers there and finite, nothing else on it (the console formats them, and the
``--json`` events spread them into their own).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from typing import Any, Required, TypedDict, cast

from autotune.trial.result import Window
from autotune.trial.untrusted import Refused, loads, open_file

# An event is a few hundred bytes; a trial writes a few hundred of them.
MAX_EVENT = 64 * 1024
MAX_FILE = 16 * 1024 * 1024
_PER_LOOK = 1024 * 1024  # read at most this much of new events in one look
# Each kind of event: the numbers it carries, and those it may carry (``t`` on all).
_EVENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "built": (("build_s",), ()),
    "compiled": (("seconds",), ()),
    "warmup_step": (("seconds",), ()),
    "window": (("index", "samples", "seconds", "samples_per_sec"),
               ("data_wait_s", "comm_wait_s")),
}


class ProgressEvent(TypedDict, total=False):
    """One event as it is read back: its kind, the wall clock it was written at, and the
    numbers of its kind (``_EVENTS``), each a finite number."""

    event: Required[str]
    t: float
    build_s: float
    seconds: float
    index: int
    samples: int
    samples_per_sec: float
    data_wait_s: float
    comm_wait_s: float


# Who is handed each event as it comes (the console, --json, pruning).
OnEvent = Callable[[ProgressEvent], None]


def _line(event: str, data: dict[str, object]) -> str:
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


def read_events(path: str) -> list[ProgressEvent]:
    """The trial's progress events so far (in the file's first ``MAX_FILE`` bytes): whole
    lines only (the last may be half written), autotune's events only (``_event``)."""
    try:
        with open_file(path) as f:
            data = f.read(MAX_FILE)
    except OSError:
        return []
    return _events(data[:data.rfind(b"\n") + 1])


def _events(data: bytes) -> list[ProgressEvent]:
    events = []
    for line in data.split(b"\n"):
        with contextlib.suppress(Refused):
            if (event := _event(loads(line, max_bytes=MAX_EVENT))) is not None:
                events.append(event)
    return events


def _event(doc: object) -> ProgressEvent | None:
    """``doc`` as the event autotune writes: a known kind with each of its numbers a finite
    number, and nothing else; None when it is not one."""
    if not isinstance(doc, dict) or doc.get("event") not in _EVENTS:
        return None
    needed, optional = _EVENTS[doc["event"]]
    if any(k not in doc for k in needed):
        return None
    event: dict[str, object] = {"event": doc["event"]}
    for key in ("t", *needed, *optional):
        if key in doc:
            value = doc[key]
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value):
                return None
            event[key] = value
    return cast(ProgressEvent, event)


def measured_span(events: list[ProgressEvent]) -> tuple[float, float] | None:
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


class Tail:
    """The events of a trial's progress file as they are written: each look reads on from
    where the last one stopped, at most ``_PER_LOOK`` bytes."""

    def __init__(self, path: str) -> None:
        self.path, self.offset = path, 0

    def forward(self, on_event: OnEvent) -> None:
        """Hand each new, whole event to ``on_event``."""
        try:
            with open_file(self.path) as f:
                f.seek(self.offset)
                data = f.read(_PER_LOOK)
        except OSError:
            return
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) > MAX_EVENT:
            end = len(data)  # no line end within an event's length: not an event, passed over
        self.offset += end
        for event in _events(data[:end]):
            on_event(event)
