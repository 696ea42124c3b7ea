"""When a knob, or one of its values, does not apply to the hardware at hand, and why.

Each rule reads what the machine room detected (a ``Machine``: ``machine.hardware.Hardware``
has these fields; config, being pure, names only what it reads) and the number of ranks, never the
machine itself, and returns the reason in words, or None where the knob or value can run. Torch's
abilities are read from its version, so narrowing a space never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from autotune.config.knobs import Config


class Device(Protocol):
    """A GPU as the rules read it."""

    @property
    def compute_capability(self) -> tuple[int, int]: ...


class Machine(Protocol):
    """What the rules read of the machine the machine room detected."""

    @property
    def device(self) -> str: ...  # "cuda" or "cpu"
    @property
    def gpus(self) -> Sequence[Device]: ...
    @property
    def cpu_cores(self) -> int: ...
    @property
    def torch_version(self) -> str: ...
    @property
    def nccl_version(self) -> str | None: ...
    @property
    def cpp_compiler(self) -> str | None: ...
    @property
    def flash_attn(self) -> bool: ...
    @property
    def supports_bf16(self) -> bool: ...
    @property
    def supports_fp16(self) -> bool: ...


# Why a whole knob does not apply here, or None.
Applies = Callable[[Machine, int], "str | None"]
# Why one value of a knob cannot run here, or None.
ValueOk = Callable[[object, Machine, int], "str | None"]

# DistributedDataParallel's optional arguments, each with the first torch release that takes it.
DDP_ARGUMENTS = {"gradient_as_bucket_view": (1, 7), "static_graph": (1, 11)}


def version(text: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> ``(2, 13)``."""
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit())


def torch_takes(argument: str, torch_version: str) -> bool:
    """Whether DDP in torch ``torch_version`` (``2.13.0+cpu``) takes ``argument``: read from
    the version, so narrowing a space never imports torch."""
    return version(torch_version) >= DDP_ARGUMENTS[argument]


def always(hw: Machine, world_size: int) -> str | None:
    """The knob applies everywhere."""
    return None


def any_value(value: object, hw: Machine, world_size: int) -> str | None:
    """Every value of the knob can run everywhere."""
    return None


def nccl_version_ok(table: dict[str, tuple[int, int]], variable: str) -> ValueOk:
    """A value NCCL in use does not know would fail every trial: drop it, saying why."""

    def check(value: object, hw: Machine, world_size: int) -> str | None:
        if value == "default" or not hw.nccl_version or not isinstance(value, str):
            return None
        have = tuple(int(x) for x in hw.nccl_version.split(".")[:2] if x.isdigit())
        for name in value.split(","):
            need = table[name]
            if have < need:
                return (f"{variable}={name} needs NCCL >= {need[0]}.{need[1]}; this torch has "
                        f"NCCL {hw.nccl_version}")
        return None

    return check


def needs_ranks(hw: Machine, world_size: int) -> str | None:
    """DDP's knobs need several ranks."""
    if world_size <= 1:
        return "DDP is only used with more than one rank (world size 1)"
    return None


def needs_nccl(hw: Machine, world_size: int) -> str | None:
    """NCCL's knobs need CUDA GPUs and several ranks."""
    if hw.device != "cuda":
        return "NCCL knobs need the nccl backend (no CUDA GPU here)"
    if world_size <= 1:
        return "NCCL knobs need more than one rank (world size 1)"
    return None


def needs_ddp_argument(argument: str) -> Applies:
    """A DDP knob that this torch's DistributedDataParallel must take as an argument."""

    def check(hw: Machine, world_size: int) -> str | None:
        if world_size <= 1:
            return "DDP is only used with more than one rank (world size 1)"
        if not torch_takes(argument, hw.torch_version):
            return f"this torch's DistributedDataParallel has no {argument} argument"
        return None

    return check


def sharding_applies(hw: Machine, world_size: int) -> str | None:
    """Sharding splits the model over several ranks."""
    if world_size <= 1:
        return "sharding splits the model over ranks: one rank holds it whole (world size 1)"
    return None


def offload_applies(hw: Machine, world_size: int) -> str | None:
    """FSDP's CPU offload moves GPU memory to the host: on a CPU there is nothing to move."""
    if hw.device != "cuda":
        return "CPU offload moves GPU memory to the host (no CUDA GPU here: it is there already)"
    return sharding_applies(hw, world_size)


def sharding_value(value: object, nodes: int) -> str | None:
    """Hybrid sharding shards within a node and replicates across nodes: it needs several."""
    if value == "hybrid-shard" and nodes <= 1:
        return ("hybrid-shard shards within a node and replicates across nodes: one node here "
                "(pass --nnodes N)")
    return None


