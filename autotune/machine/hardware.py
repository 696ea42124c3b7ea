"""What this machine is: the fingerprint and the probes behind it.

This is the only module that asks the machine. It never initialises CUDA: GPUs are read through NVML
(``nvidia-ml-py``, module ``pynvml``) and torch attributes that need no CUDA context, so the tuner
process leaves every byte of GPU memory to the trials.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import platform
import re
import socket
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

import autotune
from autotune.machine import nvml


@dataclass(frozen=True)
class GPU:
    index: int  # NVML's index (the physical order, not CUDA_VISIBLE_DEVICES')
    name: str
    memory_total_bytes: int
    compute_capability: tuple[int, int]
    # The fastest PCIe link this GPU can train in this slot (a GPU idles at a lower generation,
    # so the current link is read under load, by the probe), and its active NVLink links.
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None
    nvlink_links: int | None = None


@dataclass(frozen=True)
class Hardware:
    """The devices a study runs on, and the versions a measurement depends on."""

    device: str  # "cuda" or "cpu"
    gpus: tuple[GPU, ...]
    cpu_model: str
    cpu_cores: int
    cpu_bf16: bool
    memory_total_bytes: int
    memory_available_bytes: int
    torch_version: str
    cuda_version: str | None = None
    nccl_version: str | None = None
    driver_version: str | None = None
    notes: tuple[str, ...] = field(default=())
    cpp_compiler: str | None = None  # what torch.compile's CPU backend would build with
    flash_attn: bool = False  # the flash-attn package is installed
    # What tells CPUs of one name apart (a VM calls every AMD CPU "AMD EPYC", Zen 3 to Zen 5,
    # 2x apart in speed): /proc/cpuinfo's vendor, family, model and stepping, and the ISA flags
    # the knobs depend on (isa_flags). None / () where unread, as the test doubles leave them.
    cpu_vendor: str | None = None
    cpu_family: int | None = None
    cpu_model_number: int | None = None
    cpu_stepping: int | None = None
    cpu_flags: tuple[str, ...] = ()

    @property
    def supports_bf16(self) -> bool:
        if self.device == "cuda":
            return all(g.compute_capability >= (8, 0) for g in self.gpus)
        return self.cpu_bf16

    @property
    def supports_fp16(self) -> bool:
        return self.device == "cuda"

    @property
    def device_memory_bytes(self) -> int:
        """Memory one rank may use: the smallest GPU's memory, or the RAM available now on CPU."""
        if self.device == "cuda":
            return min(g.memory_total_bytes for g in self.gpus)
        return self.memory_available_bytes

    @property
    def device_memory_ceiling(self) -> int:
        """The most a memory limit may ask for: GPU memory, or all of the RAM on CPU."""
        if self.device == "cuda":
            return min(g.memory_total_bytes for g in self.gpus)
        return self.memory_total_bytes

    def fingerprint(self) -> dict[str, Any]:
        """What makes a measurement valid elsewhere. Excludes what changes minute to minute."""
        return {
            "device": self.device,
            "gpus": [
                {"name": g.name, "memory_total_bytes": g.memory_total_bytes,
                 "compute_capability": list(g.compute_capability),
                 # The interconnect: a Gen4 x8 slot or missing NVLink changes every number.
                 **({"pcie_max": f"Gen{g.pcie_max_gen} x{g.pcie_max_width}"}
                    if g.pcie_max_gen else {}),
                 **({"nvlink_links": g.nvlink_links} if g.nvlink_links is not None else {})}
                for g in self.gpus
            ],
            "gpu_count": len(self.gpus),
            "cpu_model": self.cpu_model,
            "cpu_vendor": self.cpu_vendor,
            "cpu_family": self.cpu_family,
            "cpu_model_number": self.cpu_model_number,
            "cpu_stepping": self.cpu_stepping,
            "cpu_flags": list(self.cpu_flags),
            "cpu_cores": self.cpu_cores,
            "memory_total_gib": round(self.memory_total_bytes / 2**30),
            "driver_version": self.driver_version,
            "cuda_version": self.cuda_version,
            "nccl_version": self.nccl_version,
            "torch_version": self.torch_version,
            "autotune_version": autotune.__version__,
        }

    def fingerprint_id(self) -> str:
        blob = json.dumps(self.fingerprint(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:8]

    def describe(self) -> str:
        if self.device == "cuda":
            names = {g.name for g in self.gpus}
            return f"{len(self.gpus)} x {', '.join(sorted(names))} (CUDA {self.cuda_version})"
        bf16 = "bf16" if self.cpu_bf16 else "no native bf16"
        return f"CPU {self.cpu_model}{_family_model(self.fingerprint())}, {self.cpu_cores} " \
               f"cores, {bf16}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gpus"] = [asdict(g) for g in self.gpus]
        return data


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


