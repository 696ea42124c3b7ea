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
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from autotune.errors import one_line
from autotune.measurement import RESULT_SCHEMA, is_oom, median_and_cv

DEFAULT_MEASURE = {
    "min_window_s": 1.0,
    "min_windows": 3,
    "max_windows": 10,
    "target_cv": 0.03,
    "max_seconds": 60.0,  # measuring budget per trial, warm-up included
    "warmup_min_steps": 2,
    "warmup_max_steps": 8,
    "warmup_tolerance": 0.15,
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
    """End this trial's whole process group if the tuner dies, so no orphan holds a device.

    Two ways in: SIGTERM, which Linux sends when the parent exits (PR_SET_PDEATHSIG, set here
    rather than in a preexec_fn, which is unsafe in a tuner with threads), and, for a main thread
    stuck in native code, a thread that notices the parent change.
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: os.killpg(os.getpgrp(), signal.SIGKILL))
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    parent = int(os.environ.get("AUTOTUNE_TUNER_PID", os.getppid()))
    if os.getppid() != parent:  # the tuner died before the tie was made
        os.killpg(os.getpgrp(), signal.SIGKILL)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="autotune-parent-watch").start()


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


def _batches(make_loader: Callable[[], Any]) -> Iterator[Any]:
    """An endless stream of batches: a new epoch (a new loader iterator) when one ends."""
    loader = make_loader()
    while True:
        yield from loader


def run(spec: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Build the workload for the config and measure it; returns the result document."""
    t_enter = time.time()
    import torch

    from autotune.knobs import Config
    from autotune.workloads import resolve

    config = Config.from_dict(spec["config"])
    measure = {**DEFAULT_MEASURE, **spec.get("measure", {})}
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if spec["device"] == "cuda" else torch.device("cpu")
    memory = Memory(device)
    timings: dict[str, float] = {"imports_s": time.time() - t_enter}
    result: dict[str, Any] = {"schema": RESULT_SCHEMA, "status": "error", "reason": None,
                              "windows": [], "timings": timings, "memory_source": memory.source,
                              "device": device.type, "torch_version": torch.__version__,
                              "threads": torch.get_num_threads(), "peak_memory_bytes": 0}
    try:
        _measure(spec, config, measure, device, memory, timings, result, progress, resolve)
    except BaseException as exc:  # noqa: BLE001 - the trial reports every failure as data
        if isinstance(exc, KeyboardInterrupt):
            raise
        result["status"] = "oom" if is_oom(exc) else "error"
        result["reason"] = one_line(exc)
        traceback.print_exc(file=sys.stderr)
    with contextlib.suppress(Exception):
        result["peak_memory_bytes"] = memory.peak()
    return result


def _measure(spec: dict[str, Any], config: Any, measure: dict[str, Any], device: Any,
             memory: Memory, timings: dict[str, float], result: dict[str, Any],
             progress: Progress, resolve: Callable[..., Any]) -> None:
    import torch

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
    workload = resolve(spec["workload"]["spec"], spec["workload"].get("params", {}))
    model = workload.build_model().to(device)
    model.train()
    optimizer = workload.build_optimizer(model)
    dataset = workload.build_dataset()
    loader_kwargs: dict[str, Any] = dict(
        batch_size=config.micro_batch_size, shuffle=True, drop_last=True,
        num_workers=config.num_workers, pin_memory=config.pin_memory and device.type == "cuda",
        collate_fn=getattr(workload, "collate_fn", None),
        generator=torch.Generator().manual_seed(0))
    if config.num_workers > 0:
        loader_kwargs.update(prefetch_factor=config.prefetch_factor or 2, persistent_workers=True)
    loader = torch.utils.data.DataLoader(dataset, **loader_kwargs)
    if len(loader) == 0:
        raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one micro-batch "
                         f"of {config.micro_batch_size}; make the dataset larger")
    batches = _batches(lambda: loader)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.amp)
    # GradScaler only for fp16 on CUDA: bf16 has fp32's range and needs no loss scaling.
    scaler = torch.amp.GradScaler("cuda", enabled=config.amp == "fp16" and device.type == "cuda")
    non_blocking = bool(loader_kwargs["pin_memory"])

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(after_micro: Callable[[int], None] | None = None) -> float:
        """One optimizer step of grad_accum_steps micro-batches; returns seconds spent waiting
        for data (next batch plus the host-to-device copy)."""
        wait = 0.0
        for micro in range(config.grad_accum_steps):
            if after_micro is not None and micro > 0:
                after_micro(micro)
            t = time.perf_counter()
            batch = _to_device(next(batches), device, non_blocking)
            wait += time.perf_counter() - t
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                                enabled=amp_dtype is not None):
                loss = workload.loss(model, batch) / config.grad_accum_steps
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return wait

    timings["build_s"] = time.time() - t0
    progress.emit("built", build_s=timings["build_s"])

    # Warm-up: whole steps, each synchronised, until step time settles.
    t_warm = time.time()
    step_times: list[float] = []
    ended_by = "max_steps"
    budget = measure["max_seconds"]

    def check_fits(step_s: float, steps_done: int) -> None:
        """A config whose warm-up and one window cannot fit the measuring budget is reported
        as too slow as soon as that is known, instead of burning the whole trial timeout.
        The first step carries one-time costs (lazy init, worker start-up, autotuning) and is
        measured up to ~1.6x a steady step here, so it is judged against twice the budget."""
        still = max(measure["warmup_min_steps"] - steps_done, 0) + 1
        allowed = (2.0 if steps_done <= 1 else 1.25) * budget
        if time.time() - t_warm + still * step_s > allowed:
            raise _TooSlow(step_s, config.samples_per_step / step_s)

    def first_micro(micro: int) -> None:
        sync()
        check_fits((time.time() - t_warm) / micro * config.grad_accum_steps, 0)

    try:
        while len(step_times) < measure["warmup_max_steps"]:
            sync()
            t = time.perf_counter()
            step(first_micro if not step_times else None)
            sync()
            step_times.append(time.perf_counter() - t)
            progress.emit("warmup_step", seconds=step_times[-1])
            if len(step_times) >= measure["warmup_min_steps"]:
                a, b = step_times[-2], step_times[-1]
                if abs(a - b) / max(a, b) <= measure["warmup_tolerance"]:
                    ended_by = "stable"
                    break
            else:
                check_fits(step_times[-1], len(step_times))
            # Past the minimum, long steps end warm-up by time; before it, never: the first step
            # carries start-up costs and is no measure of steady state.
            if len(step_times) >= measure["warmup_min_steps"] and \
                    time.time() - t_warm > 0.4 * measure["max_seconds"]:
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

    # Timed windows, end to end (data loading included), synchronised only at their edges.
    t_measure = time.time()
    windows: list[dict[str, Any]] = result["windows"]
    rates: list[float] = []
    while True:
        sync()
        t = time.perf_counter()
        wait = sum(step() for _ in range(steps_per_window))
        sync()
        seconds = time.perf_counter() - t
        samples = steps_per_window * config.samples_per_step
        windows.append({"steps": steps_per_window, "samples": samples, "seconds": seconds,
                        "data_wait_s": wait})
        rates.append(samples / seconds)
        progress.emit("window", index=len(windows) - 1, samples=samples, seconds=seconds,
                      data_wait_s=wait, samples_per_sec=rates[-1])
        if len(rates) >= measure["min_windows"] and median_and_cv(rates)[1] <= measure["target_cv"]:
            break
        if len(rates) >= measure["max_windows"]:
            break
        # Stop when another window would run past the measuring budget, warm-up included
        # (but keep >= 1 window).
        if time.time() - t_warm + seconds > measure["max_seconds"]:
            break
    timings["measure_s"] = time.time() - t_measure
    med, cv = median_and_cv(rates)
    result.update(status="ok", samples_per_sec=med, spread_cv=cv if len(rates) > 1 else None,
                  step_time_s=sum(w["seconds"] for w in windows) / sum(w["steps"] for w in windows),
                  steps_per_window=steps_per_window)
    fps = workload.flops_per_sample() if hasattr(workload, "flops_per_sample") else None
    result["flops_per_sample"] = float(fps) if fps else None


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
    progress = Progress(args[2] if len(args) == 3 else None)
    result = run(spec, progress)
    try:
        import psutil

        result["timings"]["process_start_to_end_s"] = time.time() - psutil.Process().create_time()
    except Exception:
        pass
    tmp = Path(args[1] + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args[1])  # atomic: the tuner never reads half a result
    sys.stdout.flush()
    # Skip interpreter teardown (loader workers, CUDA): the result is written; exit now.
    os._exit(0)


if __name__ == "__main__":
    main()
