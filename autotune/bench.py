"""The measured training loop. Runs inside the trial process, never in the tuner.

``python -m autotune.bench SPEC.json RESULT.json PROGRESS.jsonl``. The spec names the workload, the
config and the measurement settings; the result is one JSON document (schema in measurement.py);
progress lines (one JSON object per event) let the tuner show windows as they come and keep them if
the trial is killed at its timeout.

Protocol (nanoGPT's bench.py is the model: synchronise, burn in, measure, report):
  warm-up  whole optimizer steps, timed one by one, until two consecutive steps agree within
           ``warmup_tolerance`` (allocator growth, cuDNN autotuning, lazy init are over), or a
           step/time cap is hit;
  windows  k whole optimizer steps each, k chosen so a window lasts ``min_window_s``; the device
           is synchronised only at window edges; data loading is inside the window;
  stop     after ``min_windows`` once the spread (CV) is under ``target_cv``, or at
           ``max_windows``, or when ``max_seconds`` (warm-up included) is spent. A config
           too slow to warm up and time one window in that budget ends early as ``timeout``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import resource
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from autotune.errors import one_line
from autotune.measurement import RESULT_SCHEMA, is_oom, median_and_cv, merge_ranks

DEFAULT_MEASURE = {
    "min_window_s": 1.0,
    "min_windows": 3,
    "max_windows": 10,
    "target_cv": 0.03,
    "max_seconds": 60.0,  # measuring budget per trial, warm-up included
    "warmup_min_steps": 2,
    "warmup_max_steps": 8,
    "warmup_tolerance": 0.15,
    # All-reduce on every micro-step instead of only the last (no no_sync): for benchmarks that
    # show what no_sync gains; never searched.
    "sync_each_micro": False,
    # Time the all-reduce through a DDP communication hook (multi-rank trials). Off only in the
    # benchmark that measures what the hook itself costs.
    "time_comm": True,
}


class _TooSlow(Exception):
    def __init__(self, step_s: float, rate: float) -> None:
        super().__init__(step_s)
        self.step_s, self.rate = step_s, rate


class Progress:
    """Appends one JSON line per event; the tuner tails the file."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115

    def emit(self, event: str, **data: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, "t": time.time(), **data}) + "\n")


