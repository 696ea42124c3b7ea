"""What limits a config: MFU against the probe's measured peak, and the rules that name the
bottleneck with the numbers behind it. Pure functions over stored measurements.

MFU (model FLOPs utilisation) = samples/s x training FLOPs per sample / peak FLOP/s. The FLOPs
are counted once per study with ``torch.utils.flop_counter`` (forward and backward, no optimizer);
the peak is the probe's measured matmul/GEMM peak for the dtype the trial computes in (bf16 or
fp16 under autocast, else fp32), times the GPUs a trial uses (ranks on one CPU share its peak).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from autotune.config.knobs import Config
from autotune.machine.probe import peak_for
from autotune.profile.documents import FindingDoc, ProbeDoc
from autotune.trial.measurement import Measurement, Status
from autotune.units import format_bytes

INPUT_BOUND = 0.15  # data wait share of the timed wall time
COMM_BOUND = 0.15  # exposed all-reduce share of the timed wall time
MEMORY_BOUND = 0.85  # peak memory share of the limit
LOW_MFU = 0.30  # share of the measured peak
# A rate this many times the measured peak is not a measurement: the probe's peak is the best a
# matmul reached, and a probe taken under load reads low (it is then not cached), so the margin
# is wide; beyond it, the FLOPs per sample or the rate are wrong.
BEYOND_PEAK = 1.5
KINDS = ("input-bound", "communication-bound", "memory-bound", "degraded-link", "slow-device",
         "low-mfu", "compute-bound", "unexplained")


@dataclass(frozen=True)
class MemoryWall:
    """The smallest larger micro-batch that did not fit: which trial, and whether it was
    measured (an OOM or a peak over the limit) or only predicted by the memory model."""

    trial: int
    micro_batch: int
    measured: bool

    def words(self) -> str:
        if self.measured:
            return f"micro-batch {self.micro_batch} passed it (trial {self.trial})"
        return (f"micro-batch {self.micro_batch} is predicted to pass it (trial {self.trial}, "
                "not run)")


@dataclass(frozen=True)
class Finding:
    kind: str  # one of KINDS
    text: str  # one line, its numbers in it
    evidence: dict[str, object]

    def to_dict(self) -> FindingDoc:
        return self.to_doc()

    def to_doc(self) -> FindingDoc:
        """As a profile holds it."""
        return {"kind": self.kind, "text": self.text, "evidence": dict(self.evidence)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Finding:
        return cls(str(d.get("kind") or ""), str(d.get("text") or ""),
                   dict(d.get("evidence") or {}))


def mfu(samples_per_sec: float | None, flops_per_sample: float | None,
        peak_tflops: float | None, world_size: int, device: str) -> float | None:
    """Achieved FLOP/s over the peak of the devices in use; None when a figure is missing."""
    if not (samples_per_sec and flops_per_sample and peak_tflops):
        return None
    devices = world_size if device == "cuda" else 1
    return samples_per_sec * flops_per_sample / (peak_tflops * 1e12 * devices)


def with_efficiency(m: Measurement, config: Config, device: str,
                    probe: ProbeDoc | None) -> Measurement:
    """The measurement with its MFU and the peak it was taken against (when both are known).
    A rate the machine cannot reach (``BEYOND_PEAK`` times its measured peak at the workload's
    FLOPs per sample) is an error with the reason, never a result, unless the probe was taken
    under load: its peaks may then be several times low, and refusing against them would refuse
    every honest trial."""
    peak = peak_for(probe, config.amp, device)
    share = mfu(m.samples_per_sec, m.flops_per_sample, peak, config.world_size, device)
    m = replace(m, mfu=None if share is None else round(share, 4), peak_tflops=peak)
    if m.ok and share is not None and share > BEYOND_PEAK and not (probe or {}).get("contended"):
        return replace(m, status=Status.ERROR, reason=(
            f"{m.samples_per_sec:,.4g} samples/s at {m.flops_per_sample:.3g} FLOPs per sample "
            f"is {m.tflops:.3g} TFLOP/s, {share:.1f}x the measured {_dtype(config)} peak of "
            f"{peak:g} TFLOP/s per device: beyond what this machine can do, so the rate or the "
            "workload's FLOPs per sample is wrong; not a measurement"))
    return m


def _dtype(config: Config) -> str:
    return config.amp if config.amp in ("bf16", "fp16") else "fp32"


def diagnose(measurement: Measurement, config: Config, *, device: str, limit: int,
             probe: ProbeDoc | None = None,
             larger_over_limit: MemoryWall | None = None,
             tried: Tried | None = None,
             unapplied: Mapping[str, str] | None = None) -> list[Finding]:
    """What limits ``config``, from its measurement (with the MFU the tuner computed), the
    memory limit, the probe's summary and, when the study has one, the smallest larger
    micro-batch that passed the limit. Never empty: when nothing else holds it back, the
    config is compute-bound, or, when a wait was not measured, unexplained. Only measurements
    make a finding: a memory wall the memory model predicted is named as a prediction and is
    not, alone, memory-bound. Each finding says what would test it, and ``tried`` (the study's
    measured configs) says when that test already ran and what it measured; ``unapplied`` (a
    script's knobs it never applies, with the reasons) says when the study cannot run it."""
    m, c, probe = measurement, config, probe or {}
    test = _Tests(c, m.samples_per_sec, tried, unapplied)
    shares = m.breakdown or {}
    # A wait no window measured is unknown (a script that does not report it), never 0%; with
    # one rank there is no all-reduce to wait for.
    data = shares.get("data_wait")
    comm = shares.get("comm_wait", 0.0 if c.world_size == 1 else None)
    peak_mem = int(m.peak_memory_bytes or 0)
    used = peak_mem / limit if limit else 0.0
    found = [f for f in (
        _input_bound(data, c, device, (m.gpu or {}).get("gpu_util_mean"), test)
        if data is not None else None,
        _communication_bound(comm, c, probe, test) if comm is not None else None,
        _memory_bound(peak_mem, used, limit, larger_over_limit)) if f is not None]
    wall = larger_over_limit
    found += _probe_flags(probe, device)
    low, evidence = _efficiency(m.mfu, m.peak_tflops, c, device, probe,
                                bool(found), test)
    if low is not None:
        found.append(low)
    if not found:
        share = m.mfu
        what = (f"MFU {100 * share:.0f}% of the measured {_dtype(c)} peak" if share is not None
                else "no MFU (a script's FLOPs are not counted)" if m.script
                else "no MFU (no FLOPs figure or no probe)")
        predicted = f"; {wall.words()}" if wall is not None and not wall.measured else ""
        accumulate = test.accumulation()
        waits = (f"data wait {_share(data)}, communication {_share(comm)}, memory "
                 f"{100 * used:.0f}% of the limit{predicted}")
        if data is None or comm is None:
            # Nothing measured rules the unmeasured wait out: compute-bound would be a guess.
            loader = test.workers("")
            kind, text = "unexplained", (
                f"not diagnosed: {what}; {waits}: the step's time is compute or a wait that was "
                "not measured, and these figures cannot tell which (autotune's HF and Lightning "
                f"callbacks measure the data wait; a plain loop passes autotune.step(data_s=...)"
                f"); {loader}, {accumulate}")
        else:
            kind, text = "compute-bound", (
                f"compute-bound: {what}; {waits}: the math is the limit; a larger effective "
                f"batch amortises the optimizer step ({accumulate}), and beyond that the gains "
                "are in the model (fused kernels, torch.compile)")
        found.append(Finding(kind, text,
            {**evidence, "data_wait_share": None if data is None else round(data, 4),
             "comm_wait_share": None if comm is None else round(comm, 4),
             "memory_share": round(used, 4), "test": accumulate,
             "predicted_over_limit": None if wall is None or wall.measured
             else {"trial": wall.trial, "micro_batch": wall.micro_batch}}))
    return found


def _share(value: float | None) -> str:
    return "unknown (not reported)" if value is None else f"{100 * value:.0f}%"


@dataclass(frozen=True)
class TriedConfig:
    """What the study measured of one config: the trial, its outcome, its samples/sec (ok)."""

    trial: int
    status: Status
    samples_per_sec: float | None


# What the study measured, by config (StudySnapshot.tried builds it).
Tried = Mapping[Config, TriedConfig]


class _Tests:
    """The config change that would test a finding, and what the study already measured of
    it: a diagnosis must not suggest a test the study ran, as if it had not."""

    def __init__(self, config: Config, rate: float | None, tried: Tried | None,
                 unapplied: Mapping[str, str] | None = None) -> None:
        self.config, self.rate, self.tried = config, rate, tried or {}
        self.unapplied = unapplied or {}

    def change(self, words: str, **knobs: Any) -> str:
        cannot = [self.unapplied[k] for k in knobs if k in self.unapplied]
        if cannot:  # the script never applies that knob: no trial of this study can test it
            return f"test: {words}; not run by this study: {cannot[0]}"
        seen = self.tried.get(replace(self.config, **knobs))
        if seen is None:
            return f"test: {words}"
        got = seen.samples_per_sec
        what = seen.status if not got else f"{got:.4g} samples/s" + (
            f", {got / self.rate:.2f}x this config" if self.rate else "")
        return f"test: {words}; measured already, trial {seen.trial}: {what}"

    def workers(self, rest: str) -> str:
        """More loader workers (at least 2), with their prefetching."""
        c = self.config
        n = max(2, 2 * c.num_workers)
        return self.change(f"num_workers {n}{rest}", num_workers=n,
                           prefetch_factor=c.prefetch_factor or 2)

    def accumulation(self) -> str:
        c = self.config
        return self.change(f"grad_accum_steps {2 * c.grad_accum_steps} with micro-batch "
                           f"{c.micro_batch_size}", grad_accum_steps=2 * c.grad_accum_steps)


def _input_bound(data: float, c: Config, device: str, util: float | None,
                 tests: _Tests) -> Finding | None:
    if data < INPUT_BOUND:
        return None
    if c.num_workers == 0:
        advice = "loader workers would prepare batches while the model computes"
    else:
        advice = "more loader workers or a larger prefetch_factor would keep batches ready"
    if device == "cuda" and not c.pin_memory:
        advice += "; pin_memory makes the host-to-device copy asynchronous"
    seen = f"; GPU utilisation averaged {util:.0f}%" if util is not None else ""
    test = tests.workers(" with the rest unchanged")
    return Finding("input-bound", (
        f"input-bound: the step waits for data {100 * data:.0f}% of its time (num_workers "
        f"{c.num_workers}, pin_memory {'on' if c.pin_memory else 'off'}, prefetch_factor "
        f"{c.prefetch_factor or 'default'}){seen}: {advice} ({test})"),
        {"data_wait_share": round(data, 4), "num_workers": c.num_workers,
         "pin_memory": c.pin_memory, "prefetch_factor": c.prefetch_factor,
         "gpu_util_mean": util, "test": test})


def _communication_bound(comm: float, c: Config, probe: ProbeDoc,
                         tests: _Tests) -> Finding | None:
    if comm < COMM_BOUND:
        return None
    busbw = probe.get("allreduce_busbw_gbs")
    measured = f"; the probe measured {busbw:g} GB/s all-reduce bus bandwidth" if busbw else ""
    test = tests.accumulation()
    return Finding("communication-bound", (
        f"communication-bound: the step waits {100 * comm:.0f}% of its time for the gradient "
        f"all-reduce ({c.world_size} ranks, {c.ddp_bucket_cap_mb} MB buckets){measured}: "
        f"more accumulation steps or a larger micro-batch all-reduce less often per sample "
        f"({test})"),
        {"comm_wait_share": round(comm, 4), "world_size": c.world_size,
         "bucket_cap_mb": c.ddp_bucket_cap_mb, "allreduce_busbw_gbs": busbw, "test": test})


def _memory_bound(peak_mem: int, used: float, limit: int,
                  wall: MemoryWall | None) -> Finding | None:
    """Memory-bound needs a measurement: a peak near the limit, or a larger micro-batch that
    ran out of memory or passed the limit. A wall the memory model only predicted is named as
    such, never the finding's reason."""
    measured_wall = wall is not None and wall.measured
    if used < MEMORY_BOUND and not measured_wall:
        return None
    larger = f"; {wall.words()}" if wall is not None else ""
    test = "test: the next micro-batch with a larger --memory-limit or activation checkpointing"
    return Finding("memory-bound", (
        f"memory-bound: peak {format_bytes(peak_mem)} is {100 * used:.0f}% of the "
        f"{format_bytes(limit)} limit{larger}: activation checkpointing, a lower precision "
        f"or a larger --memory-limit would let larger batches run ({test})"),
        {"peak_memory_bytes": peak_mem, "memory_limit_bytes": limit,
         "share": round(used, 4), "test": test,
         "larger_over_limit": None if wall is None else
         {"trial": wall.trial, "micro_batch": wall.micro_batch, "measured": wall.measured}})


def _probe_flags(probe: ProbeDoc, device: str) -> list[Finding]:
    """The probe's flags about this study's device: a degraded link or a slow device."""
    found = []
    for flag in probe.get("flags", []):
        if (device == "cuda") == flag.startswith("CPU"):
            continue  # the other device's figures do not limit this study
        link = any(w in flag for w in ("PCIe", "host-to-device", "device-to-host", "all-reduce"))
        test = "test: `autotune probe --refresh` after checking the machine"
        found.append(Finding("degraded-link" if link else "slow-device",
                             ("degraded link: " if link else "slow device: ") + flag
                             + f" ({test})", {"probe_flag": flag, "test": test}))
    return found


def _efficiency(share: float | None, peak: float | None, c: Config, device: str,
                probe: ProbeDoc, explained: bool,
                tests: _Tests) -> tuple[Finding | None, dict[str, Any]]:
    """A low-MFU finding (None when MFU is unknown or not low) and the MFU evidence."""
    if share is None or not peak:
        return None, {"mfu": None}
    ranks = c.world_size if device == "cuda" else 1
    achieved = share * peak * ranks
    evidence = {"mfu": share, "achieved_tflops": round(achieved, 4), "peak_tflops": peak,
                "dtype": _dtype(c)}
    if share >= LOW_MFU:
        return None, evidence
    why = ("see above" if explained else
           "the time goes to work other than large matmuls (a small micro-batch, "
           "elementwise and normalisation kernels, the optimizer step, launch overheads)")
    if c.amp == "off" and probe.get("peak_tflops", {}).get("bf16", 0) > peak:
        why += "; this config computes in fp32"
    test = tests.change(f"micro-batch {2 * c.micro_batch_size} with the rest unchanged",
                        micro_batch_size=2 * c.micro_batch_size)
    return Finding("low-mfu", (
        f"low MFU: {100 * share:.0f}% of the measured {_dtype(c)} peak ({achieved:.3g} "
        f"of {peak * ranks:.3g} TFLOP/s): {why} ({test})"), {**evidence, "test": test}), \
        evidence
