"""The one contract between the tuner and a trial: what to measure and how.

The tuner builds a ``TrialSpec``; ``trial.launch`` writes its JSON form next to the trial; the
trial process (``trial.bench``) reads it back with ``TrialSpec.from_json``. The measuring settings
and their defaults are defined here once: the CLI's flags, the runner's budget text, the
confirmation's longer windows and the in-trial loop all read them from ``MeasureSettings``. The
answer travels the other way as one JSON document (``trial.result``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from autotune.config.knobs import Config
from autotune.trial.reports import finite_number
from autotune.workloads import WorkloadSpec

# ``flops_source`` of a FLOPs-per-sample figure a trial counted with PyTorch's FLOP counter.
COUNTED = "torch.utils.flop_counter"


@dataclass(frozen=True)
class MeasureSettings:
    """How a trial measures; the defaults are what ``autotune run`` uses without flags.

    Warm-up runs whole optimizer steps until two in a row agree within ``warmup_tolerance``
    (between ``warmup_min_steps`` and ``warmup_max_steps``); then timed windows of at least
    ``min_window_s`` each, until ``min_windows`` agree within ``target_cv``, or
    ``max_windows``, or ``max_seconds`` (warm-up included) is spent.
    """

    min_window_s: float = 1.0
    min_windows: int = 3
    max_windows: int = 10
    target_cv: float = 0.03
    max_seconds: float = 60.0  # measuring budget per trial, warm-up included
    warmup_min_steps: int = 2
    warmup_max_steps: int = 8
    warmup_tolerance: float = 0.15
    # A config that compiles (torch.compile) gets its first optimizer step, where compilation
    # happens, before warm-up and outside the measuring budget, and at most this long.
    max_compile_s: float = 120.0
    # All-reduce on every micro-step instead of only the last (no no_sync): for benchmarks that
    # show what no_sync gains; never searched.
    sync_each_micro: bool = False
    # Time the all-reduce through a DDP communication hook (multi-rank trials). Off only in the
    # benchmark that measures what the hook itself costs.
    time_comm: bool = True
    # Trials of the user's own script (``autotune run -- CMD``): how long it may run before
    # every rank reported a first step, and how long it gets to stop by itself once measured.
    no_progress_s: float = 120.0
    stop_grace_s: float = 10.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_longer_windows(self, factor: float = 2.0) -> MeasureSettings:
        """These settings with windows ``factor`` times as long (the confirmation's)."""
        return replace(self, min_window_s=factor * self.min_window_s)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, strict: bool = True) -> MeasureSettings:
        """Settings from their dict form, missing keys at their defaults. Unknown keys are an
        error, or, with ``strict=False`` (settings recorded by another autotune version),
        ignored."""
        data = dict(data or {})
        defaults = {f.name: f.default for f in fields(cls)}
        unknown = sorted(set(data) - set(defaults))
        if unknown and strict:
            raise ValueError(f"unknown measure settings {unknown}; known: {sorted(defaults)}")
        values = {k: v for k, v in data.items() if k in defaults}
        for name, value in values.items():
            kind = type(defaults[name])
            ok = isinstance(value, bool) if kind is bool else \
                isinstance(value, int | float) and not isinstance(value, bool) and \
                (kind is float or isinstance(value, int))
            if not ok:
                raise ValueError(f"measure setting {name} must be {kind.__name__}, got "
                                 f"{value!r}")
        converted: dict[str, Any] = {k: float(v) if type(defaults[k]) is float else v
                                     for k, v in values.items()}
        return cls(**converted)

    @classmethod
    def same(cls, recorded: Mapping[str, Any] | None, settings: MeasureSettings) -> bool:
        """Whether settings recorded on a trial (in full, or only the keys given then, as
        studies made before this form recorded them) are ``settings``."""
        return isinstance(recorded, Mapping) and cls.from_dict(recorded, strict=False) == settings


@dataclass(frozen=True)
class TrialSpec:
    """Everything a trial process needs: the workload, the config, the device, the measuring
    settings, the memory limit (enforced inside a CUDA trial by the caching allocator), an
    address-space limit (tests), and the study's FLOPs per sample, or a request to count it."""

    workload: WorkloadSpec
    config: Config
    device: str = "cpu"
    measure: MeasureSettings = field(default_factory=MeasureSettings)
    memory_limit_bytes: int | None = None
    address_space_bytes: int | None = None
    flops_per_sample: float | None = None
    flops_source: str | None = None
    count_flops: bool = False
    # The precisions the sentinel reads (``trial.sentinel``): a study's; none, no reading.
    sentinel: tuple[str, ...] = ()
    # The wall clock (time.time()) at which the trial's timeout ends it: written by the
    # launcher as it starts the trial, so a trial that cannot warm up and time a window by
    # then stops itself, as too slow, instead of being killed with nothing.
    ends_by: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"workload": {"spec": self.workload.spec, "params": dict(self.workload.params)},
                "config": self.config.to_dict(), "device": self.device,
                "measure": self.measure.to_dict(),
                "memory_limit_bytes": self.memory_limit_bytes,
                "address_space_bytes": self.address_space_bytes,
                "flops": ({"per_sample": self.flops_per_sample, "source": self.flops_source}
                          if self.flops_per_sample else {}),
                "count_flops": self.count_flops,
                **({"sentinel": list(self.sentinel)} if self.sentinel else {}),
                **({"ends_by": self.ends_by} if self.ends_by is not None else {})}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> TrialSpec:
        flops = doc.get("flops") or {}
        return cls(workload=WorkloadSpec(doc["workload"]["spec"],
                                         dict(doc["workload"].get("params") or {})),
                   config=Config.from_dict(doc["config"]), device=doc.get("device", "cpu"),
                   measure=MeasureSettings.from_dict(doc.get("measure")),
                   memory_limit_bytes=doc.get("memory_limit_bytes"),
                   address_space_bytes=doc.get("address_space_bytes"),
                   flops_per_sample=flops.get("per_sample"), flops_source=flops.get("source"),
                   count_flops=bool(doc.get("count_flops")),
                   sentinel=tuple(str(p) for p in doc.get("sentinel") or ()),
                   ends_by=finite_number(dict(doc), "ends_by"))

