"""The probe's checks: each measured figure against the theoretical peak of its link or device
(PCIe lanes, NVLink links, datasheet matmul peaks, memory bus, a CPU's FMA units), flagged when
below ``LOW_SHARE`` of it; degraded PCIe links named."""

from __future__ import annotations

import re

from autotune.machine import cpu as cpu_info
from autotune.machine.probe.documents import CpuRecord, ProbeDoc
from autotune.machine.probe.inventory import GpuRecord
from autotune.machine.probe.kernels import ALLREDUCE_BYTES

# A figure's theoretical peak, what it is (or why there is none), and whether falling far below
# it is a problem worth flagging.
Theoretical = tuple[float | None, str | None, bool]

LOW_SHARE = 0.5  # a measured figure below this share of its theoretical peak is flagged

# GB/s per lane and direction after line encoding (8b/10b to Gen2, 128b/130b from Gen3).
PCIE_GBS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
# NVLink GB/s per link and direction, by compute capability's major version (V100 to B200).
NVLINK_GBS_PER_LINK = {7: 25.0, 8: 25.0, 9: 25.0, 10: 50.0}
# Datasheet dense peaks (no sparsity), TFLOP/s, for GPUs commonly tuned on; others get none.
GPU_DATASHEET: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H100 NVL|H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"H100|H200|GH200", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.1, "fp16": 362.1}),
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
)


def check(doc: ProbeDoc) -> None:
    """Set each figure against its theoretical peak (``peak``, ``basis``, ``share``, ``low``)
    and add a flag line for each low figure and each degraded link."""
    figures = doc["figures"]
    gpus = {str(g["index"]): g for g in doc.get("gpus", [])}
    for name, fig in figures.items():
        peak, basis, flaggable = _theoretical(name, doc, gpus)
        share = round(fig["value"] / peak, 3) if peak else None
        fig["peak"], fig["basis"], fig["share"] = peak, basis, share
        fig["low"] = bool(flaggable and peak and fig["value"] < LOW_SHARE * peak)
        if fig["low"] and peak and share is not None:
            doc["flags"].append(f"{label(name)}: {fig['value']:g} {fig['unit']} is "
                                f"{100 * share:.0f}% of the {peak:g} {fig['unit']} "
                                f"theoretical ({basis})")
    for g in doc.get("gpus", []):
        line = degraded_link(g)
        if line:
            doc["flags"].append(line)


def degraded_link(g: GpuRecord) -> str | None:
    """``GPU 3 runs PCIe Gen3 x8; it can run Gen4 x16``, or None. An idle GPU lowers its link
    generation to save power, so a generation below the best counts only when read under load
    (``under_load``); a narrower link, or a slot slower than the GPU, counts always."""
    p = g["pcie"]
    gen, width, max_gen, max_width = p["gen"], p["width"], p["max_gen"], p["max_width"]
    if not (gen and width and max_gen and max_width):
        return None
    slow_gen = gen < max_gen and p.get("under_load")
    if width < max_width or slow_gen:
        return f"GPU {g['index']} runs PCIe Gen{gen} x{width}; it can run Gen{max_gen} x{max_width}"
    gpu_max = p.get("gpu_max_gen")
    if gpu_max and max_gen < gpu_max:
        return (f"GPU {g['index']} sits in a PCIe Gen{max_gen} slot; the GPU can run "
                f"Gen{gpu_max} (another slot, or the BIOS's PCIe setting)")
    return None


def _theoretical(name: str, doc: ProbeDoc, gpus: dict[str, GpuRecord]) -> Theoretical:
    """(peak, basis, whether falling far below it is a problem worth flagging)."""
    parts = name.split(".")
    if parts[0] == "cpu":
        if parts[1] == "gemm":
            return _cpu_gemm_peak(parts[2], doc["cpu"])
        return None, "no theoretical figure: the DIMM layout is not readable without root", False
    if parts[0] == "allreduce":
        return _allreduce_peak(doc, int(parts[2]))
    g = gpus.get(parts[0].removeprefix("gpu"))
    if g is None:
        return None, None, False
    if parts[1] in ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
        p = g["pcie"]
        gen, width = p.get("max_gen"), p.get("max_width")
        if not (gen in PCIE_GBS_PER_LANE and width):
            return None, None, False
        # Pageable copies stage through a pinned buffer: slower by design, shown, not flagged.
        return (round(PCIE_GBS_PER_LANE[gen] * width, 1), f"PCIe Gen{gen} x{width}",
                parts[1].endswith("pinned"))
    if parts[1] == "memory_bandwidth":
        peak = g.get("memory_bandwidth_peak_gbs")
        return peak, "memory bus width x memory clock x 2" if peak else None, bool(peak)
    if parts[1] == "matmul":
        for pattern, peaks in GPU_DATASHEET:
            if re.search(pattern, g["name"]):
                return peaks.get(parts[2]), f"{g['name']} datasheet, dense", True
        return None, f"no datasheet figure for {g['name']}", False
    return None, None, False


