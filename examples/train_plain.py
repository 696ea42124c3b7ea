"""A plain PyTorch training loop that applies every part of an autotune profile.

    python examples/train_plain.py --profile studies/<study>/profile.yaml --seconds 20
    autotune launch profile.yaml -- torchrun --nproc-per-node 2 examples/train_plain.py
    autotune run -- python examples/train_plain.py --workload mlp

The model and data are the workload the profile was tuned on, so the speed printed at the end
can be compared with the profile's (``--workload`` picks another; a profile tuned on a command
by `autotune run` names none: mlp then); in your script they are your own. Everything else is
what you would keep: the profile sets the DataLoader, precision, accumulation, DDP and
environment.
The speed is reported two ways: over the whole timed run, and as the median of 0.5 s windows,
which is how autotune's trials report theirs (a machine that is busy now and then slows some
windows; the median leaves those out, the whole-run figure does not).

Under `autotune run` each trial runs this script with a candidate profile: the loop reports
every optimizer step (``autotune.step()``) and leaves when ``autotune.should_stop()``; outside a
trial both do nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import autotune
from autotune.workloads import builtin_workloads, parse_params, resolve


@dataclass
class Training:
    """What the profile built: the model (DDP with several ranks), its optimizer, the loader,
    the loss scaler, and the precision and accumulation every step uses."""

    profile: autotune.Profile
    device: torch.device
    workload: Any  # your model, data and loss go here
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: torch.utils.data.DataLoader
    sampler: torch.utils.data.DistributedSampler | None
    scaler: torch.amp.GradScaler
    world: int

    def batches(self):
        epoch = 0
        while True:
            if self.sampler is not None:
                self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def step(self, stream) -> torch.Tensor:
        """One optimizer step: ``accumulation_steps`` micro-batches, gradients all-reduced on
        the last one only (DDP's no_sync on the others)."""
        accum = self.profile.accumulation_steps
        for micro in range(accum):
            batch = to_device(next(stream), self.device, self.loader.pin_memory)
            quiet = self.world > 1 and micro < accum - 1
            # DDP's no_sync, or FSDP's gradient sync off: reduced on the last micro-step only.
            with self.profile.no_sync(self.model) if quiet else contextlib.nullcontext():
                with self.profile.autocast(self.device):
                    loss = self.workload.loss(self.model, batch) / accum
                self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach() * accum


def to_device(batch, device, non_blocking):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return type(batch)(to_device(v, device, non_blocking) for v in batch)


def choose_workload(profile: autotune.Profile, name: str | None = None,
                    params: list[str] | None = None) -> Any:
    """The model, data and loss to train: workload ``name`` (a built-in, a .py file or
    module:function) with ``params`` ("k=v") over the profile's own. By default the profile's
    workload; mlp for a profile tuned on a command (`autotune run`), which names no model."""
    spec = profile.workload.get("spec") or ""
    if name is None:
        names_model = spec in builtin_workloads() or spec.endswith(".py") or ":" in spec
        name = spec if names_model else "mlp"
    tuned_params = (profile.workload.get("params") or {}) if name == spec else {}
    return resolve(name, {**tuned_params, **parse_params(params or [])})


def build(profile: autotune.Profile, device: torch.device, world: int = 1,
          local_rank: int = 0, workload: Any = None) -> Training:
    """Model, optimizer, DataLoader and scaler as the profile sets them, for ``workload``
    (default: ``choose_workload(profile)``)."""
    if workload is None:
        workload = choose_workload(profile)
    torch.manual_seed(0)
    # Attention implementation and activation checkpointing, FSDP2 sharding when the profile
    # shards (under the process group started in main), then compile when tuned.
    # Its blocks are the FSDP units: the workload's own (your model's layers), else a
    # transformers model's (``_no_split_modules``).
    module = workload.build_model()
    blocks = workload.blocks(module) if hasattr(workload, "blocks") else None
    module = profile.prepare_model(module, compile=False, device=device, blocks=blocks).to(device)
    # The tuned optimizer implementation (fused, foreach) for the workload's own optimizer.
    optimizer = profile.apply_optimizer(workload.build_optimizer(module))
    model = profile.compile_model(module)  # torch.compile in the tuned mode, or as is
    dataset = workload.build_dataset()
    if world > 1 and not profile.sharded:  # DDP around the compiled model, as the trials
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None,
            **profile.ddp_kwargs())  # bucket size, gradient views, static graph
    sampler = torch.utils.data.DistributedSampler(dataset) if world > 1 else None
    loader = torch.utils.data.DataLoader(
        dataset, sampler=sampler, shuffle=sampler is None, drop_last=True,
        collate_fn=getattr(workload, "collate_fn", None),
        **profile.dataloader_kwargs(device))  # batch size, workers, pinning, prefetch
    scaler = profile.grad_scaler(device)  # enabled only for fp16 on CUDA
    return Training(profile, device, workload, model, optimizer, loader, sampler, scaler, world)


