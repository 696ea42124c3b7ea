"""Know the machine: ``autotune probe``, its figures, and the cache ``autotune run`` reads.

Three parts, each where it belongs:
  inventory  in this process, through NVML only (no CUDA context): per GPU its name, memory,
             PCIe link now and at best, NVLink links, NUMA node; the topology and P2P support
             between each pair of GPUs; the CPU's model, cores, NUMA nodes and memory;
  measured   in subprocesses (``python -m autotune.probe cpu|gpu|allreduce OUT.json``): CPU GEMM
             peaks (fp32, bf16) and memory bandwidth; per GPU host-to-device and device-to-host
             copies from pinned and pageable memory, device memory bandwidth and matmul peaks
             (fp32, tf32, bf16, fp16); all-reduce bus bandwidth across the GPUs per NCCL
             algorithm (nccl-tests' busbw: algbw x 2(n-1)/n);
  checks     each measured figure against the theoretical peak of its link or device, flagged
             when below ``LOW_SHARE`` of it; degraded PCIe links named.

A probe is cached per hardware fingerprint (``AUTOTUNE_CACHE_DIR``, else ~/.cache/autotune), so
``autotune run`` probes a machine once and reads its peaks for MFU afterwards.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from autotune.hardware import (
    Hardware,
    cpu_flags,
    cpu_max_mhz,
    cpu_vendor_family,
    numa_nodes,
    nvlink_links,
    nvml,
    nvml_call,
    text,
)

PROBE_SCHEMA = "autotune.probe/v1"
LOW_SHARE = 0.5  # a measured figure below this share of its theoretical peak is flagged
ALLREDUCE_BYTES = (2**20, 32 * 2**20, 256 * 2**20)
NCCL_ALGOS = ("default", "Ring", "Tree")
CPU_GEMM_CALL_S = 0.05  # a CPU GEMM size slower than this per call is the largest tried

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
# nvmlDeviceGetNvLinkVersion answers with NVML's nvmlNvlinkVersion_t, not the version itself.
_NVLINK_VERSIONS = {1: "1.0", 2: "2.0", 3: "2.2", 4: "3.0", 5: "3.1", 6: "4.0", 7: "5.0", 8: "6.0"}
_TOPOLOGY = {0: "same board", 10: "one PCIe switch", 20: "several PCIe switches",
             30: "PCIe host bridge", 40: "same NUMA node", 50: "across NUMA nodes"}


def cache_dir() -> Path:
    env = os.environ.get("AUTOTUNE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autotune"


def cache_path(hw: Hardware) -> Path:
    return cache_dir() / f"probe-{hw.fingerprint_id()}.json"


def cached(hw: Hardware) -> dict[str, Any] | None:
    """This machine's cached measurements, or None (absent, unreadable, or of another schema)."""
    try:
        doc = json.loads(cache_path(hw).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == PROBE_SCHEMA else None


def probe(hw: Hardware, *, refresh: bool = False, workdir: Path | None = None,
          on_step: Callable[[str], None] | None = None, allreduce: bool = True) -> dict[str, Any]:
    """The machine's probe. The inventory is read every time (NVML, milliseconds; a link can
    retrain); the measurements come from the cache unless ``refresh`` or there is none, and are
    cached when taken. Then the checks. A part that fails to measure is named under
    ``errors``; the rest still comes back."""
    doc: dict[str, Any] = {"schema": PROBE_SCHEMA}
    doc["cpu"] = {"model": hw.cpu_model, "cores": hw.cpu_cores, "numa_nodes": numa_nodes(),
                  "memory_total_bytes": hw.memory_total_bytes, "bf16": hw.cpu_bf16,
                  "max_mhz": cpu_max_mhz()}
    doc.update(inventory())
    found = None if refresh else cached(hw)
    if found is None:
        found = _measure(hw, doc["gpus"], workdir, on_step or (lambda line: None), allreduce)
        path = cache_path(hw)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(found, indent=1))
        path.with_suffix(".tmp").replace(path)
    for key in ("created", "fingerprint_id", "seconds", "errors"):
        doc[key] = found.get(key)
    doc["figures"] = {k: dict(v) for k, v in found.get("figures", {}).items()}
    for g in doc["gpus"]:
        g["pcie"].update(found.get("pcie_under_load", {}).get(str(g["index"]), {}))
    doc["notes"] = ["NVIDIA GPUs found, but this torch build has no CUDA: their bandwidth and "
                    "matmul peaks were not measured"] if doc["gpus"] and hw.device != "cuda" \
        else []
    doc["flags"] = []
    check(doc)
    return doc