def _cpu_gemm_peak(dtype: str, cpu: CpuRecord) -> Theoretical:
    """cores x clock x FLOP per cycle of the widest FMA (two FMA units assumed): an estimate,
    for fp32 only; bf16 on AMX or AVX512-BF16 has no dependable public per-cycle figure."""
    mhz = cpu.get("max_mhz")
    if dtype != "fp32":
        return None, "no dependable theoretical figure for bf16 on CPUs", False
    per_cycle, isa = fp32_flops_per_cycle(cpu_info.cpu_flags(), *cpu_info.cpu_vendor_family())
    if not mhz or not per_cycle:
        return None, "no theoretical figure: unknown clock or vector unit", False
    peak = cpu["cores"] * mhz * 1e6 * per_cycle / 1e12
    return (round(peak, 3), f"estimate: {cpu['cores']} cores x {mhz:.0f} MHz x {per_cycle} "
            f"FLOP/cycle ({isa}, two FMA units assumed)", True)


def fp32_flops_per_cycle(flags: set[str], vendor: str | None,
                         family: int | None) -> tuple[int, str]:
    """fp32 FLOP per cycle and core of the widest FMA, two units: (0, "") when unknown. AMD's
    Zen 4 (family 25 with avx512f) runs AVX-512 on 256-bit units, so its peak is AVX2's: 64
    there would put every Zen 4 GEMM at half its peak."""
    if "avx512f" in flags:
        if vendor == "AuthenticAMD" and family == 25:
            return 32, "AVX-512 on Zen 4's 256-bit units"
        return 64, "AVX-512"
    if "fma" in flags:
        return 32, "AVX2"
    if "avx" in flags:
        return 16, "AVX"
    return 0, ""


def _allreduce_peak(doc: ProbeDoc, size: int) -> Theoretical:
    """Bus bandwidth is bounded by each GPU's slowest path to the others: its NVLinks when
    every pair is NVLink-connected, else its PCIe link. Small messages are latency-bound:
    only the largest size is held to the peak."""
    gpus = doc.get("gpus") or []
    if len(gpus) < 2:
        return None, None, False
    largest = size >= max(ALLREDUCE_BYTES)
    if all(pair["nvlinks"] for pair in doc.get("topology", [])):
        per_gpu = min((g["nvlink"]["links"] or 0) *
                      NVLINK_GBS_PER_LINK.get(g["compute_capability"][0], 25.0) for g in gpus)
        return float(per_gpu), "NVLink links x per-link bandwidth, one direction", largest
    lanes = [(g["pcie"]["max_gen"], g["pcie"]["max_width"]) for g in gpus]
    known = [(gen, width) for gen, width in lanes if gen in PCIE_GBS_PER_LANE and width]
    if len(known) == len(lanes):
        peak = min(PCIE_GBS_PER_LANE[gen] * width for gen, width in known)
        return round(peak, 1), "the slowest GPU's PCIe link, one direction", largest
    return None, None, False


def label(name: str) -> str:
    parts = name.split(".")
    what = {"h2d_pinned": "host-to-device (pinned)", "h2d_pageable": "host-to-device (pageable)",
            "d2h_pinned": "device-to-host (pinned)", "d2h_pageable": "device-to-host (pageable)",
            "memory_bandwidth": "memory bandwidth", "gemm": "GEMM", "matmul": "matmul"}
    if parts[0] == "allreduce":
        return f"all-reduce busbw, NCCL_ALGO={parts[1]}, {int(parts[2]) / 2**20:g} MiB"
    head = "CPU" if parts[0] == "cpu" else f"GPU {parts[0].removeprefix('gpu')}"
    return " ".join([head, what.get(parts[1], parts[1]), *parts[2:]])
