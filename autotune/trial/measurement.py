"""What one run of one config produced, and the outcome classifier.

A trial process reports one JSON document (``trial.result``). ``classify`` turns the finished
process (exit code, timeout, that document, stderr) into a Measurement, its figures derived from
the windows by ``trial.protocol.WindowStats``. It is a pure function: every outcome rule is here
and tested without starting a process.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, TypedDict

from autotune.trial import sentinel
from autotune.trial.protocol import WindowStats
from autotune.trial.protocol import median_and_cv as median_and_cv  # its home before protocol
from autotune.trial.result import (
    Applied,
    CompileInfo,
    DdpInfo,
    RankSummary,
    ScriptInfo,
    Timings,
    TrialResultDoc,
    WarmUpInfo,
    Window,
    check_result,
)

# What allocators print when memory runs out: CUDA's caching allocator, the CPU allocator, Python,
# and the DataLoader when the kernel's OOM killer took one of its workers.
_OOM_PATTERNS = re.compile(
    r"CUDA out of memory|OutOfMemoryError|DefaultCPUAllocator: can't allocate memory|"
    r"\bMemoryError\b|std::bad_alloc|CUBLAS_STATUS_ALLOC_FAILED|out of memory|"
    r"DataLoader worker \(pid.*killed by signal: Killed",
    re.IGNORECASE,
)

# torchrun's closing report lists the failed ranks with their exit codes (negative: the signal
# that killed it), the "first observed" one last. A rank killed by a signal writes no report of
# its own.
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n(?:[^\n]*\n)*?\s*exitcode\s*:\s*(-?\d+)")
_TORCHRUN_ROOT_MARK = "Root Cause (first observed failure):"
# Signals torchrun itself sends to the ranks it stops after another one failed.
_STOP_SIGNALS = {-signal.SIGTERM, -signal.SIGINT}


def _signal_death(stderr_tail: str, reporter: int | None) -> tuple[int, int] | None:
    """(rank, exit code) of a rank that torchrun saw die from a signal, when that is the cause.

    torchrun stamps each failure with the second it noticed it, so when a rank dies from a signal
    its peers' "connection reset" often fails in the same second and may be named the "first
    observed". A signal death outranks a peer's written report: the dead rank could not write one.
    """
    summary = stderr_tail[stderr_tail.rfind("FAILED"):] if "FAILED" in stderr_tail else ""
    deaths = [(int(r), int(c)) for r, c in _TORCHRUN_FAILURE.findall(summary)
              if int(c) < 0 and int(r) != reporter]
    if not deaths:
        return None
    root_at = summary.find(_TORCHRUN_ROOT_MARK)
    root = _TORCHRUN_FAILURE.search(summary, root_at) if root_at >= 0 else None
    if root and (int(root.group(1)), int(root.group(2))) in deaths:
        return int(root.group(1)), int(root.group(2))
    killed = [d for d in deaths if d[1] not in _STOP_SIGNALS]
    return killed[0] if killed else None


class Status(StrEnum):
    """What one trial process measured of its config (``Measurement.status``); stored as its
    value, so a study's records read the same in every version."""

    OK = "ok"
    OOM = "oom"
    PRUNED = "pruned"  # stopped early: clearly slower than the best (or ruled out, in old code)
    TIMEOUT = "timeout"  # too slow to measure within its budget
    DIVERGED = "diverged"  # the loss went NaN or infinite
    ERROR = "error"


class EndedBy(StrEnum):
    """Why a trial ended when it did not simply finish (``Measurement.ended_by``)."""

    INTERRUPTED = "interrupted"  # the user's Ctrl-C: not a result
    BUDGET = "budget"  # the run's --timeout: not a result, measured again by the next run
    TRIAL_TIMEOUT = "trial_timeout"  # killed at its hard per-trial limit, or stopped before it
    TOO_SLOW = "too_slow"  # the trial itself found it cannot be measured within its budget
    MEMORY_LIMIT = "memory_limit"  # the launcher ended it for passing the memory limit
    PRUNED = "pruned"  # the tuner stopped it: its first windows were clearly below the best
    COMPILE_LIMIT = "compile_limit"  # torch.compile ran past its own time limit in the trial
    NODE_LOST = "node_lost"  # a cluster engine lost a node of the trial: not a result, run again


