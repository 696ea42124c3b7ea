"""A trial's ranks: where this process stands among them, how they agree on every decision, and
how long a step waits for their gradients' all-reduce."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any


class Ranks:
    """This process's place in the trial: alone (world size 1), or one of WORLD_SIZE ranks
    started by torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE.

    Ranks must take every decision together (when warm-up ends, when to stop measuring), or one
    would leave a collective the others still wait in. ``agree`` gives all of them the same
    numbers to decide from: the maximum over ranks, i.e. the slowest rank's view.
    """

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._device: Any = None
        # The rank that writes the progress and result files: global rank 0 (on a cluster
        # engine its node's part relays them to the tuner: ``trial.executors``).
        self.reports = self.rank == 0

    def start(self, device: Any) -> str | None:
        """Join the process group (nccl on CUDA, gloo on CPU); returns the backend."""
        self._device = device
        if self.world == 1:
            return None
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend)
        return backend

    def agree(self, *values: float) -> list[float]:
        """Each value's maximum over all ranks."""
        if self.world == 1:
            return list(values)
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (on every rank)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            with contextlib.suppress(Exception):  # a peer already gone changes nothing now
                dist.barrier()


class CommTimer:
    """A DDP communication hook that all-reduces as DDP's default does (average of the bucket)
    and measures how long the step waits for it.

    DDP starts each bucket's all-reduce when its gradients are ready, overlapping the rest of the
    backward pass; the last bucket is ready when the backward's compute is done. What the step
    still waits after that moment is exposed communication: the latest all-reduce end minus the
    last bucket's start. Host clocks on CPU; CUDA events on GPU (NCCL runs asynchronously to the
    host), read at window edges, where the device is synchronised anyway.

    It also counts all-reduces per micro-step index, which shows that accumulation syncs only on
    the last micro-step (``no_sync`` on the others).
    """

    def __init__(self, world: int, cuda: bool) -> None:
        self.world, self.cuda = world, cuda
        self.micro = 0  # index of the micro-step running now, set by the loop
        self.calls_by_micro: dict[int, int] = {}
        self.last_step_buckets = 0
        self._starts: list[Any] = []
        self._ends: list[Any] = []
        self._pending: list[tuple[Any, list[Any]]] = []
        self._wait_s = 0.0

    def _mark(self) -> Any:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def hook(self, state: Any, bucket: Any) -> Any:
        import torch.distributed as dist

        self.calls_by_micro[self.micro] = self.calls_by_micro.get(self.micro, 0) + 1
        self._starts.append(self._mark())
        tensor = bucket.buffer()
        tensor.div_(self.world)
        future = dist.all_reduce(tensor, async_op=True).get_future()

        def done(f: Any) -> Any:
            self._ends.append(self._mark())
            return f.value()[0]

        return future.then(done)

    def end_step(self) -> None:
        """Called after a step's last backward: DDP has waited for every bucket by then."""
        if self._starts and self._ends:
            self.last_step_buckets = len(self._starts)
            if self.cuda:
                self._pending.append((self._starts[-1], list(self._ends)))
            else:
                self._wait_s += max(0.0, max(self._ends) - self._starts[-1])
        self._starts, self._ends = [], []

    def take_wait(self) -> float:
        """Seconds of exposed communication since the last call (device synchronised)."""
        for start, ends in self._pending:
            self._wait_s += max(0.0, max(start.elapsed_time(e) for e in ends) / 1000.0)
        self._pending = []
        wait, self._wait_s = self._wait_s, 0.0
        return wait
