"""Search spaces: load and validate YAML, narrow to the hardware, turn into Optuna suggestions.

A space file declares knobs under ``knobs:``, each either ``{choices: [...]}`` or an integer range
``{low: L, high: H, log: false, step: 1}`` (``domains.py``). Every problem in a file is reported
at once. Narrowing (``narrowing.py``) removes what the hardware cannot run; a knob that does not
apply is fixed and recorded with the reason, never silently searched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from autotune.config.domains import Choices, Domain, IntRange, SearchSpace
from autotune.config.knobs import KNOBS
from autotune.config.narrowing import (
    NarrowedSpace,
    baseline_for_global_batch,
    check_global_batch,
    narrow,
)
from autotune.config.values import KnobValue
from autotune.errors import SpaceError, UsageError
from autotune.paths import data_dir

# Names other modules import from here; the narrowing ones live in narrowing.py.
__all__ = ["Choices", "Domain", "IntRange", "NarrowedSpace", "SearchSpace",
           "baseline_for_global_batch", "builtin_spaces", "check_global_batch", "load_space",
           "narrow", "parse_space", "resolve_space_path"]


def builtin_spaces() -> dict[str, Path]:
    """Search spaces that ship with autotune, by name."""
    root = data_dir("search_spaces")
    return {p.stem: p for p in sorted(root.glob("*.yaml"))}


def resolve_space_path(name_or_path: str) -> Path:
    """The file of a space: a path to a YAML file, or a built-in space's name."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise UsageError(f"search space file {name_or_path} does not exist; "
                             "pass a YAML file or a built-in name (see `autotune list`)")
        return path
    spaces = builtin_spaces()
    if name_or_path not in spaces:
        raise UsageError(f"unknown search space {name_or_path!r}; built-in spaces: "
                         f"{', '.join(sorted(spaces))}, or pass a path to a YAML file")
    return spaces[name_or_path]


def load_space(name_or_path: str) -> SearchSpace:
    """Load and validate a space; raises SpaceError listing every problem found."""
    path = resolve_space_path(name_or_path)
    source = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except UnicodeDecodeError:
        raise SpaceError(source, ["not text (a search space is a YAML file)"]) from None
    except OSError as exc:
        raise SpaceError(source, [f"cannot be read ({exc.strerror})"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", exc)
        raise SpaceError(source, [f"not valid YAML{where}: {problem}"]) from None
    return parse_space(data, name=path.stem, source=source)


def parse_space(data: Any, name: str, source: str) -> SearchSpace:
    """Validate a space file's parsed YAML; raises SpaceError listing every problem found."""
    problems: list[str] = []
    if not isinstance(data, dict) or not isinstance(data.get("knobs"), dict):
        raise SpaceError(source, ["the file must be a mapping with a 'knobs:' mapping inside"])
    for key in sorted(set(data) - {"knobs", "description"}):
        problems.append(f"unknown top-level key {key!r} (allowed: knobs, description)")
    knobs: dict[str, Domain] = {}
    for knob_name, spec in data["knobs"].items():
        if knob_name not in KNOBS:
            problems.append(f"unknown knob {knob_name!r} (known: {', '.join(KNOBS)})")
            continue
        domain = _parse_domain(knob_name, spec, problems)
        if domain is not None:
            knobs[knob_name] = domain
    if problems:
        raise SpaceError(source, problems)
    return SearchSpace(name=name, source=source, knobs=knobs)


def _parse_domain(name: str, spec: Any, problems: list[str]) -> Domain | None:
    if not isinstance(spec, dict):
        problems.append(f"knob {name}: expected {{choices: [...]}} or {{low: .., high: ..}}, "
                        f"got {spec!r}")
        return None
    if "choices" in spec:
        return _parse_choices(name, spec, problems)
    return _parse_range(name, spec, problems)


def _parse_choices(name: str, spec: dict[Any, Any], problems: list[str]) -> Choices | None:
    extra = sorted(set(spec) - {"choices"})
    if extra:
        problems.append(f"knob {name}: unknown keys {extra} next to 'choices'")
    raw = spec["choices"]
    if not isinstance(raw, list) or not raw:
        problems.append(f"knob {name}: choices must be a non-empty list, got {raw!r}")
        return None
    values: list[KnobValue] = []
    for value in raw:
        try:
            parsed = KNOBS[name].parse(value)
        except ValueError as exc:
            problems.append(f"knob {name}: {exc}")
            continue
        if parsed not in values:
            values.append(parsed)
    return Choices(tuple(values)) if values else None


def _parse_range(name: str, spec: dict[Any, Any], problems: list[str]) -> IntRange | None:
    extra = sorted(set(spec) - {"low", "high", "log", "step"})
    if extra or "low" not in spec or "high" not in spec:
        problems.append(f"knob {name}: a range needs 'low' and 'high' (optional 'log', 'step'); "
                        f"got keys {sorted(spec)}")
        return None
    try:
        low, high = KNOBS[name].parse(spec["low"]), KNOBS[name].parse(spec["high"])
    except ValueError as exc:
        problems.append(f"knob {name}: {exc}")
        return None
    if isinstance(low, bool) or not isinstance(low, int) or not isinstance(high, int):
        problems.append(f"knob {name}: ranges are for integer knobs; use choices")
        return None
    log, step = spec.get("log", False), spec.get("step", 1)
    if low > high:
        problems.append(f"knob {name}: low ({low}) must be <= high ({high})")
    if not isinstance(log, bool):
        problems.append(f"knob {name}: log must be true or false, got {log!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        problems.append(f"knob {name}: step must be an integer >= 1, got {step!r}")
    elif log and step != 1:
        problems.append(f"knob {name}: log ranges take no step (Optuna's rule), got step {step}")
    if log and low < 1:
        problems.append(f"knob {name}: a log range needs low >= 1, got {low}")
    return IntRange(low, high, bool(log), step if isinstance(step, int) else 1)
