"""The measured training loop. Runs inside the trial process, never in the tuner.

``python -m autotune.trial.bench SPEC.json RESULT.json PROGRESS.jsonl``. The spec
(``trial.spec.TrialSpec``) names the workload, the config and the measuring settings; the result is
one JSON document (``trial.result``); progress lines (one JSON object per event) let
the tuner show windows as they come and keep them if the trial is killed at its timeout.

Protocol (``trial.protocol``, timed by ``loop.py``):
  warm-up  whole optimizer steps, timed one by one, until two consecutive steps agree within
           ``warmup_tolerance`` (allocator growth, cuDNN autotuning, lazy init are over), or a
           step/time cap is hit;
  windows  k whole optimizer steps each, k chosen so a window lasts ``min_window_s``; the device
           is synchronised only at window edges; data loading is inside the window;
  stop     after ``min_windows`` once the spread (CV) is under ``target_cv``, or at
           ``max_windows``, or when ``max_seconds`` (warm-up included) is spent. A config
           too slow to warm up and time one window in that budget ends early as ``timeout``.

The parts: ``build`` (the workload for the config, applied), ``loop`` (warm-up and windows),
``ranks`` (agreeing across ranks, timing the all-reduce), ``device`` (batches, peak memory),
``flops`` and ``process`` (the tie to the tuner, the result file); the progress file is
``trial.progress``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from autotune.errors import one_line
from autotune.trial.bench.process import tie_to_tuner, write_json
from autotune.trial.bench.ranks import Ranks
from autotune.trial.measurement import COMPILE_LIMIT, TRIAL_TIMEOUT, is_oom
from autotune.trial.merge import merge_ranks
from autotune.trial.progress import Progress
from autotune.trial.protocol import stop_reason
from autotune.trial.result import RESULT_SCHEMA, Timings, TrialResultDoc
from autotune.trial.spec import TrialSpec


def run(spec: TrialSpec, progress: Progress, ranks: Ranks | None = None) -> TrialResultDoc:
    """Build the workload for the config and measure it; returns this rank's result document.

    A failure is reported as data; ``failed_at`` marks one this rank hit on its own (an
    exception), as opposed to an outcome all ranks agreed on (too slow to measure).
    """
    t_enter = time.time()
    import torch

    from autotune.trial.bench.device import Memory

    ranks = ranks or Ranks()
    if ranks.world != spec.config.world_size:
        raise SystemExit(f"autotune.trial.bench: WORLD_SIZE is {ranks.world} but the config "
                         f"asks for {spec.config.world_size} rank(s)")
    device = torch.device("cuda", ranks.local_rank) \
        if spec.device == "cuda" else torch.device("cpu")
    memory = Memory(device)
    timings: Timings = {"imports_s": time.time() - t_enter}
    result: TrialResultDoc = {
        "schema": RESULT_SCHEMA, "status": "error", "reason": None, "windows": [],
        "timings": timings, "memory_source": memory.source, "device": device.type,
        "torch_version": torch.__version__, "threads": torch.get_num_threads(),
        "peak_memory_bytes": 0, "rank": ranks.rank, "world_size": ranks.world}
    try:
        _measure(spec, device, memory, result, progress, ranks)
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


def _measure(spec: TrialSpec, device: Any, memory: Any, result: TrialResultDoc,
             progress: Progress, ranks: Ranks) -> None:
    """Build, warm up, time the windows, count FLOPs: the result's fields as they come."""
    from autotune.trial.bench.build import build
    from autotune.trial.bench.flops import flops_for
    from autotune.trial.bench.loop import Diverged, TooSlow, measure_windows, protocol_for, warm_up

    timings, settings = result["timings"], spec.measure
    _read_sentinel(spec, device, result, ranks)  # before the config's knobs are applied
    t0 = time.time()
    trainer = build(spec, device, ranks, result, memory)
    timings["build_s"] = time.time() - t0
    progress.emit("built", build_s=timings["build_s"])
    if spec.config.compile != "off" and not _compile(trainer, spec, progress, result, ranks):
        return
    ends_by = math.inf if spec.ends_by is None else spec.ends_by  # the trial timeout's end
    protocol = protocol_for(trainer, settings, ends_by, result["windows"])
    t_warm = time.time()
    try:
        warm = warm_up(trainer, protocol, progress)
    except TooSlow as slow:
        result["status"] = "timeout"
        result["reason"] = stop_reason(slow.answer, settings)
        result["first_step_samples_per_sec"] = slow.rate
        if slow.late:
            # What the trial timeout would have done, only sooner: the tuner reads it so (a
            # timeout its run's --timeout set is no verdict on the config).
            result["ended_by"] = TRIAL_TIMEOUT
        timings["warmup_s"] = time.time() - t_warm
        return
    timings["warmup_s"] = time.time() - t_warm
    result["warmup"] = warm.record(timings["warmup_s"])
    _record_state(trainer, result, ranks)
    if "compile_step_s" in timings:
        # What compiling cost: the first step beyond a steady one.
        first, steady = timings["compile_step_s"], warm.step_times[-1]
        result["compile"] = {**result.get("compile", {}), "mode": spec.config.compile,
                             "first_step_s": first, "seconds": max(0.0, first - steady),
                             "steady_step_s": steady}
    if trainer.comm is not None:
        trainer.comm.take_wait()  # warm-up's communication is not part of any window
    t_measure = time.time()
    try:
        steps = measure_windows(trainer, protocol, progress)
    except Diverged as exc:
        result["status"], result["reason"] = "diverged", str(exc)
        timings["measure_s"] = time.time() - t_measure
        return
    timings["measure_s"] = time.time() - t_measure
    result["status"], result["steps_per_window"] = "ok", steps
    if trainer.comm is not None:
        result["comm"] = {"calls_by_micro": {str(k): v for k, v in
                                             sorted(trainer.comm.calls_by_micro.items())},
                          "buckets_per_sync": trainer.comm.last_step_buckets,
                          "sync_each_micro": settings.sync_each_micro}
    flops = flops_for(spec, trainer.workload, trainer.module, trainer.dataset, device,
                      trainer.amp_dtype)
    if "flops_count_error" in flops:
        result["flops_count_error"] = flops["flops_count_error"]
    result["flops_per_sample"] = flops["flops_per_sample"]
    result["flops_source"] = flops["flops_source"]
    if (tokens := tokens_per_sample(trainer.dataset)) is not None:
        result["tokens_per_sample"] = tokens


