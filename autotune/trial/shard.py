"""How a config's sharding is applied: FSDP2 (``torch.distributed.fsdp.fully_shard``) on each of
the model's blocks, then on the root, as torchtitan does, with the mixed-precision policy that
follows ``amp``; and what took effect, read back from the model. Trials (``trial.bench``) and
training scripts (``Profile.prepare_model``) both shard through here, so what was measured is what
trains. torch is imported inside the functions only.

  replicated     DDP (``trial.apply.ddp_kwargs``): every rank holds the whole model
  shard-grad-op  parameters, gradients and optimizer state sharded; parameters gathered for the
                 forward and kept until the backward (``reshard_after_forward=False``, ZeRO-2-like)
  full-shard     the same, parameters gathered again for the backward (``True``, ZeRO-3-like)
  hybrid-shard   full-shard within a node, replicated across nodes (a 2-D mesh)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, TypedDict

from autotune.config.knobs import Config


class ShardingInForce(TypedDict, total=False):
    """What FSDP applied, read back from the model: the strategy, the mesh (replicas x shards),
    how many modules are FSDP units (blocks plus the root), whether parameters are gathered
    again after forward, the dtypes of the mixed-precision policy, and CPU offload."""

    strategy: str
    mesh: list[int]
    units: int
    reshard_after_forward: bool
    param_dtype: str | None
    reduce_dtype: str | None
    offload: bool


class ModelState(TypedDict):
    """The bytes one rank holds for the model besides activations, measured after the first
    optimizer step: parameters, their gradients and the optimizer's state (local shards under
    FSDP), and the parameter count of the whole model."""

    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int


def blocks_of(model: Any, workload: Any = None) -> list[Any]:
    """The model's repeated blocks, each its own FSDP unit: what the workload's ``blocks(model)``
    returns, else the modules whose class a transformers model names in ``_no_split_modules``
    (its decoder or encoder layers), else none (the root alone is one unit)."""
    declared = getattr(workload, "blocks", None)
    if callable(declared):
        return list(declared(model))
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        return []
    found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    # The outermost only: a block inside another block is sharded with it.
    inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inner]


def mesh_shape(config: Config, local_world: int) -> tuple[int, ...]:
    """The device mesh of a sharded config: one dimension of all ranks, or (nodes, ranks per
    node) for hybrid sharding."""
    world = config.world_size
    if config.sharding == "hybrid-shard":
        if local_world <= 0 or world % local_world or world == local_world:
            raise ValueError(f"sharding=hybrid-shard needs several nodes of equal rank counts; "
                             f"{world} rank(s), {local_world} per node")
        return (world // local_world, local_world)
    return (world,)


def shard(module: Any, config: Config, device: Any, blocks: list[Any]) -> Any:
    """``fully_shard`` each of ``blocks`` and then ``module`` itself, as ``config.sharding``
    says, under an initialised process group; returns the module (now an ``FSDPModule``).
    Parameters are gathered in the amp dtype (bf16/fp16) where amp is on, and gradients reduced
    in fp32 or in that dtype (``fsdp_reduce_dtype``); CPU offload only on CUDA."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if config.sharding == "replicated":
        raise ValueError("sharding=replicated is DDP's, not FSDP's")
    if config.cpu_offload and device.type != "cuda":
        raise ValueError("cpu_offload=true moves GPU memory to the host: there is no GPU here")
    # The process group's ranks (a trial's are the config's; one rank shards over itself,
    # which exercises FSDP's path without its communication: scripts/gpu_check.sh).
    world = dist.get_world_size()
    shape = mesh_shape(replace(config, world_size=world),
                       int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.amp)
    reduce = torch.float32 if amp is None or config.fsdp_reduce_dtype == "fp32" else amp
    kwargs: dict[str, Any] = {
        "mesh": mesh, "reshard_after_forward": config.sharding != "shard-grad-op",
        "mp_policy": MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=reduce)}
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in blocks:
        fully_shard(block, **kwargs)
    # The root's own parameters (embeddings, the head, the last norm) form the last unit.
    fully_shard(module, **kwargs)
    return module


def sharding_in_force(module: Any, strategy: str) -> ShardingInForce:
    """What FSDP applied to ``module``, read back: its mesh from a parameter's placement, its
    units, its blocks' resharding after forward and the mixed-precision policy (from FSDP's
    state, a private part of torch: left out where this torch differs)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    found: ShardingInForce = {"strategy": strategy, "units": len(units)}
    param = next(iter(module.parameters()), None)
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None:
        found["mesh"] = [int(n) for n in mesh.shape]
    with contextlib.suppress(Exception):
        block = units[0] if len(units) > 1 else module
        group = block._get_fsdp_state()._fsdp_param_group
        found["reshard_after_forward"] = group.post_forward_mesh_info is not None
        policy = group.mp_policy
        found["param_dtype"] = _dtype_name(policy.param_dtype)
        found["reduce_dtype"] = _dtype_name(policy.reduce_dtype)
        found["offload"] = type(group.offload_policy).__name__ == "CPUOffloadPolicy"
    return found


def _dtype_name(dtype: Any) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def no_grad_sync(model: Any) -> Iterator[None]:
    """Skip the gradients' reduction for a micro-step of accumulation: DDP's ``no_sync``, or
    FSDP2's ``set_requires_gradient_sync(False)`` (reduced at the last micro-step)."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def model_state(module: Any, optimizer: Any) -> ModelState:
    """The bytes this rank holds for parameters, gradients (as many as the parameters they
    belong to: they are freed between steps) and optimizer state, local shards only."""
    params = param_bytes = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        params += int(p.numel())
        param_bytes += int(local.numel()) * local.element_size()
    state = 0
    for values in optimizer.state.values():
        for value in values.values():
            if hasattr(value, "to_local"):
                value = value.to_local()
            if hasattr(value, "element_size") and value.dim() > 0:
                state += int(value.numel()) * value.element_size()
    return {"params": params, "param_bytes": param_bytes, "grad_bytes": param_bytes,
            "optimizer_bytes": state}
