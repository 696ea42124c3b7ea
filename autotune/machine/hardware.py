"""What this machine is: the ``Hardware`` record the other rooms read, and ``detect()``, which
fills it in.

The machine room is the only one that asks the machine. It never initialises CUDA: GPUs are read
through NVML (``nvidia-ml-py``, module ``pynvml``) and torch attributes that need no CUDA context,
so the tuner process leaves every byte of GPU memory to the trials. The CPU is read in ``cpu.py``,
the fingerprint built and compared in ``fingerprint.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from autotune.machine import nvml
from autotune.machine.cpu import (
    BF16_FLAGS,
    cpu_cores,
    cpu_flags,
    cpu_identity,
    cpu_max_mhz,
    cpu_model_and_bf16,
    cpu_vendor_family,
    isa_flags,
    numa_nodes,
)
from autotune.machine.fingerprint import (
    CPU_IDENTITY,
    CPU_IDENTITY_WORDS,
    FingerprintMatch,
    compare_fingerprints,
    describe_fingerprint,
    family_model,
    fingerprint_id,
    fingerprint_of,
)
from autotune.machine.host import hostname, process_alive, process_identity

# Names other modules import from here; the CPU's readers live in cpu.py, the fingerprint's in
# fingerprint.py, this process's identity in host.py.
__all__ = ["BF16_FLAGS", "CPU_IDENTITY", "CPU_IDENTITY_WORDS", "GPU", "FingerprintMatch",
           "Hardware", "compare_fingerprints", "cpu_flags", "cpu_identity", "cpu_max_mhz",
           "cpu_vendor_family", "describe_fingerprint", "detect", "hostname", "isa_flags",
           "numa_nodes", "process_alive", "process_identity", "torch_build"]


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
        """What makes a measurement valid elsewhere (``fingerprint.Fingerprint``'s fields),
        as the plain dict a study or profile stores."""
        return dict(fingerprint_of(self))

    def fingerprint_id(self) -> str:
        return fingerprint_id(fingerprint_of(self))

    def describe(self) -> str:
        if self.device == "cuda":
            names = {g.name for g in self.gpus}
            return f"{len(self.gpus)} x {', '.join(sorted(names))} (CUDA {self.cuda_version})"
        bf16 = "bf16" if self.cpu_bf16 else "no native bf16"
        where = family_model(self.cpu_family, self.cpu_model_number)
        return f"CPU {self.cpu_model}{where}, {self.cpu_cores} cores, {bf16}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gpus"] = [asdict(g) for g in self.gpus]
        return data


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
            found: dict[str, object] = {}
            for node in ast.parse((Path(folders[0]) / "version.py").read_text()).body:
                if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                    target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                    if isinstance(target, ast.Name) and target.id in ("__version__", "cuda"):
                        found[target.id] = ast.literal_eval(node.value)
            version, cuda = found.get("__version__"), found.get("cuda")
            if isinstance(version, str):
                return version, cuda if isinstance(cuda, str) else None
        except (ImportError, IndexError, OSError, SyntaxError, ValueError):
            pass
    import torch

    return str(torch.__version__), torch.version.cuda


def detect() -> Hardware:
    """Read this machine without initialising CUDA (and without importing torch on a machine
    with no NVIDIA GPU)."""
    cpu_model, cpu_bf16 = cpu_model_and_bf16()
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
        cpu_cores=cpu_cores(),
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
