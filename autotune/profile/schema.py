"""The ``Profile``: what a profile holds (schema ``autotune.profile/v2``, see DESIGN.md), its
file form, and the calls a training script makes to apply it.

Each call delegates: how a config becomes torch's arguments lives in ``trial.apply`` (shared
with the trials, so a script runs what was measured), the environment in ``profile.env``, the
framework kwargs beside their callbacks in ``autotune.integrations``, called with the profile's
config and the device it was measured on (one way: the integrations never import the profile).
Each call records its first use in a trial of ``autotune run -- CMD`` (``steps.accessed``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autotune import steps
from autotune.config.knobs import Config
from autotune.errors import ProfileError
from autotune.profile import describe, env
from autotune.profile.documents import (
    BaselineDoc,
    ConfirmationDoc,
    FindingDoc,
    IntervalDoc,
    ProbeDoc,
    ProvenanceDoc,
    ResultDoc,
)
from autotune.trial.apply import (
    LoaderKwargs,
    OptimizerKwargs,
    TorchFlags,
    attention_refused,
    autocast_dtype,
    compile_model,
    ddp_kwargs,
    loader_kwargs,
    model_knobs_refused,
    optimizer_kwargs,
    prepare_model,
    rebuild_optimizer,
    set_torch_flags,
    uses_grad_scaler,
)
from autotune.trial.shard import blocks_of, no_grad_sync, shard, sharding_in_force

if TYPE_CHECKING:
    import torch

    from autotune.integrations.lightning import TrainerKwargs

# v2 added the model and process knobs (compile, optimizer_impl, matmul_precision, attention,
# activation_checkpointing, cpu_threads); a v1 profile loads with their baseline values.
SCHEMA_VERSION = 2
READS = (1, 2)
SCHEMA = f"autotune.profile/v{SCHEMA_VERSION}"


def _tracked(method: Callable[..., Any]) -> Any:
    """Record the first call of a ``Profile`` method in a trial of ``autotune run -- CMD``
    (``steps.accessed``): the tuner searches only the knobs the script applies. Costs a
    global lookup outside a trial."""
    name = method.__name__

    @functools.wraps(method)
    def tracked(self: Profile, *args: Any, **kwargs: Any) -> Any:
        steps.accessed(name)
        return method(self, *args, **kwargs)

    return tracked


@dataclass(frozen=True)
class Profile:
    """A tuned configuration and what it measured; its methods apply it in a training script.

    Everything a trial set is here: the DataLoader (``dataloader_kwargs``), precision
    (``autocast``, ``grad_scaler``), accumulation, DDP (``ddp_kwargs``) and the environment the
    ranks started with (``env``, ``apply_env``).
    """

    workload: dict[str, Any]  # the workload's spec: {name, spec, params} (params: its own)
    config: Config
    env: dict[str, str]
    result: ResultDoc
    baseline: BaselineDoc
    speedup: float | None
    # The machine's, as ``machine.hardware`` writes and compares it: a stored one may come from
    # an earlier autotune with fewer fields, so its readers check each value they use.
    fingerprint: dict[str, object]
    provenance: ProvenanceDoc
    notes: list[str] = field(default_factory=list)
    schema: str = SCHEMA
    # The interleaved re-measurement that chose the winner (absent when there was none).
    confirmation: ConfirmationDoc | None = None
    # The machine's probe in a few numbers (peaks, links, flags), and what limits this config.
    probe: ProbeDoc | None = None
    diagnosis: list[FindingDoc] = field(default_factory=list)
    # Where a re-check of ``speedup`` lands (a confirmed win only).
    speedup_interval: IntervalDoc | None = None

    # -- what was tuned -------------------------------------------------------------------------

    @property
    @_tracked
    def micro_batch_size(self) -> int:
        """Samples per forward/backward on each rank: the DataLoader's batch_size."""
        return self.config.micro_batch_size

    @property
    @_tracked
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (gradients synchronised on the last one only)."""
        return self.config.grad_accum_steps

    @property
    def world_size(self) -> int:
        """Ranks the profile was measured with."""
        return self.config.world_size

    @property
    def samples_per_step(self) -> int:
        """Global samples per optimizer step: micro-batch x accumulation x ranks."""
        return self.config.samples_per_step

    @property
    def samples_per_sec(self) -> float:
        """The measured throughput: the confirmation's median when there was one."""
        return float(self.result["samples_per_sec"])

    # -- applying it ----------------------------------------------------------------------------

    @_tracked
    def dataloader_kwargs(self, device: str | torch.device | None = None) -> LoaderKwargs:
        """``batch_size``, ``num_workers``, ``pin_memory`` and, with workers, ``prefetch_factor``
        and ``persistent_workers``, as the trials ran them. Add your dataset, sampler and
        collate_fn. ``pin_memory`` is on only when batches go to a GPU (``device``, default:
        CUDA if available)."""
        return loader_kwargs(self.config, _device_type(device))

    @_tracked
    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``DistributedDataParallel``: the bucket size and, where this
        torch's DDP takes them, gradient views and static graph."""
        return ddp_kwargs(self.config)

    @_tracked
    def autocast(self, device: str | torch.device | None = None) -> Any:
        """A context manager for the forward pass and loss: ``torch.autocast`` in the profile's
        precision, or a no-op for fp32."""
        import torch

        dtype = autocast_dtype(self.config)
        return torch.autocast(_device_type(device), dtype=dtype or torch.float32,
                              enabled=dtype is not None)

    @_tracked
    def grad_scaler(self, device: str | torch.device | None = None) -> torch.amp.GradScaler:
        """A ``torch.amp.GradScaler``, enabled only for fp16 on CUDA (bf16 and fp32 need no
        loss scaling; a disabled scaler passes ``scale``, ``step`` and ``update`` through)."""
        import torch

        kind = _device_type(device)
        return torch.amp.GradScaler(kind, enabled=uses_grad_scaler(self.config, kind))

    @_tracked
    def apply_env(self, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
        """Set the profile's environment (``NCCL_ALGO``, ``NCCL_PROTO``) in this process.

        NCCL reads these when the process group starts, so this refuses once one is running:
        call it before ``init_process_group``, or start the script with ``autotune launch``.
        A different value already set is replaced, with a warning naming both.
        """
        return env.apply(self.env, environ)

    def refused_here(self) -> list[str]:
        """Why values of this profile cannot be applied on this machine (each refused when it
        would be applied; ``profile check`` refuses to start): a flash attention that
        transformers would replace by a kernel from the Hub."""
        if self.config.attention == "default":
            return []
        refused = attention_refused(self.config.attention)
        return [refused] if refused else []

    def foreign_env(self) -> list[str]:
        """Names in the profile's ``env`` that autotune does not tune (``TUNED_ENV``)."""
        return env.foreign(self.env)

    def check_env(self) -> None:
        """Refuse a profile whose env holds anything autotune does not tune: a profile is data,
        and LD_PRELOAD, PYTHONPATH, BASH_ENV or PATH set from one would run foreign code."""
        env.refuse_foreign(self.env)

    @_tracked
    def apply_torch_flags(self) -> TorchFlags:
        """Set the process-wide settings the profile tuned: intra-op threads (when it set
        them), the fp32 matmul precision (TF32 or not) and glibc's retention of freed host
        memory (``malloc_retain``). Call once at start, before building the model. Returns
        what is in force afterwards."""
        return set_torch_flags(self.config)

    @property
    @_tracked
    def attn_implementation(self) -> str | None:
        """The attention implementation for transformers' ``from_pretrained`` /
        ``from_config`` (``attn_implementation=``); None: the model's own default."""
        if self.config.attention == "default":
            return None
        refused = attention_refused(self.config.attention)
        if refused:
            raise ProfileError(refused)
        return self.config.attention

    @_tracked
    def optimizer_kwargs(self) -> OptimizerKwargs:
        """``foreach`` / ``fused`` for your torch optimizer's constructor, as the trials ran it
        (``{}``: the optimizer's own default). ``AdamW(params, lr=..., **p.optimizer_kwargs())``."""
        return optimizer_kwargs(self.config)

    @_tracked
    def apply_optimizer(self, optimizer: Any) -> Any:
        """``optimizer`` rebuilt (same class, groups and hyperparameters) with the tuned
        implementation, before its first step: for a script whose optimizer is built elsewhere
        (the workload's ``build_optimizer``); the same object when the profile keeps the default.
        Build any LR scheduler after this call: one built before drives the old optimizer."""
        return rebuild_optimizer(optimizer, self.config)

    @_tracked
    def prepare_model(self, model: Any, compile: bool = True, device: Any = None,
                      blocks: list[Any] | None = None) -> Any:
        """The model as the trials ran it: its attention implementation and activation
        checkpointing (transformers models), then, for a sharded profile, FSDP2 on each block
        and the root (``blocks``: default a transformers model's ``_no_split_modules``; under
        the process group, on ``device``), then ``torch.compile`` in the tuned mode. Build the
        optimizer on what this returns. A replicated profile: wrap what this returns in DDP, as
        the trials do (compiling around DDP can leave a ``torch.nn`` model uncompiled); a
        sharded one needs no wrapper. Returns the model to train.

        A knob the model has no way to take (attention or checkpointing on a plain
        ``torch.nn.Module``) stays off, with an ``autotune: not applied: ...`` line on
        stderr, as ``autotune launch`` says of a Trainer's model. In a trial of ``autotune
        run -- CMD`` it is a ``ProfileError`` instead: a trial must not measure a config it
        did not run."""
        config = self.config
        refused = model_knobs_refused(model, config)
        if refused and not steps.in_trial():
            for why in refused.values():
                steps.note_once(f"autotune: not applied: {why}")
            baseline = Config()  # the defaults are the baseline: the knob left off
            config = dataclasses.replace(config, **{k: getattr(baseline, k) for k in refused})
        try:
            model = prepare_model(model, config)
            if config.sharding != "replicated":
                model = self._shard(model, config, device, blocks)
        except ValueError as exc:
            raise ProfileError(str(exc)) from None
        return self.compile_model(model) if compile else model

    def _shard(self, model: Any, config: Config, device: Any, blocks: list[Any] | None) -> Any:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(f"sharding={config.sharding}: start the process group "
                             "(torch.distributed.init_process_group) before prepare_model")
        if dist.get_world_size() == 1:
            return model  # one rank holds the whole model: nothing to shard
        device = torch.device(device) if device is not None else torch.device(
            "cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        ranks = dataclasses.replace(config, world_size=dist.get_world_size())
        return shard(model.to(device), ranks, device,
                     blocks if blocks is not None else blocks_of(model))

    @property
    def sharded(self) -> bool:
        """Whether ``prepare_model`` shards the model (FSDP2) rather than leaving it to DDP."""
        return self.config.sharding != "replicated" and self.config.world_size > 1

    def sharding_applied(self, model: Any) -> dict[str, Any]:
        """What FSDP applied to a model ``prepare_model`` sharded, read back from it (its
        mesh, units, resharding and mixed-precision dtypes)."""
        return dict(sharding_in_force(model, self.config.sharding))

    @_tracked
    def no_sync(self, model: Any) -> Any:
        """A context manager for the micro-steps of accumulation but the last: DDP's
        ``no_sync``, or FSDP2's gradient sync switched off (reduced at the last one)."""
        return no_grad_sync(model)

    @_tracked
    def compile_model(self, model: Any) -> Any:
        """``torch.compile(model, mode=...)`` when the profile compiles, else ``model``."""
        return compile_model(model, self.config)

    # -- integrations ---------------------------------------------------------------------------

    @_tracked
    def hf_training_args(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.TrainingArguments``: per-device batch,
        accumulation, precision, the DataLoader's workers/pinning/prefetch, ``use_cpu`` for a
        profile tuned on a CPU and, with ranks, the DDP bucket size and static graph; compiling,
        TF32 and activation checkpointing as the trials ran them; ``optim`` only where AdamW
        needs another name than TrainingArguments' default to step as tuned (else the
        default, or your own ``optim=``, stands; ``autotune launch`` sets the implementation
        on whichever optimizer the Trainer builds) (``autotune.integrations.hf.training_args``)."""
        from autotune.integrations.hf import training_args

        return training_args(self.config, self._measured_on())

    @_tracked
    def lightning_trainer_kwargs(self) -> TrainerKwargs:
        """Keyword arguments for a Lightning ``Trainer``
        (``autotune.integrations.lightning.trainer_kwargs``): ``precision``,
        ``accumulate_grad_batches`` and, with ranks, ``devices`` and a ``DDPStrategy`` carrying
        the DDP arguments. Build the DataLoader with ``dataloader_kwargs()``.

        Lightning's Trainer takes none of the model knobs: call ``apply_torch_flags()`` at
        start, ``prepare_model(self.model)`` in your LightningModule's ``configure_model``, and
        pass ``optimizer_kwargs()`` to the optimizer ``configure_optimizers`` builds."""
        try:
            from autotune.integrations.lightning import trainer_kwargs
        except ImportError:
            raise ProfileError("lightning_trainer_kwargs() needs Lightning: pip install "
                               "lightning") from None
        return trainer_kwargs(self.config)

    def _measured_on(self) -> str | None:
        """The device the profile was measured on (``cpu``, ``cuda``); None: its fingerprint
        does not say."""
        device = self.fingerprint.get("device")
        return device if isinstance(device, str) else None

    # -- reading it -----------------------------------------------------------------------------

    def summary(self) -> str:
        """A few lines for a human: what was tuned, what it measured, against what, where."""
        return describe.summary(self)

    def to_dict(self) -> dict[str, object]:
        """The profile's document, as its file holds it (absent blocks left out)."""
        return {
            "schema": self.schema,
            "workload": self.workload,
            "config": self.config.to_dict(),
            "env": dict(self.env),
            "result": self.result,
            "baseline": self.baseline,
            "speedup": self.speedup,
            **({"speedup_interval": self.speedup_interval} if self.speedup_interval else {}),
            "fingerprint": self.fingerprint,
            "provenance": self.provenance,
            "notes": list(self.notes),
            **({"diagnosis": list(self.diagnosis)} if self.diagnosis else {}),
            **({"probe": self.probe} if self.probe else {}),
            **({"confirmation": self.confirmation} if self.confirmation else {}),
        }

    def to_yaml(self) -> str:
        """The profile as the file ``save`` writes."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None,
                              width=100)

    def save(self, path: str | Path) -> Path:
        """Write atomically: a crash mid-write never leaves a half profile behind."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_yaml())
        os.replace(tmp, path)
        return path


def _device_type(device: str | torch.device | None) -> str:
    if device is None:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device if isinstance(device, str) else device.type
