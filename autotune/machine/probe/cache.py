"""The probe's cache: one JSON document of measurements per hardware fingerprint, in
``AUTOTUNE_CACHE_DIR`` (else ~/.cache/autotune), so ``autotune run`` probes a machine once.

Only a probe taken on a quiet machine is cached (``probe`` decides), and only for
``max_age_days()``: a VM's host, microcode or neighbours change under an unchanged fingerprint,
and a peak measured once would otherwise hold for good."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

from autotune.errors import UsageError
from autotune.machine.hardware import Hardware
from autotune.machine.probe.documents import CachedProbe

PROBE_SCHEMA = "autotune.probe/v1"
MAX_AGE_DAYS = 30.0
MAX_AGE_ENV = "AUTOTUNE_PROBE_MAX_AGE_DAYS"


def cache_dir() -> Path:
    env = os.environ.get("AUTOTUNE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autotune"


def cache_path(hw: Hardware) -> Path:
    return cache_dir() / f"probe-{hw.fingerprint_id()}.json"


def max_age_days() -> float:
    """How old a cached probe may be before it is measured again: ``MAX_AGE_DAYS``, or
    ``$AUTOTUNE_PROBE_MAX_AGE_DAYS``."""
    text = os.environ.get(MAX_AGE_ENV)
    if not text:
        return MAX_AGE_DAYS
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if not days > 0:  # also NaN
        raise UsageError(f"{MAX_AGE_ENV} must be a number of days > 0, got {text!r}: set it "
                         f"to e.g. 7, or unset it for {MAX_AGE_DAYS:g}")
    return days


def age_days(doc: CachedProbe, now: datetime | None = None) -> float | None:
    """Days since ``doc`` was measured (its ``created``), None where that is unreadable."""
    try:
        created = datetime.fromisoformat(str(doc.get("created")))
    except ValueError:
        return None
    if created.tzinfo is None:
        created = created.replace(tzinfo=UTC)
    return ((now or datetime.now(UTC)) - created).total_seconds() / 86400


def stored(hw: Hardware) -> CachedProbe | None:
    """This machine's cache file, however old; None where absent, unreadable, of another
    schema, or with figures that are not figures (each needs a number and a unit): then the
    next probe measures again."""
    try:
        doc = json.loads(cache_path(hw).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != PROBE_SCHEMA:
        return None
    figures = doc.get("figures")
    if not isinstance(figures, dict) or not all(
            isinstance(f, dict) and isinstance(f.get("value"), int | float)
            and isinstance(f.get("unit"), str) for f in figures.values()):
        return None
    return cast(CachedProbe, doc)  # its schema and figures checked above


def stale(doc: CachedProbe) -> str | None:
    """Why a cached probe is measured again (too old, or of no readable date), else None."""
    age = age_days(doc)
    if age is None:
        return f"its date {doc.get('created')!r} is unreadable"
    limit = max_age_days()
    if age > limit:
        return f"it is {age:.0f} days old, more than {limit:g} ({MAX_AGE_ENV})"
    return None


def cached(hw: Hardware) -> CachedProbe | None:
    """This machine's cached measurements, or None (absent, unreadable, of another schema, or
    older than ``max_age_days()``: then the next probe measures again)."""
    doc = stored(hw)
    return doc if doc is not None and stale(doc) is None else None


def save(hw: Hardware, doc: CachedProbe) -> None:
    """Cache ``doc`` for this machine, atomically."""
    path = cache_path(hw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(doc, indent=1))
    path.with_suffix(".tmp").replace(path)