def _tie_to_tuner() -> None:
    """End this trial's process group if the tuner or this process's parent dies, so no orphan
    holds a device.

    A single-rank trial's parent is the tuner; a rank's parent is torchrun's agent, which starts
    each rank in a session of its own. Three ways in: SIGTERM, which Linux sends when the parent
    exits (PR_SET_PDEATHSIG, set here rather than in a preexec_fn, which is unsafe in a tuner with
    threads) and which torchrun's agent sends to tear the ranks down; and, for a main thread stuck
    in native code, a thread that notices the parent change or the tuner's end.
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: _stopped())
    # A Python handler runs only when the main thread runs Python; one blocked in native code (a
    # collective whose peer is gone) would ignore torchrun's SIGTERM until its SIGKILL 30 s later.
    # The C-level handler writes every signal to the wakeup fd at once: the watch thread acts on it.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    parent = os.getppid()
    tuner = int(os.environ.get("AUTOTUNE_TUNER_PID", parent))
    # On another node of a trial across machines the tuner's pid means nothing: the parent
    # (that node's torchrun agent) is watched alone.
    here = os.environ.get("AUTOTUNE_TUNER_HOST", socket.gethostname()) == socket.gethostname()

    def orphaned() -> bool:
        return os.getppid() != parent or (here and not _alive(tuner))

    if orphaned():  # the tuner died before the tie was made
        os.killpg(os.getpgrp(), signal.SIGKILL)

    def watch() -> None:
        while True:
            ready, _, _ = select.select([wake_r], [], [], 0.5)
            if ready and int(signal.SIGTERM) in os.read(wake_r, 256):
                _stopped()
            if orphaned():
                os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="autotune-parent-watch").start()


def _stopped() -> None:
    """End this process and its loader workers now, on a SIGTERM: the workers by SIGKILL, this
    process with exit code 143 (128 + SIGTERM). Not by SIGKILL: torchrun would report this rank
    as killed (-9), which reads as the kernel's OOM killer, and when it stops this rank because
    a peer failed, the trial would be blamed on memory instead of the peer's own error."""
    import psutil

    me, group = os.getpid(), os.getpgrp()
    with contextlib.suppress(Exception):
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(Exception):
                proc.kill()
        for proc in psutil.process_iter():  # the group's others, reparented ones too
            with contextlib.suppress(Exception):
                if proc.pid != me and os.getpgid(proc.pid) == group:
                    proc.kill()
    os._exit(128 + signal.SIGTERM)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: only its exit status is left)."""
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


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
        # The rank that writes the progress and result files: global rank 0, or in a trial
        # across machines whose nodes do not share a file system, the first rank of the
        # tuner's node (which torchrun's c10d rendezvous need not make rank 0).
        reporting = os.environ.get("AUTOTUNE_REPORTING_NODE")
        self.reports = self.rank == 0 if reporting is None else \
            (reporting == "1" and self.local_rank == 0)

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


def _to_device(batch: Any, device: Any, non_blocking: bool) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: _to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_to_device(v, device, non_blocking) for v in batch)
    return batch


class Memory:
    """Peak memory of this process: CUDA reserved plus the context NVML sees, or peak RSS on CPU."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.source = "cuda_max_reserved+nvml_overhead" if device.type == "cuda" else "ru_maxrss"

    def reset(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        import torch

        if self.device.type != "cuda":
            # ru_maxrss is in KiB on Linux. Loader workers are separate processes: the tuner
            # samples the whole process tree and takes the larger figure.
            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        reserved_peak = int(torch.cuda.max_memory_reserved(self.device))
        # NVML counts what the caching allocator cannot see: the CUDA context, cuBLAS workspaces,
        # NCCL buffers. Add the part of NVML's figure that is not reserved memory right now.
        used = _nvml_process_bytes(self.device)
        overhead = max(0, used - int(torch.cuda.memory_reserved(self.device))) if used else 0
        return reserved_peak + overhead


def _nvml_process_bytes(device: Any) -> int:
    try:
        import pynvml
        import torch

        props: Any = torch.cuda.get_device_properties(device)
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    return int(proc.usedGpuMemory)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0  # containers often hide other PIDs from NVML; reserved memory still counts
    return 0


def _batches(loader: Any, sampler: Any = None) -> Iterator[Any]:
    """An endless stream of batches: a new epoch (a new loader iterator) when one ends."""
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)  # a new shuffle per epoch, the same on every rank
        yield from loader
        epoch += 1


def run(spec: dict[str, Any], progress: Progress, ranks: Ranks | None = None) -> dict[str, Any]:
    """Build the workload for the config and measure it; returns this rank's result document.

    A failure is reported as data; ``failed_at`` marks one this rank hit on its own (an
    exception), as opposed to an outcome all ranks agreed on (too slow to measure).
    """
    t_enter = time.time()
    import torch

    from autotune.knobs import Config
    from autotune.workloads import resolve

    ranks = ranks or Ranks()
    config = Config.from_dict(spec["config"])
    if ranks.world != config.world_size:
        raise SystemExit(f"autotune.bench: WORLD_SIZE is {ranks.world} but the config asks for "
                         f"{config.world_size} rank(s)")
    measure = {**DEFAULT_MEASURE, **spec.get("measure", {})}
    device = torch.device("cuda", ranks.local_rank) \
        if spec["device"] == "cuda" else torch.device("cpu")
    memory = Memory(device)
    timings: dict[str, float] = {"imports_s": time.time() - t_enter}
    result: dict[str, Any] = {"schema": RESULT_SCHEMA, "status": "error", "reason": None,
                              "windows": [], "timings": timings, "memory_source": memory.source,
                              "device": device.type, "torch_version": torch.__version__,
                              "threads": torch.get_num_threads(), "peak_memory_bytes": 0,
                              "rank": ranks.rank, "world_size": ranks.world}
    try:
        _measure(spec, config, measure, device, memory, timings, result, progress, resolve,
                 ranks)
    except BaseException as exc:  # noqa: BLE001 - the trial reports every failure as data
        if isinstance(exc, KeyboardInterrupt):
            raise
        result["status"] = "oom" if is_oom(exc) else "error"
        result["reason"] = one_line(exc)
        result["failed_at"] = time.time()
        traceback.print_exc(file=sys.stderr)
    with contextlib.suppress(Exception):
        result["peak_memory_bytes"] = memory.peak()
    return result


