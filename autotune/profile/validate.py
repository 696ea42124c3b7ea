"""A profile's dict form checked before it becomes a ``Profile``: the schema version, the blocks
it must hold, and every value against the knob registry. A profile is data that may have been
edited or downloaded, and what it holds goes into training, so a value outside the registry is
refused here, never passed on to torch or transformers. Every problem is named in one error.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Mapping
from typing import Any, Union, get_args, get_origin, get_type_hints, is_typeddict

from autotune.config.knobs import ENV_KNOBS, KNOBS, Config, parse_values
from autotune.errors import ProfileError
from autotune.profile.documents import (
    BaselineDoc,
    ConfirmationDoc,
    FindingDoc,
    IntervalDoc,
    ProbeDoc,
    ProvenanceDoc,
    ResultDoc,
)
from autotune.profile.schema import READS, SCHEMA, SCHEMA_VERSION, Profile

_SCHEMA_RE = re.compile(r"autotune\.profile/v(\d+)")
_MAPPINGS = ("workload", "config", "env", "result", "baseline", "fingerprint", "provenance")
_REQUIRED = ("schema", *_MAPPINGS, "speedup")
_OPTIONAL = (("confirmation", dict), ("notes", list), ("diagnosis", list), ("probe", dict),
             ("speedup_interval", dict))
# Each block's type (``documents``): what its readers may rely on once it has loaded.
_DOCUMENTS: dict[str, object] = {
    "result": ResultDoc, "baseline": BaselineDoc, "provenance": ProvenanceDoc,
    "confirmation": ConfirmationDoc, "probe": ProbeDoc, "diagnosis": list[FindingDoc],
    "notes": list[str], "speedup_interval": IntervalDoc}


def check_schema(schema: object, source: str) -> None:
    """Accept the versions this autotune reads; else name both versions, and which side must
    change."""
    if schema == SCHEMA:
        return
    found = _SCHEMA_RE.fullmatch(schema) if isinstance(schema, str) else None
    if found is None:
        raise ProfileError(f"{source} has schema {schema!r}, which is not an autotune profile "
                           f"schema; this autotune reads {SCHEMA!r}")
    if int(found.group(1)) in READS:
        return
    if int(found.group(1)) > SCHEMA_VERSION:
        raise ProfileError(f"{source} has schema {schema!r}, newer than this autotune reads "
                           f"({SCHEMA!r}): upgrade autotune to load it")
    raise ProfileError(f"{source} has schema {schema!r}, older than this autotune reads "
                       f"({SCHEMA!r}): re-export it with `autotune run` on its study")


def from_dict(data: Any, source: str = "<profile>") -> Profile:
    """Validate a profile's dict form; every problem is named in one error."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source} is not a profile: expected a mapping, got "
                           f"{type(data).__name__}; the file is damaged or not a profile")
    check_schema(data.get("schema"), source)
    problems = _shape_problems(data)
    config: Config | None = None
    values: list[str] = []  # what the knob registry refuses
    if isinstance(data.get("config"), dict):
        config, values = _config(data["config"], "config")
    if isinstance(data.get("baseline"), dict) and data["baseline"].get("config") is not None:
        values += _config(data["baseline"]["config"], "baseline.config")[1]
    if values:
        # Edited, not damaged: say which values, what they may be, and where that is written.
        raise ProfileError(f"{source}: {'; '.join(values + problems)}; a profile holds only "
                           "the values autotune's knob registry lists (docs/profiles.md): "
                           "correct it, or re-export the profile with `autotune run`")
    if problems or config is None:
        raise ProfileError(f"{source} {'; '.join(problems)}: the file is damaged or truncated; "
                           "re-export it with `autotune run` on its study")
    return Profile(workload=data["workload"], config=config, env=dict(data.get("env") or {}),
                   result=data["result"], baseline=data["baseline"], speedup=data["speedup"],
                   fingerprint=data["fingerprint"], provenance=data["provenance"],
                   notes=list(data.get("notes") or []),
                   confirmation=data.get("confirmation") or None,
                   probe=data.get("probe") or None, diagnosis=list(data.get("diagnosis") or []),
                   speedup_interval=data.get("speedup_interval") or None)