# The members by their old names, for the modules that import them.
INTERRUPTED, BUDGET, TRIAL_TIMEOUT = EndedBy.INTERRUPTED, EndedBy.BUDGET, EndedBy.TRIAL_TIMEOUT
TOO_SLOW, MEMORY_LIMIT, PRUNED = EndedBy.TOO_SLOW, EndedBy.MEMORY_LIMIT, EndedBy.PRUNED
COMPILE_LIMIT, NODE_LOST = EndedBy.COMPILE_LIMIT, EndedBy.NODE_LOST


def is_oom(exc: BaseException) -> bool:
    """accelerate's should_reduce_batch_size idea: recognise OOM by type and by message."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" \
        or bool(_OOM_PATTERNS.search(str(exc)))


@dataclass(frozen=True)
class RawResult:
    """What the launcher saw of a finished trial process; the input of ``classify``."""

    returncode: int | None
    timed_out: bool
    result: TrialResultDoc | None
    stderr_tail: str
    wall_s: float
    tree_peak_bytes: int = 0  # peak memory of the trial's process tree, sampled by the launcher
    killed_for_memory: bool = False  # the launcher ended it for passing the memory limit
    memory_limit_bytes: int | None = None  # the limit the launcher enforced (CPU), if any
    interrupted: bool = False
    timeout_s: float = 0.0
    partial_windows: list[Window] = field(default_factory=list)
    stopped: str | None = None  # the tuner ended it early (pruning), with this reason
    gpu: dict[str, Any] = field(default_factory=dict)  # NVML samples' summary (monitor.py)


@dataclass(frozen=True)
class Measurement:
    """One trial's outcome. ``samples_per_sec`` is the median over steady-state windows."""

    status: Status
    reason: str | None = None
    samples_per_sec: float | None = None
    spread_cv: float | None = None
    peak_memory_bytes: int = 0
    windows: list[Window] = field(default_factory=list)
    breakdown: dict[str, float] = field(default_factory=dict)
    step_time_s: float | None = None
    warmup: WarmUpInfo = field(default_factory=WarmUpInfo)
    timings: Timings = field(default_factory=Timings)
    wall_s: float = 0.0
    tflops: float | None = None
    stderr_tail: str = ""
    # From an incomplete measurement (a timeout): partial windows, or the first (slowest) step.
    # Never used as a result; it tells the sampler roughly where a too-slow config stood.
    rough_samples_per_sec: float | None = None
    ended_by: EndedBy | None = None  # None when it simply finished
    # Multi-rank trials: each rank's summary (rate, windows, waits, all-reduce counts) and the
    # DDP arguments that were applied.
    ranks: list[RankSummary] = field(default_factory=list)
    ddp: DdpInfo = field(default_factory=DdpInfo)
    # The GPUs as NVML saw them during the timed windows (machine.monitor.summarize); empty on CPU.
    gpu: dict[str, Any] = field(default_factory=dict)
    # Efficiency, set by the tuner from the study's FLOPs per sample and the probe's peak:
    # FLOPs per sample and where the figure came from, and achieved / peak FLOP/s.
    flops_per_sample: float | None = None
    flops_source: str | None = None
    mfu: float | None = None
    peak_tflops: float | None = None
    # What took effect in the trial, read back from torch, the model and the optimizer
    # (threads, matmul precision, attention, checkpointing, optimizer flags, compiled), and
    # what compiling cost (mode, first step, seconds beyond a steady step).
    applied: Applied = field(default_factory=Applied)
    compile: CompileInfo = field(default_factory=CompileInfo)
    # A trial of the user's script: its name, steps per rank, the Profile methods it called
    # (``steps.accessed``), and whether it left the sample count to the config.
    script: ScriptInfo = field(default_factory=ScriptInfo)
    # The sentinel's reading of the machine before the warm-up (``trial.sentinel``): rates
    # of a fixed matmul per precision and a memory copy, its seconds, threads and ranks.
    sentinel: dict[str, float] = field(default_factory=dict)
    # A token workload's sequence positions per sample (padding included): tokens per second.
    tokens_per_sample: int | None = None

    def __post_init__(self) -> None:
        # Stored values come back as strings: typed once, here. An unknown one is malformed.
        object.__setattr__(self, "status", Status(self.status))
        if self.ended_by is not None:
            object.__setattr__(self, "ended_by", EndedBy(self.ended_by))

    @property
    def is_result(self) -> bool:
        """False when the run, not the config, ended the trial: it is retried, not recorded."""
        return self.ended_by not in (INTERRUPTED, BUDGET, NODE_LOST)

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    def overhead_share(self) -> float | None:
        """Share of the trial's wall time spent before measuring: start, imports, build, warm-up."""
        measure = self.timings.get("measure_s")
        if measure is None or self.wall_s <= 0:
            return None
        return max(0.0, 1.0 - measure / self.wall_s)

    def to_dict(self) -> dict[str, Any]:
        """As stored: plain JSON values (the enums as their strings)."""
        d = asdict(self)
        d["status"] = self.status.value
        d["ended_by"] = None if self.ended_by is None else self.ended_by.value
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        """The measurement stored on a trial. Keys this version does not know (a newer study)
        are left out; a missing status reads as an error."""
        known = {f.name for f in fields(cls)}
        kept = {k: v for k, v in data.items() if k in known}
        kept.setdefault("status", Status.ERROR)
        return cls(**kept)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


