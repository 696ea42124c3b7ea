"""How a config is applied: the DataLoader arguments, the autocast dtype, loss scaling and DDP's
arguments. Trials (``trial.bench``) and training scripts (``Profile``) both build from these, so
what was measured is what trains. torch is imported inside the functions that need it only.
"""

from __future__ import annotations

from typing import Any

from autotune.config.knobs import Config


def loader_kwargs(config: Config, device_type: str) -> dict[str, Any]:
    """The DataLoader arguments a config sets; the caller adds dataset, sampler and collate_fn.

    pin_memory only where batches go to a GPU; prefetch and persistent workers only with workers
    (DataLoader refuses prefetch_factor without them). Trials and training both build from this.
    """
    kwargs: dict[str, Any] = {"batch_size": config.micro_batch_size,
                              "num_workers": config.num_workers,
                              "pin_memory": config.pin_memory and device_type == "cuda"}
    if config.num_workers > 0:
        kwargs.update(prefetch_factor=config.prefetch_factor or 2, persistent_workers=True)
    return kwargs


def autocast_dtype(config: Config) -> Any:
    """The torch dtype autocast runs in, or None for fp32 (autocast off)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.amp)


def uses_grad_scaler(config: Config, device_type: str) -> bool:
    """Loss scaling only for fp16 on CUDA: bf16 has fp32's range and needs none."""
    return config.amp == "fp16" and device_type == "cuda"


def ddp_kwargs(config: Config) -> dict[str, Any]:
    """Keyword arguments for DistributedDataParallel: only those the installed torch takes, and
    only values that differ from DDP's own defaults (so an older torch runs the baseline)."""
    wanted: dict[str, Any] = {"bucket_cap_mb": config.ddp_bucket_cap_mb}
    if config.ddp_gradient_as_bucket_view:
        wanted["gradient_as_bucket_view"] = True
    if config.ddp_static_graph:
        wanted["static_graph"] = True
    return {k: v for k, v in wanted.items() if ddp_accepts(k)}


def ddp_accepts(name: str) -> bool:
    """Whether the installed torch's DistributedDataParallel takes this keyword argument."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return name in inspect.signature(DistributedDataParallel.__init__).parameters