def _shape_problems(data: Mapping[str, Any]) -> list[str]:
    """What the dict form lacks, or holds in the wrong shape (the config's values apart)."""
    problems = [f"lacks {k}" for k in _REQUIRED if k not in data]
    problems += [f"{k} is not a mapping" for k in _MAPPINGS
                 if k in data and not isinstance(data[k], dict)
                 and not (k == "env" and data[k] is None)]
    if isinstance(data.get("result"), dict) and \
            not _positive(data["result"].get("samples_per_sec"), zero=True):
        # 0: a trial's candidate, written before anything was measured
        problems.append("has no result.samples_per_sec (a finite number >= 0)")
    env = data.get("env") or {}
    if isinstance(env, dict) and not all(isinstance(k, str) and isinstance(v, str)
                                         for k, v in env.items()):
        problems.append("has an env whose names and values are not all strings")
    elif isinstance(env, dict):
        problems += _env_problems(env)
    speedup = data.get("speedup")
    if speedup is not None and not _positive(speedup):
        problems.append(f"has a speedup that is not a positive number ({speedup!r})")
    for name, kind in _OPTIONAL:
        if data.get(name) is not None and not isinstance(data[name], kind):
            problems.append(f"has a {name} that is not a {'mapping' if kind is dict else 'list'}")
    for name, doc in _DOCUMENTS.items():
        if isinstance(data.get(name), dict | list):
            problems += [f"has {p}" for p in _mismatches(data[name], doc, name)]
    return problems


def _mismatches(value: object, hint: Any, where: str) -> list[str]:
    """Where ``value`` does not hold what the type ``hint`` (a block of ``documents``) says, one
    line each. Keys the type does not name pass: a later autotune may write more."""
    if where in _CHECKED_ELSEWHERE:
        return []
    origin = get_origin(hint)
    if is_typeddict(hint) or origin is dict:
        if not isinstance(value, dict):
            return [f"{where} that is not a mapping"]
        hints = get_type_hints(hint) if is_typeddict(hint) else \
            dict.fromkeys(value, get_args(hint)[1])
        return [line for k, v in value.items() if k in hints
                for line in _mismatches(v, hints[k], f"{where}.{_key(k)}")]
    if origin is list:
        if not isinstance(value, list):
            return [f"{where} that is not a list"]
        return [line for i, v in enumerate(value)
                for line in _mismatches(v, get_args(hint)[0], f"{where}[{i}]")]
    options = get_args(hint) if origin in (Union, types.UnionType) else (hint,)
    if value is None and type(None) in options or any(_is(value, o) for o in options):
        return []
    containers = [o for o in options if is_typeddict(o) or get_origin(o) in (dict, list)]
    if len(containers) == 1 and isinstance(value, dict | list):
        return _mismatches(value, containers[0], where)  # name the value inside that is wrong
    what = " or ".join(_NAMES.get(o, "a list" if get_origin(o) is list else "a mapping")
                       for o in options if not (o is int and float in options))
    text = repr(value)
    return [f"{where} = {text if len(text) <= 40 else text[:37] + '...'}, not {what}"]


# The config's values are the knob registry's to check (``_config``), with its own words.
_CHECKED_ELSEWHERE = {"baseline.config"}
_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          type(None): "null"}


def _is(value: object, kind: object) -> bool:
    """``value`` is a ``kind`` as YAML writes it: an integer is a number too, a bool is not."""
    if kind is object:
        return True
    if kind in (int, float) and isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, int | float)
    return kind in _NAMES and isinstance(kind, type) and isinstance(value, kind)


def _key(key: object) -> str:
    """A key from the file as a problem names it: escaped when it is not plain text."""
    return key if isinstance(key, str) and key.isprintable() else repr(key)


def _config(data: Any, key: str) -> tuple[Config | None, list[str]]:
    """A profile's config, every value checked against the knob registry, and a line for each
    value it refuses (naming the key, the value and the allowed values). A Hub id as the
    attention implementation, say, would download code."""
    if not isinstance(data, dict):
        return None, [f"{key} is not a mapping"]
    unknown = sorted(set(data) - set(Config.__dataclass_fields__))
    values, problems = parse_values(data)
    lines = [f"{key}.{p}" for p in problems]
    if unknown:
        lines.insert(0, f"{key} has keys no knob has ({', '.join(map(repr, unknown))})")
    return (None if lines else Config(**values)), lines


def _env_problems(env: Mapping[str, str]) -> list[str]:
    """The tuned variables' values, checked as their knobs check them (names autotune does not
    tune are refused where the env is applied, and shown by ``profile show``)."""
    problems = []
    for name, knob in ENV_KNOBS.items():
        if name in env:
            try:
                KNOBS[knob].parse(env[name])
            except ValueError as exc:
                problems.append(f"has env.{exc}")
    return problems


def _positive(value: object, zero: bool = False) -> bool:
    """A finite number above zero, or zero too (YAML's .nan and .inf are floats as well)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and \
        math.isfinite(value) and (value > 0 or (zero and value == 0))