def malloc_applies(hw: Machine, world_size: int) -> str | None:
    """Retaining freed host memory matters where the model's tensors live in it: on a CPU."""
    if hw.device != "cpu":
        return "malloc_retain keeps freed host memory: the model's tensors live on the GPU"
    return None


def needs_gpu(hw: Machine, world_size: int) -> str | None:
    """pin_memory helps only host-to-GPU copies."""
    if hw.device != "cuda":
        return "pin_memory only speeds up host-to-GPU copies (no CUDA GPU here)"
    return None


def amp_value(value: object, hw: Machine, world_size: int) -> str | None:
    """fp16 and bf16 need a device that trains in them natively."""
    if value == "fp16" and not hw.supports_fp16:
        return "fp16 autocast is not a training precision on this device"
    if value == "bf16" and not hw.supports_bf16:
        if hw.device == "cuda":
            return "bf16 needs compute capability >= 8.0"
        return "this CPU has no native bf16 (avx512_bf16 or amx_bf16); it would be emulated"
    return None


def workers_value(value: object, hw: Machine, world_size: int) -> str | None:
    """Loader workers of all ranks fit the CPU cores."""
    if isinstance(value, int) and value * world_size > hw.cpu_cores:
        return f"{value} workers x {world_size} rank(s) exceed the {hw.cpu_cores} CPU cores"
    return None


def compile_applies(hw: Machine, world_size: int) -> str | None:
    """torch.compile on a CPU builds C++."""
    if hw.device == "cpu" and not hw.cpp_compiler:
        return "torch.compile on a CPU needs a C++ compiler (none found: install g++)"
    return None


def compile_value(value: object, hw: Machine, world_size: int) -> str | None:
    """CUDA graphs need CUDA."""
    if value == "reduce-overhead" and hw.device != "cuda":
        return "reduce-overhead uses CUDA graphs (no CUDA GPU here)"
    return None


def tf32_applies(hw: Machine, world_size: int) -> str | None:
    """TF32 needs NVIDIA GPUs of compute capability 8.0 or more."""
    if hw.device != "cuda":
        return "TF32 matmuls need an NVIDIA GPU (no CUDA GPU here)"
    if not all(g.compute_capability >= (8, 0) for g in hw.gpus):
        return "TF32 needs compute capability >= 8.0"
    return None


def optimizer_value(value: object, hw: Machine, world_size: int) -> str | None:
    """An implementation that is torch's default here adds nothing; fused on a CPU needs 2.4."""
    if value == {"cpu": "for-loop", "cuda": "foreach"}.get(hw.device):
        return f"what torch's default already does on this device ({hw.device})"
    if value == "fused" and hw.device == "cpu" and version(hw.torch_version) < (2, 4):
        return f"a fused optimizer on the CPU needs torch >= 2.4 (this is {hw.torch_version})"
    return None


def attention_value(value: object, hw: Machine, world_size: int) -> str | None:
    """flash_attention_2 needs CUDA and the flash-attn package."""
    if value == "flash_attention_2" and (hw.device != "cuda" or not hw.flash_attn):
        return "flash_attention_2 needs a CUDA GPU and the flash-attn package"
    return None


def threads_value(value: object, hw: Machine, world_size: int) -> str | None:
    """Intra-op threads of all ranks fit the CPU cores, and differ from torch's default."""
    if not isinstance(value, int):
        return None
    # torch's default: one thread per core, but torchrun sets OMP_NUM_THREADS=1 for several
    # ranks per node.
    if value and value == (hw.cpu_cores if world_size == 1 else 1):
        return "torch's default here (0)"
    if value * world_size > hw.cpu_cores:
        return f"{value} threads x {world_size} rank(s) exceed the {hw.cpu_cores} CPU cores"
    return None


def oversubscribed(config: Config, cpu_cores: int) -> str | None:
    """Why a config that sets intra-op threads asks for more CPU cores than the machine has,
    counting its loader workers (each a process of its own) with the threads; None when it
    fits, or leaves the threads to torch."""
    if not config.cpu_threads:
        return None
    need = (config.cpu_threads + config.num_workers) * config.world_size
    if need <= cpu_cores:
        return None
    return (f"oversubscribed: {config.cpu_threads} thread(s) + {config.num_workers} loader "
            f"worker(s) per rank x {config.world_size} rank(s) need {need} cores; this "
            f"machine has {cpu_cores}")
