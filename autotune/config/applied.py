"""How a config reaches the processes it is measured or trained in, beyond ``trial/apply.py``: the
knobs applied through the environment (NCCL reads them when the process group starts), and which
``Profile`` methods apply each knob in a user's training script.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.config.knobs import Config

# Every environment variable env_for can set: the only ones a profile's ``env`` may carry into
# a process (``Profile.apply_env``, ``autotune launch``, ``autotune profile env``). A profile is
# data; anything else in its env (LD_PRELOAD, PYTHONPATH, BASH_ENV, PATH...) could run code.
# Each with the knob whose value it carries (a profile's env value is checked as that knob's).
ENV_KNOBS = {"NCCL_ALGO": "nccl_algo", "NCCL_PROTO": "nccl_proto"}
TUNED_ENV = tuple(ENV_KNOBS)


def env_for(config: Config) -> dict[str, str]:
    """The environment variables a config sets in the trial (and later in training) processes.

    NCCL reads these when the process group starts, so they must be in place before that.
    """
    if config.world_size <= 1:
        return {}
    values = {name: str(getattr(config, knob)) for name, knob in ENV_KNOBS.items()}
    return {name: value for name, value in values.items() if value != "default"}


# Which ``Profile`` methods apply each knob in a training script: a script tuned as it runs
# (``autotune run -- CMD``) that calls none of a knob's methods cannot feel it, so the knob is
# not searched. The NCCL knobs are absent: the trial's launcher sets them in the environment.
APPLIED_BY: dict[str, tuple[str, ...]] = {
    "micro_batch_size": ("micro_batch_size", "dataloader_kwargs", "hf_training_args"),
    "grad_accum_steps": ("accumulation_steps", "hf_training_args", "lightning_trainer_kwargs"),
    "amp": ("autocast", "hf_training_args", "lightning_trainer_kwargs"),
    "ddp_bucket_cap_mb": ("ddp_kwargs", "hf_training_args", "lightning_trainer_kwargs"),
    "ddp_gradient_as_bucket_view": ("ddp_kwargs", "lightning_trainer_kwargs"),
    "ddp_static_graph": ("ddp_kwargs", "hf_training_args", "lightning_trainer_kwargs"),
    "num_workers": ("dataloader_kwargs", "hf_training_args"),
    "pin_memory": ("dataloader_kwargs", "hf_training_args"),
    "prefetch_factor": ("dataloader_kwargs", "hf_training_args"),
    "optimizer_impl": ("optimizer_kwargs", "apply_optimizer", "hf_training_args"),
    "compile": ("compile_model", "hf_training_args"),
    "matmul_precision": ("apply_torch_flags", "hf_training_args"),
    "attention": ("attn_implementation", "prepare_model"),
    "activation_checkpointing": ("prepare_model", "hf_training_args"),
    "cpu_threads": ("apply_torch_flags",),
    "malloc_retain": ("apply_torch_flags",),
    "sharding": ("prepare_model",),
    "fsdp_reduce_dtype": ("prepare_model",),
    "cpu_offload": ("prepare_model",),
}


_PROPERTIES = ("micro_batch_size", "accumulation_steps", "attn_implementation")


def unapplied(searched: list[str], accessed: set[str], script: str,
              read_back: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The searched knobs a script never applies, each with the reason printed and stored on
    the study. A knob applies when the script calls one of its ``APPLIED_BY`` methods (or reads
    one of those properties), or when autotune's bootstrap read it back in effect in the
    script's Trainer (``read_back``: its ``applied`` knobs, and its ``fixed`` ones with why
    not)."""
    found: dict[str, str] = {}
    took = set(read_back.get("applied", ())) if read_back else set()
    refused = dict(read_back.get("fixed", {})) if read_back else {}
    for name in searched:
        methods = APPLIED_BY.get(name)
        if methods is None or accessed & set(methods) or name in took:
            continue
        if name in refused:
            found[name] = refused[name]
            continue
        if read_back:
            found[name] = (f"{script}: autotune could not read {name} back from its "
                           f"{read_back.get('via', 'Trainer')}: it is not searched")
            continue
        if not accessed:  # not one profile method: the script never loaded its profile
            found[name] = (f"{script} never loads a profile (autotune.load_profile()): {name} "
                           "is not searched")
            continue
        calls = " or ".join(m if m in _PROPERTIES else f"{m}()" for m in methods)
        found[name] = f"{script} never uses {calls}: {name} is not searched"
    return found
