"""What a search-space file declares, once validated: each knob's domain (a list of choices, or
an integer range) by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict


class ChoicesForm(TypedDict):
    """``Choices`` as a study stores it."""

    choices: list[Any]


class RangeForm(TypedDict):
    """``IntRange`` as a study stores it."""

    low: int
    high: int
    log: bool
    step: int


@dataclass(frozen=True)
class Choices:
    """The values a knob may take, in the order the space lists them."""

    values: tuple[Any, ...]  # each of the knob's type (an int knob's are ints)

    def describe(self) -> str:
        return "{" + ", ".join(show(v) for v in self.values) + "}"

    def to_dict(self) -> ChoicesForm:
        return {"choices": list(self.values)}


@dataclass(frozen=True)
class IntRange:
    """Integers from ``low`` to ``high``, both included: every ``step``-th, or log-uniform."""

    low: int
    high: int
    log: bool = False
    step: int = 1

    def describe(self) -> str:
        scale = ", log" if self.log else (f", step {self.step}" if self.step != 1 else "")
        return f"[{self.low} .. {self.high}{scale}]"

    def contains(self, value: int) -> bool:
        return self.low <= value <= self.high and (value - self.low) % self.step == 0

    def to_dict(self) -> RangeForm:
        return {"low": self.low, "high": self.high, "log": self.log, "step": self.step}


Domain = Choices | IntRange


def show(value: object) -> str:
    """A value as a space file spells it (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class SearchSpace:
    """A validated space file: knob name -> domain."""

    name: str
    source: str
    knobs: dict[str, Domain]
