"""What a Trainer runs with, against the config it was given: which knobs took effect and which
did not, each with the reason. Read back from the objects the Trainer built (its DataLoader,
optimizer, model, precision), never taken from the config (``compare`` is pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autotune.config.knobs import Config
from autotune.config.values import KnobValue

if TYPE_CHECKING:
    from autotune.trial.result import ReadbackDoc

# Knobs the launcher applies (the ranks it starts, NCCL's environment): not the Trainer's.
LAUNCHER_KNOBS = ("world_size", "nccl_algo", "nccl_proto")
# A config value that leaves the knob as the script and framework have it: nothing to apply.
AS_BUILT = {"optimizer_impl": "default", "attention": "default", "cpu_threads": 0}


@dataclass
class Readback:
    """Knobs in effect as the config asked, and those not, with why (one line each)."""

    via: str  # "Trainer (transformers 5.2.0)", "Lightning Trainer (lightning 2.6.6)"
    applied: list[str] = field(default_factory=list)
    fixed: dict[str, str] = field(default_factory=dict)
    seen: dict[str, KnobValue] = field(default_factory=dict)  # knob -> the value read back
    script: dict[str, KnobValue] = field(default_factory=dict)  # what the script asked itself
    isolated: list[str] = field(default_factory=list)  # what a trial turned off in it

    def to_doc(self) -> ReadbackDoc:
        """The read-back as a trial records it (``steps.readback``): plain values only."""
        return {"via": self.via, "applied": sorted(self.applied), "fixed": dict(self.fixed),
                "seen": {k: v for k, v in self.seen.items() if _plain(v)},
                "script": {k: v for k, v in self.script.items() if _plain(v)},
                "isolated": list(self.isolated)}


def _plain(value: object) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def compare(config: Config, seen: Mapping[str, KnobValue], unreachable: Mapping[str, str],
            via: str) -> Readback:
    """Each knob of ``config`` (but the launcher's): applied when the value read back is the
    config's (or the config leaves it as built), fixed with the reason when the framework
    cannot reach it (``unreachable``) or runs another value. A knob neither read nor
    unreachable is left out of both: nothing is claimed about it."""
    out = Readback(via=via, seen=dict(seen))
    wanted = config.to_dict()
    for knob, value in wanted.items():
        if knob in LAUNCHER_KNOBS:
            continue
        if knob in unreachable:
            out.fixed[knob] = unreachable[knob]
        elif AS_BUILT.get(knob, object()) == value or (knob == "prefetch_factor"
                                                        and not wanted.get("num_workers")):
            out.applied.append(knob)
        elif knob in seen:
            if seen[knob] == value:
                out.applied.append(knob)
            else:
                out.fixed[knob] = (f"{knob}={shown(value)} was set, but the {via} runs "
                                   f"{shown(seen[knob])}: the script sets it itself")
    return out


def shown(value: object) -> str:
    """A knob's value as the run prints it."""
    return "off" if value is False else "on" if value is True else str(value)


def optimizer_impl(foreach: bool | None, fused: bool | None) -> str:
    """An optimizer's step in the config's terms."""
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    return "for-loop" if foreach is False else "default"


def amp_of(mixed_precision: str | None) -> str:
    """Accelerate's / Lightning's precision names in the config's."""
    text = str(mixed_precision or "no")
    if text.startswith("bf16"):
        return "bf16"
    if text.startswith("16") or text.startswith("fp16"):
        return "fp16"
    return "off"
