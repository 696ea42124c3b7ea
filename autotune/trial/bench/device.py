"""The device side of a trial: batches moved to it, an endless stream of them, and the peak
memory the trial reports (CUDA's reserved peak plus what NVML sees, or peak RSS on CPU)."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from typing import Any


def to_device(batch: Any, device: Any, non_blocking: bool) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


class Memory:
    """Peak memory of this process: CUDA reserved plus the context NVML sees, or peak RSS on CPU."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.source = "cuda_max_reserved+nvml_overhead" if device.type == "cuda" else "ru_maxrss"

    def reset(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        import torch

        if self.device.type != "cuda":
            # ru_maxrss is in KiB on Linux. Loader workers are separate processes: the tuner
            # samples the whole process tree and takes the larger figure.
            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        reserved_peak = int(torch.cuda.max_memory_reserved(self.device))
        # NVML counts what the caching allocator cannot see: the CUDA context, cuBLAS workspaces,
        # NCCL buffers. Add the part of NVML's figure that is not reserved memory right now.
        used = _nvml_process_bytes(self.device)
        overhead = max(0, used - int(torch.cuda.memory_reserved(self.device))) if used else 0
        return reserved_peak + overhead


def _nvml_process_bytes(device: Any) -> int:
    try:
        import pynvml
        import torch

        props: Any = torch.cuda.get_device_properties(device)
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    return int(proc.usedGpuMemory)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0  # containers often hide other PIDs from NVML; reserved memory still counts
    return 0


def endless(loader: Any, sampler: Any = None) -> Iterator[Any]:
    """An endless stream of batches: a new epoch (a new loader iterator) when one ends."""
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)  # a new shuffle per epoch, the same on every rank
        yield from loader
        epoch += 1
