"""Sizes and durations as people write them: parsed from flags, formatted for output."""

from __future__ import annotations

import re

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")
SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
              "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
              "tib": 2**40}


def parse_duration(text: str, flag: str) -> float:
    """``90``, ``90s``, ``10m``, ``1h30m`` -> seconds; ValueError naming ``flag`` otherwise."""
    match = _DURATION.match(text.strip().lower())
    if not text.strip() or match is None or not any(match.groups()):
        raise ValueError(f"{flag} must be a duration like 90s, 10m or 1h30m, got {text!r}")
    h, m, s = (float(g) if g else 0.0 for g in match.groups())
    seconds = h * 3600 + m * 60 + s
    if seconds <= 0:
        raise ValueError(f"{flag} must be positive, got {text!r}")
    return seconds


def parse_size(text: str) -> tuple[float, str]:
    """``20GiB`` -> (20.0, "gib"); (nan, unit) when the number does not parse. The unit is
    lower-cased and may be one not in ``SIZE_UNITS``: the caller says what it accepts."""
    text = text.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        return float(number), text[len(number):]
    except ValueError:
        return float("nan"), text[len(number):]


def format_duration(seconds: float) -> str:
    """``12m 00s`` or ``45s``."""
    seconds = int(round(seconds))
    return f"{seconds // 60}m {seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def format_span(seconds: float) -> str:
    """A training run's length: ``12m 00s`` under an hour, ``7.5 h`` under three days, else
    ``4.2 days``."""
    if seconds < 3600:
        return format_duration(seconds)
    if seconds < 72 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def format_bytes(n: float) -> str:
    """``1.50 GiB`` or ``512 MiB``."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
