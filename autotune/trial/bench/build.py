"""Building a trial: the workload for the config on its device, its DataLoader, precision and
DDP, and one optimizer step of it. Everything a config sets is applied here, through
``config.apply``, the functions a training script's ``Profile`` uses too."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from autotune.config.knobs import Config
from autotune.trial.apply import (
    autocast_dtype,
    compile_model,
    ddp_kwargs,
    loader_kwargs,
    model_in_force,
    optimizer_in_force,
    prepare_model,
    rebuild_optimizer,
    set_torch_flags,
    uses_grad_scaler,
)
from autotune.trial.bench.device import Memory, endless, to_device
from autotune.trial.bench.ranks import CommTimer, Ranks
from autotune.trial.result import Applied, CompileInfo, TrialResultDoc
from autotune.trial.shard import blocks_of, no_grad_sync, shard, sharding_in_force
from autotune.trial.spec import TrialSpec
from autotune.workloads import resolve


@dataclass
class Trainer:
    """A built trial: the model (DDP-wrapped with several ranks), its optimizer, an endless
    stream of batches, the precision, and ``step``, one optimizer step."""

    config: Config
    device: Any
    workload: Any
    module: Any  # the model itself, for counting FLOPs
    model: Any  # what trains: the module, or DDP around it
    optimizer: Any
    dataset: Any
    loader: Any
    batches: Iterator[Any]
    amp_dtype: Any  # None for fp32
    scaler: Any
    non_blocking: bool
    ranks: Ranks
    comm: CommTimer | None = None
    sync_each_micro: bool = False
    # Micro-steps whose loss was NaN or infinite since the last look: a device tensor summed
    # without a sync, read at window edges (``nonfinite_steps``).
    nonfinite: Any = None
    # Each micro-step's loss (detached, divided by the accumulation), when a list is given:
    # how the tests compare strategies' losses (``autotune.testing.losses``); None in trials.
    losses: list[Any] | None = None

    def nonfinite_steps(self) -> int:
        """Micro-steps with a NaN or infinite loss so far, over all ranks (a sync: call it only
        where the device is synchronised anyway)."""
        count = 0.0 if self.nonfinite is None else float(self.nonfinite.item())
        (worst,) = self.ranks.agree(count)
        return int(worst)

    def sync(self) -> None:
        """Wait for the device: done at window edges only."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def step(self, after_micro: Callable[[int], None] | None = None) -> float:
        """One optimizer step of ``grad_accum_steps`` micro-batches; returns seconds spent
        waiting for data (next batch plus the host-to-device copy). Gradients are all-reduced on
        the last micro-step only: the others run under DDP's no_sync. ``after_micro(i)`` runs
        before micro-step i > 0 (how the first step is judged while it runs)."""
        import torch

        accum = self.config.grad_accum_steps
        wait = 0.0
        for micro in range(accum):
            if after_micro is not None and micro > 0:
                after_micro(micro)
            t = time.perf_counter()
            batch = to_device(next(self.batches), self.device, self.non_blocking)
            wait += time.perf_counter() - t
            quiet = self.ranks.world > 1 and micro < accum - 1 and not self.sync_each_micro
            if self.comm is not None:
                self.comm.micro = micro
            with no_grad_sync(self.model) if quiet else contextlib.nullcontext():
                with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                    enabled=self.amp_dtype is not None):
                    loss = self.workload.loss(self.model, batch) / accum
                if self.losses is not None:
                    self.losses.append(loss.detach())
                bad = (~torch.isfinite(loss.detach())).sum()
                self.nonfinite = bad if self.nonfinite is None else self.nonfinite + bad
                self.scaler.scale(loss).backward()
            if self.comm is not None and not quiet:
                self.comm.end_step()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return wait