def measure(training: Training, seconds: float, warmup_steps: int,
            max_steps: float = math.inf) -> dict[str, Any]:
    """Train and time it: one step of one-time costs, ``warmup_steps`` that size the run, then
    about ``seconds`` of timed steps, in windows of about 0.5 s. Ends early at ``max_steps``
    steps in all, or once the tuner running this script as a trial says stop."""
    device, world = training.device, training.world
    stream = training.batches()
    ran, loss = 0, torch.tensor(float("nan"))

    def run(n: float) -> int:
        """Up to ``n`` optimizer steps; returns how many ran."""
        nonlocal ran, loss
        done = 0
        while done < n and ran < max_steps and not autotune.should_stop():
            loss = training.step(stream)
            autotune.step()  # the step has ended: the tuner counts it (a no-op outside a trial)
            done, ran = done + 1, ran + 1
        return done

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def slowest(seconds: float) -> float:  # ranks run equal step counts: agree on timings
        if world == 1:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    run(1)  # the first step pays one-time costs (workers, allocator, DDP buckets)
    sync()
    t0 = time.perf_counter()
    warm = run(warmup_steps)  # also sizes the timed run
    sync()
    per_step = max(slowest(time.perf_counter() - t0) / max(warm, 1), 1e-9)
    steps = max(3, int(seconds / per_step)) if seconds < math.inf else math.inf
    window_steps = max(1, round(0.5 / per_step))
    windows: list[float] = []
    timed, start = 0, time.perf_counter()
    mark = start
    while timed < steps:
        wanted = min(window_steps, steps - timed)
        done = run(wanted)
        timed += done
        if done == window_steps:
            sync()
            now = time.perf_counter()
            windows.append(slowest(now - mark))
            mark = now
        if done < wanted:  # stopped
            break
    sync()
    elapsed = slowest(time.perf_counter() - start)
    samples_per_step = training.profile.accumulation_steps * training.loader.batch_size * world
    rate = timed * samples_per_step / elapsed  # global samples per second, the whole run
    median = statistics.median(window_steps * samples_per_step / w for w in windows) \
        if windows else rate
    return {"samples_per_sec": rate, "median_window_samples_per_sec": median, "steps": timed,
            "seconds": elapsed, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="profile.yaml (default: $AUTOTUNE_PROFILE, which "
                        "`autotune launch` and `autotune run` set)")
    parser.add_argument("--seconds", type=float, help="how long to time steps (default: 20; in "
                        "a trial of `autotune run`, until the tuner stops it)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--max-steps", type=int, help="stop after this many steps in all")
    parser.add_argument("--workload", help="the workload to train (default: the profile's; mlp "
                        "for a profile tuned on a command)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a parameter of the workload (repeatable)")
    args = parser.parse_args()

    profile = autotune.load_profile(args.profile)  # warns if tuned on other hardware
    profile.apply_env()  # NCCL_ALGO/NCCL_PROTO: before the process group starts
    profile.apply_torch_flags()  # intra-op threads, TF32: before building the model
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if world != profile.world_size and rank == 0:
        print(f"note: the profile was measured with {profile.world_size} rank(s), this is {world}")
    workload = choose_workload(profile, args.workload, args.param)
    training = build(profile, device, world, local_rank, workload)
    seconds = args.seconds if args.seconds is not None else \
        math.inf if autotune.in_trial() else 20.0
    report = measure(training, seconds, args.warmup_steps, args.max_steps or math.inf)
    model = training.model  # DDP's arguments, as it holds them, or FSDP's sharding
    ddp = {"bucket_cap_mb": model.bucket_bytes_cap / 2**20,
           "gradient_as_bucket_view": model.gradient_as_bucket_view,
           "static_graph": model.static_graph} if world > 1 and not profile.sharded else {}
    sharding = profile.sharding_applied(model) if world > 1 and profile.sharded else {}
    if rank == 0:
        tuned = profile.samples_per_sec  # 0 in a trial's candidate profile: nothing measured yet
        print(json.dumps({**report, "profile_samples_per_sec": tuned,
                          "ratio": report["samples_per_sec"] / tuned if tuned else None,
                          "env": {k: os.environ.get(k) for k in profile.env}, "ddp": ddp,
                          "sharding": sharding}))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
