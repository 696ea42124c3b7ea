"""The probe's measurements, run in subprocesses (``python -m autotune.machine.probe.kernels
cpu|gpu|allreduce [ALGO] OUT.json``): CPU GEMM peaks (fp32, bf16) and memory bandwidth; per GPU
host-to-device and device-to-host copies from pinned and pageable memory, device memory bandwidth
and matmul peaks (fp32, tf32, bf16, fp16); all-reduce bus bandwidth across the GPUs per NCCL
algorithm (nccl-tests' busbw: algbw x 2(n-1)/n). torch is imported only in the subprocess."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

import psutil

from autotune.machine import nvml
from autotune.machine.probe.documents import Figure, FigureDetails, LinkNow, Measured

ALLREDUCE_BYTES = (2**20, 32 * 2**20, 256 * 2**20)
NCCL_ALGOS = ("default", "Ring", "Tree")
CPU_GEMM_CALL_S = 0.05  # a CPU GEMM size slower than this per call is the largest tried
# A CPU GEMM was contended when its threads got less than this share of their CPU time while
# no core was idle: another process held the cores. Both are needed: alone on a 2-core VM an
# AMX bf16 GEMM of 512^2 or 1024^2 keeps one of two threads busy (share 0.5, a core idle),
# while beside one busy process a 2-thread GEMM gets one core (0.5, none idle) and half its rate.
CONTENDED_SHARE = 0.75
IDLE_CORES = 0.5  # "no core idle": fewer idle cores than this, on average over the block


@dataclass(frozen=True)
class Load:
    """What one timed block got of the CPU, and what the rest of the machine did meanwhile."""

    cpu_s: float  # this process's CPU time, all threads
    wall_s: float
    threads: int  # the threads it may use (torch's intra-op threads, at most the cores)
    idle_cores: float  # the machine's idle cores (idle + iowait), averaged over the block
    others_cores: float  # what other processes (and the hypervisor's steal) took, in cores

    @property
    def share(self) -> float:
        """This process's CPU time over what its threads could have had: ~1.0 alone."""
        if self.wall_s <= 0 or self.threads <= 0:
            return 1.0
        return self.cpu_s / (self.wall_s * self.threads)


def contended(loads: dict[str, Load]) -> str | None:
    """Why a CPU measurement was taken under load (each block whose threads were starved while
    no core was idle, ``CONTENDED_SHARE``), or None: it measured the machine."""
    starved = [f"{name} got {100 * load.share:.0f}% of its {load.threads} thread(s)' CPU time, "
               f"no core idle, other processes took {load.others_cores:.1f} cores"
               for name, load in loads.items()
               if load.share < CONTENDED_SHARE and load.idle_cores < IDLE_CORES]
    return "; ".join(starved) or None


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _cpu_clock() -> tuple[float, float, float]:
    """(this process's CPU time, the usable cores' idle time, their busy time incl. steal):
    read before and after a block (``_load``). Only the cores this process may run on count:
    a container sees the host's."""
    per = psutil.cpu_times(percpu=True)
    cpus = [per[i] for i in _cpus() if i < len(per)] or per
    idle = sum(t.idle + getattr(t, "iowait", 0.0) for t in cpus)
    busy = sum(t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0)
               + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0) for t in cpus)
    return time.process_time(), idle, busy


def _load(before: tuple[float, float, float], wall_s: float, threads: int) -> Load:
    cpu, idle, busy = (b - a for a, b in zip(before, _cpu_clock(), strict=True))
    wall = max(wall_s, 1e-9)
    return Load(cpu, wall_s, min(threads, len(_cpus())), max(0.0, idle / wall),
                max(0.0, (busy - cpu) / wall))


def _best_rate(fn: Callable[..., Any], amount: float, sync: Callable[[], None],
               seconds: float = 0.6, blocks: int = 3,
               agree: Callable[[float], float] | None = None) -> float:
    """The best rate (amount per second) over ``blocks`` timed blocks of repeated calls: a
    peak is the best a part does, not its average under whatever else the machine runs.
    ``agree`` turns this process's time of one call into the one all ranks use, so that ranks
    of a collective make the same number of calls."""
    fn()
    sync()
    t = time.perf_counter()
    fn()
    sync()
    once = time.perf_counter() - t
    if agree is not None:
        once = agree(once)
    reps = max(1, int(seconds / blocks / max(once, 1e-6)))
    best = 0.0
    for _ in range(blocks):
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = max(best, amount * reps / (time.perf_counter() - t))
    return best


