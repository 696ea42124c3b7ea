"""The knob registry and the config type.

A knob is one system setting the tuner may change. Each knob knows how to parse a value from a
search-space file, its baseline value (what a user runs without tuning), and when it does not apply
to the hardware at hand. How a knob is applied inside a trial lives in ``bench.py`` (the only code
that runs in the trial process); ``env_for`` below covers the knobs applied through the environment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.hardware import Hardware

AMP_MODES = ("off", "fp16", "bf16")
NCCL_ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")


@dataclass(frozen=True)
class Config:
    """One point of the search space: a frozen, typed value with a stable dict form.

    The defaults are the baseline: what a PyTorch user runs without tuning (fp32, accumulation 1,
    no loader workers, DDP's default 25 MB buckets, NCCL left to decide). The micro-batch default is
    replaced by the workload's own default batch.
    """

    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    amp: str = "off"
    ddp_bucket_cap_mb: int = 25
    nccl_algo: str = "default"
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    world_size: int = 1

    @property
    def samples_per_step(self) -> int:
        """Global samples per optimizer step: micro-batch x accumulation x ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """Build a config from its dict form; unknown keys are an error, missing ones default."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {sorted(names)}")
        return cls(**dict(data))


def _int_at_least(minimum: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer >= {minimum}, got {value!r}")
        if value < minimum:
            raise ValueError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _parse_amp(value: Any) -> str:
    # YAML 1.1 reads a bare `off` as False; accept it rather than make users quote it.
    if value is False:
        return "off"
    if not isinstance(value, str) or value.lower() not in AMP_MODES:
        raise ValueError(f"must be one of {list(AMP_MODES)}, got {value!r}")
    return value.lower()


def _parse_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


def _parse_nccl_algo(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be 'default' or one of {list(NCCL_ALGOS)}, got {value!r}")
    if value.lower() == "default":
        return "default"
    canonical = {a.lower(): a for a in NCCL_ALGOS}
    parts = [p.strip() for p in value.split(",")]
    bad = [p for p in parts if p.lower() not in canonical]
    if bad:
        raise ValueError(f"must be 'default' or one of {list(NCCL_ALGOS)}, got {value!r}")
    return ",".join(canonical[p.lower()] for p in parts)


def _needs_ranks(hw: Hardware, world_size: int) -> str | None:
    if world_size <= 1:
        return "DDP is only used with more than one rank (world size 1)"
    return None


def _needs_nccl(hw: Hardware, world_size: int) -> str | None:
    if hw.device != "cuda":
        return "NCCL knobs need the nccl backend (no CUDA GPU here)"
    if world_size <= 1:
        return "NCCL knobs need more than one rank (world size 1)"
    return None


def _needs_gpu(hw: Hardware, world_size: int) -> str | None:
    if hw.device != "cuda":
        return "pin_memory only speeds up host-to-GPU copies (no CUDA GPU here)"
    return None


def _amp_value(value: Any, hw: Hardware, world_size: int) -> str | None:
    if value == "fp16" and not hw.supports_fp16:
        return "fp16 autocast is not a training precision on this device"
    if value == "bf16" and not hw.supports_bf16:
        if hw.device == "cuda":
            return "bf16 needs compute capability >= 8.0"
        return "this CPU has no native bf16 (avx512_bf16 or amx_bf16); it would be emulated"
    return None


def _workers_value(value: Any, hw: Hardware, world_size: int) -> str | None:
    if value * world_size > hw.cpu_cores:
        return f"{value} workers x {world_size} rank(s) exceed the {hw.cpu_cores} CPU cores"
    return None


@dataclass(frozen=True)
class Knob:
    """One tunable setting: how to parse it, and when it (or one of its values) does not apply."""

    name: str
    help: str
    parse: Callable[[Any], Any]
    # Returns why the whole knob does not apply here, or None.
    applies: Callable[[Hardware, int], str | None] = lambda hw, world: None
    # Returns why one value cannot run here, or None.
    value_ok: Callable[[Any, Hardware, int], str | None] = lambda value, hw, world: None
    # Name of a knob that must be > 0 for this one to matter (prefetch needs workers).
    only_when_positive: str | None = None


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("micro_batch_size", "samples per forward/backward on each rank", _int_at_least(1)),
        Knob("grad_accum_steps", "micro-batches per optimizer step", _int_at_least(1)),
        Knob("amp", "autocast precision: off (fp32), fp16 or bf16", _parse_amp,
             value_ok=_amp_value),
        Knob("ddp_bucket_cap_mb", "DDP gradient bucket size in MB", _int_at_least(1),
             applies=_needs_ranks),
        Knob("nccl_algo", "NCCL_ALGO for the ranks; default lets NCCL decide", _parse_nccl_algo,
             applies=_needs_nccl),
        Knob("num_workers", "DataLoader worker processes per rank", _int_at_least(0),
             value_ok=_workers_value),
        Knob("pin_memory", "DataLoader pin_memory", _parse_bool, applies=_needs_gpu),
        Knob("prefetch_factor", "batches each loader worker prepares ahead", _int_at_least(1),
             only_when_positive="num_workers"),
    )
}


def env_for(config: Config) -> dict[str, str]:
    """The environment variables a config sets in the trial (and later in training) processes.

    NCCL reads these when the process group starts, so they must be in place before that.
    """
    env: dict[str, str] = {}
    if config.nccl_algo != "default" and config.world_size > 1:
        env["NCCL_ALGO"] = config.nccl_algo
    return env