def _read_sentinel(spec: TrialSpec, device: Any, result: TrialResultDoc, ranks: Ranks) -> None:
    """The machine's speed, read before anything of the config is built (``trial.sentinel``),
    where the spec asks: the same work in every trial, at most about 1/200 of the measuring
    budget per probe (a short test trial reads briefly)."""
    if not spec.sentinel:
        return
    from autotune.trial.sentinel import probe_seconds, read

    result["sentinel"] = read(device, spec.sentinel, ranks.world,
                              probe_s=probe_seconds(spec.measure.max_seconds))


def tokens_per_sample(dataset: Any) -> int | None:
    """Sequence positions per sample (padding included) of a token workload: the length of its
    first sample's ``input_ids``; None for a workload of another kind."""
    with contextlib.suppress(Exception):
        ids = dataset[0]["input_ids"]
        if getattr(ids, "dim", lambda: 0)() == 1:
            return int(ids.shape[0])
    return None


def _record_state(trainer: Any, result: TrialResultDoc, ranks: Ranks) -> None:
    """What the memory model of sharding reads: this rank's parameters, gradients and the
    optimizer's state as they are after the warm-up's steps (local shards under FSDP)."""
    if ranks.world > 1:
        from autotune.trial.shard import model_state

        result["applied"]["model_state"] = model_state(trainer.module, trainer.optimizer)


