"""Fake hardware descriptions, for narrowing and planning tests on machines without a GPU."""

from __future__ import annotations

from autotune.machine.hardware import GPU, Hardware


def fake_cpu(cores: int = 2, bf16: bool = True, memory_gib: int = 24,
             cpp_compiler: str | None = "/usr/bin/g++") -> Hardware:
    return Hardware(device="cpu", gpus=(), cpu_model="Fake CPU", cpu_cores=cores, cpu_bf16=bf16,
                    memory_total_bytes=memory_gib * 2**30,
                    memory_available_bytes=(memory_gib - 2) * 2**30, torch_version="2.13.0",
                    cpp_compiler=cpp_compiler)


def fake_gpus(count: int = 1, name: str = "NVIDIA H200", memory_gib: int = 141,
              compute_capability: tuple[int, int] = (9, 0), cores: int = 16) -> Hardware:
    gpus = tuple(GPU(i, name, memory_gib * 2**30, compute_capability) for i in range(count))
    return Hardware(device="cuda", gpus=gpus, cpu_model="Fake CPU", cpu_cores=cores,
                    cpu_bf16=True, memory_total_bytes=128 * 2**30,
                    memory_available_bytes=120 * 2**30, torch_version="2.13.0",
                    cuda_version="12.8", nccl_version="2.27.3", driver_version="570.1")
