"""What each knob's value may be: the allowed names and limits, and the parsers that check a value
read from a file (a search space, a profile, a study) and give it its canonical spelling.

Each parser takes anything a YAML or JSON reader can return and either returns the value or raises
ValueError saying the rule and the value. The registry (``knobs.KNOBS``) pairs them with knobs.
"""

from __future__ import annotations

from collections.abc import Callable

# A knob's value, as a config holds it and its dict form stores it.
KnobValue = int | str | bool | None

AMP_MODES = ("off", "fp16", "bf16")
# NCCL_ALGO and NCCL_PROTO values, each with the first NCCL release that knows it (release notes:
# Tree 2.4, LL128 2.5, CollNetDirect/CollNetChain 2.14, NVLS 2.17, NVLSTree 2.18, PAT 2.23).
NCCL_ALGOS = {"Tree": (2, 4), "Ring": (0, 0), "CollNetDirect": (2, 14), "CollNetChain": (2, 14),
              "NVLS": (2, 17), "NVLSTree": (2, 18), "PAT": (2, 23)}
NCCL_PROTOS = {"LL": (0, 0), "LL128": (2, 5), "Simple": (0, 0)}
# torch.compile modes; "off" runs the model eagerly. reduce-overhead uses CUDA graphs.
COMPILE_MODES = ("off", "default", "max-autotune-no-cudagraphs", "reduce-overhead")
# How the optimizer steps: "default" leaves it as the workload built it (torch then picks
# foreach on CUDA, the for-loop on CPU).
OPTIMIZER_IMPLS = ("default", "for-loop", "foreach", "fused")
# fp32 matmuls: "highest" (IEEE fp32) or "high" (TF32 on NVIDIA GPUs of compute capability 8.0+).
MATMUL_PRECISIONS = ("highest", "high")
# How the ranks hold the model (``trial/shard.py``): replicated (DDP), or sharded by FSDP2 with
# the parameters kept gathered from forward to backward (ZeRO-2-like), gathered again for backward
# (ZeRO-3-like), or sharded within each node and replicated across nodes (a 2-D mesh).
SHARDINGS = ("replicated", "shard-grad-op", "full-shard", "hybrid-shard")
# The dtype FSDP reduces gradients in under amp: fp32, or the amp dtype itself (half the bytes).
REDUCE_DTYPES = ("fp32", "amp")
# The attention implementation of a transformers model; "default" is the model's own choice.
ATTENTIONS = ("default", "eager", "sdpa", "flash_attention_2")
# The largest value each integer knob takes: far beyond any machine (a 2**62 micro-batch
# overflows the sample count; a billion threads aborts the process inside libgomp).
MAX_BATCH = 2**24
MAX_ACCUM = 2**16
MAX_BUCKET_MB = 2**16
MAX_WORKERS = 1024
MAX_PREFETCH = 1024
MAX_THREADS = 4096
MAX_WORLD = 2**17


def int_in(minimum: int, maximum: int) -> Callable[[object], int]:
    """An integer knob's parser. The upper bound is far above any machine's need; it keeps a
    value from a hand-edited file (2**62 samples, a billion threads) from reaching torch, where
    it overflows a count or aborts the process inside OpenMP."""

    def parse(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer from {minimum} to {maximum}, got {value!r}")
        if not minimum <= value <= maximum:
            raise ValueError(f"must be an integer from {minimum} to {maximum}, got {value}")
        return value

    return parse


def parse_amp(value: object) -> str:
    """``off``, ``fp16`` or ``bf16``, any case."""
    # YAML 1.1 reads a bare `off` as False; accept it rather than make users quote it.
    if value is False:
        return "off"
    if not isinstance(value, str) or value.lower() not in AMP_MODES:
        raise ValueError(f"must be one of {list(AMP_MODES)}, got {value!r}")
    return value.lower()


def one_of(values: tuple[str, ...]) -> Callable[[object], str]:
    """A parser that takes exactly one of ``values``."""

    def parse(value: object) -> str:
        if value is False and "off" in values:  # YAML 1.1 reads a bare `off` as False
            return "off"
        if not isinstance(value, str) or value not in values:
            raise ValueError(f"must be one of {list(values)}, got {value!r}")
        return value

    return parse


def parse_bool(value: object) -> bool:
    """``true`` or ``false``; no truthy strings or numbers."""
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


def parse_world(value: object) -> int:
    """The number of ranks."""
    return int_in(1, MAX_WORLD)(value)


def nccl_values(table: dict[str, tuple[int, int]], variable: str) -> Callable[[object], str]:
    """Parse 'default' or a comma-separated list of NCCL names, case-insensitively, into their
    canonical spelling (NCCL itself is case-insensitive; the profile should read the same)."""
    canonical = {name.lower(): name for name in table}

    def parse(value: object) -> str:
        allowed = f"'default' or a comma-separated list of {list(table)}"
        if not isinstance(value, str):
            raise ValueError(f"{variable} must be {allowed}, got {value!r}")
        if value.strip().lower() == "default":
            return "default"
        parts = [p.strip() for p in value.split(",")]
        bad = [p for p in parts if p.lower() not in canonical]
        if bad:
            raise ValueError(f"{variable} must be {allowed}, got {value!r}")
        return ",".join(canonical[p.lower()] for p in parts)

    return parse