class _Common(TypedDict, total=False):
    """What every outcome of one trial process carries, whatever the outcome."""

    peak_memory_bytes: int
    wall_s: float
    stderr_tail: str
    gpu: dict[str, Any]
    applied: Applied
    compile: CompileInfo
    script: ScriptInfo
    sentinel: dict[str, float]


def classify(raw: RawResult, device: str = "cpu") -> Measurement:
    """Map a finished trial process to ok / oom / timeout / error, with the reason.

    Order matters: a user's Ctrl-C and our own kills are known facts and come first; then the
    trial's own report; then what the exit code and stderr say about a process that died silently.
    """
    doc = raw.result
    reported = doc.get("peak_memory_bytes") if isinstance(doc, dict) else 0
    reported_peak = reported if isinstance(reported, int) else 0
    # On CPU the process tree's sampled peak counts too (loader workers are separate processes);
    # on CUDA the device figure reported by the trial is the one the limit is about.
    peak = reported_peak if device == "cuda" else max(reported_peak, raw.tree_peak_bytes)
    common: _Common = {"peak_memory_bytes": peak, "wall_s": raw.wall_s,
                       "stderr_tail": raw.stderr_tail, "gpu": dict(raw.gpu)}
    ended = _ended_by_us(raw, peak, common)
    if ended is not None:
        return ended
    death = None
    if doc is None or "failed_at" in doc:
        death = _signal_death(raw.stderr_tail, doc.get("rank") if doc else None)
    if death:
        # A rank died from a signal; the others' reports (a peer closing the connection) are
        # consequences of it.
        rank, name = death[0], _signal_name(death[1])
        if name == "SIGKILL":
            return Measurement(Status.OOM, f"rank {rank} was killed by SIGKILL, most likely the "
                               "kernel's OOM killer", **common)
        return Measurement(Status.ERROR, f"rank {rank} died from {name}", **common)
    if doc is not None:
        return _from_report(doc, raw, peak, common)
    return _from_exit(raw, common)


def _node_lost(raw: RawResult) -> str | None:
    """What the Ray engine's client said when a node of the trial was lost (its exit code and
    last line ``autotune: node lost: ...``), or None."""
    from autotune.trial.executors.ray_client import NODE_LOST as LOST_EXIT

    if raw.returncode != LOST_EXIT:
        return None
    lines = [ln for ln in raw.stderr_tail.splitlines() if ln.startswith("autotune: node lost:")]
    return lines[-1].removeprefix("autotune: ") if lines else None


def _ended_by_us(raw: RawResult, peak: int, common: _Common) -> Measurement | None:
    """A trial the user or the launcher ended: Ctrl-C, the memory limit, pruning, the
    timeout. None when it ended on its own."""
    if raw.interrupted:
        return Measurement(Status.ERROR, "interrupted by the user", ended_by=INTERRUPTED, **common)
    if raw.killed_for_memory:
        return Measurement(Status.OOM, "process tree passed the memory limit at "
                           f"{peak / 2**30:.2f} GiB", ended_by=MEMORY_LIMIT, **common)
    partial = WindowStats(raw.partial_windows) if raw.partial_windows else None
    if raw.stopped:
        return Measurement(Status.PRUNED, raw.stopped, windows=raw.partial_windows,
                           breakdown=partial.breakdown if partial else {},
                           rough_samples_per_sec=partial.median if partial else None,
                           ended_by=PRUNED, **common)
    lost = _node_lost(raw)
    if lost:
        return Measurement(Status.ERROR, lost, ended_by=NODE_LOST, **common)
    if raw.timed_out:
        reason = f"killed at the {raw.timeout_s:.0f}s trial timeout"
        if partial:
            reason += f" after {len(partial.windows)} window(s) at {partial.median:.2f} samples/s"
            return Measurement(Status.TIMEOUT, reason, windows=raw.partial_windows,
                               breakdown=partial.breakdown, rough_samples_per_sec=partial.median,
                               ended_by=TRIAL_TIMEOUT, **common)
        return Measurement(Status.TIMEOUT, reason, ended_by=TRIAL_TIMEOUT, **common)
    return None


