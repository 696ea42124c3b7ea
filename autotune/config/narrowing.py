"""A search space narrowed to the hardware: what a study searches there, what was fixed or removed
and why, and how Optuna's suggestions become configs.

Narrowing keeps what this hardware can run (``rules.py``, through the registry), keeps the
baseline's values measurable, and with ``--global-batch`` keeps only the micro-batch sizes that
divide it, deriving the accumulation from them. Pure: Optuna is only a type here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypedDict

from autotune.config.domains import (
    Choices,
    ChoicesForm,
    Domain,
    IntRange,
    RangeForm,
    SearchSpace,
    show,
)
from autotune.config.knobs import DECLARED, KNOBS, Config
from autotune.config.rules import Machine, sharding_value
from autotune.config.values import KnobValue
from autotune.errors import UsageError


class Suggests(Protocol):
    """What ``suggest`` asks of a trial (an ``optuna.Trial``: config does not import Optuna)."""

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any: ...
    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1,
                    log: bool = False) -> int: ...

# What was dropped from a knob's domain (a value, or a span of them such as "33..64"), and why.
Removed = dict[str, list[tuple[KnobValue, str]]]


class Reasoned(TypedDict):
    """A fixed or removed value with its reason, as a study stores it."""

    value: KnobValue
    reason: str


class NarrowedSpaceForm(TypedDict):
    """``NarrowedSpace`` as a study stores it."""

    name: str
    source: str
    world_size: int
    global_batch: int | None
    derived: dict[str, str]
    searched: dict[str, ChoicesForm | RangeForm]
    fixed: dict[str, Reasoned]
    removed: dict[str, list[Reasoned]]


@dataclass(frozen=True)
class NarrowedSpace:
    """The space this study searches on this hardware, and what was fixed or removed, and why."""

    name: str
    source: str
    searched: dict[str, Domain]
    fixed: dict[str, tuple[KnobValue, str]]  # knob -> (value, reason)
    removed: Removed = field(default_factory=dict)
    world_size: int = 1
    # With --global-batch B, accumulation follows from the micro-batch: B / (micro x ranks).
    global_batch: int | None = None
    derived: dict[str, str] = field(default_factory=dict)  # knob -> how it is computed

    def suggest(self, trial: Suggests, baseline: Config) -> Config:
        """Ask Optuna for one config (define-by-run, so conditional knobs stay conditional:
        a knob whose condition fails is not asked for, and takes its fallback value)."""
        values: dict[str, KnobValue] = {name: value for name, (value, _) in self.fixed.items()}
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
            if knob.when is not None \
                    and not knob.when[1](*(value_of(n) for n in knob.when[0])):
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

    def params_for(self, config: Config) -> dict[str, KnobValue]:
        """Optuna params that make a trial run ``config`` (for enqueueing the baseline)."""
        data = config.to_dict()
        return {name: data[name] for name in self.searched if KNOBS[name].active(data)}

    def describe(self) -> list[str]:
        lines = [f"  {name:<18} {d.describe()}" for name, d in self.searched.items()]
        for name, pairs in self.removed.items():
            for value, why in pairs:
                lines.append(f"  {name:<18} dropped {show(value)}: {why}")
        for name, how in self.derived.items():
            lines.append(f"  {name:<18} derived: {how}")
        for name, (value, why) in self.fixed.items():
            lines.append(f"  {name:<18} fixed to {show(value)}: {why}")
        return lines

    def to_dict(self) -> NarrowedSpaceForm:
        return {
            "name": self.name,
            "source": self.source,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "derived": dict(self.derived),
            "searched": {k: d.to_dict() for k, d in self.searched.items()},
            "fixed": {k: {"value": v, "reason": why} for k, (v, why) in self.fixed.items()},
            "removed": {k: [{"value": v, "reason": why} for v, why in pairs]
                        for k, pairs in self.removed.items()},
        }


def _suggest_one(trial: Suggests, name: str, domain: Domain) -> Any:
    if isinstance(domain, Choices):
        return trial.suggest_categorical(name, list(domain.values))
    return trial.suggest_int(name, domain.low, domain.high, log=domain.log, step=domain.step)


def _config(values: Mapping[str, KnobValue], baseline: Config, world_size: int) -> Config:
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
                     removed: Removed) -> Choices:
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


def narrow(space: SearchSpace, hw: Machine, world_size: int, baseline: Config,
           global_batch: int | None = None, supports: Collection[str] = (),
           workload: str = "the workload", nodes: int = 1) -> NarrowedSpace:
    """Keep what this hardware can run; the baseline's values always stay in the space.

    With ``global_batch``, only micro-batch sizes that divide it (per rank) stay, and the
    accumulation is derived from them. The knobs that change the model or its optimizer
    (``DECLARED``) are searched only when the workload names them in ``supports``. Raises
    UsageError when a knob loses every value it had. Hybrid sharding needs ``nodes`` > 1.
    """
    base = baseline.to_dict()
    searched: dict[str, Domain] = {}
    fixed: dict[str, tuple[KnobValue, str]] = {}
    removed: Removed = {}
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
            why = knob.value_ok(value, hw, world_size) or (
                sharding_value(value, nodes) if name == "sharding" else None)
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


def _narrow_range(name: str, domain: IntRange, hw: Machine, world_size: int, base: Any,
                  removed: Removed) -> IntRange:
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

