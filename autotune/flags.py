"""Command-line flags declared once, on the fields of a dataclass of options.

A field that the command line sets carries its ``Flag`` in the field's metadata (``option``
declares both): the flag's names and help and, where the command line hands over something other
than the field's value (a duration's text, ``name=value`` words), the ``Form`` that reads it. The
flag's default is the field's. ``flags_of`` binds each flag to its field; the CLI builds a
command's parameters from them, and ``read_flags`` turns the values the command receives back
into the dataclass, collecting every problem instead of stopping at the first.

Standard library only: the tuner's options declare their flags here without importing typer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar, get_type_hints

from autotune.errors import UsageError
from autotune.units import parse_duration

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T")
_Options = TypeVar("_Options", bound="DataclassInstance")


@dataclass(frozen=True)
class Form:
    """How a flag's command-line value becomes its field's value, where the two differ."""

    takes: object  # the type the command line hands over
    read: Callable[[Any, str], object]  # (that value, the flag's name) -> the field's value
    write: Callable[[Any], object]  # the field's default -> the flag's default
    unreadable: object  # the field's value when ``read`` fails: one that no rule objects to


def _seconds(text: str | None, flag: str) -> float | None:
    return None if text is None else parse_duration(text, flag)


# A duration's text (90s, 10m, 1h30m). Unreadable, it is no bound, so no rule about the bound
# (such as --trial-seconds' 2/3 of --trial-timeout) adds a second problem about the same flag.
DURATION = Form(str | None, _seconds, lambda s: None if s is None else f"{s:g}s", math.inf)


@dataclass(frozen=True)
class Flag:
    """How a command line sets one field: the flag's names and help, and its form when the
    command line hands over something other than the field's value."""

    names: tuple[str, ...]  # the first is the flag's name; an argument's is its parameter name
    help: str
    form: Form | None = None
    part: str = ""  # it sets this attribute of the field's value, not the whole value
    argument: bool = False  # positional, not an option


def option(default: _T, *names: str, help: str, form: Form | None = None,
           argument: bool = False) -> _T:
    """A dataclass field with ``default`` that the flag ``names`` sets."""
    return field(default=default, metadata={"flags": (Flag(names, help, form, "", argument),)})


def flags(*declared: Flag) -> dict[str, tuple[Flag, ...]]:
    """Field metadata for flags written out, e.g. several flags that each set a ``part``."""
    return {"flags": declared}


@dataclass(frozen=True)
class BoundFlag:
    """A flag with what its field decides: the type the command line hands over, and the
    flag's default as the command line would hand it over."""

    field: str
    flag: Flag
    takes: object
    default: object

    @property
    def name(self) -> str:
        return self.flag.names[0].split("/")[0]

    @property
    def param(self) -> str:
        """The command's parameter name: ``--trial-seconds`` -> ``trial_seconds``."""
        return self.name.lstrip("-").replace("-", "_")

    def read(self, value: object, found: list[str]) -> object:
        """The field's value (or its part's) from the command line's; a problem goes to
        ``found``."""
        form = self.flag.form
        if form is None:
            return value
        try:
            return form.read(value, self.name)
        except (UsageError, ValueError) as exc:
            found.append(str(exc))
            return form.unreadable


def flags_of(cls: type[DataclassInstance]) -> tuple[BoundFlag, ...]:
    """Every flag declared on the dataclass ``cls``, in field order."""
    hints = get_type_hints(cls)
    return tuple(_bind(f, flag, hints[f.name]) for f in fields(cls)
                 for flag in f.metadata.get("flags", ()))


def _default(f: Field[Any]) -> object:
    return f.default_factory() if callable(f.default_factory) else f.default


def _bind(f: Field[Any], flag: Flag, kind: object) -> BoundFlag:
    default = _default(f)
    if flag.part:
        kind, default = get_type_hints(type(default))[flag.part], getattr(default, flag.part)
    if flag.form is not None:
        kind, default = flag.form.takes, flag.form.write(default)
    return BoundFlag(f.name, flag, kind, default)


def read_flags(cls: type[_Options], bound: tuple[BoundFlag, ...],
               values: Mapping[str, object], found: list[str], **fixed: object) -> _Options:
    """``cls`` from a command's parameter values, named as ``BoundFlag.param`` names them (one
    not given keeps its field's default), and ``fixed`` field values; every value that does not
    read is one line in ``found``."""
    declared = {f.name: f for f in fields(cls)}
    # Each value is what its flag's form reads, the field's type (the tests read every default
    # back into the defaults); cls checks the names.
    given: dict[str, object] = dict(fixed)
    for flag in bound:
        if flag.param not in values:
            continue
        value = flag.read(values[flag.param], found)
        if flag.flag.part:
            whole = given[flag.field] if flag.field in given else _default(declared[flag.field])
            assert is_dataclass(whole) and not isinstance(whole, type)
            value = replace(whole, **{flag.flag.part: value})
        given[flag.field] = value
    return cls(**given)
