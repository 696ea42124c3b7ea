"""The probe's documents, as JSON holds them: a measured figure, what each measuring subprocess
writes, what the cache holds, and the whole probe (``probe()``, ``autotune probe --json``). The
inventory's part is read every time (``inventory.Inventory``), the measured part comes from the
cache or is measured now (``CachedProbe``), and the checks add the flags (``peaks``)."""

from __future__ import annotations

from typing import NotRequired, Required, TypedDict

from autotune.machine.probe.inventory import GpuPair, GpuRecord


class FigureDetails(TypedDict, total=False):
    """What a measured figure was measured on, as far as it applies."""

    bytes: int  # the size of what was copied or all-reduced
    kind: str  # "copy": bandwidth counts bytes read plus bytes written (STREAM's convention)
    size: int  # the side of the square matrices multiplied
    threads: int  # a CPU GEMM's intra-op threads
    cpu_share: float  # the share of its threads' CPU time a CPU GEMM got (``Load.share``)
    ranks: int  # the ranks of an all-reduce
    algbw: float  # an all-reduce's algorithm bandwidth, GB/s (busbw is the value)


class Figure(FigureDetails, total=False):
    """One measured figure, as the probe's cache and ``autotune probe --json`` hold it; the
    probe's checks (``peaks.check``) add how it compares with its theoretical peak."""

    value: Required[float]
    unit: Required[str]  # "GB/s" or "TFLOP/s"
    peak: float | None
    basis: str | None  # what the peak is, or why there is none
    share: float | None  # value / peak
    low: bool  # below ``peaks.LOW_SHARE`` of a peak worth flagging


class LinkNow(TypedDict):
    """A GPU's PCIe link as NVML reports it while copies keep it busy."""

    gen: int
    width: int
    under_load: bool


class Measured(TypedDict):
    """What one measuring subprocess writes: its figures by name (``cpu.gemm.fp32``,
    ``gpu0.h2d_pinned``, ``allreduce.Ring.1048576``), and for the CPU why it was contended, for
    the GPUs their links under load (by NVML index)."""

    figures: dict[str, Figure]
    contended: NotRequired[str | None]
    pcie_under_load: NotRequired[dict[str, LinkNow]]


class CachedProbe(TypedDict):
    """The measured part of a probe, as the cache holds it: the figures of every measuring
    subprocess together. A file of this schema from an earlier autotune may lack the fields
    marked not required (``probe`` reads them with defaults)."""

    schema: str
    created: NotRequired[str]  # when it was measured, ISO 8601
    fingerprint_id: NotRequired[str]
    figures: dict[str, Figure]
    errors: NotRequired[list[str]]  # each part that failed to measure, and why
    pcie_under_load: NotRequired[dict[str, LinkNow]]  # by NVML index
    contended: NotRequired[str | None]  # why the CPU part was measured under load
    seconds: NotRequired[float]  # how long measuring took


class CpuRecord(TypedDict):
    """The CPU as the probe reports it (``hardware.Hardware``'s fields, and its clock)."""

    model: str
    cores: int
    numa_nodes: int
    memory_total_bytes: int
    bf16: bool
    max_mhz: float | None
    vendor: str | None
    family: int | None
    model_number: int | None
    stepping: int | None
    isa_flags: list[str]


class ProbeDoc(TypedDict):
    """The whole probe, in the order ``autotune probe --json`` prints it."""

    schema: str
    cpu: CpuRecord
    # The inventory (``inventory.Inventory``).
    gpus: list[GpuRecord]
    topology: list[GpuPair]
    gpu_note: str | None
    driver_version: str | None
    cuda_driver_version: str | None
    # The measured part (``CachedProbe``).
    created: str | None
    fingerprint_id: str | None
    seconds: float | None
    errors: list[str] | None  # each part that failed to measure, and why
    contended: str | None  # why it was measured under load, or None
    figures: dict[str, Figure]
    # What the probe says about them.
    notes: list[str]
    flags: list[str]  # each low figure against its theoretical peak, each degraded link
