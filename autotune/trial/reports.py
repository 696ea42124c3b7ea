"""Reading what a script's trial reports: each rank's step file (``autotune.steps`` writes it),
tailed line by line and checked as untrusted input. A line that is not autotune's (longer than
``MAX_LINE``, nested too deep, not JSON), a step out of order, an end time that is not finite,
goes back, precedes the trial or lies in the future, a count that is not a whole number, or
steps of two processes in one rank's file stop the reading of that rank with the reason
(``bad``); the driver ends the trial on it, naming the step. A loss the script reported as not
finite is kept as ``diverged``.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.config.knobs import KNOBS
from autotune.trial.result import ReadbackDoc
from autotune.trial.sentinel import Reading, clean
from autotune.trial.untrusted import Refused, loads, open_file

# The shortest optimizer step a report may claim: reporting one step (``autotune.step()``)
# costs ~3 us (benchmarks/step_cost.py), so end times closer than this were not measured.
MIN_STEP_S = 20e-6
# How far past the tuner's clock a step's end may lie (both read the same machine's clock).
FUTURE_SLACK_S = 2.0
# The profile method names a script's access lines may carry (``Profile`` methods).
_ACCESS_NAME = re.compile(r"[a-z_]{1,40}")
# The longest line a step file may hold: a step is ~60 bytes, the bootstrap's read-back a few
# KB. Past it, a line is not autotune's, and an unfinished one is not kept growing.
MAX_LINE = 64 * 1024
# How much of a step file is read at a time (the tuner's memory, whatever the script writes),
# and at most in one look (~30,000 steps: a script's steps take 20 us or more).
_CHUNK = 1 << 20
_PER_READ = 2 * _CHUNK


# What a read-back line may hold (``autotune.bootstrap``): knob and field names, short
# printable text, plain values; anything else is not the bootstrap's.
_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,59}")
_MAX_TEXT, _MAX_ITEMS = 400, 64


def check_readback(doc: Any, rank: int) -> ReadbackDoc:
    """A read-back line's document, checked as untrusted input; raises ``BadReport``."""
    def bad(what: str) -> BadReport:
        return BadReport(f"rank {rank} reported what its Trainer runs with, but {what}")

    def text(value: Any, where: str) -> str:
        if not isinstance(value, str) or len(value) > _MAX_TEXT or not value.isprintable():
            raise bad(f"{where} is not a short line of text")
        return value

    def names(value: Any, where: str, known: bool, keyed: bool = False) -> list[str]:
        if not isinstance(value, dict if keyed else list) or len(value) > _MAX_ITEMS:
            raise bad(f"{where} is not a {'table' if keyed else 'list'} of names")
        for name in value:
            if not isinstance(name, str) or not _FIELD_NAME.fullmatch(name) or (
                    known and name not in KNOBS):
                raise bad(f"{where} names {str(name)[:60]!r}, not a knob")
        return list(value)

    def plain(value: Any, where: str) -> dict[str, bool | int | float | str | None]:
        names(value, where, known=True, keyed=True)
        for v in value.values():
            if not (v is None or isinstance(v, bool | int | str)
                    or (isinstance(v, float) and math.isfinite(v))) \
                    or (isinstance(v, str) and (len(v) > 100 or not v.isprintable())):
                raise bad(f"{where} holds {str(v)[:60]!r}, not a plain value")
        return dict(value)

    if not isinstance(doc, dict):
        raise bad("it is not a document")
    fixed = doc.get("fixed", {})
    names(fixed, "fixed", known=True, keyed=True)
    return {"via": text(doc.get("via"), "via"),
            "applied": names(doc.get("applied", []), "applied", known=True),
            "fixed": {k: text(v, f"the reason for {k}") for k, v in fixed.items()},
            "seen": plain(doc.get("seen", {}), "seen"),
            "script": plain(doc.get("script", {}), "script"),
            "isolated": names(doc.get("isolated", []), "isolated", known=False)}


class BadReport(Exception):
    """A line of a step file that cannot be trusted: malformed, non-finite, out of order, or
    in the future."""


def finite_number(e: Mapping[str, object], key: str) -> float | None:
    """``e[key]`` as a finite float; None when it is not one (bools are not numbers)."""
    value = e.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def check_step(e: dict[str, Any], *, rank: int, step: int, last_end: float | None,
               since: float, now: float) -> str | None:
    """Why a step line of ``rank`` cannot be its step ``step`` (None when it can): the tuner
    reads what a script wrote, so everything is checked (pure; ``now`` and ``since`` are the
    wall clock now and when the trial started)."""
    s = e.get("s")
    if isinstance(s, bool) or not isinstance(s, int) or s != step:
        return f"rank {rank} reported step {s!r} where step {step} was due"
    t, where = finite_number(e, "t"), f"step {step} of rank {rank}"
    if t is None:
        return f"{where} has end time {e.get('t')!r}, not a finite number"
    if t < since:
        return f"{where} ended at {t:.3f}, before the trial started ({since:.3f})"
    if t > now + FUTURE_SLACK_S:
        return f"{where} ended at {t:.3f}, {t - now:.0f}s in the future"
    if last_end is not None and t < last_end:
        return (f"{where} ended at {t:.6f}, before step {step - 1} did ({last_end:.6f}): end "
                "times must not go back")
    n = e.get("n")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return f"{where} counts {n!r} samples, not a whole number >= 0"
    if "d" in e and (finite_number(e, "d") is None or e["d"] < 0):
        return f"{where} waited {e['d']!r} s for data, not a finite number >= 0"
    m = e.get("m", 0)
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        return f"{where} reports peak memory {m!r}, not a whole number of bytes"
    return None


