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
        return f"CPU {self.cpu_model}, {self.cpu_cores} cores, {bf16}"

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


def _cpu_info() -> tuple[str, bool]:
    model = _cpuinfo().get("model name") or platform.processor() or platform.machine()
    # x86: avx512_bf16 or AMX; Arm: the bf16 feature flag.
    bf16 = bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})
    return model or "unknown", bf16


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
    )


def _cpp_compiler() -> str | None:
    """The C++ compiler Inductor's CPU backend finds ($CXX, else g++ or clang++ on PATH)."""
    import shutil

    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def describe_fingerprint(fp: dict[str, Any]) -> str:
    """Where a study or profile was measured, in a few words, from its stored fingerprint."""
    if fp.get("gpus"):
        return f"{fp.get('gpu_count')} x {fp['gpus'][0]['name']}"
    return f"CPU {fp.get('cpu_model')}, {fp.get('cpu_cores')} cores"


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