def _from_report(doc: TrialResultDoc, raw: RawResult, peak: int, common: _Common) -> Measurement:
    """The trial's own result document: checked, then its outcome."""
    problems = check_result(doc)
    if problems:
        return Measurement(Status.ERROR, "bad trial result: " + "; ".join(problems), **common)
    status = doc["status"]
    common = {**common, "applied": Applied(**(doc.get("applied") or {})),
              "compile": CompileInfo(**(doc.get("compile") or {})),
              "script": ScriptInfo(**(doc.get("script") or {})),
              "sentinel": sentinel.clean(doc.get("sentinel"))}
    if status != "ok":
        rough = doc.get("first_step_samples_per_sec")
        ended: EndedBy | None = None
        if status == "timeout":
            # The trial stopped itself at its compile limit, or before the trial timeout it
            # could not have been measured by (as if killed there), or as too slow.
            said = doc.get("ended_by")
            ended = EndedBy(said) if said in (COMPILE_LIMIT, TRIAL_TIMEOUT) else TOO_SLOW
        return Measurement(Status(status), doc.get("reason") or _last_line(raw.stderr_tail),
                           windows=doc.get("windows") or [], timings=doc.get("timings") or {},
                           warmup=doc.get("warmup") or {},
                           rough_samples_per_sec=rough if isinstance(rough, float) else None,
                           ended_by=ended, **common)
    stats = WindowStats(doc["windows"])
    limit = raw.memory_limit_bytes
    if limit and peak > limit:
        # Passed the limit between two of the launcher's samples and finished anyway: the same
        # outcome as being caught, an OOM (the windows are kept for the record).
        return Measurement(Status.OOM, f"peak memory {peak / 2**30:.2f} GiB passed the memory "
                           f"limit of {limit / 2**30:.2f} GiB", windows=doc["windows"],
                           timings=doc.get("timings") or {}, ended_by=MEMORY_LIMIT, **common)
    given = doc.get("flops_per_sample")
    fps = float(given) if isinstance(given, int | float) and given > 0 else None
    # A note on a measured result (a script ended by signal after its windows).
    note = doc.get("note")
    med = stats.median
    return Measurement(
        Status.OK, note if isinstance(note, str) else None, samples_per_sec=med,
        spread_cv=stats.spread, windows=doc["windows"], breakdown=stats.breakdown,
        step_time_s=doc.get("step_time_s"), warmup=doc.get("warmup") or {},
        timings=doc.get("timings") or {}, tflops=med * fps / 1e12 if fps else None,
        flops_per_sample=fps, flops_source=doc.get("flops_source"),
        tokens_per_sample=_positive_int(doc.get("tokens_per_sample")),
        ranks=doc.get("ranks") or [], ddp=doc.get("ddp") or {}, **common,
    )


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def _from_exit(raw: RawResult, common: _Common) -> Measurement:
    """A trial that died without a report: what its stderr and exit code say."""
    if _OOM_PATTERNS.search(raw.stderr_tail):
        return Measurement(Status.OOM, _last_line(_oom_lines(raw.stderr_tail)), **common)
    if raw.returncode is not None and raw.returncode < 0:
        name = _signal_name(raw.returncode)
        if name == "SIGKILL":
            # Nobody here sent it (timeouts and limit kills are handled above): the kernel's OOM
            # killer is by far the most common sender.
            return Measurement(Status.OOM, "killed by SIGKILL, most likely the kernel's OOM killer",
                               **common)
        return Measurement(Status.ERROR, f"trial process died from {name}", **common)
    return Measurement(Status.ERROR, f"trial exited with code {raw.returncode} and no result: "
                       f"{_last_line(raw.stderr_tail)}", **common)


def _oom_lines(text: str) -> str:
    return "\n".join(ln for ln in text.splitlines() if _OOM_PATTERNS.search(ln))
