"""The documents a profile holds beside its config: what the winner measured (``result``), what
it beat (``baseline``), how it was chosen (``confirmation``), where it came from
(``provenance``), the machine's probe (``probe``) and what limits it (``diagnosis``).

Each is a ``TypedDict``: at run time the plain dict the YAML holds, so a training script reads
``profile.result["samples_per_sec"]`` as it always has; the type says which keys a reader may
find and what they hold. Keys are optional unless marked ``Required``: a v1 profile, a profile
of an earlier autotune and a trial's candidate (written before anything ran) hold fewer.
"""

from __future__ import annotations

from typing import Required, TypedDict

# A knob's value in a config's dict form (``Config.to_dict``), as the YAML holds it.
KnobValue = str | int | float | bool | None

# How a figure was measured: ``MeasureSettings``' dict form (seconds, counts, switches).
MeasureValue = float | bool


class RankDoc(TypedDict, total=False):
    """One rank's own figures in a multi-rank result."""

    rank: int
    samples_per_sec: float | None
    peak_memory_bytes: int | None


class CompileDoc(TypedDict, total=False):
    """What compiling cost a compiled winner, and when it pays for itself against the same
    config run eagerly (the last four only when the study measured that one)."""

    mode: str | None
    seconds: float
    against_trial: int
    step_s: float
    eager_step_s: float
    payback_steps: int | None  # None: no faster than eager, it never pays


class EfficiencyDoc(TypedDict, total=False):
    """FLOPs and MFU of a result or baseline, at its (possibly confirmed) samples/s."""

    flops_per_sample: float | None
    flops_source: str | None
    tflops: float | None
    mfu: float | None  # achieved over the probe's measured peak
    peak_tflops: float | None


class ResultDoc(EfficiencyDoc, total=False):
    """What the winner measured: the confirmation's median when one ran (the search trial's own
    figure is then ``trial_samples_per_sec``), and how, so ``profile check`` can measure it
    again alike. ``samples_per_sec`` is 0 in a trial's candidate, written before it ran."""

    samples_per_sec: Required[float]
    spread_cv: float | None  # None: a single timed window
    windows: int
    step_time_s: float | None
    peak_memory_bytes: int
    memory_limit_bytes: int | None
    breakdown: dict[str, float]  # share of the step by phase (data_wait, compute, ...)
    trial: int
    samples_per_optimizer_step: int
    measure: dict[str, MeasureValue]
    ranks: list[RankDoc]
    # What the trial process applied (threads, attention, optimizer, ...), as it reported it.
    applied: dict[str, object]
    compile: CompileDoc
    trial_samples_per_sec: float
    tokens_per_sample: int  # a token workload's sequence positions per sample (padding included)


class BaselineDoc(EfficiencyDoc, total=False):
    """The config the winner is compared with, and what it measured; ``config`` and
    ``samples_per_sec`` are None before the baseline has run."""

    config: dict[str, KnobValue] | None
    samples_per_sec: float | None
    spread_cv: float | None
    peak_memory_bytes: int
    trial: int


class CandidateDoc(TypedDict, total=False):
    """One config of the confirmation: its samples/s in each interleaved round."""

    trial: Required[int]
    config: dict[str, KnobValue]
    samples_per_sec: list[float]
    median: float | None
    spread_cv: float
    window_cvs: list[float]  # each round's in-process spread
    sentinel: list[dict[str, float]]  # each round's reading of the machine (trial.sentinel)
    peak_memory_bytes: int
    baseline: bool
    failures: list[str]
    measure: dict[str, MeasureValue]
    screened_out: str  # why it ran in the first round only


class IntervalDoc(TypedDict, total=False):
    """Where a re-check of the speedup lands: ``level`` of re-checks of as many interleaved
    rounds, on the machine as it was (``tuner.interval``)."""

    low: Required[float]
    high: Required[float]
    level: float
    rounds: int
    method: str
    machine_changed: bool  # its rounds ran on a machine that changed (the profile's notes say how)


class DecisionDoc(TypedDict, total=False):
    """How the confirmation chose: by median, by memory headroom within the margin, or no
    config beyond the noise (``decided_by``: "no win beyond noise")."""

    winner_trial: int | None
    runner_up_trial: int | None
    margin: float
    decided_by: str
    excluded: dict[str, str]  # trial number -> why it could not win


class ConfirmationDoc(TypedDict, total=False):
    """The interleaved re-measurement of the top configs and the baseline that chose the
    winner."""

    rounds: Required[int]
    measured_trials: int
    planned_rounds: int
    stopped_early: str | None
    machine_changed: list[str]  # the sentinel's rates that moved under it, a line each
    round_added: bool  # a round ran beyond the plan because the machine moved
    left_out: str  # configs within the margin the time left held no round of (a line)
    measure: dict[str, MeasureValue]
    candidates: list[CandidateDoc]
    decision: DecisionDoc
    created: str  # ISO 8601, UTC


class ProvenanceDoc(TypedDict, total=False):
    """Where the profile came from. A trial's candidate names its study, its trial and
    ``candidate: true`` only."""

    study: str
    storage: str  # the study's storage URL, its password removed
    trials: int  # trials that ran a process
    global_batch: int | None  # --global-batch, when the run kept it
    repeats_reused: int
    created: str  # ISO 8601, UTC
    autotune_version: str | None
    trial: str
    candidate: bool


class ProbeDoc(TypedDict, total=False):
    """The machine's probe in a few numbers: the peaks MFU is read against, bandwidths, links."""

    created: str | None
    peak_tflops: dict[str, float]  # by dtype: fp32, tf32, bf16, fp16
    peak_basis: str
    memory_bandwidth_gbs: float | None
    links: list[str]
    flags: list[str]
    contended: str | None  # why its peaks may be low: it was taken under load
    h2d_pinned_gbs: float | None
    allreduce_busbw_gbs: float | None


class FindingDoc(TypedDict, total=False):
    """What limits the winner: one finding of the diagnosis, its numbers in its text."""

    kind: str  # low-mfu, input-bound, memory-bound, ... (the diagnosis's KINDS)
    text: str
    evidence: dict[str, object]  # the figures behind the text, for a human to read

