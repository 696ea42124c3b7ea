"""A small training script for tests of `autotune run -- CMD`: a tiny MLP, a plain loop, and
switches for what a user's script may do wrong.

    python loop.py [--apply autocast,dataloader,...] [--behave ok|hang|crash-on-bf16|silent|
                   short|ignore-stop|rank0-only|no-profile] [--max-steps N] [--profile P]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import autotune


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(64, generator=torch.Generator().manual_seed(i))
        return x, x.sum(0, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--apply", default="dataloader,autocast")
    parser.add_argument("--behave", default="ok")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--profile", help="the profile to load (default: $AUTOTUNE_PROFILE)")
    parser.add_argument("--linger", type=float, default=0.0,
                        help="seconds spent after the loop (a checkpoint being saved)")
    args = parser.parse_args()
    apply = set(args.apply.split(",")) if args.apply else set()
    if args.behave == "no-profile":
        apply = set()

    profile = None if args.behave == "no-profile" else autotune.load_profile(args.profile)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, **(profile.ddp_kwargs() if "ddp" in apply else {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader_kwargs = profile.dataloader_kwargs("cpu") if "dataloader" in apply else \
        {"batch_size": 16}
    # A script that ignores the stop must still be running when its grace period ends.
    n = 10**9 if args.behave == "ignore-stop" else 100_000
    loader = torch.utils.data.DataLoader(Data(n), drop_last=True, **loader_kwargs)
    if args.behave == "crash-on-bf16" and profile is not None and profile.config.amp == "bf16":
        raise RuntimeError("this script cannot train in bf16")
    step = 0
    for x, y in loader:
        if args.behave == "hang" and step == 3:
            time.sleep(3600)
        with profile.autocast("cpu") if profile and "autocast" in apply else \
                torch.autocast("cpu", enabled=False):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.sleep:
            time.sleep(args.sleep)
        step += 1
        if args.behave != "silent" and (args.behave != "rank0-only" or rank == 0):
            autotune.step(x.shape[0])
        if step >= args.max_steps or args.behave == "short" and step >= 3:
            break
        if args.behave != "ignore-stop" and autotune.should_stop():
            break
    time.sleep(args.linger)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