def _measure(hw: Hardware, gpus: list[dict[str, Any]], workdir: Path | None,
             say: Callable[[str], None], allreduce: bool) -> dict[str, Any]:
    """The measured part, each in a subprocess: what the cache holds."""
    import tempfile

    from autotune.launch import run_tool

    start = time.monotonic()
    doc: dict[str, Any] = {"schema": PROBE_SCHEMA,
                           "created": datetime.now(UTC).isoformat(timespec="seconds"),
                           "fingerprint_id": hw.fingerprint_id(), "figures": {}, "errors": [],
                           "pcie_under_load": {}}
    with tempfile.TemporaryDirectory(prefix="autotune-probe-", dir=workdir) as tmp:
        say("measuring CPU GEMM peaks and memory bandwidth")
        out, why = run_tool(["autotune.probe", "cpu"], Path(tmp) / "cpu.json", timeout_s=180)
        if out is None:
            doc["errors"].append(f"cpu: {why}")
        else:
            doc["figures"].update(out["figures"])
        if gpus and hw.device == "cuda":
            say(f"measuring {len(gpus)} GPU(s): copies, memory bandwidth, matmul peaks")
            out, why = run_tool(["autotune.probe", "gpu"], Path(tmp) / "gpu.json",
                                timeout_s=120 + 60 * len(gpus))
            if out is None:
                doc["errors"].append(f"gpu: {why}")
            else:
                doc["figures"].update(out["figures"])
                doc["pcie_under_load"] = out.get("pcie_under_load", {})
            if allreduce and len(gpus) > 1:
                for algo in NCCL_ALGOS:
                    say(f"measuring all-reduce bus bandwidth, NCCL_ALGO={algo}")
                    env = {} if algo == "default" else {"NCCL_ALGO": algo}
                    out, why = run_tool(["autotune.probe", "allreduce", algo],
                                        Path(tmp) / f"allreduce-{algo}.json", timeout_s=180,
                                        env=env, nproc=len(gpus))
                    if out is None:
                        doc["errors"].append(f"all-reduce {algo}: {why}")
                    else:
                        doc["figures"].update(out["figures"])
    doc["seconds"] = round(time.monotonic() - start, 1)
    return doc


# -- inventory (NVML, this process) ------------------------------------------------------------