def build(spec: TrialSpec, device: Any, ranks: Ranks, result: TrialResultDoc,
          memory: Memory) -> Trainer:
    """Set up the device, join the ranks, and build the workload for ``spec.config``; what was
    applied (backend, DDP arguments) goes into ``result``. ``memory``'s peak starts here."""
    import torch

    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if spec.memory_limit_bytes:
            # Make the caching allocator itself refuse to pass the limit: an over-limit config
            # then fails as a real OOM instead of succeeding on memory the user does not have.
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, spec.memory_limit_bytes / total), device)
        memory.reset()  # after set_device: it needs the CUDA context that creates
    result["backend"] = ranks.start(device)
    # What took effect, read back from torch, the model and the optimizer (not the config),
    # recorded as it is known: a build that fails later still tells what it had set.
    flags = set_torch_flags(spec.config)
    applied: Applied = {"threads": flags["threads"], "matmul_precision": flags["matmul_precision"],
                        "malloc_retain": flags["malloc_retain"]}
    result["applied"] = applied
    workload = resolve(spec.workload.spec, spec.workload.params)
    module = prepare_model(workload.build_model(), spec.config).to(device)
    module.train()
    if spec.config.sharded:
        # FSDP2 shards the module in place, before its optimizer is built on the shards.
        module = model = shard(module, spec.config, device, blocks_of(module, workload))
        applied["sharding"] = sharding_in_force(module, spec.config.sharding)
        comm = None
    optimizer = rebuild_optimizer(workload.build_optimizer(module), spec.config)
    if not spec.config.sharded:
        # Compiled inside DDP, not around it: Dynamo skips a DDP-wrapped forward that lives in
        # torch.nn (nn.Linear, nn.Sequential) and would run it eagerly. Whether anything
        # compiled is read after the first step (``compiled_graphs``), not the wrapper's type.
        model, comm = _distributed(compile_model(module, spec.config), spec, device, ranks,
                                   result)
    else:
        model = compile_model(module, spec.config)
    applied.update(model_in_force(module))
    applied["optimizer"], applied["compiled"] = optimizer_in_force(optimizer), "off"
    dataset = workload.build_dataset()
    loader, sampler = _loader(workload, dataset, spec.config, device, ranks)
    return Trainer(
        config=spec.config, device=device, workload=workload, module=module, model=model,
        optimizer=optimizer, dataset=dataset, loader=loader, batches=endless(loader, sampler),
        amp_dtype=autocast_dtype(spec.config),
        scaler=torch.amp.GradScaler("cuda", enabled=uses_grad_scaler(spec.config, device.type)),
        non_blocking=bool(loader.pin_memory), ranks=ranks, comm=comm,
        sync_each_micro=spec.measure.sync_each_micro)


def _distributed(module: Any, spec: TrialSpec, device: Any, ranks: Ranks,
                 result: TrialResultDoc) -> tuple[Any, CommTimer | None]:
    """DDP around the module with several ranks (and the all-reduce timer), else the module."""
    if ranks.world == 1:
        return module, None
    from torch.nn.parallel import DistributedDataParallel

    kwargs = ddp_kwargs(spec.config)
    model = DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)
    comm = None
    if spec.measure.time_comm:
        timer = comm = CommTimer(ranks.world, device.type == "cuda")
        # DDP checks a hook's annotations against its own types: register an unannotated one.
        model.register_comm_hook(None, lambda state, bucket: timer.hook(state, bucket))
    result["ddp"] = {"kwargs": kwargs,
                     "bucket_cap_bytes": int(getattr(model, "bucket_bytes_cap", 0))}
    return model, comm


def _loader(workload: Any, dataset: Any, config: Config, device: Any,
            ranks: Ranks) -> tuple[Any, Any]:
    """The DataLoader as the config sets it, and the rank's sampler (None on one rank)."""
    import torch

    sampler: Any = None
    if ranks.world > 1:
        # Each rank reads its own shard; drop_last keeps the ranks' step counts equal.
        sampler = torch.utils.data.DistributedSampler(
            dataset, num_replicas=ranks.world, rank=ranks.rank, shuffle=True, seed=0,
            drop_last=True)
    loader = torch.utils.data.DataLoader(
        dataset, shuffle=sampler is None, sampler=sampler, drop_last=True,
        collate_fn=getattr(workload, "collate_fn", None),
        generator=torch.Generator().manual_seed(0), **loader_kwargs(config, device.type))
    if len(loader) == 0:
        raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one micro-batch "
                         f"of {config.micro_batch_size} per rank; make the dataset larger")
    return loader, sampler


def compiled_graphs() -> int:
    """Graphs torch.compile (Dynamo) has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# torch's compile timers (``torch._dynamo.utils.compilation_time_metrics``) of the compiler
# backend: AOT autograd and Inductor for the forward graphs, Inductor for the backward ones
# (compiled at the first backward). A cache hit skips them; Dynamo's tracing and the step itself
# remain. (BERT-base 8x1 fp32 here: a 74.1 s first step, 58.3 s of it in these two; 15.9 s from
# the cache.)
BACKEND_TIMERS = ("OutputGraph.call_user_compiler", "compile_fx.<locals>.bw_compiler")


def compile_cache_use() -> CompileInfo:
    """What compiling did so far with torch's compile cache: ``backend_s``, the seconds the
    compiler backend took (what a process finding the graphs in the cache skips), and
    ``cached``, whether every graph compiled is in the cache now or came from it (none
    bypassed it, every miss was stored). Empty where this torch keeps neither (private API)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters

        backend = sum(float(sum(compilation_time_metrics.get(key, [])))
                      for key in BACKEND_TIMERS)
        aot = counters["aot_autograd"]
        hit, miss, saved = (int(aot[k]) for k in ("autograd_cache_hit", "autograd_cache_miss",
                                                   "autograd_cache_saved"))
        return {"backend_s": backend,
                "cached": hit + saved > 0 and saved >= miss and not aot["autograd_cache_bypass"]}
    except Exception:  # noqa: BLE001 - a torch without these timers: no estimate, no failure
        return {}
