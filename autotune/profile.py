"""Profiles: the exported winner, in schema ``autotune.profile/v1`` (see DESIGN.md).

Loading never executes code (``yaml.safe_load``), rejects unknown schema versions with a message
naming both versions, and warns when the fingerprint differs from the machine it is loaded on.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autotune.errors import ProfileError
from autotune.knobs import Config

SCHEMA = "autotune.profile/v1"
_REQUIRED = ("schema", "workload", "config", "env", "result", "baseline", "speedup",
             "fingerprint", "provenance")


class FingerprintWarning(UserWarning):
    """The profile was tuned on different hardware or software than this machine."""


@dataclass(frozen=True)
class Profile:
    workload: dict[str, Any]
    config: Config
    env: dict[str, str]
    result: dict[str, Any]
    baseline: dict[str, Any]
    speedup: float | None
    fingerprint: dict[str, Any]
    provenance: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    schema: str = SCHEMA
    # The interleaved re-measurement that chose the winner (absent when there was none).
    confirmation: dict[str, Any] | None = None

    @property
    def micro_batch_size(self) -> int:
        return self.config.micro_batch_size

    @property
    def accumulation_steps(self) -> int:
        return self.config.grad_accum_steps

    @property
    def samples_per_sec(self) -> float:
        return float(self.result["samples_per_sec"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "workload": self.workload,
            "config": self.config.to_dict(),
            "env": dict(self.env),
            "result": self.result,
            "baseline": self.baseline,
            "speedup": self.speedup,
            "fingerprint": self.fingerprint,
            "provenance": self.provenance,
            "notes": list(self.notes),
            **({"confirmation": self.confirmation} if self.confirmation else {}),
        }

    def save(self, path: str | Path) -> Path:
        """Write atomically: a crash mid-write never leaves a half profile behind."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None,
                                      width=100))
        os.replace(tmp, path)
        return path


def from_dict(data: Any, source: str = "<profile>") -> Profile:
    """Validate a profile's dict form; every problem is named in one error."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source} is not a profile: expected a mapping, got "
                           f"{type(data).__name__}")
    schema = data.get("schema")
    if schema != SCHEMA:
        raise ProfileError(f"{source} has schema {schema!r}; this autotune reads {SCHEMA!r}. "
                           "Re-export it with a matching autotune version")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ProfileError(f"{source} lacks {', '.join(missing)}; the file is damaged or "
                           "truncated: re-export it with `autotune run`")
    try:
        config = Config.from_dict(data["config"])
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{source} has a bad config: {exc}") from None
    result = data["result"]
    if not isinstance(result, dict) or not isinstance(result.get("samples_per_sec"), int | float):
        raise ProfileError(f"{source} has no result.samples_per_sec; re-export it")
    return Profile(workload=data["workload"], config=config, env=dict(data["env"] or {}),
                   result=result, baseline=data["baseline"], speedup=data["speedup"],
                   fingerprint=data["fingerprint"], provenance=data["provenance"],
                   notes=list(data.get("notes") or []),
                   confirmation=data.get("confirmation") or None)


def load_profile(path: str | Path, check_fingerprint: bool = True) -> Profile:
    """Load a profile safely. Warns (FingerprintWarning) when tuned on other hardware."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)  # safe_load refuses !!python/object and friends
    except yaml.YAMLError as exc:
        raise ProfileError(f"profile {path} is not valid YAML ({str(exc).splitlines()[0]}); "
                           "the file is damaged: re-export it") from None
    profile = from_dict(data, str(path))
    if check_fingerprint:
        from autotune.hardware import detect

        differs = fingerprint_diff(profile.fingerprint, detect().fingerprint())
        if differs:
            warnings.warn(f"profile {path} was tuned on other hardware: {'; '.join(differs)}",
                          FingerprintWarning, stacklevel=2)
    return profile


def fingerprint_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Human lines for each fingerprint field that differs (``field: A here B``)."""
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r} here" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]