def _measure(spec: dict[str, Any], config: Any, measure: dict[str, Any], device: Any,
             memory: Memory, timings: dict[str, float], result: dict[str, Any],
             progress: Progress, resolve: Callable[..., Any], ranks: Ranks) -> None:
    import torch

    from autotune.knobs import autocast_dtype, ddp_kwargs, uses_grad_scaler
    from autotune.knobs import loader_kwargs as loader_settings

    t0 = time.time()
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        limit = spec.get("memory_limit_bytes")
        if limit:
            # Make the caching allocator itself refuse to pass the limit: an over-limit config
            # then fails as a real OOM instead of succeeding on memory the user does not have.
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        memory.reset()
    result["backend"] = ranks.start(device)
    workload = resolve(spec["workload"]["spec"], spec["workload"].get("params", {}))
    module = workload.build_model().to(device)
    module.train()
    optimizer = workload.build_optimizer(module)
    model: Any = module
    comm: CommTimer | None = None
    if ranks.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        kwargs = ddp_kwargs(config)
        model = DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)
        if measure.get("time_comm", True):
            timer = comm = CommTimer(ranks.world, device.type == "cuda")
            # DDP checks a hook's annotations against its own types: register an unannotated one.
            model.register_comm_hook(None, lambda state, bucket: timer.hook(state, bucket))
        result["ddp"] = {"kwargs": kwargs,
                         "bucket_cap_bytes": int(getattr(model, "bucket_bytes_cap", 0))}
    dataset = workload.build_dataset()
    sampler: Any = None
    if ranks.world > 1:
        # Each rank reads its own shard; drop_last keeps the ranks' step counts equal.
        sampler = torch.utils.data.DistributedSampler(
            dataset, num_replicas=ranks.world, rank=ranks.rank, shuffle=True, seed=0,
            drop_last=True)
    loader_kwargs: dict[str, Any] = dict(
        shuffle=sampler is None, sampler=sampler, drop_last=True,
        collate_fn=getattr(workload, "collate_fn", None),
        generator=torch.Generator().manual_seed(0), **loader_settings(config, device.type))
    loader = torch.utils.data.DataLoader(dataset, **loader_kwargs)
    if len(loader) == 0:
        raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one micro-batch "
                         f"of {config.micro_batch_size} per rank; make the dataset larger")
    batches = _batches(loader, sampler)
    amp_dtype = autocast_dtype(config)
    scaler = torch.amp.GradScaler("cuda", enabled=uses_grad_scaler(config, device.type))
    non_blocking = bool(loader_kwargs["pin_memory"])
    sync_each_micro = bool(measure.get("sync_each_micro"))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(after_micro: Callable[[int], None] | None = None) -> float:
        """One optimizer step of grad_accum_steps micro-batches; returns seconds spent waiting
        for data (next batch plus the host-to-device copy). Gradients are all-reduced on the
        last micro-step only: the others run under DDP's no_sync."""
        wait = 0.0
        for micro in range(config.grad_accum_steps):
            if after_micro is not None and micro > 0:
                after_micro(micro)
            t = time.perf_counter()
            batch = _to_device(next(batches), device, non_blocking)
            wait += time.perf_counter() - t
            last = micro == config.grad_accum_steps - 1
            quiet = ranks.world > 1 and not last and not sync_each_micro
            if comm is not None:
                comm.micro = micro
            with model.no_sync() if quiet else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                                    enabled=amp_dtype is not None):
                    loss = workload.loss(model, batch) / config.grad_accum_steps
                scaler.scale(loss).backward()
            if comm is not None and not quiet:
                comm.end_step()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return wait

    timings["build_s"] = time.time() - t0
    progress.emit("built", build_s=timings["build_s"])

    # Warm-up: whole steps, each synchronised, until step time settles. Step times and the time
    # spent are agreed over the ranks (the slowest counts), so all ranks decide alike.
    t_warm = time.time()
    step_times: list[float] = []
    ended_by = "max_steps"
    budget = measure["max_seconds"]

    def check_fits(step_s: float, steps_done: int, elapsed: float) -> None:
        """A config whose warm-up and one window cannot fit the measuring budget is reported
        as too slow as soon as that is known, instead of burning the whole trial timeout.
        The first step carries one-time costs (lazy init, worker start-up, autotuning) and is
        measured up to ~1.6x a steady step here, so it is judged against twice the budget."""
        still = max(measure["warmup_min_steps"] - steps_done, 0) + 1
        allowed = (2.0 if steps_done <= 1 else 1.25) * budget
        if elapsed + still * step_s > allowed:
            raise _TooSlow(step_s, config.samples_per_step / step_s)

    micro0_s = 0.0

    def first_micro(micro: int) -> None:
        """Within the first step: judge the step from its micro-steps so far. Micro-step 0
        carries the start-up costs, so with 3+ micro-steps the estimate uses the later ones
        (else a long accumulation would multiply those costs by the accumulation count)."""
        nonlocal micro0_s
        sync()
        (elapsed,) = ranks.agree(time.time() - t_warm)
        if micro == 1:
            micro0_s = elapsed
            if config.grad_accum_steps > 2:
                return
            step_s = elapsed * config.grad_accum_steps
        else:
            step_s = (elapsed - micro0_s) / (micro - 1) * config.grad_accum_steps
        check_fits(step_s, 0, elapsed)

    try:
        while len(step_times) < measure["warmup_max_steps"]:
            sync()
            t = time.perf_counter()
            step(first_micro if not step_times else None)
            sync()
            step_s, elapsed = ranks.agree(time.perf_counter() - t, time.time() - t_warm)
            step_times.append(step_s)
            progress.emit("warmup_step", seconds=step_s)
            if len(step_times) >= measure["warmup_min_steps"]:
                a, b = step_times[-2], step_times[-1]
                if abs(a - b) / max(a, b) <= measure["warmup_tolerance"]:
                    ended_by = "stable"
                    break
            else:
                check_fits(step_s, len(step_times), elapsed)
            # Past the minimum, long steps end warm-up by time; before it, never: the first step
            # carries start-up costs and is no measure of steady state.
            if len(step_times) >= measure["warmup_min_steps"] and \
                    elapsed > 0.4 * measure["max_seconds"]:
                ended_by = "time"
                break
    except _TooSlow as slow:
        result["status"] = "timeout"
        result["reason"] = (f"one optimizer step takes ~{slow.step_s:.1f}s; warm-up and a window "
                            f"do not fit the {measure['max_seconds']:.0f}s measuring budget")
        result["first_step_samples_per_sec"] = slow.rate
        timings["warmup_s"] = time.time() - t_warm
        return
    timings["warmup_s"] = time.time() - t_warm
    step_estimate = step_times[-1]
    steps_per_window = max(1, math.ceil(measure["min_window_s"] / max(step_estimate, 1e-6)))
    result["warmup"] = {"steps": len(step_times), "seconds": timings["warmup_s"],
                        "ended_by": ended_by, "step_times_s": step_times}
    if comm is not None:
        comm.take_wait()  # warm-up's communication is not part of any window

    # Timed windows, end to end (data loading included), synchronised only at their edges. Each
    # rank keeps its own windows; the stop rule reads the slowest rank's.
    t_measure = time.time()
    windows: list[dict[str, Any]] = result["windows"]
    rates: list[float] = []
    while True:
        sync()
        t = time.perf_counter()
        wait = sum(step() for _ in range(steps_per_window))
        sync()
        seconds = time.perf_counter() - t
        window = {"steps": steps_per_window, "seconds": seconds, "data_wait_s": wait,
                  "samples": steps_per_window * config.samples_per_rank_step}
        if comm is not None:
            window["comm_wait_s"] = comm.take_wait()
        windows.append(window)
        slowest, elapsed = ranks.agree(seconds, time.time() - t_warm)
        samples = steps_per_window * config.samples_per_step
        rates.append(samples / slowest)
        progress.emit("window", index=len(windows) - 1, samples=samples, seconds=slowest,
                      data_wait_s=wait, comm_wait_s=window.get("comm_wait_s", 0.0),
                      samples_per_sec=rates[-1])
        if len(rates) >= measure["min_windows"] and median_and_cv(rates)[1] <= measure["target_cv"]:
            break
        if len(rates) >= measure["max_windows"]:
            break
        # Stop when another window would run past the measuring budget, warm-up included
        # (but keep >= 1 window).
        if elapsed + slowest > measure["max_seconds"]:
            break
    timings["measure_s"] = time.time() - t_measure
    result.update(status="ok", steps_per_window=steps_per_window)
    if comm is not None:
        result["comm"] = {"calls_by_micro": {str(k): v for k, v in
                                             sorted(comm.calls_by_micro.items())},
                          "buckets_per_sync": comm.last_step_buckets,
                          "sync_each_micro": sync_each_micro}
    _flops(spec, workload, module, dataset, device, amp_dtype, result)


