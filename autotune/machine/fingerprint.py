"""The fingerprint: what makes a measurement valid elsewhere (accelerators and their links, the CPU
and its identity, memory, driver, CUDA, NCCL, torch and autotune versions), as studies and profiles
store it; and reading a stored one back: in words, and against this machine's.

A stored fingerprint is data from a file or a study, possibly written by an earlier autotune that
recorded fewer fields: the readers here take any mapping and check what they use.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NotRequired, TypedDict

import autotune
from autotune.machine.cpu import BF16_FLAGS

if TYPE_CHECKING:
    from autotune.machine.hardware import GPU, Hardware

# What the fingerprint gained to tell CPUs apart: a study or profile stored by an earlier
# autotune lacks these fields, and so cannot say whether this machine has its CPU.
CPU_IDENTITY = ("cpu_vendor", "cpu_family", "cpu_model_number", "cpu_stepping", "cpu_flags")
CPU_IDENTITY_WORDS = {"cpu_vendor": "vendor", "cpu_family": "family",
                      "cpu_model_number": "model", "cpu_stepping": "stepping",
                      "cpu_flags": "ISA flags"}


class GpuFingerprint(TypedDict):
    """One GPU in the fingerprint; the link fields only where NVML reported them."""

    name: str
    memory_total_bytes: int
    compute_capability: list[int]
    pcie_max: NotRequired[str]  # "Gen4 x16": the best link this GPU can train in its slot
    nvlink_links: NotRequired[int]


class Fingerprint(TypedDict):
    """The fingerprint as this autotune writes it. Excludes what changes minute to minute."""

    device: str
    gpus: list[GpuFingerprint]
    gpu_count: int
    cpu_model: str
    cpu_vendor: str | None
    cpu_family: int | None
    cpu_model_number: int | None
    cpu_stepping: int | None
    cpu_flags: list[str]
    cpu_cores: int
    memory_total_gib: int
    driver_version: str | None
    cuda_version: str | None
    nccl_version: str | None
    torch_version: str
    autotune_version: str


def _gpu(g: GPU) -> GpuFingerprint:
    entry: GpuFingerprint = {"name": g.name, "memory_total_bytes": g.memory_total_bytes,
                             "compute_capability": list(g.compute_capability)}
    # The interconnect: a Gen4 x8 slot or missing NVLink changes every number.
    if g.pcie_max_gen:
        entry["pcie_max"] = f"Gen{g.pcie_max_gen} x{g.pcie_max_width}"
    if g.nvlink_links is not None:
        entry["nvlink_links"] = g.nvlink_links
    return entry


def fingerprint_of(hw: Hardware) -> Fingerprint:
    """What makes a measurement on ``hw`` valid elsewhere."""
    return {
        "device": hw.device,
        "gpus": [_gpu(g) for g in hw.gpus],
        "gpu_count": len(hw.gpus),
        "cpu_model": hw.cpu_model,
        "cpu_vendor": hw.cpu_vendor,
        "cpu_family": hw.cpu_family,
        "cpu_model_number": hw.cpu_model_number,
        "cpu_stepping": hw.cpu_stepping,
        "cpu_flags": list(hw.cpu_flags),
        "cpu_cores": hw.cpu_cores,
        "memory_total_gib": round(hw.memory_total_bytes / 2**30),
        "driver_version": hw.driver_version,
        "cuda_version": hw.cuda_version,
        "nccl_version": hw.nccl_version,
        "torch_version": hw.torch_version,
        "autotune_version": autotune.__version__,
    }


def fingerprint_id(fp: Mapping[str, object]) -> str:
    """A short name for a fingerprint: the same fields and values give the same name."""
    blob = json.dumps(fp, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:8]


def family_model(family: object, model: object) -> str:
    """`` (family 25 model 17)``, or nothing where either is unknown."""
    return f" (family {family} model {model})" if family is not None and model is not None \
        else ""


def describe_fingerprint(fp: Mapping[str, object]) -> str:
    """Where a study or profile was measured, in a few words, from its stored fingerprint: on
    a CPU with the family and model that tell one "AMD EPYC" from another, where recorded."""
    gpus = fp.get("gpus")
    if gpus:
        first = gpus[0] if isinstance(gpus, list) else None
        name = first.get("name") if isinstance(first, Mapping) else None
        return f"{fp.get('gpu_count')} x {name}"
    flags = fp.get("cpu_flags")  # absent (an earlier autotune) or empty (unread): not said
    have = set(flags) if isinstance(flags, list | tuple) else set()
    bf16 = "" if not flags else ", bf16" if have & BF16_FLAGS else ", no native bf16"
    where = family_model(fp.get("cpu_family"), fp.get("cpu_model_number"))
    return f"CPU {fp.get('cpu_model')}{where}, {fp.get('cpu_cores')} cores{bf16}"


@dataclass(frozen=True)
class FingerprintMatch:
    """A stored fingerprint against this machine's."""

    differs: list[str]  # ``field: A vs B here``, for each field that differs
    unverified: list[str]  # CPU_IDENTITY fields this machine has and the stored one predates

    @property
    def same(self) -> bool:
        """Every field both record matches, and the stored one lacks nothing else."""
        return not self.differs

    def unverified_words(self) -> str:
        """What could not be checked, in words: ``family, model, ISA flags``."""
        return ", ".join(CPU_IDENTITY_WORDS[k] for k in self.unverified)


def compare_fingerprints(stored: Mapping[str, object],
                         here: Mapping[str, object]) -> FingerprintMatch:
    """Fields present in both must match; a field in one only differs, except the CPU's
    identity fields missing from ``stored`` (recorded by an earlier autotune): those are
    ``unverified``, and the caller decides (a study resumes with a warning when nothing
    differs, docs/probe.md)."""
    unverified = [k for k in CPU_IDENTITY if k in here and k not in stored]
    keys = sorted((set(stored) | set(here)) - set(unverified))
    return FingerprintMatch(
        differs=[f"{k}: {stored.get(k)!r} vs {here.get(k)!r} here" for k in keys
                 if stored.get(k) != here.get(k)],
        unverified=unverified)