def _compile(trainer: Any, spec: TrialSpec, progress: Progress, result: TrialResultDoc,
             ranks: Ranks) -> bool:
    """The compile step, recorded; False when it ran past the compile limit (the result then
    says so). A compile that compiled no graph is an error: the model would run eagerly under
    a compiled label."""
    from autotune.trial.bench.build import compile_cache_use, compiled_graphs

    compiled = _compile_step(trainer, spec, progress)
    if compiled is None:
        result["status"], result["ended_by"] = "timeout", COMPILE_LIMIT
        result["reason"] = (f"compiling (torch.compile mode {spec.config.compile}) took more "
                            f"than the {spec.measure.max_compile_s:.0f}s compile limit")
        if ranks.world > 1:
            # This rank's own failure: its peers may be inside a collective it will not join;
            # reported as such, torchrun ends the group (``main``).
            result["failed_at"] = time.time()
        return False
    result["timings"]["compile_step_s"] = compiled
    result["compile"] = compile_cache_use()  # what a fresh process of it would skip
    graphs = compiled_graphs()
    if not graphs:
        raise RuntimeError(f"torch.compile (mode {spec.config.compile}) compiled no graph in "
                           "the first step: the model ran eagerly, so this config would "
                           "measure something other than what it names")
    result["applied"]["compiled"] = spec.config.compile
    result["applied"]["compiled_graphs"] = graphs
    return True


class _CompileLimit(BaseException):
    """Raised by the compile timer; a BaseException, so no ``except Exception`` inside torch
    (TORCHDYNAMO_SUPPRESS_ERRORS) swallows it."""


def _compile_step(trainer: Any, spec: TrialSpec, progress: Progress) -> float | None:
    """One optimizer step, in which torch.compile compiles forward and backward, bounded by
    ``max_compile_s`` (a timer interrupts a compile that runs longer); its seconds, or None
    when it ran out of time. Every rank compiles; they agree on the slowest."""

    ran_out: list[bool] = []

    def expired(signum: int, frame: Any) -> None:
        ran_out.append(True)
        raise _CompileLimit  # torch.compile may wrap it in its own error: ``ran_out`` tells

    limit = spec.measure.max_compile_s
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, limit)
    t = time.perf_counter()
    try:
        try:
            trainer.sync()
            trainer.step()
            trainer.sync()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)  # inside: a late alarm is caught below
    except BaseException:
        if not ran_out:
            raise
    finally:
        signal.signal(signal.SIGALRM, previous)
    if ran_out:  # also when something inside torch swallowed the interrupt
        return None
    (seconds,) = trainer.ranks.agree(time.perf_counter() - t)
    progress.emit("compiled", seconds=seconds)
    return seconds


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m autotune.trial.bench SPEC.json RESULT.json [PROGRESS.jsonl]",
              file=sys.stderr)
        return 2
    spec = TrialSpec.from_json(json.loads(Path(args[0]).read_text()))
    tie_to_tuner()
    limit = spec.address_space_bytes
    if limit:  # before torch is imported, so every allocation counts against it
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    ranks = Ranks()
    progress = Progress(args[2] if len(args) == 3 and ranks.reports else None)
    result = run(spec, progress, ranks)
    with contextlib.suppress(Exception):
        import psutil

        result["timings"]["process_start_to_end_s"] = time.time() - psutil.Process().create_time()
    if ranks.world > 1 and "failed_at" in result:
        # The other ranks may be stuck in a collective and cannot be gathered: leave this rank's
        # report next to the result and exit non-zero, which makes torchrun end the group.
        write_json(f"{args[1]}.rank{ranks.rank}", result)
        sys.stdout.flush()
        os._exit(1)
    docs = ranks.gather(result)
    if ranks.reports:
        write_json(args[1], merge_ranks(docs))
    # No rank leaves before the reporting rank has written: an early exit could cut the
    # gather short.
    ranks.barrier()
    sys.stdout.flush()
    # Skip interpreter teardown (loader workers, CUDA, the process group): the result is
    # written; exit now.
    os._exit(0)