def _figure(value: float, unit: str, **details: Unpack[FigureDetails]) -> Figure:
    return Figure(value=round(value, 4 if unit == "TFLOP/s" else 2), unit=unit, **details)


def measure_cpu() -> Measured:
    """GEMM peak per dtype (the best of square sizes up to 2048) and copy bandwidth, all cores;
    ``contended``: why the GEMMs were taken under load, or None. A contended first try is
    measured once more (a passing job), and each figure is the better of the two."""
    import torch

    figures, loads = _cpu_gemms()
    why = contended(loads)
    if why:
        again, loads_again = _cpu_gemms()
        second = contended(loads_again)
        why = f"on both tries: {second}" if second else None
        for name, fig in again.items():
            if fig["value"] > figures[name]["value"]:
                figures[name] = fig
    n = 256 * 2**20 // 4
    src, dst = torch.ones(n), torch.zeros(n)
    # STREAM's copy convention: bytes read plus bytes written.
    rate = _best_rate(lambda: dst.copy_(src), 2 * n * 4 / 1e9, lambda: None, seconds=1.0)
    figures["cpu.memory_bandwidth"] = _figure(rate, "GB/s", bytes=n * 4, kind="copy")
    return {"figures": figures, "contended": why}


def _cpu_gemms() -> tuple[dict[str, Figure], dict[str, Load]]:
    """The GEMM peaks, each with the CPU share its threads got (``cpu_share``), and the
    ``Load`` of each dtype's block.

    Sizes grow only while one call stays short: a CPU without native bf16 emulates it about 100x
    slower than fp32 (measured: 2.3 s for one 1024^2 bf16 GEMM on a 2-core AVX2 EPYC), and a
    2048^2 one there would take the probe minutes."""
    import torch

    threads = torch.get_num_threads()
    figures: dict[str, Figure] = {}
    loads: dict[str, Load] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        best, size = 0.0, 0
        before, start = _cpu_clock(), time.perf_counter()
        for n in (512, 1024, 2048):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            t = time.perf_counter()
            torch.mm(a, b)
            once = time.perf_counter() - t
            # Longer than the GPU's: a shared CPU's GEMM rate swings by 2x within seconds
            # (measured on a 2-core VM, bf16), and a peak is the best it reaches.
            rate = _best_rate(lambda a=a, b=b: torch.mm(a, b), 2 * n**3 / 1e12, lambda: None,
                              seconds=1.2, blocks=4 if once < 0.1 else 2)
            if rate > best:
                best, size = rate, n
            if once > CPU_GEMM_CALL_S:
                break
        load = loads[f"{name} GEMM"] = _load(before, time.perf_counter() - start, threads)
        figures[f"cpu.gemm.{name}"] = _figure(best, "TFLOP/s", size=size, threads=threads,
                                              cpu_share=round(load.share, 2))
    return figures, loads


def measure_gpus() -> Measured:
    """Per visible GPU: pinned and pageable copies both ways (256 MiB), device memory bandwidth
    (a 1 GiB copy), matmul peaks (8192^2); the PCIe link as NVML reads it under load."""
    import torch

    figures: dict[str, Figure] = {}
    under_load: dict[str, LinkNow] = {}
    try:
        nv = nvml.binding()
        nv.nvmlInit()
    except Exception:
        nv = None
    for local in range(torch.cuda.device_count()):
        dev = torch.device("cuda", local)
        # Figures are named by NVML's index, as the inventory names the GPUs: found through
        # the PCI bus (CUDA numbers GPUs fastest first, NVML by bus).
        handle = nvml.call(nv.nvmlDeviceGetHandleByPciBusId, _bus_id(dev)) \
            if nv is not None else None
        index = nvml.call(nv.nvmlDeviceGetIndex, handle) if handle is not None else None
        index = local if index is None else int(index)
        torch.cuda.set_device(dev)
        found, link = _measure_gpu(dev, nv)
        figures.update({f"gpu{index}.{k}": v for k, v in found.items()})
        if link:
            under_load[str(index)] = link
        torch.cuda.empty_cache()
    if nv is not None:
        nv.nvmlShutdown()
    return {"figures": figures, "pcie_under_load": under_load}


