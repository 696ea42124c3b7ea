"""Search spaces: load and validate YAML, narrow to the hardware, turn into Optuna suggestions.

A space file declares knobs under ``knobs:``, each either ``{choices: [...]}`` or an integer range
``{low: L, high: H, log: false, step: 1}``. Every problem in a file is reported at once. Narrowing
removes what the hardware cannot run; a knob that does not apply is fixed and recorded with the
reason, never silently searched.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autotune.config.knobs import DECLARED, KNOBS, Config
from autotune.errors import SpaceError, UsageError
from autotune.paths import data_dir

if TYPE_CHECKING:
    import optuna

    from autotune.machine.hardware import Hardware


@dataclass(frozen=True)
class Choices:
    values: tuple[Any, ...]

    def describe(self) -> str:
        return "{" + ", ".join(_show(v) for v in self.values) + "}"


@dataclass(frozen=True)
class IntRange:
    low: int
    high: int
    log: bool = False
    step: int = 1

    def describe(self) -> str:
        scale = ", log" if self.log else (f", step {self.step}" if self.step != 1 else "")
        return f"[{self.low} .. {self.high}{scale}]"

    def contains(self, value: int) -> bool:
        return self.low <= value <= self.high and (value - self.low) % self.step == 0


Domain = Choices | IntRange


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class SearchSpace:
    """A validated space file: knob name -> domain."""

    name: str
    source: str
    knobs: dict[str, Domain]


def builtin_spaces() -> dict[str, Path]:
    """Search spaces that ship with autotune, by name."""
    root = data_dir("search_spaces")
    return {p.stem: p for p in sorted(root.glob("*.yaml"))}


def resolve_space_path(name_or_path: str) -> Path:
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
    knob = KNOBS[name]
    if not isinstance(spec, dict):
        problems.append(f"knob {name}: expected {{choices: [...]}} or {{low: .., high: ..}}, "
                        f"got {spec!r}")
        return None
    if "choices" in spec:
        extra = sorted(set(spec) - {"choices"})
        if extra:
            problems.append(f"knob {name}: unknown keys {extra} next to 'choices'")
        raw = spec["choices"]
        if not isinstance(raw, list) or not raw:
            problems.append(f"knob {name}: choices must be a non-empty list, got {raw!r}")
            return None
        values: list[Any] = []
        for value in raw:
            try:
                parsed = knob.parse(value)
            except ValueError as exc:
                problems.append(f"knob {name}: {exc}")
                continue
            if parsed not in values:
                values.append(parsed)
        return Choices(tuple(values)) if values else None
    extra = sorted(set(spec) - {"low", "high", "log", "step"})
    if extra or "low" not in spec or "high" not in spec:
        problems.append(f"knob {name}: a range needs 'low' and 'high' (optional 'log', 'step'); "
                        f"got keys {sorted(spec)}")
        return None
    try:
        low, high = knob.parse(spec["low"]), knob.parse(spec["high"])
    except ValueError as exc:
        problems.append(f"knob {name}: {exc}")
        return None
    if not isinstance(low, int) or isinstance(low, bool):
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


@dataclass(frozen=True)
class NarrowedSpace:
    """The space this study searches on this hardware, and what was fixed or removed, and why."""

    name: str
    source: str
    searched: dict[str, Domain]
    fixed: dict[str, tuple[Any, str]]  # knob -> (value, reason)
    removed: dict[str, list[tuple[Any, str]]] = field(default_factory=dict)
    world_size: int = 1
    # With --global-batch B, accumulation follows from the micro-batch: B / (micro x ranks).
    global_batch: int | None = None
    derived: dict[str, str] = field(default_factory=dict)  # knob -> how it is computed

    def suggest(self, trial: optuna.Trial, baseline: Config) -> Config:
        """Ask Optuna for one config (define-by-run, so conditional knobs stay conditional:
        a knob whose condition fails is not asked for, and takes its fallback value)."""
        values: dict[str, Any] = {name: value for name, (value, _) in self.fixed.items()}
        base = baseline.to_dict()

        def value_of(name: str) -> Any:
            if name not in values:
                if name in self.derived:
                    values[name] = self._derived_value(name, value_of("micro_batch_size"))
                elif name in self.searched:
                    values[name] = _suggest_one(trial, name, self.searched[name])
                else:
                    values[name] = base[name]
            return values[name]

        for name in self.searched:
            knob = KNOBS[name]
            if knob.when is not None and not knob.when[1](value_of(knob.when[0])):
                values[name] = knob.when[2]
            else:
                value_of(name)
        for name in self.derived:
            value_of(name)
        return _config(values, baseline, self.world_size)

    def _derived_value(self, name: str, micro: int) -> int:
        assert name == "grad_accum_steps" and self.global_batch is not None
        return self.global_batch // self.world_size // micro

    def variant(self, base: Config, **changes: Any) -> Config:
        """``base`` with ``changes``, then the space's fixed values, derived knobs and
        conditions applied: the config a trial enqueued with ``params_for`` of it would run."""
        values = {**base.to_dict(), **{n: v for n, (v, _) in self.fixed.items()}, **changes}
        for name in self.derived:
            values[name] = self._derived_value(name, values["micro_batch_size"])
        return _config(values, base, self.world_size)

    def fix(self, reasons: dict[str, str], baseline: Config) -> NarrowedSpace:
        """This space with the named searched knobs fixed at their baseline, for the reasons
        given (a script that never applies them)."""
        base = baseline.to_dict()
        moved = {k: (base[k], why) for k, why in reasons.items() if k in self.searched}
        return replace(self, searched={k: d for k, d in self.searched.items() if k not in moved},
                       fixed={**self.fixed, **moved})

    def params_for(self, config: Config) -> dict[str, Any]:
        """Optuna params that make a trial run ``config`` (for enqueueing the baseline)."""
        data = config.to_dict()
        return {name: data[name] for name in self.searched if KNOBS[name].active(data)}

    def describe(self) -> list[str]:
        lines = [f"  {name:<18} {d.describe()}" for name, d in self.searched.items()]
        for name, pairs in self.removed.items():
            for value, why in pairs:
                lines.append(f"  {name:<18} dropped {_show(value)}: {why}")
        for name, how in self.derived.items():
            lines.append(f"  {name:<18} derived: {how}")
        for name, (value, why) in self.fixed.items():
            lines.append(f"  {name:<18} fixed to {_show(value)}: {why}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        def domain(d: Domain) -> dict[str, Any]:
            if isinstance(d, Choices):
                return {"choices": list(d.values)}
            return {"low": d.low, "high": d.high, "log": d.log, "step": d.step}

        return {
            "name": self.name,
            "source": self.source,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "derived": dict(self.derived),
            "searched": {k: domain(d) for k, d in self.searched.items()},
            "fixed": {k: {"value": v, "reason": why} for k, (v, why) in self.fixed.items()},
            "removed": {k: [{"value": v, "reason": why} for v, why in pairs]
                        for k, pairs in self.removed.items()},
        }


def _suggest_one(trial: optuna.Trial, name: str, domain: Domain) -> Any:
    if isinstance(domain, Choices):
        return trial.suggest_categorical(name, list(domain.values))
    return trial.suggest_int(name, domain.low, domain.high, log=domain.log, step=domain.step)


def _config(values: dict[str, Any], baseline: Config, world_size: int) -> Config:
    merged = baseline.to_dict()
    merged.update(values)
    merged["world_size"] = world_size
    for name, knob in KNOBS.items():
        if knob.when is not None and not knob.active(merged):
            merged[name] = knob.when[2]
    if merged["num_workers"] and merged["prefetch_factor"] is None:
        merged["prefetch_factor"] = 2  # DataLoader's default with workers
    return Config.from_dict(merged)


def check_global_batch(global_batch: int, world_size: int) -> int:
    """Samples per rank per optimizer step for ``--global-batch``; UsageError when impossible."""
    if global_batch < 1:
        raise UsageError(f"--global-batch must be >= 1, got {global_batch}")
    if global_batch % world_size:
        raise UsageError(f"--global-batch {global_batch} is not divisible by the {world_size} "
                         f"ranks (--nproc); pass a multiple of {world_size}")
    return global_batch // world_size


def _divisor_choices(domain: Domain, per_rank: int, global_batch: int, world_size: int,
                     removed: dict[str, list[tuple[Any, str]]]) -> Choices:
    """The micro-batch sizes of ``domain`` that divide the samples each rank takes per step."""
    if isinstance(domain, IntRange):
        values = [v for v in range(domain.low, min(domain.high, per_rank) + 1, domain.step)
                  if per_rank % v == 0]
    else:
        values = list(domain.values)
    why = (f"does not divide --global-batch {global_batch} / {world_size} rank(s) = {per_rank} "
           "samples per rank")
    keep = [v for v in values if per_rank % v == 0]
    above = [v for v in values if v > per_rank]
    for v in values:
        if per_rank % v and v <= per_rank:
            removed.setdefault("micro_batch_size", []).append((v, why))
    if above:  # the open-ended default space: one line, not a dozen
        span = f"{above[0]}..{above[-1]}" if len(above) > 1 else above[0]
        removed.setdefault("micro_batch_size", []).append(
            (span, f"larger than the {per_rank} samples per rank of --global-batch "
                   f"{global_batch} / {world_size} rank(s)"))
    if not keep:
        raise UsageError(f"no micro_batch_size in the search space divides --global-batch "
                         f"{global_batch} / {world_size} rank(s) = {per_rank}; pass a global "
                         "batch that is a multiple of a searched micro-batch size x ranks")
    return Choices(tuple(keep))


def baseline_for_global_batch(default_micro: int, global_batch: int, world_size: int) -> Config:
    """What a user runs untuned at this global batch: the workload's default micro-batch, or
    the largest divisor of the per-rank batch below it, with the accumulation that completes it."""
    per_rank = check_global_batch(global_batch, world_size)
    micro = max(d for d in range(1, min(default_micro, per_rank) + 1) if per_rank % d == 0)
    return Config(micro_batch_size=micro, grad_accum_steps=per_rank // micro,
                  world_size=world_size)


def narrow(space: SearchSpace, hw: Hardware, world_size: int, baseline: Config,
           global_batch: int | None = None, supports: Collection[str] = (),
           workload: str = "the workload") -> NarrowedSpace:
    """Keep what this hardware can run; the baseline's values always stay in the space.

    With ``global_batch``, only micro-batch sizes that divide it (per rank) stay, and the
    accumulation is derived from them. The knobs that change the model or its optimizer
    (``DECLARED``) are searched only when the workload names them in ``supports``. Raises
    UsageError when a knob loses every value it had.
    """
    base = baseline.to_dict()
    searched: dict[str, Domain] = {}
    fixed: dict[str, tuple[Any, str]] = {}
    removed: dict[str, list[tuple[Any, str]]] = {}
    derived: dict[str, str] = {}
    knobs = dict(space.knobs)
    if global_batch is not None:
        per_rank = check_global_batch(global_batch, world_size)
        micro = knobs.get("micro_batch_size", Choices((baseline.micro_batch_size,)))
        knobs["micro_batch_size"] = _divisor_choices(micro, per_rank, global_batch, world_size,
                                                     removed)
        knobs.pop("grad_accum_steps", None)
        derived["grad_accum_steps"] = (f"--global-batch {global_batch} / (micro_batch_size x "
                                       f"{world_size} rank(s))")
    for name, knob in KNOBS.items():
        if name in derived:
            continue
        domain = knobs.get(name)
        if domain is None:
            fixed[name] = (base[name], f"not in search space {space.name}")
            continue
        why_not = knob.applies(hw, world_size)
        if not why_not and name in DECLARED and name not in supports:
            why_not = (f"{workload} does not declare it (a workload lists the model knobs it "
                       "takes in `supports`)")
        if why_not:
            fixed[name] = (base[name], why_not)
            continue
        if isinstance(domain, IntRange):
            searched[name] = _narrow_range(name, domain, hw, world_size, base[name], removed)
            continue
        keep = []
        for value in domain.values:
            why = knob.value_ok(value, hw, world_size)
            if why:
                removed.setdefault(name, []).append((value, why))
            else:
                keep.append(value)
        if base[name] is not None and base[name] not in keep and name != "prefetch_factor":
            keep.insert(0, base[name])  # the baseline is always measurable
        if not keep:
            raise UsageError(f"knob {name} has no value this hardware can run "
                             f"({removed.get(name)}); widen it in {space.source}")
        if len(keep) == 1:
            fixed[name] = (keep[0], "only one value left")
        else:
            searched[name] = Choices(tuple(keep))
    for name, (value, _) in list(fixed.items()):
        # A fixed knob still has to be runnable (e.g. a space that fixes prefetch without workers).
        if value is None and name != "prefetch_factor":
            raise UsageError(f"knob {name} has no value; add it to {space.source}")
    return NarrowedSpace(space.name, space.source, searched, fixed, removed, world_size,
                         global_batch, derived)


def _narrow_range(name: str, domain: IntRange, hw: Hardware, world_size: int, base: Any,
                  removed: dict[str, list[tuple[Any, str]]]) -> IntRange:
    """Clip an integer range to the values this hardware can run, and widen it to hold the
    baseline's value (a range must stay a range: it cannot have holes)."""
    values = range(domain.low, domain.high + 1, domain.step)
    if len(values) <= 4096:
        why = {v: KNOBS[name].value_ok(v, hw, world_size) for v in values}
        keep = [v for v in values if not why[v]]
        dropped = [v for v in values if why[v]]
        if not keep:
            raise UsageError(f"knob {name} has no value this hardware can run "
                             f"({why[values[0]]}); change its range")
        if any(keep[0] < v < keep[-1] for v in dropped):
            raise UsageError(f"knob {name}: this hardware cannot run values inside the range "
                             f"{domain.low}..{domain.high}; list the values as choices instead")
        if dropped:
            removed.setdefault(name, []).append(
                (f"{dropped[0]}..{dropped[-1]}", str(why[dropped[0]])))
        domain = replace(domain, low=keep[0], high=keep[-1])
    if base is not None and not domain.contains(base):
        if (base - domain.low) % domain.step:
            raise UsageError(f"knob {name}: the baseline value {base} is not on the range's step "
                             f"{domain.step}; the baseline must be measurable: adjust low/step")
        domain = replace(domain, low=min(domain.low, base), high=max(domain.high, base))
    return domain

