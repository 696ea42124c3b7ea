"""Know the machine: ``autotune probe``, its figures, and the cache ``autotune run`` reads.

Four parts, each in its own module:
  inventory  in this process, through NVML only (no CUDA context): GPUs, links, topology;
  kernels    measured in subprocesses: CPU GEMM and copy bandwidth; per GPU copies, memory
             bandwidth and matmul peaks; all-reduce bus bandwidth per NCCL algorithm;
  peaks      each measured figure against the theoretical peak of its link or device, flagged
             when below ``LOW_SHARE`` of it; degraded PCIe links named;
  cache      the measurements per hardware fingerprint, so a machine is probed once (and again
             after ``MAX_AGE_DAYS``).
This module puts them together (``probe``), and gives a study its summary and MFU peaks. A probe
taken under load (``kernels.contended``) is used, marked ``contended`` and never cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from autotune.machine.hardware import Hardware, cpu_max_mhz, numa_nodes
from autotune.machine.probe.cache import PROBE_SCHEMA, cache_path, cached, save, stale, stored
from autotune.machine.probe.inventory import inventory
from autotune.machine.probe.kernels import ALLREDUCE_BYTES, NCCL_ALGOS
from autotune.machine.probe.peaks import check, label
from autotune.units import format_bytes

__all__ = ["PROBE_SCHEMA", "cache_path", "cached", "contended_line", "peak_for", "probe",
           "render", "stale_cache", "summary"]
KERNELS = "autotune.machine.probe.kernels"


def probe(hw: Hardware, *, refresh: bool = False, workdir: Path | None = None,
          on_step: Callable[[str], None] | None = None, allreduce: bool = True) -> dict[str, Any]:
    """The machine's probe. The inventory is read every time (NVML, milliseconds; a link can
    retrain); the measurements come from the cache unless ``refresh``, there is none, or it is
    older than the cache's age limit, and are cached when taken, unless taken under load
    (``contended``: used for this run, said through ``on_step`` and in the notes). Then the
    checks. A part that fails to measure is named under ``errors``; the rest still comes
    back."""
    say = on_step or (lambda line: None)
    doc: dict[str, Any] = {"schema": PROBE_SCHEMA}
    doc["cpu"] = {"model": hw.cpu_model, "cores": hw.cpu_cores, "numa_nodes": numa_nodes(),
                  "memory_total_bytes": hw.memory_total_bytes, "bf16": hw.cpu_bf16,
                  "max_mhz": cpu_max_mhz(), "vendor": hw.cpu_vendor, "family": hw.cpu_family,
                  "model_number": hw.cpu_model_number, "stepping": hw.cpu_stepping,
                  "isa_flags": list(hw.cpu_flags)}
    doc.update(inventory())
    found = None if refresh else cached(hw)
    if found is None:
        why = None if refresh else stale_cache(hw)
        if why:
            say(f"the cached probe is not used: {why}; measuring again")
        found = _measure(hw, doc["gpus"], workdir, say, allreduce)
        if found.get("contended"):
            say("measured under load: not cached (the note says why)")
        else:
            save(hw, found)
    for key in ("created", "fingerprint_id", "seconds", "errors"):
        doc[key] = found.get(key)
    doc["contended"] = found.get("contended")
    doc["figures"] = {k: dict(v) for k, v in found.get("figures", {}).items()}
    for g in doc["gpus"]:
        g["pcie"].update(found.get("pcie_under_load", {}).get(str(g["index"]), {}))
    doc["notes"] = ["NVIDIA GPUs found, but this torch build has no CUDA: their bandwidth and "
                    "matmul peaks were not measured"] if doc["gpus"] and hw.device != "cuda" \
        else []
    if doc["contended"]:
        doc["notes"].append(contended_line(doc))
    doc["flags"] = []
    check(doc)
    return doc


def stale_cache(hw: Hardware) -> str | None:
    """Why this machine's cached probe is not used (too old, or of no readable date); None
    where there is none, or it is fresh."""
    old = stored(hw)
    return stale(old) if old is not None else None


def _measure(hw: Hardware, gpus: list[dict[str, Any]], workdir: Path | None,
             say: Callable[[str], None], allreduce: bool) -> dict[str, Any]:
    """The measured part, each in a subprocess: what the cache holds."""
    import tempfile

    from autotune.trial.launch import run_tool  # the only place that starts processes

    start = time.monotonic()
    doc: dict[str, Any] = {"schema": PROBE_SCHEMA,
                           "created": datetime.now(UTC).isoformat(timespec="seconds"),
                           "fingerprint_id": hw.fingerprint_id(), "figures": {}, "errors": [],
                           "pcie_under_load": {}}
    with tempfile.TemporaryDirectory(prefix="autotune-probe-", dir=workdir) as tmp:
        say("measuring CPU GEMM peaks and memory bandwidth")
        out, why = run_tool([KERNELS, "cpu"], Path(tmp) / "cpu.json",
                            timeout_s=180)
        if out is None:
            doc["errors"].append(f"cpu: {why}")
        else:
            doc["figures"].update(out["figures"])
            doc["contended"] = out.get("contended")
        if gpus and hw.device == "cuda":
            say(f"measuring {len(gpus)} GPU(s): copies, memory bandwidth, matmul peaks")
            out, why = run_tool([KERNELS, "gpu"], Path(tmp) / "gpu.json",
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
                    out, why = run_tool([KERNELS, "allreduce", algo],
                                        Path(tmp) / f"allreduce-{algo}.json", timeout_s=180,
                                        env=env, nproc=len(gpus))
                    if out is None:
                        doc["errors"].append(f"all-reduce {algo}: {why}")
                    else:
                        doc["figures"].update(out["figures"])
    doc["seconds"] = round(time.monotonic() - start, 1)
    return doc


def contended_line(doc: dict[str, Any]) -> str:
    """What a probe taken under load means, in one line (``doc['contended']`` is why)."""
    return (f"probe taken under load ({doc['contended']}): not cached; numbers may be low "
            "(and MFU high): `autotune probe --refresh` on a quiet machine measures again")


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
    if doc.get("contended"):
        out["contended"] = doc["contended"]  # its peaks may be low: MFU read against them, high
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
        against = (f"  {100 * f['share']:.0f}% of {f['peak']:g} ({f['basis']})"
                   if f.get("share") is not None else f"  ({f['basis']})" if f.get("basis")
                   else "")
        lines.append(f"{'LOW' if f.get('low') else 'measured':9s}{label(name)}: "
                     f"{f['value']:g} {f['unit']}{against}")
    lines += [f"flag    {line}" for line in doc.get("flags", [])]
    lines += [f"note    {line}" for line in doc.get("notes", [])]
    lines += [f"error   {line}" for line in doc.get("errors", [])]
    return lines