def _measure_gpu(dev: Any, nv: Any) -> tuple[dict[str, Figure], LinkNow | None]:
    import torch

    def sync() -> None:
        torch.cuda.synchronize(dev)

    figures: dict[str, Figure] = {}
    link: LinkNow | None = None
    size = 256 * 2**20
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    for kind, host in (("pinned", torch.empty(size, dtype=torch.uint8, pin_memory=True)),
                       ("pageable", torch.empty(size, dtype=torch.uint8))):
        host.fill_(1)

        def h2d(h: Any = host) -> Any:
            return gpu.copy_(h, non_blocking=True)

        def d2h(h: Any = host) -> Any:
            return h.copy_(gpu, non_blocking=True)

        figures[f"h2d_{kind}"] = _figure(_best_rate(h2d, size / 1e9, sync), "GB/s", bytes=size)
        if kind == "pinned" and nv is not None:
            link = _link_now(nv, dev, h2d)
        figures[f"d2h_{kind}"] = _figure(_best_rate(d2h, size / 1e9, sync), "GB/s", bytes=size)
    n = 2**30
    src = torch.ones(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def copy() -> Any:
        return dst.copy_(src)

    figures["memory_bandwidth"] = _figure(_best_rate(copy, 2 * n / 1e9, sync), "GB/s", bytes=n,
                                          kind="copy")
    n = 8192
    for name, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                              ("bf16", torch.bfloat16, False), ("fp16", torch.float16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(n, n, dtype=dtype, device=dev)
        b = torch.randn(n, n, dtype=dtype, device=dev)

        def mm(a: Any = a, b: Any = b) -> Any:
            return torch.mm(a, b)

        figures[f"matmul.{name}"] = _figure(_best_rate(mm, 2 * n**3 / 1e12, sync), "TFLOP/s",
                                            size=n)
    torch.backends.cuda.matmul.allow_tf32 = False
    return figures, link


def _bus_id(dev: Any) -> bytes:
    import torch

    props: Any = torch.cuda.get_device_properties(dev)
    return (f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:"
            f"{props.pci_device_id:02x}.0").encode()


def _link_now(nv: Any, dev: Any, copy: Callable[[], Any]) -> LinkNow | None:
    """The PCIe link NVML reports while copies keep it busy (an idle GPU trains down)."""
    import torch

    handle = nvml.call(nv.nvmlDeviceGetHandleByPciBusId, _bus_id(dev))
    if handle is None:
        return None
    for _ in range(20):
        copy()
    gen = nvml.call(nv.nvmlDeviceGetCurrPcieLinkGeneration, handle)
    width = nvml.call(nv.nvmlDeviceGetCurrPcieLinkWidth, handle)
    torch.cuda.synchronize(dev)
    return {"gen": gen, "width": width, "under_load": True} if gen and width else None


def measure_allreduce(algo: str) -> Measured | None:
    """One rank of the all-reduce test (torchrun starts one per GPU; NCCL_ALGO is set in the
    environment): busbw per message size, as nccl-tests computes it. Rank 0 returns it."""
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")  # gloo: for the tests
    if cuda:
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dist.init_process_group("gloo")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    world = dist.get_world_size()
    figures: dict[str, Figure] = {}
    for size in ALLREDUCE_BYTES:
        t = torch.ones(size // 4, dtype=torch.float32, device=dev)

        def once(t: Any = t) -> None:
            dist.all_reduce(t)

        algbw = _best_rate(once, size / 1e9, sync, seconds=0.5,
                           agree=lambda x: _agreed(x, dist.ReduceOp.MAX, dev))
        # The slowest rank's view decides: the minimum bandwidth over the ranks.
        agreed = torch.tensor([algbw], device=dev)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        busbw = float(agreed.item()) * 2 * (world - 1) / world
        figures[f"allreduce.{algo}.{size}"] = _figure(busbw, "GB/s", bytes=size, ranks=world,
                                                       algbw=round(float(agreed.item()), 2))
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    return {"figures": figures} if rank == 0 else None


def _agreed(value: float, op: Any, dev: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=op)
    return float(t.item())


def main(argv: list[str] | None = None) -> int:
    """``python -m autotune.machine.probe.kernels cpu|gpu|allreduce [ALGO] OUT.json``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] not in ("cpu", "gpu", "allreduce"):
        print("usage: python -m autotune.machine.probe.kernels cpu|gpu|allreduce [ALGO] "
              "OUT.json",
              file=sys.stderr)
        return 2
    if args[0] == "cpu":
        out: Measured | None = measure_cpu()
    elif args[0] == "gpu":
        out = measure_gpus()
    else:
        out = measure_allreduce(args[1])
    if out is not None:
        path = Path(args[-1])
        path.with_suffix(".tmp").write_text(json.dumps(out))
        path.with_suffix(".tmp").replace(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
