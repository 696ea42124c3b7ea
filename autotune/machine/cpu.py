"""This machine's CPU, read from /proc and /sys: its name, the identity that tells CPUs of one name
apart (vendor, family, model, stepping, the ISA flags that decide speed), its clock, cores and NUMA
nodes. Each reader returns None, or an empty value, where the kernel does not say.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import TypedDict

# Native bf16 GEMMs: x86's avx512_bf16 or AMX, Arm's bf16 feature.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})

# The ISA flags a knob's speed depends on: AVX2/FMA and AVX-512 (the fp32 GEMM width, the vector
# ISA Inductor builds for), AMX, VNNI and the bf16 extensions (native bf16 autocast), and on Arm
# bf16, SVE, i8mm, SME. The rest stay out: a hypervisor shows or hides many harmless flags, and
# they would split one machine type into many.
_ISA_FLAG = re.compile(r"avx2|fma|avx512.*|amx.*|avx_vnni.*|avx_ne_convert|"
                       r"bf16|sve.*|i8mm|sme(\d.*|[bfi].*)?")  # not smep: x86's kernel guard


class CpuIdentity(TypedDict):
    """What tells CPUs of one name apart, as ``Hardware`` and the fingerprint hold it."""

    cpu_vendor: str | None
    cpu_family: int | None
    cpu_model_number: int | None
    cpu_stepping: int | None
    cpu_flags: tuple[str, ...]


def _cpuinfo() -> dict[str, str]:
    """/proc/cpuinfo's fields as the first processor lists them; empty where unreadable."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block
                key, _, value = line.partition(":")
                found.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return found


def cpu_model_and_bf16() -> tuple[str, bool]:
    """The CPU's name, and whether it has native bf16 GEMMs (``BF16_FLAGS``)."""
    model = _cpuinfo().get("model name") or platform.processor() or platform.machine()
    return model or "unknown", bool(cpu_flags() & BF16_FLAGS)


def isa_flags(flags: set[str]) -> tuple[str, ...]:
    """The flags of ``flags`` that decide speed (``_ISA_FLAG``), sorted."""
    return tuple(sorted(f for f in flags if _ISA_FLAG.fullmatch(f)))


def _number(text: str | None) -> int | None:
    """A /proc/cpuinfo number: decimal on x86, ``0x..`` for Arm's implementer and part."""
    try:
        return int(text, 16) if text and text.startswith("0x") else int(text or "")
    except ValueError:
        return None


def cpu_identity() -> CpuIdentity:
    """This CPU's vendor, family, model number, stepping (x86; on Arm the implementer,
    architecture, part and revision) and ISA flags, as the fingerprint holds them."""
    info = _cpuinfo()
    return {"cpu_vendor": info.get("vendor_id") or info.get("CPU implementer"),
            "cpu_family": _number(info.get("cpu family") or info.get("CPU architecture")),
            "cpu_model_number": _number(info.get("model") or info.get("CPU part")),
            "cpu_stepping": _number(info.get("stepping") or info.get("CPU revision")),
            "cpu_flags": isa_flags(cpu_flags())}


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``avx512f``, ``amx_bf16``, ...), empty where unreadable."""
    info = _cpuinfo()
    return set((info.get("flags") or info.get("Features") or "").split())


def cpu_vendor_family() -> tuple[str | None, int | None]:
    """``vendor_id`` and ``cpu family`` (``AuthenticAMD``, 25), None where unreadable: what
    tells a Zen 4 (AVX-512 on 256-bit units) from a Zen 5."""
    info = _cpuinfo()
    family = info.get("cpu family", "")
    return info.get("vendor_id"), int(family) if family.isdigit() else None


def cpu_max_mhz() -> float | None:
    """The CPU's top clock: cpufreq's maximum, else what /proc/cpuinfo reports (a VM's nominal)."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1e3
    except (OSError, ValueError):
        pass
    try:
        return float(_cpuinfo()["cpu MHz"])
    except (KeyError, ValueError):
        return None


def numa_nodes() -> int:
    """NUMA nodes with CPUs or memory (1 where the kernel does not say)."""
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return len(nodes) or 1


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
