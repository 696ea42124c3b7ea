"""Each knob in a framework's own terms: the ``TrainingArguments`` field of Hugging Face's Trainer
that carries it, with the value a config gives that field, and Lightning's name for a precision.

One table, read by the integration that builds a script's ``TrainingArguments``
(``integrations.hf.training_args``) and by the bootstrap that sets them in a script nobody edited
(``bootstrap.hf``): the two cannot disagree on which field carries which knob. It lives in the
config room because both may import it (the bootstrap must stay light and never reach the tuner),
and because it is names and values only: transformers and Lightning are not imported here; which
fields the installed transformers has is checked where they are set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from autotune.config.knobs import Config

LightningPrecision = Literal["bf16-mixed", "16-mixed", "32-true"]


def lightning_precision(amp: str) -> LightningPrecision:
    """Lightning's ``precision`` for an ``amp`` value."""
    return "bf16-mixed" if amp == "bf16" else "16-mixed" if amp == "fp16" else "32-true"


@dataclass(frozen=True)
class HfField:
    """One ``TrainingArguments`` field: the knob it carries (None for ``use_cpu``, which says
    the device the profile was measured on), its value for a config measured on a device (None:
    the field keeps the script's or TrainingArguments' own value), and, for a field
    transformers 5 renamed, its name before."""

    name: str
    knob: str | None
    value: Callable[[Config, str | None], object]
    older: str | None = None


def _on(flag: bool) -> bool | None:
    """True where the config turns a feature on; else the field is left as it is."""
    return True if flag else None


def hf_optim(config: Config, device: str | None) -> str | None:
    """The TrainingArguments ``optim`` that steps AdamW as ``config.optimizer_impl``; None where
    the config keeps the optimizer's own implementation, or where no name reaches it on
    ``device`` (the one the profile was measured on). torch's AdamW given neither ``foreach``
    nor ``fused``, which ``adamw_torch`` builds, steps foreach on a GPU and the for-loop on a
    CPU."""
    if config.optimizer_impl == "fused":
        return "adamw_torch_fused"
    torch_picks = "for-loop" if device == "cpu" else "foreach"
    return "adamw_torch" if config.optimizer_impl == torch_picks else None


def _hf_shards(config: Config, device: str | None) -> bool:
    return device != "cpu" and hf_unreached(config, device) == {} and config.sharded


def hf_unreached(config: Config, device: str | None) -> dict[str, str]:
    """The sharding knobs a Trainer cannot take from ``config`` measured on ``device``, each
    with why: accelerate runs FSDP on GPUs only, its FSDP2 plugin has no hybrid mesh, and no
    reduce dtype of its own (it follows the precision)."""
    if not config.sharded:
        return {}
    if device == "cpu":
        return {"sharding": f"sharding={config.sharding}: accelerate shards only on GPUs; on a "
                            "CPU the Trainer's ranks run replicated (DDP)"}
    if config.sharding == "hybrid-shard":
        return {"sharding": "sharding=hybrid-shard: the Trainer's FSDP2 (accelerate) takes no "
                            "hybrid mesh"}
    if config.amp != "off" and config.fsdp_reduce_dtype == "amp":
        return {"fsdp_reduce_dtype": "fsdp_reduce_dtype=amp: the Trainer's FSDP2 (accelerate) "
                                     "sets the reduce dtype from its precision itself"}
    return {}


# In the order ``training_args`` returns them (and ``autotune profile show --hf-args`` prints).
HF_FIELDS: tuple[HfField, ...] = (
    HfField("per_device_train_batch_size", "micro_batch_size", lambda c, d: c.micro_batch_size),
    HfField("gradient_accumulation_steps", "grad_accum_steps", lambda c, d: c.grad_accum_steps),
    HfField("bf16", "amp", lambda c, d: c.amp == "bf16"),
    HfField("fp16", "amp", lambda c, d: c.amp == "fp16"),
    HfField("dataloader_num_workers", "num_workers", lambda c, d: c.num_workers),
    # TrainingArguments pins by default; the profile says whether pinning paid.
    HfField("dataloader_pin_memory", "pin_memory", lambda c, d: c.pin_memory),
    # The DataLoader refuses prefetching without workers.
    HfField("dataloader_prefetch_factor", "prefetch_factor",
            lambda c, d: (c.prefetch_factor or 2) if c.num_workers > 0 else None),
    HfField("dataloader_persistent_workers", "num_workers", lambda c, d: _on(c.num_workers > 0)),
    # What was measured; also how Hugging Face allows bf16 on a CPU.
    HfField("use_cpu", None, lambda c, d: _on(d == "cpu")),
    HfField("ddp_bucket_cap_mb", "ddp_bucket_cap_mb",
            lambda c, d: c.ddp_bucket_cap_mb if c.world_size > 1 else None),
    HfField("ddp_static_graph", "ddp_static_graph",
            lambda c, d: _on(c.world_size > 1 and c.ddp_static_graph)),
    HfField("torch_compile", "compile", lambda c, d: _on(c.compile != "off")),
    HfField("torch_compile_mode", "compile",
            lambda c, d: c.compile if c.compile not in ("off", "default") else None),
    HfField("tf32", "matmul_precision", lambda c, d: _on(c.matmul_precision == "high")),
    # Dropped where it is the installed TrainingArguments' own default (``training_args``).
    HfField("optim", "optimizer_impl", hf_optim),
    HfField("activation_checkpointing", "activation_checkpointing",
            lambda c, d: _on(c.activation_checkpointing), older="gradient_checkpointing"),
    HfField("activation_checkpointing_kwargs", "activation_checkpointing",
            lambda c, d: {"use_reentrant": False} if c.activation_checkpointing else None,
            older="gradient_checkpointing_kwargs"),
    # FSDP2 through accelerate, on GPUs (accelerate shards on no CPU: ``hf_unreached``): the
    # Trainer wraps its model's layers (``_no_split_modules``).
    HfField("fsdp", "sharding", lambda c, d: _on(_hf_shards(c, d))),
    HfField("fsdp_config", "sharding", lambda c, d: {
        "version": 2, "reshard_after_forward": c.sharding == "full-shard",
        **({"cpu_offload": True} if c.cpu_offload else {})} if _hf_shards(c, d) else None),
)

# The knob each field carries, under its name in any transformers (a field the installed one
# lacks is reported as a knob it cannot reach).
HF_FIELD_KNOB: dict[str, str] = {
    name: f.knob for f in HF_FIELDS if f.knob is not None
    for name in (f.name, f.older) if name is not None}
