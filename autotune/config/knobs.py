"""The knob registry and the config type.

A knob is one system setting the tuner may change. Each knob knows how to parse a value from a
search-space file (``values.py``), its baseline value (what a user runs without tuning: the
``Config`` defaults), and when it does not apply to the hardware at hand (``rules.py``). Pure:
nothing here imports torch or touches the machine. How a config is applied (DataLoader, autocast,
DDP) is in ``trial/apply.py``, shared by trials and training scripts; ``applied.py`` covers the
knobs applied through the environment, and which profile methods apply each knob in a script.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from autotune.config import rules
from autotune.config.applied import APPLIED_BY, ENV_KNOBS, TUNED_ENV, env_for, unapplied
from autotune.config.rules import DDP_ARGUMENTS, oversubscribed, torch_takes
from autotune.config.values import (
    ATTENTIONS,
    COMPILE_MODES,
    MATMUL_PRECISIONS,
    MAX_ACCUM,
    MAX_BATCH,
    MAX_BUCKET_MB,
    MAX_PREFETCH,
    MAX_THREADS,
    MAX_WORKERS,
    NCCL_ALGOS,
    NCCL_PROTOS,
    OPTIMIZER_IMPLS,
    REDUCE_DTYPES,
    SHARDINGS,
    KnobValue,
    int_in,
    nccl_values,
    one_of,
    parse_amp,
    parse_bool,
    parse_world,
)

# Names other modules import from here; they live in the modules named above.
__all__ = ["APPLIED_BY", "DDP_ARGUMENTS", "DECLARED", "ENV_KNOBS", "KNOBS", "TUNED_ENV",
           "Config", "Knob", "env_for", "oversubscribed", "parse_values", "torch_takes",
           "unapplied"]

# Knobs that change the model or its optimizer: searched only for a workload that declares them
# in its ``supports`` (a user's model may not take them; it then keeps its own behaviour).
DECLARED = ("optimizer_impl", "compile", "attention", "activation_checkpointing")


@dataclass(frozen=True)
class Config:
    """One point of the search space: a frozen, typed value with a stable dict form, and its own
    key: equal configs compare and hash equal, so sets and dicts of configs need no dict form or
    JSON key (``from_dict`` fills the defaults and gives values their canonical spelling, so a
    config read back equals the one written).

    The defaults are the baseline: what a PyTorch user runs without tuning (fp32, accumulation 1,
    no loader workers, DDP's default 25 MB buckets, NCCL left to decide). The micro-batch default is
    replaced by the workload's own default batch.
    """

    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    amp: str = "off"
    ddp_bucket_cap_mb: int = 25
    ddp_gradient_as_bucket_view: bool = False
    ddp_static_graph: bool = False
    nccl_algo: str = "default"
    nccl_proto: str = "default"
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    optimizer_impl: str = "default"
    compile: str = "off"
    matmul_precision: str = "highest"
    attention: str = "default"
    activation_checkpointing: bool = False
    cpu_threads: int = 0  # intra-op threads per rank; 0 leaves torch's own choice
    sharding: str = "replicated"
    fsdp_reduce_dtype: str = "fp32"
    cpu_offload: bool = False
    malloc_retain: bool = False  # glibc keeps freed host memory (no trim, no per-tensor mmap)
    world_size: int = 1

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 holds the model (else DDP, or nothing with one rank)."""
        return self.sharding != "replicated" and self.world_size > 1

    @property
    def samples_per_step(self) -> int:
        """Global samples per optimizer step: micro-batch x accumulation x ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    @property
    def samples_per_rank_step(self) -> int:
        """Samples one rank processes per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """The config in a few words: what differs between trials, not the fixed knobs."""
        parts = [f"batch {self.micro_batch_size}x{self.grad_accum_steps}",
                 "fp32" if self.amp == "off" else self.amp, f"workers {self.num_workers}"]
        if self.num_workers:
            parts.append(f"prefetch {self.prefetch_factor}")
        if self.pin_memory:
            parts.append("pinned")
        if self.cpu_threads:
            parts.append(f"threads {self.cpu_threads}")
        if self.optimizer_impl != "default":
            parts.append(f"optimizer {self.optimizer_impl}")
        if self.compile != "off":
            parts.append(f"compile {self.compile}")
        if self.matmul_precision != "highest":
            parts.append("tf32")
        if self.attention != "default":
            parts.append(f"attention {self.attention}")
        if self.activation_checkpointing:
            parts.append("checkpointing")
        if self.malloc_retain:
            parts.append("malloc retain")
        if self.sharded:
            parts.append(f"{self.world_size} ranks, {self.sharding}")
            if self.amp != "off" and self.fsdp_reduce_dtype != "fp32":
                parts.append(f"reduce in {self.amp}")
            if self.cpu_offload:
                parts.append("cpu offload")
        elif self.world_size > 1:
            parts.append(f"{self.world_size} ranks, bucket {self.ddp_bucket_cap_mb}MB")
            if self.ddp_gradient_as_bucket_view:
                parts.append("grad views")
            if self.ddp_static_graph:
                parts.append("static graph")
            if self.nccl_algo != "default" or self.nccl_proto != "default":
                parts.append(f"nccl {self.nccl_algo}/{self.nccl_proto}")
        return ", ".join(parts)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """Build a config from its dict form; unknown keys are an error, missing ones default,
        and every value is checked against the knob registry (``parse_values``): a config
        read from a profile, a study or a trial's spec is data, and nothing outside the
        registry reaches torch or transformers. Raises ValueError naming every bad value."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {sorted(names)}")
        values, problems = parse_values(data)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**values)




@dataclass(frozen=True)
class Knob:
    """One tunable setting: how to parse it, and when it (or one of its values) does not apply."""

    name: str
    help: str
    parse: Callable[[object], KnobValue]
    # Returns why the whole knob does not apply here, or None.
    applies: rules.Applies = rules.always
    # Returns why one value cannot run here, or None.
    value_ok: rules.ValueOk = rules.any_value
    # A knob that only matters, or only works, for some values of others: (those knobs, the
    # test their values must pass, this knob's value otherwise). Prefetch needs loader workers;
    # DDP's knobs need DDP (not FSDP).
    when: tuple[tuple[str, ...], Callable[..., bool], KnobValue] | None = None

    def active(self, values: Mapping[str, object]) -> bool:
        """Whether this knob matters given the other knobs' ``values`` (see ``when``)."""
        return self.when is None or self.when[1](*(values[n] for n in self.when[0]))


def _replicated(sharding: object) -> bool:
    return sharding == "replicated"


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("micro_batch_size", "samples per forward/backward on each rank",
             int_in(1, MAX_BATCH)),
        Knob("grad_accum_steps", "micro-batches per optimizer step", int_in(1, MAX_ACCUM)),
        Knob("amp", "autocast precision: off (fp32), fp16 or bf16", parse_amp,
             value_ok=rules.amp_value),
        Knob("ddp_bucket_cap_mb", "DDP gradient bucket size in MB", int_in(1, MAX_BUCKET_MB),
             applies=rules.needs_ranks, when=(("sharding",), _replicated, 25)),
        Knob("ddp_gradient_as_bucket_view", "DDP gradients as views into the buckets "
             "(saves a copy and memory)", parse_bool,
             applies=rules.needs_ddp_argument("gradient_as_bucket_view"),
             when=(("sharding",), _replicated, False)),
        # static_graph with no_sync accumulation crashes in DDP's reducer, and once that is
        # patched stops all-reducing (pytorch PR 187732): only without accumulation.
        Knob("ddp_static_graph", "DDP static_graph: the same parameters get gradients every "
             "step (only without accumulation)", parse_bool,
             applies=rules.needs_ddp_argument("static_graph"),
             when=(("grad_accum_steps", "sharding"),
                   lambda accum, sharding: accum == 1 and sharding == "replicated", False)),
        Knob("nccl_algo", "NCCL_ALGO for the ranks; default lets NCCL decide",
             nccl_values(NCCL_ALGOS, "NCCL_ALGO"), applies=rules.needs_nccl,
             value_ok=rules.nccl_version_ok(NCCL_ALGOS, "NCCL_ALGO")),
        Knob("nccl_proto", "NCCL_PROTO for the ranks; default lets NCCL decide",
             nccl_values(NCCL_PROTOS, "NCCL_PROTO"), applies=rules.needs_nccl,
             value_ok=rules.nccl_version_ok(NCCL_PROTOS, "NCCL_PROTO")),
        Knob("num_workers", "DataLoader worker processes per rank", int_in(0, MAX_WORKERS),
             value_ok=rules.workers_value),
        Knob("pin_memory", "DataLoader pin_memory", parse_bool, applies=rules.needs_gpu),
        Knob("prefetch_factor", "batches each loader worker prepares ahead",
             int_in(1, MAX_PREFETCH),
             when=(("num_workers",), lambda workers: workers > 0, None)),
        Knob("optimizer_impl", "optimizer step: default (as built), for-loop, foreach or fused",
             one_of(OPTIMIZER_IMPLS), value_ok=rules.optimizer_value),
        Knob("compile", "torch.compile mode for the model, or off", one_of(COMPILE_MODES),
             applies=rules.compile_applies, value_ok=rules.compile_value),
        Knob("matmul_precision", "fp32 matmuls: highest (IEEE) or high (TF32)",
             one_of(MATMUL_PRECISIONS), applies=rules.tf32_applies),
        Knob("attention", "the model's attention implementation (transformers models)",
             one_of(ATTENTIONS), value_ok=rules.attention_value),
        Knob("activation_checkpointing", "recompute activations in backward: less memory, "
             "more compute", parse_bool),
        Knob("sharding", "how the ranks hold the model: replicated (DDP), shard-grad-op "
             "(FSDP2, parameters kept from forward to backward), full-shard (FSDP2, gathered "
             "again for backward) or hybrid-shard (full-shard within a node, replicated across)",
             one_of(SHARDINGS), applies=rules.sharding_applies),
        Knob("fsdp_reduce_dtype", "the dtype FSDP reduces gradients in under amp: fp32 or the "
             "amp dtype", one_of(REDUCE_DTYPES), applies=rules.sharding_applies,
             when=(("sharding", "amp"), lambda sharding, amp: sharding != "replicated"
                   and amp != "off", "fp32")),
        Knob("cpu_offload", "FSDP keeps parameters, gradients and optimizer state in host "
             "memory (CUDA only)", parse_bool, applies=rules.offload_applies,
             when=(("sharding",), lambda sharding: sharding != "replicated", False)),
        Knob("cpu_threads", "intra-op CPU threads per rank (torch.set_num_threads); 0: torch's "
             "default", int_in(0, MAX_THREADS), value_ok=rules.threads_value),
        Knob("malloc_retain", "glibc keeps freed host memory in the process (no trimming, no "
             "mmap per large tensor) instead of faulting fresh pages in every step (CPU only)",
             parse_bool, applies=rules.malloc_applies),
    )
}


def parse_values(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data``'s values parsed by the knob registry (canonical spelling: ``BF16`` -> ``bf16``),
    with one line per value the registry refuses (``attention must be one of [...], got
    'kernels-community/flash-attn'``). Keys that are no knob are passed through unchecked."""
    values, problems = dict(data), []
    for name, value in data.items():
        if name == "world_size":
            parse: Callable[[object], KnobValue] = parse_world
        elif name in KNOBS:
            parse = KNOBS[name].parse
        else:
            continue
        if name == "prefetch_factor" and value is None:  # no loader workers: DataLoader's None
            continue
        try:
            values[name] = parse(value)
        except ValueError as exc:
            text = str(exc)  # "must be ..." or, for NCCL, "NCCL_ALGO must be ..."
            problems.append(f"{name} {text}" if text.startswith("must") else f"{name}: {text}")
    return values, problems