def inventory(nv: Any = None) -> dict[str, Any]:
    """Every visible GPU and the links between them, through NVML; ``gpu_note`` says in one
    line why there are none."""
    from autotune.hardware import _visible_indices

    found: dict[str, Any] = {"gpus": [], "topology": [], "gpu_note": None,
                             "driver_version": None, "cuda_driver_version": None}
    try:
        nv = nv or nvml()
        nv.nvmlInit()
    except ImportError:
        found["gpu_note"] = "no GPU part: nvidia-ml-py is not installed"
        return found
    except Exception as exc:
        found["gpu_note"] = f"no GPU part: no NVIDIA driver ({exc.__class__.__name__})"
        return found
    try:
        found["driver_version"] = text(nv.nvmlSystemGetDriverVersion())
        cuda = nvml_call(nv.nvmlSystemGetCudaDriverVersion)
        found["cuda_driver_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None
        handles = {i: nv.nvmlDeviceGetHandleByIndex(i)
                   for i in _visible_indices(nv.nvmlDeviceGetCount())}
        buses = {}
        for i, h in handles.items():
            bus = nvml_call(nv.nvmlDeviceGetPciInfo, h)
            buses[i] = text(bus.busId).lower() if bus is not None else None
            cc = tuple(nv.nvmlDeviceGetCudaComputeCapability(h))
            links = nvlink_links(nv, h)
            code = nvml_call(nv.nvmlDeviceGetNvLinkVersion, h, 0) if links else None
            version = _NVLINK_VERSIONS.get(code) if code is not None else None
            width = nvml_call(nv.nvmlDeviceGetMemoryBusWidth, h)
            mem_mhz = nvml_call(nv.nvmlDeviceGetMaxClockInfo, h,
                                getattr(nv, "NVML_CLOCK_MEM", 2))
            found["gpus"].append({
                "index": i, "name": text(nv.nvmlDeviceGetName(h)),
                "memory_total_bytes": int(nv.nvmlDeviceGetMemoryInfo(h).total),
                "compute_capability": [int(cc[0]), int(cc[1])], "bus_id": buses[i],
                "numa_node": nvml_call(nv.nvmlDeviceGetNumaNodeId, h),
                "pcie": {k: nvml_call(f, h) for k, f in (
                    ("gen", nv.nvmlDeviceGetCurrPcieLinkGeneration),
                    ("width", nv.nvmlDeviceGetCurrPcieLinkWidth),
                    ("max_gen", nv.nvmlDeviceGetMaxPcieLinkGeneration),
                    ("max_width", nv.nvmlDeviceGetMaxPcieLinkWidth),
                    ("gpu_max_gen", nv.nvmlDeviceGetGpuMaxPcieLinkGeneration))},
                "nvlink": {"links": links, "version": version},
                # Theoretical device memory bandwidth: bus width x memory clock x 2 (DDR).
                "memory_bandwidth_peak_gbs": round(width * mem_mhz * 2 / 8 / 1e3, 1)
                if width and mem_mhz else None,
            })
        indices = sorted(handles)
        for n, a in enumerate(indices):
            for b in indices[n + 1:]:
                found["topology"].append(_pair(nv, handles, buses, a, b))
    except Exception as exc:  # a GPU lost or hidden mid-read: keep what was read, say so
        found["gpu_note"] = f"GPU part incomplete: NVML failed ({type(exc).__name__}: {exc})"
        return found
    finally:
        nv.nvmlShutdown()
    if not found["gpus"]:
        found["gpu_note"] = "no GPU part: NVML sees no GPU (CUDA_VISIBLE_DEVICES hides them all?)"
    return found


def _pair(nv: Any, handles: dict[int, Any], buses: dict[int, str | None], a: int,
          b: int) -> dict[str, Any]:
    """How GPUs a and b are connected: NVLink (a link of a ends at b) or PCIe's common
    ancestor; whether they can read each other's memory (P2P)."""
    ha, hb = handles[a], handles[b]
    nvlinks = 0
    for i in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        remote = nvml_call(nv.nvmlDeviceGetNvLinkRemotePciInfo, ha, i)
        if remote is not None and text(remote.busId).lower() == buses[b]:
            nvlinks += 1
    ancestor = nvml_call(nv.nvmlDeviceGetTopologyCommonAncestor, ha, hb)
    status = nvml_call(nv.nvmlDeviceGetP2PStatus, ha, hb, 0)  # 0: NVML_P2P_CAPS_INDEX_READ
    if nvlinks:
        link = f"NVLink x{nvlinks}"
    elif nvml_call(nv.nvmlDeviceGetP2PStatus, ha, hb, 2) == 0:  # 2: ..._INDEX_NVLINK
        # HGX/DGX boards: every link ends at an NVSwitch, none at the peer GPU itself.
        nvlinks = min(nvlink_links(nv, ha) or 0, nvlink_links(nv, hb) or 0)
        link = f"NVLink x{nvlinks} through NVSwitch"
    else:
        link = f"PCIe, {_TOPOLOGY.get(ancestor, 'unknown')}"
    return {"gpus": [a, b], "link": link, "nvlinks": nvlinks,
            "p2p": None if status is None else status == 0}


# -- checks ------------------------------------------------------------------------------------

def check(doc: dict[str, Any]) -> None:
    """Set each figure against its theoretical peak (``peak``, ``basis``, ``share``, ``low``)
    and add a flag line for each low figure and each degraded link."""
    figures = doc["figures"]
    gpus = {str(g["index"]): g for g in doc.get("gpus", [])}
    for name, fig in figures.items():
        peak, basis, flaggable = _theoretical(name, doc, gpus)
        fig.update(peak=peak, basis=basis)
        fig["share"] = round(fig["value"] / peak, 3) if peak else None
        fig["low"] = bool(flaggable and peak and fig["value"] < LOW_SHARE * peak)
        if fig["low"]:
            doc["flags"].append(f"{_label(name)}: {fig['value']:g} {fig['unit']} is "
                                f"{100 * fig['share']:.0f}% of the {peak:g} {fig['unit']} "
                                f"theoretical ({basis})")
    for g in doc.get("gpus", []):
        line = degraded_link(g)
        if line:
            doc["flags"].append(line)


def degraded_link(g: dict[str, Any]) -> str | None:
    """``GPU 3 runs PCIe Gen3 x8; it can run Gen4 x16``, or None. An idle GPU lowers its link
    generation to save power, so a generation below the best counts only when read under load
    (``under_load``); a narrower link, or a slot slower than the GPU, counts always."""
    p = g.get("pcie") or {}
    gen, width, max_gen, max_width = (p.get(k) for k in ("gen", "width", "max_gen", "max_width"))
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


def _theoretical(name: str, doc: dict[str, Any],
                 gpus: dict[str, dict[str, Any]]) -> tuple[float | None, str | None, bool]:
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


def _cpu_gemm_peak(dtype: str, cpu: dict[str, Any]) -> tuple[float | None, str | None, bool]:
    """cores x clock x FLOP per cycle of the widest FMA (two FMA units assumed): an estimate,
    for fp32 only; bf16 on AMX or AVX512-BF16 has no dependable public per-cycle figure."""
    mhz = cpu.get("max_mhz")
    if dtype != "fp32":
        return None, "no dependable theoretical figure for bf16 on CPUs", False
    per_cycle, isa = fp32_flops_per_cycle(cpu_flags(), *cpu_vendor_family())
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


def _allreduce_peak(doc: dict[str, Any], size: int) -> tuple[float | None, str | None, bool]:
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
    lanes = [(g["pcie"].get("max_gen"), g["pcie"].get("max_width")) for g in gpus]
    if all(gen in PCIE_GBS_PER_LANE and width for gen, width in lanes):
        peak = min(PCIE_GBS_PER_LANE[gen] * width for gen, width in lanes)
        return round(peak, 1), "the slowest GPU's PCIe link, one direction", largest
    return None, None, False


def _label(name: str) -> str:
    parts = name.split(".")
    what = {"h2d_pinned": "host-to-device (pinned)", "h2d_pageable": "host-to-device (pageable)",
            "d2h_pinned": "device-to-host (pinned)", "d2h_pageable": "device-to-host (pageable)",
            "memory_bandwidth": "memory bandwidth", "gemm": "GEMM", "matmul": "matmul"}
    if parts[0] == "allreduce":
        return f"all-reduce busbw, NCCL_ALGO={parts[1]}, {int(parts[2]) / 2**20:g} MiB"
    head = "CPU" if parts[0] == "cpu" else f"GPU {parts[0].removeprefix('gpu')}"
    return " ".join([head, what.get(parts[1], parts[1]), *parts[2:]])


# -- what a study takes from the probe ---------------------------------------------------------

def summary(doc: dict[str, Any], device: str) -> dict[str, Any]:
    """The probe in a few numbers, for the study, the profile and MFU: the matmul peaks of the
    device a study runs on (the slowest GPU's), its memory bandwidth, the slowest pinned copy,
    the best all-reduce bus bandwidth at the largest size, the links and the flags."""
    figs = doc.get("figures", {})

    def lowest(suffix: str) -> float | None:
        values = [f["value"] for n, f in figs.items()
                  if n.startswith("gpu") and n.split(".", 1)[1] == suffix]
        return min(values) if values else None

    if device == "cuda":
        peaks = {d: lowest(f"matmul.{d}") for d in ("fp32", "tf32", "bf16", "fp16")}
        memory = lowest("memory_bandwidth")
        basis = "measured matmul peak of the slowest GPU"
    else:
        peaks = {d: figs[f"cpu.gemm.{d}"]["value"] for d in ("fp32", "bf16")
                 if f"cpu.gemm.{d}" in figs}
        memory = figs.get("cpu.memory_bandwidth", {}).get("value")
        basis = "measured CPU GEMM peak, all cores"
    big = [f["value"] for n, f in figs.items()
           if n.startswith("allreduce.") and int(n.split(".")[2]) == max(ALLREDUCE_BYTES)]
    out = {"created": doc.get("created"), "peak_tflops": {k: v for k, v in peaks.items() if v},
           "peak_basis": basis, "memory_bandwidth_gbs": memory,
           "links": [_link_line(g) for g in doc.get("gpus", [])] if device == "cuda" else [],
           "flags": list(doc.get("flags", []))}
    if device == "cuda":
        out["h2d_pinned_gbs"] = lowest("h2d_pinned")
        out["allreduce_busbw_gbs"] = max(big) if big else None
    return out


def peak_for(summary_: dict[str, Any] | None, amp: str, device: str) -> float | None:
    """The measured peak (TFLOP/s) a trial's math runs against: bf16 or fp16 under autocast,
    else fp32 (trials leave TF32 off, PyTorch's default for matmuls)."""
    if not summary_:
        return None
    dtype = amp if amp in ("bf16", "fp16") else "fp32"
    value = (summary_.get("peak_tflops") or {}).get(dtype)
    return float(value) if value else None


def _link_line(g: dict[str, Any]) -> str:
    p, links = g.get("pcie") or {}, (g.get("nvlink") or {}).get("links")
    pcie = f"PCIe Gen{p.get('gen')} x{p.get('width')}" if p.get("gen") else "PCIe unknown"
    return f"GPU {g['index']}: {pcie}" + (f", {links} NVLink" if links else "")


def render(doc: dict[str, Any]) -> list[str]:
    """``autotune probe``'s human output."""
    from autotune.hardware import format_bytes

    c = doc["cpu"]
    lines = [f"CPU     {c['model']}, {c['cores']} cores, {c['numa_nodes']} NUMA node(s), "
             f"{format_bytes(c['memory_total_bytes'])}"
             + (f", {c['max_mhz']:.0f} MHz" if c.get("max_mhz") else "")]
    if doc.get("gpu_note"):
        lines.append(f"GPU     {doc['gpu_note']}")
    for g in doc.get("gpus", []):
        p = g["pcie"]
        best = f"Gen{p.get('max_gen')} x{p.get('max_width')}" if p.get("max_gen") else "?"
        lines.append(f"GPU {g['index']}   {g['name']}, {format_bytes(g['memory_total_bytes'])}, "
                     f"driver {doc['driver_version']} (CUDA {doc['cuda_driver_version']}); "
                     f"PCIe Gen{p.get('gen')} x{p.get('width')} now, {best} at best"
                     + (f"; {g['nvlink']['links']} NVLink" if g["nvlink"]["links"] else "")
                     + (f"; NUMA {g['numa_node']}" if g.get("numa_node") is not None else ""))
    for pair in doc.get("topology", []):
        p2p = {True: "P2P", False: "no P2P", None: "P2P unknown"}[pair["p2p"]]
        lines.append(f"link    GPU {pair['gpus'][0]} - GPU {pair['gpus'][1]}: {pair['link']}, "
                     f"{p2p}")
    for name, f in doc.get("figures", {}).items():
        against = (f"  {100 * f['share']:.0f}% of {f['peak']:g} ({f['basis']})"
                   if f.get("share") is not None else f"  ({f['basis']})" if f.get("basis")
                   else "")
        lines.append(f"{'LOW' if f.get('low') else 'measured':9s}{_label(name)}: "
                     f"{f['value']:g} {f['unit']}{against}")
    lines += [f"flag    {line}" for line in doc.get("flags", [])]
    lines += [f"note    {line}" for line in doc.get("notes", [])]
    lines += [f"error   {line}" for line in doc.get("errors", [])]
    return lines


# -- measured (subprocesses) -------------------------------------------------------------------

def _best_rate(fn: Callable[..., Any], amount: float, sync: Callable[[], None],
               seconds: float = 0.6, blocks: int = 3,
               agree: Callable[[float], float] | None = None) -> float:
    """The best rate (amount per second) over ``blocks`` timed blocks of repeated calls: a
    peak is the best a part does, not its average under whatever else the machine runs.
    ``agree`` turns this process's time of one call into the one all ranks use, so that ranks
    of a collective make the same number of calls."""
    fn()
    sync()
    t = time.perf_counter()
    fn()
    sync()
    once = time.perf_counter() - t
    if agree is not None:
        once = agree(once)
    reps = max(1, int(seconds / blocks / max(once, 1e-6)))
    best = 0.0
    for _ in range(blocks):
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = max(best, amount * reps / (time.perf_counter() - t))
    return best


def _figure(value: float, unit: str, **extra: Any) -> dict[str, Any]:
    return {"value": round(value, 4 if unit == "TFLOP/s" else 2), "unit": unit, **extra}


def measure_cpu() -> dict[str, Any]:
    """GEMM peak per dtype (the best of square sizes up to 2048) and copy bandwidth, all cores.

    Sizes grow only while one call stays short: a CPU without native bf16 emulates it about 100x
    slower than fp32 (measured: 2.3 s for one 1024^2 bf16 GEMM on a 2-core AVX2 EPYC), and a
    2048^2 one there would take the probe minutes."""
    import torch

    figures = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        best, size = 0.0, 0
        for n in (512, 1024, 2048):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            t = time.perf_counter()
            torch.mm(a, b)
            once = time.perf_counter() - t
            # Longer than the GPU's: a shared CPU's GEMM rate swings by 2x within seconds
            # (measured on a 2-core VM, bf16), and a peak is the best it reaches.
            rate = _best_rate(lambda a=a, b=b: torch.mm(a, b), 2 * n**3 / 1e12, lambda: None,
                              seconds=1.2, blocks=4 if once < 0.1 else 2)
            if rate > best:
                best, size = rate, n
            if once > CPU_GEMM_CALL_S:
                break
        figures[f"cpu.gemm.{name}"] = _figure(best, "TFLOP/s", size=size,
                                              threads=torch.get_num_threads())
    n = 256 * 2**20 // 4
    src, dst = torch.ones(n), torch.zeros(n)
    # STREAM's copy convention: bytes read plus bytes written.
    rate = _best_rate(lambda: dst.copy_(src), 2 * n * 4 / 1e9, lambda: None, seconds=1.0)
    figures["cpu.memory_bandwidth"] = _figure(rate, "GB/s", bytes=n * 4, kind="copy")
    return {"figures": figures}


def measure_gpus() -> dict[str, Any]:
    """Per visible GPU: pinned and pageable copies both ways (256 MiB), device memory bandwidth
    (a 1 GiB copy), matmul peaks (8192^2); the PCIe link as NVML reads it under load."""
    import torch

    figures: dict[str, Any] = {}
    under_load: dict[str, Any] = {}
    try:
        nv = nvml()
        nv.nvmlInit()
    except Exception:
        nv = None
    for local in range(torch.cuda.device_count()):
        dev = torch.device("cuda", local)
        # Figures are named by NVML's index, as the inventory names the GPUs: found through
        # the PCI bus (CUDA numbers GPUs fastest first, NVML by bus).
        handle = nvml_call(nv.nvmlDeviceGetHandleByPciBusId, _bus_id(dev)) \
            if nv is not None else None
        index = nvml_call(nv.nvmlDeviceGetIndex, handle) if handle is not None else None
        index = local if index is None else int(index)
        torch.cuda.set_device(dev)
        found, link = _measure_gpu(dev, nv)
        figures.update({f"gpu{index}.{k}": v for k, v in found.items()})
        if link:
            under_load[str(index)] = link
        torch.cuda.empty_cache()
    if nv is not None:
        nv.nvmlShutdown()
    return {"figures": figures, "pcie_under_load": under_load}


def _measure_gpu(dev: Any, nv: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    def sync() -> None:
        torch.cuda.synchronize(dev)

    figures: dict[str, Any] = {}
    link: dict[str, Any] = {}
    size = 256 * 2**20
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    for kind, host in (("pinned", torch.empty(size, dtype=torch.uint8, pin_memory=True)),
                       ("pageable", torch.empty(size, dtype=torch.uint8))):
        host.fill_(1)

        def h2d(h: Any = host) -> Any:
            return gpu.copy_(h, non_blocking=True)

        def d2h(h: Any = host) -> Any:
            return h.copy_(gpu, non_blocking=True)

        figures[f"h2d_{kind}"] = _figure(_best_rate(h2d, size / 1e9, sync), "GB/s", bytes=size)
        if kind == "pinned" and nv is not None:
            link = _link_now(nv, dev, h2d)
        figures[f"d2h_{kind}"] = _figure(_best_rate(d2h, size / 1e9, sync), "GB/s", bytes=size)
    n = 2**30
    src = torch.ones(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def copy() -> Any:
        return dst.copy_(src)

    figures["memory_bandwidth"] = _figure(_best_rate(copy, 2 * n / 1e9, sync), "GB/s", bytes=n,
                                          kind="copy")
    n = 8192
    for name, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                              ("bf16", torch.bfloat16, False), ("fp16", torch.float16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(n, n, dtype=dtype, device=dev)
        b = torch.randn(n, n, dtype=dtype, device=dev)

        def mm(a: Any = a, b: Any = b) -> Any:
            return torch.mm(a, b)

        figures[f"matmul.{name}"] = _figure(_best_rate(mm, 2 * n**3 / 1e12, sync), "TFLOP/s",
                                            size=n)
    torch.backends.cuda.matmul.allow_tf32 = False
    return figures, link


def _bus_id(dev: Any) -> bytes:
    import torch

    props: Any = torch.cuda.get_device_properties(dev)
    return (f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:"
            f"{props.pci_device_id:02x}.0").encode()


def _link_now(nv: Any, dev: Any, copy: Callable[[], Any]) -> dict[str, Any]:
    """The PCIe link NVML reports while copies keep it busy (an idle GPU trains down)."""
    import torch

    handle = nvml_call(nv.nvmlDeviceGetHandleByPciBusId, _bus_id(dev))
    if handle is None:
        return {}
    for _ in range(20):
        copy()
    gen = nvml_call(nv.nvmlDeviceGetCurrPcieLinkGeneration, handle)
    width = nvml_call(nv.nvmlDeviceGetCurrPcieLinkWidth, handle)
    torch.cuda.synchronize(dev)
    return {"gen": gen, "width": width, "under_load": True} if gen and width else {}


def measure_allreduce(algo: str) -> dict[str, Any] | None:
    """One rank of the all-reduce test (torchrun starts one per GPU; NCCL_ALGO is set in the
    environment): busbw per message size, as nccl-tests computes it. Rank 0 returns it."""
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")  # gloo: for the tests
    if cuda:
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dist.init_process_group("gloo")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    world = dist.get_world_size()
    figures = {}
    for size in ALLREDUCE_BYTES:
        t = torch.ones(size // 4, dtype=torch.float32, device=dev)

        def once(t: Any = t) -> None:
            dist.all_reduce(t)

        algbw = _best_rate(once, size / 1e9, sync, seconds=0.5,
                           agree=lambda x: _agreed(x, dist.ReduceOp.MAX, dev))
        # The slowest rank's view decides: the minimum bandwidth over the ranks.
        agreed = torch.tensor([algbw], device=dev)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        busbw = float(agreed.item()) * 2 * (world - 1) / world
        figures[f"allreduce.{algo}.{size}"] = _figure(busbw, "GB/s", bytes=size, ranks=world,
                                                       algbw=round(float(agreed.item()), 2))
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    return {"figures": figures} if rank == 0 else None


def _agreed(value: float, op: Any, dev: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=op)
    return float(t.item())


def main(argv: list[str] | None = None) -> int:
    """``python -m autotune.probe cpu|gpu|allreduce [ALGO] OUT.json``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] not in ("cpu", "gpu", "allreduce"):
        print("usage: python -m autotune.probe cpu|gpu|allreduce [ALGO] OUT.json",
              file=sys.stderr)
        return 2
    if args[0] == "cpu":
        out: dict[str, Any] | None = measure_cpu()
    elif args[0] == "gpu":
        out = measure_gpus()
    else:
        out = measure_allreduce(args[1])
    if out is not None:
        path = Path(args[-1])
        path.with_suffix(".tmp").write_text(json.dumps(out))
        path.with_suffix(".tmp").replace(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
