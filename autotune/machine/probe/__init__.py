"""Know the machine: ``autotune probe``, its figures, and the cache ``autotune run`` reads.

Four parts, each in its own module:
  inventory  in this process, through NVML only (no CUDA context): GPUs, links, topology;
  kernels    measured in subprocesses: CPU GEMM and copy bandwidth; per GPU copies, memory
             bandwidth and matmul peaks; all-reduce bus bandwidth per NCCL algorithm;
  peaks      each measured figure against the theoretical peak of its link or device, flagged
             when below ``LOW_SHARE`` of it; degraded PCIe links named;
  cache      the measurements per hardware fingerprint, so a machine is probed once (and again
             after ``MAX_AGE_DAYS``).
Their documents' shapes (a figure, the cache's, the whole probe's) are in ``documents``.
This module puts them together (``probe``), and gives a study its summary and MFU peaks. A probe
taken under load (``kernels.contended``) is used, marked ``contended`` and never cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from autotune.machine.hardware import Hardware, cpu_max_mhz, numa_nodes
from autotune.machine.probe.cache import PROBE_SCHEMA, cache_path, cached, save, stale, stored
from autotune.machine.probe.documents import CachedProbe, CpuRecord, Figure, LinkNow, ProbeDoc
from autotune.machine.probe.inventory import GpuRecord, inventory
from autotune.machine.probe.kernels import ALLREDUCE_BYTES, NCCL_ALGOS
from autotune.machine.probe.peaks import check, label
from autotune.units import format_bytes

__all__ = ["PROBE_SCHEMA", "ProbeDoc", "cache_path", "cached", "contended_line", "peak_for",
           "probe", "render", "stale_cache", "summary"]
KERNELS = "autotune.machine.probe.kernels"
Say = Callable[[str], None]


def probe(hw: Hardware, *, refresh: bool = False, workdir: Path | None = None,
          on_step: Say | None = None, allreduce: bool = True) -> ProbeDoc:
    """The machine's probe. The inventory is read every time (NVML, milliseconds; a link can
    retrain); the measurements come from the cache unless ``refresh``, there is none, or it is
    older than the cache's age limit, and are cached when taken, unless taken under load
    (``contended``: used for this run, said through ``on_step`` and in the notes). Then the
    checks. A part that fails to measure is named under ``errors``; the rest still comes
    back."""
    say = on_step or (lambda line: None)
    cpu = _cpu(hw)
    inv = inventory()
    found = _measured(hw, inv["gpus"], refresh, workdir, say, allreduce)
    for g in inv["gpus"]:
        now = found.get("pcie_under_load", {}).get(str(g["index"]))
        if now:
            g["pcie"]["gen"], g["pcie"]["width"] = now["gen"], now["width"]
            g["pcie"]["under_load"] = now["under_load"]
    doc: ProbeDoc = {
        "schema": PROBE_SCHEMA, "cpu": cpu, "gpus": inv["gpus"], "topology": inv["topology"],
        "gpu_note": inv["gpu_note"], "driver_version": inv["driver_version"],
        "cuda_driver_version": inv["cuda_driver_version"], "created": found.get("created"),
        "fingerprint_id": found.get("fingerprint_id"), "seconds": found.get("seconds"),
        "errors": found.get("errors"), "contended": found.get("contended"),
        # Copies: the checks add to each figure, and the cached document stays as measured.
        "figures": {k: v.copy() for k, v in found["figures"].items()},
        "notes": ["NVIDIA GPUs found, but this torch build has no CUDA: their bandwidth and "
                  "matmul peaks were not measured"] if inv["gpus"] and hw.device != "cuda"
        else [],
        "flags": []}
    if doc["contended"]:
        doc["notes"].append(contended_line(doc))
    check(doc)
    return doc


def _cpu(hw: Hardware) -> CpuRecord:
    return {"model": hw.cpu_model, "cores": hw.cpu_cores, "numa_nodes": numa_nodes(),
            "memory_total_bytes": hw.memory_total_bytes, "bf16": hw.cpu_bf16,
            "max_mhz": cpu_max_mhz(), "vendor": hw.cpu_vendor, "family": hw.cpu_family,
            "model_number": hw.cpu_model_number, "stepping": hw.cpu_stepping,
            "isa_flags": list(hw.cpu_flags)}


def _measured(hw: Hardware, gpus: list[GpuRecord], refresh: bool, workdir: Path | None,
              say: Say, allreduce: bool) -> CachedProbe:
    """The cached measurements, else measured now, and cached unless taken under load."""
    found = None if refresh else cached(hw)
    if found is not None:
        return found
    why = None if refresh else stale_cache(hw)
    if why:
        say(f"the cached probe is not used: {why}; measuring again")
    found = _measure(hw, gpus, workdir, say, allreduce)
    if found.get("contended"):
        say("measured under load: not cached (the note says why)")
    else:
        save(hw, found)
    return found


def stale_cache(hw: Hardware) -> str | None:
    """Why this machine's cached probe is not used (too old, or of no readable date); None
    where there is none, or it is fresh."""
    old = stored(hw)
    return stale(old) if old is not None else None


def _measure(hw: Hardware, gpus: list[GpuRecord], workdir: Path | None, say: Say,
             allreduce: bool) -> CachedProbe:
    """The measured part, each in a subprocess: what the cache holds."""
    import tempfile

    from autotune.trial.launch import run_tool  # the only place that starts processes

    start = time.monotonic()
    doc: CachedProbe = {"schema": PROBE_SCHEMA,
                        "created": datetime.now(UTC).isoformat(timespec="seconds"),
                        "fingerprint_id": hw.fingerprint_id(), "figures": {}, "errors": [],
                        "pcie_under_load": {}}
    figures: dict[str, Figure] = doc["figures"]
    errors: list[str] = doc["errors"]
    with tempfile.TemporaryDirectory(prefix="autotune-probe-", dir=workdir) as tmp:
        say("measuring CPU GEMM peaks and memory bandwidth")
        out, why = run_tool([KERNELS, "cpu"], Path(tmp) / "cpu.json",
                            timeout_s=180)
        if out is None:
            errors.append(f"cpu: {why}")
        else:
            figures.update(out["figures"])
            doc["contended"] = out.get("contended")
        if gpus and hw.device == "cuda":
            doc["pcie_under_load"] = _measure_gpus(len(gpus), Path(tmp), say, allreduce,
                                                   figures, errors)
    doc["seconds"] = round(time.monotonic() - start, 1)
    return doc


def _measure_gpus(count: int, tmp: Path, say: Say, allreduce: bool, figures: dict[str, Figure],
                  errors: list[str]) -> dict[str, LinkNow]:
    """The GPUs' figures into ``figures`` (each part that fails into ``errors``); their links
    as read under load."""
    from autotune.trial.launch import run_tool

    under_load: dict[str, LinkNow] = {}
    say(f"measuring {count} GPU(s): copies, memory bandwidth, matmul peaks")
    out, why = run_tool([KERNELS, "gpu"], tmp / "gpu.json", timeout_s=120 + 60 * count)
    if out is None:
        errors.append(f"gpu: {why}")
    else:
        figures.update(out["figures"])
        under_load = out.get("pcie_under_load", {})
    if allreduce and count > 1:
        for algo in NCCL_ALGOS:
            say(f"measuring all-reduce bus bandwidth, NCCL_ALGO={algo}")
            env = {} if algo == "default" else {"NCCL_ALGO": algo}
            out, why = run_tool([KERNELS, "allreduce", algo], tmp / f"allreduce-{algo}.json",
                                timeout_s=180, env=env, nproc=count)
            if out is None:
                errors.append(f"all-reduce {algo}: {why}")
            else:
                figures.update(out["figures"])
    return under_load


def contended_line(doc: ProbeDoc) -> str:
    """What a probe taken under load means, in one line (``doc['contended']`` is why)."""
    return (f"probe taken under load ({doc['contended']}): not cached; numbers may be low "
            "(and MFU high): `autotune probe --refresh` on a quiet machine measures again")


def summary(doc: ProbeDoc, device: str) -> dict[str, Any]:
    """The probe in a few numbers, for the study, the profile and MFU: the matmul peaks of the
    device a study runs on (the slowest GPU's), its memory bandwidth, the slowest pinned copy,
    the best all-reduce bus bandwidth at the largest size, the links and the flags. The keys:
    ``created``, ``peak_tflops`` (by dtype), ``peak_basis``, ``memory_bandwidth_gbs``,
    ``links``, ``flags``, ``contended`` (only when it was), and on CUDA ``h2d_pinned_gbs`` and
    ``allreduce_busbw_gbs``."""
    figs = doc["figures"]

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
        copy = figs.get("cpu.memory_bandwidth")
        memory = copy["value"] if copy else None
        basis = "measured CPU GEMM peak, all cores"
    big = [f["value"] for n, f in figs.items()
           if n.startswith("allreduce.") and int(n.split(".")[2]) == max(ALLREDUCE_BYTES)]
    out = {"created": doc.get("created"), "peak_tflops": {k: v for k, v in peaks.items() if v},
           "peak_basis": basis, "memory_bandwidth_gbs": memory,
           "links": [_link_line(g) for g in doc.get("gpus", [])] if device == "cuda" else [],
           "flags": list(doc.get("flags", []))}
    if doc.get("contended"):
        out["contended"] = doc["contended"]  # its peaks may be low: MFU read against them, high
    if device == "cuda":
        out["h2d_pinned_gbs"] = lowest("h2d_pinned")
        out["allreduce_busbw_gbs"] = max(big) if big else None
    return out


def peak_for(summary_: Mapping[str, object] | None, amp: str, device: str) -> float | None:
    """The measured peak (TFLOP/s) a trial's math runs against: bf16 or fp16 under autocast,
    else fp32 (trials leave TF32 off, PyTorch's default for matmuls). ``summary_`` is
    ``summary``'s, as a study stores it (read back, so checked here)."""
    if not summary_:
        return None
    dtype = amp if amp in ("bf16", "fp16") else "fp32"
    peaks = summary_.get("peak_tflops")
    value = peaks.get(dtype) if isinstance(peaks, Mapping) else None
    return float(value) if isinstance(value, int | float | str) and value else None


def _link_line(g: GpuRecord) -> str:
    p, links = g.get("pcie") or {}, (g.get("nvlink") or {}).get("links")
    pcie = f"PCIe Gen{p.get('gen')} x{p.get('width')}" if p.get("gen") else "PCIe unknown"
    return f"GPU {g['index']}: {pcie}" + (f", {links} NVLink" if links else "")


def render(doc: ProbeDoc) -> list[str]:
    """``autotune probe``'s human output."""
    c = doc["cpu"]
    family = f" (family {c['family']} model {c['model_number']})" \
        if c.get("family") is not None and c.get("model_number") is not None else ""
    lines = [f"CPU     {c['model']}{family}, {c['cores']} cores, {c['numa_nodes']} NUMA node(s), "
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
        share = f.get("share")
        against = (f"  {100 * share:.0f}% of {f['peak']:g} ({f['basis']})"
                   if share is not None else f"  ({f['basis']})" if f.get("basis") else "")
        lines.append(f"{'LOW' if f.get('low') else 'measured':9s}{label(name)}: "
                     f"{f['value']:g} {f['unit']}{against}")
    lines += [f"flag    {line}" for line in doc.get("flags", [])]
    lines += [f"note    {line}" for line in doc.get("notes", [])]
    lines += [f"error   {line}" for line in doc.get("errors") or []]
    return lines