def _flops(spec: dict[str, Any], workload: Any, module: Any, dataset: Any, device: Any,
           amp_dtype: Any, result: dict[str, Any]) -> None:
    """FLOPs per sample for the result: the study's figure when the tuner passes one, else
    counted here once (``count_flops``, after the windows: it never touches the measurement),
    else the workload's own estimate."""
    known = spec.get("flops") or {}
    if known.get("per_sample"):
        result["flops_per_sample"], result["flops_source"] = known["per_sample"], known["source"]
        return
    if spec.get("count_flops"):
        try:
            result["flops_per_sample"] = count_flops(workload, module, dataset, device,
                                                     amp_dtype)
            result["flops_source"] = COUNTED
            return
        except Exception as exc:  # noqa: BLE001 - the measurement stands without it
            result["flops_count_error"] = one_line(exc)
    fps = workload.flops_per_sample() if hasattr(workload, "flops_per_sample") else None
    result["flops_per_sample"] = float(fps) if fps else None
    result["flops_source"] = "workload.flops_per_sample" if fps else None


COUNTED = "torch.utils.flop_counter"


def count_flops(workload: Any, module: Any, dataset: Any, device: Any, amp_dtype: Any = None,
                samples: int = 2) -> float:
    """Training FLOPs per sample, forward and backward (no optimizer), as PyTorch's FLOP
    counter sees them (matmuls, convolutions, attention), on a batch of ``samples``.

    The backward is ``autograd.grad`` over the parameters: it computes what ``backward()``
    does for the gradients without touching ``.grad`` or DDP's hooks, and, like training,
    nothing for inputs that need no gradient."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    loader = torch.utils.data.DataLoader(dataset, batch_size=samples,
                                         collate_fn=getattr(workload, "collate_fn", None))
    batch = _to_device(next(iter(loader)), device, False)
    params = [p for p in module.parameters() if p.requires_grad]
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                            enabled=amp_dtype is not None):
            loss = workload.loss(module, batch)
        torch.autograd.grad(loss, params, allow_unused=True)
    return float(counter.get_total_flops()) / samples


def _write_json(path: str, doc: dict[str, Any]) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)  # atomic: the tuner never reads half a result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m autotune.bench SPEC.json RESULT.json [PROGRESS.jsonl]",
              file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    _tie_to_tuner()
    limit = spec.get("address_space_bytes")
    if limit:  # before torch is imported, so every allocation counts against it
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    ranks = Ranks()
    progress = Progress(args[2] if len(args) == 3 and ranks.reports else None)
    result = run(spec, progress, ranks)
    try:
        import psutil

        result["timings"]["process_start_to_end_s"] = time.time() - psutil.Process().create_time()
    except Exception:
        pass
    if ranks.world > 1 and "failed_at" in result:
        # The other ranks may be stuck in a collective and cannot be gathered: leave this rank's
        # report next to the result and exit non-zero, which makes torchrun end the group.
        _write_json(f"{args[1]}.rank{ranks.rank}", result)
        sys.stdout.flush()
        os._exit(1)
    docs = ranks.gather(result)
    if ranks.reports:
        _write_json(args[1], merge_ranks(docs))
    # No rank leaves before the reporting rank has written: an early exit could cut the
    # gather short.
    ranks.barrier()
    sys.stdout.flush()
    # Skip interpreter teardown (loader workers, CUDA, the process group): the result is
    # written; exit now.
    os._exit(0)


if __name__ == "__main__":
    main()