@dataclass
class RankReports:
    """What one rank reported so far."""

    path: Path
    index: int = 0
    offset: int = 0
    partial: bytes = b""
    ends: list[float] = field(default_factory=list)  # ends[i]: wall time step i + 1 ended
    samples: list[int] = field(default_factory=list)
    waits: list[float | None] = field(default_factory=list)
    peak: int = 0
    accessed: list[str] = field(default_factory=list)
    readback: ReadbackDoc | None = None  # what its Trainer runs with (autotune's bootstrap)
    default_samples: bool = False
    bad: str | None = None  # the first report that cannot be trusted; nothing after it is read
    diverged: str | None = None  # the step whose loss the script reported as not finite
    lines: int = 0
    pids: list[int] = field(default_factory=list)  # the processes that began reporting here
    sentinel: Reading = field(default_factory=dict)  # its first step's reading of the machine

    def read(self, since: float) -> None:
        """New whole lines since the last read (tailed by offset: a long run has many), a
        chunk at a time and at most ``_PER_READ`` bytes a look: what the script writes never
        sits whole in the tuner's memory, and a script that writes faster than it can be read
        never holds the tuner (its timeout and memory limit) in one look."""
        if self.bad is not None:
            return
        try:
            with open_file(self.path) as f:
                f.seek(self.offset)
                for _ in range(_PER_READ // _CHUNK):
                    data = f.read(_CHUNK)
                    if not data:
                        break
                    self.offset += len(data)
                    self._lines(data, since)
                    if self.bad is not None:
                        break
        except OSError:  # not there yet, or not a regular file (then no step is ever read)
            return

    def _lines(self, data: bytes, since: float) -> None:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        now = time.time()
        for line in lines:
            self.lines += 1
            try:
                self._take(line, since, now)
            except BadReport as exc:
                self.bad = f"{exc} ({self.path.name}, line {self.lines})"
                return
        if len(self.partial) > MAX_LINE:
            self.bad = (f"rank {self.index} wrote more than {MAX_LINE // 1024} KiB without a line "
                        f"end, not a step report ({self.path.name}, line {self.lines + 1})")
            self.partial = b""

    def _take(self, line: bytes, since: float, now: float) -> None:
        try:
            e = loads(line, max_bytes=MAX_LINE)
        except Refused as exc:
            raise BadReport(f"rank {self.index} wrote a line that is {exc}: "
                            f"{line[:80]!r}") from None
        if not isinstance(e, dict):
            raise BadReport(f"rank {self.index} wrote {str(e)[:80]!r}, not a step report")
        if "s" in e:
            why = check_step(e, rank=self.index, step=len(self.ends) + 1,
                             last_end=self.ends[-1] if self.ends else None, since=since,
                             now=now)
            if why:
                raise BadReport(self._two_writers(why) or why)
            self.ends.append(float(e["t"]))
            self.samples.append(int(e["n"]))
            self.waits.append(float(e["d"]) if "d" in e else None)
            self.peak = max(self.peak, int(e.get("m", 0)))
            self.default_samples = self.default_samples or e.get("default") == 1
            if e.get("nan") == 1 and self.diverged is None:
                self.diverged = f"step {len(self.ends)} of rank {self.index}"
        elif "nan" in e:  # autotune.diverged(): after the steps reported so far
            at = e["nan"]
            if isinstance(at, bool) or not isinstance(at, int) or at < 0:
                raise BadReport(f"rank {self.index} reported a diverged loss at step {at!r}")
            if self.diverged is None:
                self.diverged = f"step {max(at, 1)} of rank {self.index}"
        elif "k" in e:  # the bootstrap's read-back: the first one counts
            found = check_readback(e["k"], self.index)
            if self.readback is None:
                self.readback = found
        elif "a" in e:
            name = e["a"]
            if not isinstance(name, str) or not _ACCESS_NAME.fullmatch(name):
                raise BadReport(f"rank {self.index} reported a profile method {name!r}")
            if name not in self.accessed:
                self.accessed.append(name)
        elif "sentinel" in e:  # the machine's speed at its first step: the first one counts
            self.sentinel = self.sentinel or clean(e["sentinel"])
        elif "start" in e:  # a process began reporting as this rank
            pid = e.get("pid")
            if isinstance(pid, int) and not isinstance(pid, bool) and pid not in self.pids \
                    and len(self.pids) < 8:  # two tell it; a flood of starts keeps eight
                self.pids.append(pid)
        else:
            raise BadReport(f"rank {self.index} wrote {str(e)[:80]!r}, not a step report")

    def _two_writers(self, why: str) -> str | None:
        """What a bad step means when another process began reporting as this rank after the
        first (the file holds a start line of each): not a step out of order."""
        if len(self.pids) < 2:
            return None
        pids = " and ".join(map(str, self.pids[:2]))
        return (f"two processes (pids {pids}) reported steps as rank {self.index} ({why}): "
                "a Python process nested in the trial trains too, or the rank started again; "
                "a trial measures one training process per rank")


# -- the trial's steps: all ranks' reports together -----------------------------------------------


def trial_end(ranks: Sequence[RankReports], step: int) -> float:
    """When step ``step`` (1-based) of the trial ended: when its slowest rank ended it."""
    return max(r.ends[step - 1] for r in ranks)


def slowest_span(ranks: Sequence[RankReports], a: int, b: int) -> tuple[float, int]:
    """Seconds from the end of step ``a`` to the end of step ``b`` on the slowest rank, and
    that rank's index."""
    spans = [r.ends[b - 1] - r.ends[a - 1] for r in ranks]
    slowest = max(range(len(spans)), key=spans.__getitem__)
    return spans[slowest], slowest
