"""A plain PyTorch training loop that applies every part of an autotune profile.

    python examples/train_plain.py --profile studies/<study>/profile.yaml --seconds 20
    autotune launch profile.yaml -- torchrun --nproc-per-node 2 examples/train_plain.py

The model and data are the workload the profile was tuned on, so the speed printed at the end
can be compared with the profile's; in your script they are your own. Everything else is what
you would keep: the profile sets the DataLoader, precision, accumulation, DDP and environment.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist

import autotune
from autotune.workloads import resolve


def to_device(batch, device, non_blocking):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return type(batch)(to_device(v, device, non_blocking) for v in batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="profile.yaml (default: $AUTOTUNE_PROFILE, which "
                        "`autotune launch` sets)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to time steps")
    parser.add_argument("--warmup-steps", type=int, default=3)
    args = parser.parse_args()

    profile = autotune.load_profile(args.profile)  # warns if tuned on other hardware
    profile.apply_env()  # NCCL_ALGO/NCCL_PROTO: before the process group starts
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if world != profile.world_size and rank == 0:
        print(f"note: the profile was measured with {profile.world_size} rank(s), this is {world}")

    # Your model, optimizer, loss and dataset go here.
    workload = resolve(profile.workload["spec"], profile.workload.get("params") or {})
    torch.manual_seed(0)
    model = workload.build_model().to(device)
    optimizer = workload.build_optimizer(model)
    dataset = workload.build_dataset()

    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None,
            **profile.ddp_kwargs())  # bucket size, gradient views, static graph
    sampler = torch.utils.data.DistributedSampler(dataset) if world > 1 else None
    loader = torch.utils.data.DataLoader(
        dataset, sampler=sampler, shuffle=sampler is None, drop_last=True,
        collate_fn=getattr(workload, "collate_fn", None),
        **profile.dataloader_kwargs(device))  # batch size, workers, pinning, prefetch
    non_blocking = loader.pin_memory
    scaler = profile.grad_scaler(device)  # enabled only for fp16 on CUDA
    accum = profile.accumulation_steps

    def batches():
        epoch = 0
        while True:
            if sampler is not None:
                sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream = batches()

    def train_step() -> float:
        for micro in range(accum):
            batch = to_device(next(stream), device, non_blocking)
            # All-reduce gradients once per optimizer step: skip DDP's sync on the others.
            quiet = world > 1 and micro < accum - 1
            with model.no_sync() if quiet else contextlib.nullcontext():
                with profile.autocast(device):
                    loss = workload.loss(model, batch) / accum
                scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.item() * accum

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def slowest(seconds: float) -> float:  # ranks run equal step counts: agree on timings
        if world == 1:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    train_step()  # the first step pays one-time costs (workers, allocator, DDP buckets)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.warmup_steps):  # also sizes the timed run
        train_step()
    sync()
    per_step = slowest(time.perf_counter() - t0) / max(args.warmup_steps, 1)
    steps = max(3, int(args.seconds / per_step))
    start = time.perf_counter()
    for _ in range(steps):
        loss = train_step()
    sync()
    elapsed = slowest(time.perf_counter() - start)
    rate = steps * accum * loader.batch_size * world / elapsed  # global samples per second
    if rank == 0:
        print(json.dumps({"samples_per_sec": rate, "profile_samples_per_sec":
                          profile.samples_per_sec, "ratio": rate / profile.samples_per_sec,
                          "steps": steps, "seconds": elapsed, "loss": loss}))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