# Native bf16 GEMMs: x86's avx512_bf16 or AMX, Arm's bf16 feature.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def _cpu_info() -> tuple[str, bool]:
    model = _cpuinfo().get("model name") or platform.processor() or platform.machine()
    return model or "unknown", bool(cpu_flags() & BF16_FLAGS)


# The ISA flags a knob's speed depends on: AVX2/FMA and AVX-512 (the fp32 GEMM width, the vector
# ISA Inductor builds for), AMX, VNNI and the bf16 extensions (native bf16 autocast), and on Arm
# bf16, SVE, i8mm, SME. The rest stay out: a hypervisor shows or hides many harmless flags, and
# they would split one machine type into many.
_ISA_FLAG = re.compile(r"avx2|fma|avx512.*|amx.*|avx_vnni.*|avx_ne_convert|"
                       r"bf16|sve.*|i8mm|sme(\d.*|[bfi].*)?")  # not smep: x86's kernel guard


def isa_flags(flags: set[str]) -> tuple[str, ...]:
    """The flags of ``flags`` that decide speed (``_ISA_FLAG``), sorted."""
    return tuple(sorted(f for f in flags if _ISA_FLAG.fullmatch(f)))


def _number(text: str | None) -> int | None:
    """A /proc/cpuinfo number: decimal on x86, ``0x..`` for Arm's implementer and part."""
    try:
        return int(text, 16) if text and text.startswith("0x") else int(text or "")
    except ValueError:
        return None


