"""The sentinel: a short fixed reading of the machine's speed, taken in every trial process
before its warm-up (trial side; torch imported by the caller's process).

A matmul at each precision the study uses and a memory copy, the same work in every trial of
every study: where their rates move between two trials, the machine moved, whatever the two
configs were. The tuner compares them (``tuner.drift``) between the confirmation's rounds and
against the search's trials; a speedup measured on a machine that changed under it is never
stated without saying so. About a second: each probe repeats its work for ``PROBE_S`` (at least
``MIN_REPS`` times after one untimed run) and reports the median repetition's rate. It runs at
the process's default thread count, before the config's knobs are applied, so that readings
of different configs compare; a reading compares only with readings of as many ranks.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# A config's amp value -> the precision its matmuls run in.
PRECISION_OF = {"off": "fp32", "bf16": "bf16", "fp16": "fp16"}
PROBE_S = 0.25
MIN_REPS = 3
MAX_REPS = 200
# The work: square matmuls of this size, and a copy of this many bytes (past the caches of a
# CPU; a GPU's copy of it is memory-bound too).
MATMUL_N = {"cpu": 1024, "cuda": 4096}
WARM_S = 0.05  # untimed repetitions first: thread pools spun up, clocks up
COPY_BYTES = {"cpu": 64 * 2**20, "cuda": 1024 * 2**20}


# One reading: GFLOP/s of each precision's matmul (``matmul_fp32_gflops``, ...), the copy's GB/s
# (``copy_gbs``: bytes read and written), the ``seconds`` it took, the ``threads`` it ran on
# and the ``world_size`` of the trial (ranks read at once).
Reading = dict[str, float]


def probe_seconds(max_seconds: float) -> float:
    """Seconds per probe in a trial of ``max_seconds`` of measuring: ``PROBE_S``, at most 1/200
    of it (a short test trial reads briefly)."""
    return min(PROBE_S, max_seconds / 200)


def script_request(precisions: Iterable[str], max_seconds: float) -> str:
    """What a script's trial (``autotune run -- CMD``) finds in ``steps.SENTINEL_ENV``:
    "<seconds per probe>:<precision>,<precision>..."; ``autotune.steps`` reads it at the end of
    the script's first reported step (on CPU: CUDA's part is NVML's clocks)."""
    return f"{probe_seconds(max_seconds):g}:{','.join(precisions)}"


def read_requested(request: str, world_size: int) -> Reading:
    """The reading a script's trial asked for (``steps.SENTINEL_ENV``), on the CPU."""
    import torch

    seconds, _, names = request.partition(":")
    probe_s = min(PROBE_S, max(0.001, float(seconds)))
    return read(torch.device("cpu"), [n for n in names.split(",") if n], world_size, probe_s)


def precisions_of(amps: Iterable[object]) -> tuple[str, ...]:
    """The precisions a study's amp values run in, fp32 first (the baseline's), each once."""
    found = {PRECISION_OF[a] for a in amps if isinstance(a, str) and a in PRECISION_OF}
    return tuple(p for p in ("fp32", "bf16", "fp16") if p in found | {"fp32"})


def metric(precision: str) -> str:
    return f"matmul_{precision}_gflops"


def read(device: Any, precisions: Iterable[str], world_size: int = 1,
         probe_s: float = PROBE_S) -> Reading:
    """Time the probes on ``device`` (a torch.device): one matmul per precision, then the
    copy. A precision the device cannot multiply in is left out."""
    import torch

    start = time.perf_counter()
    kind = "cuda" if device.type == "cuda" else "cpu"
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(device)) if kind == "cuda" \
        else (lambda: None)
    out: Reading = {}
    n = MATMUL_N[kind]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for p in precisions:
        if p not in dtypes or (p == "fp16" and kind == "cpu"):
            continue
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtypes[p])
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtypes[p])
        out[metric(p)] = _rate(functools.partial(torch.mm, a, b), sync, 2 * n ** 3 / 1e9,
                               probe_s)
    count = COPY_BYTES[kind] // 4
    src = torch.ones(count, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    out["copy_gbs"] = _rate(lambda: dst.copy_(src), sync, 2 * count * 4 / 1e9, probe_s)
    out["threads"] = torch.get_num_threads()
    out["world_size"] = world_size
    out["seconds"] = time.perf_counter() - start
    return out


def _rate(work: Callable[[], object], sync: Callable[[], None], units: float,
          probe_s: float) -> float:
    """``units`` per second of ``work``: the median of its timed repetitions."""
    warm = time.perf_counter() + WARM_S
    while True:
        work()
        sync()
        if time.perf_counter() >= warm:
            break
    times: list[float] = []
    end = time.perf_counter() + probe_s
    while len(times) < MIN_REPS or (time.perf_counter() < end and len(times) < MAX_REPS):
        t = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - t)
    return units / max(statistics.median(times), 1e-9)


def clean(doc: object) -> Reading:
    """A reading as a trial reported it (untrusted): only the rates, thread and rank counts it
    may hold, each a finite positive number; anything else is left out."""
    if not isinstance(doc, Mapping):
        return {}
    known = {metric(p) for p in PRECISION_OF.values()} | {"copy_gbs", "seconds", "threads",
                                                           "world_size"}
    return {k: float(v) for k, v in doc.items()
            if k in known and isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v) and v > 0}


# On CUDA, NVML's SM clock during the trial's windows plays the same part (the tuner adds it).
SM_CLOCK = "sm_clock_mhz"


def rates(reading: Mapping[str, float]) -> dict[str, float]:
    """The reading's rates alone (what moves with the machine)."""
    return {k: v for k, v in reading.items() if k in ("copy_gbs", SM_CLOCK)
            or (k.startswith("matmul_") and k.endswith("_gflops"))}


def describe(name: str) -> str:
    """'fp32 matmul', 'memory copy', 'SM clock': a rate's name for a line."""
    if name == "copy_gbs":
        return "memory copy"
    if name == SM_CLOCK:
        return "SM clock"
    return f"{name.removeprefix('matmul_').removesuffix('_gflops')} matmul"


def unit(name: str) -> str:
    return {"copy_gbs": "GB/s", SM_CLOCK: "MHz"}.get(name, "GFLOP/s")
