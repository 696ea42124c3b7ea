"""The probe's cache: one JSON document of measurements per hardware fingerprint, in
``AUTOTUNE_CACHE_DIR`` (else ~/.cache/autotune), so ``autotune run`` probes a machine once."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from autotune.machine.hardware import Hardware

PROBE_SCHEMA = "autotune.probe/v1"


def cache_dir() -> Path:
    env = os.environ.get("AUTOTUNE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autotune"


def cache_path(hw: Hardware) -> Path:
    return cache_dir() / f"probe-{hw.fingerprint_id()}.json"


def cached(hw: Hardware) -> dict[str, Any] | None:
    """This machine's cached measurements, or None (absent, unreadable, or of another schema)."""
    try:
        doc = json.loads(cache_path(hw).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == PROBE_SCHEMA else None


def save(hw: Hardware, doc: dict[str, Any]) -> None:
    """Cache ``doc`` for this machine, atomically."""
    path = cache_path(hw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(doc, indent=1))
    path.with_suffix(".tmp").replace(path)