def cpu_identity() -> dict[str, Any]:
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


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _nvml_gpus() -> tuple[list[GPU], str | None, str | None]:
    """GPUs through NVML; ([], None, reason) when there is no usable NVIDIA driver."""
    try:
        nv = nvml.binding()
    except ImportError:
        return [], None, "nvidia-ml-py is not installed"
    try:
        nv.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [], None, f"no NVIDIA driver ({exc.__class__.__name__})"
    try:
        driver = nvml.text(nv.nvmlSystemGetDriverVersion())
        gpus = []
        for i in nvml.visible_indices(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(handle).total
            cc = tuple(nv.nvmlDeviceGetCudaComputeCapability(handle))
            gen = nvml.call(nv.nvmlDeviceGetMaxPcieLinkGeneration, handle)
            width = nvml.call(nv.nvmlDeviceGetMaxPcieLinkWidth, handle)
            gpus.append(GPU(index=i, name=nvml.text(nv.nvmlDeviceGetName(handle)),
                            memory_total_bytes=int(mem),
                            compute_capability=(int(cc[0]), int(cc[1])),
                            pcie_max_gen=int(gen) if gen else None,
                            pcie_max_width=int(width) if width else None,
                            nvlink_links=nvml.nvlink_links(nv, handle)))
        return gpus, driver, None
    except Exception as exc:  # a GPU lost mid-read: the run goes on the CPU and says why
        return [], None, f"NVML failed while reading the GPUs ({type(exc).__name__}: {exc})"
    finally:
        nv.nvmlShutdown()


def torch_build() -> tuple[str, str | None]:
    """torch's version and the CUDA it was built for (None for a CPU build), read from the
    installed ``torch/version.py`` without importing torch: planning trials needs no torch, and
    importing it costs every ``autotune`` command a second or more. Imported only when that file
    cannot be read."""
    if "torch" not in sys.modules:
        try:
            spec = importlib.util.find_spec("torch")
            folders = list(spec.submodule_search_locations or []) if spec else []
            found: dict[str, Any] = {}
            for node in ast.parse((Path(folders[0]) / "version.py").read_text()).body:
                if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                    target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                    if isinstance(target, ast.Name) and target.id in ("__version__", "cuda"):
                        found[target.id] = ast.literal_eval(node.value)
            if isinstance(found.get("__version__"), str):
                return found["__version__"], found.get("cuda")
        except (ImportError, IndexError, OSError, SyntaxError, ValueError):
            pass
    import torch

    return str(torch.__version__), torch.version.cuda


def detect() -> Hardware:
    """Read this machine without initialising CUDA (and without importing torch on a machine
    with no NVIDIA GPU)."""
    cpu_model, cpu_bf16 = _cpu_info()
    identity = cpu_identity()
    mem = psutil.virtual_memory()
    notes: list[str] = []
    gpus, driver, why_not = _nvml_gpus()
    torch_version, cuda_version = torch_build()
    if gpus and cuda_version is None:
        notes.append("NVIDIA GPUs found but this torch build has no CUDA; tuning on the CPU")
        gpus = []
    elif not gpus and why_not:
        notes.append(why_not)
    nccl = None
    if gpus:
        try:
            import torch

            # Reads the linked library's version; does not create a CUDA context.
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception:
            nccl = None
    return Hardware(
        device="cuda" if gpus else "cpu",
        gpus=tuple(gpus),
        cpu_model=cpu_model,
        cpu_cores=_cpu_cores(),
        cpu_bf16=cpu_bf16,
        memory_total_bytes=int(mem.total),
        memory_available_bytes=int(mem.available),
        torch_version=torch_version,
        cuda_version=cuda_version if gpus else None,
        nccl_version=nccl,
        driver_version=driver,
        notes=tuple(notes),
        cpp_compiler=_cpp_compiler(),
        flash_attn=importlib.util.find_spec("flash_attn") is not None,
        **identity,
    )


def _cpp_compiler() -> str | None:
    """The C++ compiler Inductor's CPU backend finds ($CXX, else g++ or clang++ on PATH)."""
    import shutil

    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def describe_fingerprint(fp: dict[str, Any]) -> str:
    """Where a study or profile was measured, in a few words, from its stored fingerprint: on
    a CPU with the family and model that tell one "AMD EPYC" from another, where recorded."""
    if fp.get("gpus"):
        return f"{fp.get('gpu_count')} x {fp['gpus'][0]['name']}"
    flags = fp.get("cpu_flags")  # absent (an earlier autotune) or empty (unread): not said
    bf16 = "" if not flags else ", bf16" if set(flags) & BF16_FLAGS else ", no native bf16"
    return f"CPU {fp.get('cpu_model')}{_family_model(fp)}, {fp.get('cpu_cores')} cores{bf16}"


def _family_model(fp: dict[str, Any]) -> str:
    family, model = fp.get("cpu_family"), fp.get("cpu_model_number")
    return f" (family {family} model {model})" if family is not None and model is not None \
        else ""


# What the fingerprint gained to tell CPUs apart: a study or profile stored by an earlier
# autotune lacks these fields, and so cannot say whether this machine has its CPU.
CPU_IDENTITY = ("cpu_vendor", "cpu_family", "cpu_model_number", "cpu_stepping", "cpu_flags")
CPU_IDENTITY_WORDS = {"cpu_vendor": "vendor", "cpu_family": "family",
                      "cpu_model_number": "model", "cpu_stepping": "stepping",
                      "cpu_flags": "ISA flags"}


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


def compare_fingerprints(stored: dict[str, Any], here: dict[str, Any]) -> FingerprintMatch:
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


def process_identity() -> dict[str, Any]:
    """This process on this machine: host, pid and start time (a pid alone can be reused)."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": psutil.Process().create_time()}


def process_alive(identity: dict[str, Any]) -> bool:
    """Whether the process of ``identity`` (from this host) still runs; unknown counts as alive."""
    pid, started = identity.get("pid"), identity.get("started")
    if not isinstance(pid, int):
        return True  # leave it to the heartbeat
    try:
        return abs(psutil.Process(pid).create_time() - float(started or 0)) < 1.0
    except (psutil.Error, TypeError, ValueError):
        return False


def hostname() -> str:
    return socket.gethostname()
