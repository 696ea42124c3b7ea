"""The document a trial reports (schema ``autotune.trial/v1``): its parts, typed, and its check.

A built-in workload's trial writes it (``trial.bench``, one per rank, merged by
``trial.merge``); a script's trial gets the same document from its driver (``trial.driver``).
It crosses the process boundary as JSON, so ``check_result`` reads it as untrusted first;
``trial.measurement.classify`` turns it into a ``Measurement``, whose fields keep these parts as
they came (old studies store them so). Every part is optional in the document (``total=False``):
a failed trial reports little.
"""

from __future__ import annotations

import math
from typing import Any, NotRequired, TypedDict

from autotune.trial.apply import OptimizerInForce
from autotune.trial.shard import ModelState, ShardingInForce

RESULT_SCHEMA = "autotune.trial/v1"
STATUSES = ("ok", "oom", "timeout", "error", "diverged")


class Window(TypedDict):
    """One timed window: whole optimizer steps, end to end. ``samples`` are all ranks' (in a
    merged or a script's result; a rank's own report counts its own), ``seconds`` the slowest
    rank's. A window read back from the progress events of a killed trial has only these two
    and the waits."""

    samples: int
    seconds: float
    steps: NotRequired[int]
    data_wait_s: NotRequired[float]  # absent: not measured (a script that does not report it)
    comm_wait_s: NotRequired[float]  # multi-rank trials that time the all-reduce
    slowest_rank: NotRequired[int]
    from_warmup: NotRequired[bool]  # warm-up's last, steady step (first_window_from_warmup)


class WarmUpInfo(TypedDict, total=False):
    """How warm-up went: its steps, its seconds, why it ended (None: it had not) and each
    step's seconds."""

    steps: int
    seconds: float
    ended_by: str | None
    step_times_s: list[float]


class Timings(TypedDict, total=False):
    """Where a trial's time went, in seconds: each phase that ran."""

    imports_s: float
    build_s: float
    compile_step_s: float
    warmup_s: float
    measure_s: float
    startup_s: float  # a script's: from its start to the end of its first step
    process_start_to_end_s: float


class Applied(TypedDict, total=False):
    """What took effect in a trial, read back from torch, the model and the optimizer, not
    taken from the config: threads, fp32 matmul precision, glibc's memory retention, attention
    and checkpointing, how the optimizer steps, and the compile mode with the graphs it
    compiled."""

    threads: int
    matmul_precision: str
    malloc_retain: bool
    attention: str | None
    activation_checkpointing: bool
    optimizer: OptimizerInForce
    compiled: str
    compiled_graphs: int
    sharding: ShardingInForce
    model_state: ModelState


class CompileInfo(TypedDict, total=False):
    """What compiling cost: the first step, and how much longer it took than a steady one; the
    seconds in the compiler backend, and whether every graph is in torch's compile cache
    (``bench.build.compile_cache_use``: what a fresh process of the config would skip)."""

    mode: str
    first_step_s: float
    seconds: float
    steady_step_s: float
    backend_s: float
    cached: bool


class CommInfo(TypedDict, total=False):
    """A rank's all-reduces: counted per micro-step index (accumulation syncs on the last one
    only), buckets per synchronising step, and whether every micro-step synchronised."""

    calls_by_micro: dict[str, int]
    buckets_per_sync: int
    sync_each_micro: bool


class DdpInfo(TypedDict, total=False):
    """The DistributedDataParallel arguments a multi-rank trial applied, and the bucket size
    DDP took from them."""

    kwargs: dict[str, Any]  # DDP's own keyword arguments (``trial.apply.ddp_kwargs``)
    bucket_cap_bytes: int


class ReadbackDoc(TypedDict):
    """What a framework's Trainer ran with, read back by autotune's bootstrap (checked as
    untrusted input by ``trial.reports``): the Trainer, the knobs in effect as the config
    asked, those not (with the reason), the values read, what the script asked for itself, and
    the arguments a trial turned off so that it leaves the user's outputs alone."""

    via: str
    applied: list[str]
    fixed: dict[str, str]
    seen: dict[str, bool | int | float | str | None]
    script: dict[str, bool | int | float | str | None]
    isolated: list[str]


class ScriptInfo(TypedDict, total=False):
    """A trial of the user's script: its name, the steps each rank reported, the Profile
    methods it called, whether it left the sample count to the config, whether it trained
    another batch than the config's, and what its Trainer ran with (the bootstrap's
    read-back, from the first rank that sent one)."""

    name: str
    steps: list[int]
    accessed: list[str]
    default_samples: bool
    samples_mismatch: bool
    readback: ReadbackDoc


class RankSummary(TypedDict, total=False):
    """One rank of a multi-rank trial, shortened: its outcome, its windows' seconds, its own
    rate (median over its windows), its waits and all-reduce counts, and its peak memory."""

    rank: int | None
    status: str | None
    window_seconds: list[float]
    samples_per_sec: float
    breakdown: dict[str, float]
    comm: CommInfo
    peak_memory_bytes: int | None
    steps: int


class TrialResultDoc(TypedDict, total=False):
    """The whole document. ``failed_at`` marks a failure one rank hit on its own (its peers'
    errors are consequences); ``first_step_samples_per_sec`` is a too-slow trial's rough rate."""

    schema: str
    status: str
    reason: str | None
    note: str  # on an ok result: what happened after its windows were measured
    ended_by: str
    windows: list[Window]
    steps_per_window: int
    step_time_s: float
    samples_per_sec: float
    spread_cv: float | None
    warmup: WarmUpInfo
    timings: Timings
    peak_memory_bytes: int
    memory_source: str
    device: str
    torch_version: str
    threads: int
    backend: str | None
    rank: int
    world_size: int
    failed_at: float
    first_step_samples_per_sec: float
    applied: Applied
    compile: CompileInfo
    comm: CommInfo
    ddp: DdpInfo
    ranks: list[RankSummary]
    script: ScriptInfo
    flops_per_sample: float | None
    flops_source: str | None
    flops_count_error: str
    sentinel: dict[str, float]  # the machine's speed before the warm-up (``trial.sentinel``)
    tokens_per_sample: int  # a token workload's sequence positions per sample


def check_result(doc: Any) -> list[str]:
    """Problems with a trial result document (empty when it is valid)."""
    if not isinstance(doc, dict):
        return ["the result is not a JSON object"]
    problems = []
    if doc.get("schema") != RESULT_SCHEMA:
        problems.append(f"schema is {doc.get('schema')!r}, expected {RESULT_SCHEMA!r}")
    status = doc.get("status")
    if status not in STATUSES:
        problems.append(f"status is {status!r}, expected one of {', '.join(STATUSES)}")
    if status == "ok":
        windows = doc.get("windows")
        if not isinstance(windows, list) or not windows:
            problems.append("an ok result needs at least one timed window")
        else:
            for i, w in enumerate(windows):
                if not isinstance(w, dict) or not all(
                    isinstance(v, int | float) and not isinstance(v, bool)
                    and math.isfinite(v) and v > 0
                    for v in (w.get("samples"), w.get("seconds"))
                ):
                    problems.append(f"window {i} needs finite, positive 'samples' and "
                                    "'seconds'")
    if not isinstance(doc.get("peak_memory_bytes", 0), int):
        problems.append("peak_memory_bytes must be an integer")
    return problems
