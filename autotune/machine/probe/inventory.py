"""The probe's inventory: every visible GPU and the links between them, read in this process
through NVML only (no CUDA context): per GPU its name, memory, PCIe link now and at best, NVLink
links and version, NUMA node, theoretical memory bandwidth; per pair the topology and whether P2P
works."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from autotune.machine import nvml

# nvmlDeviceGetNvLinkVersion answers with NVML's nvmlNvlinkVersion_t, not the version itself.
_NVLINK_VERSIONS = {1: "1.0", 2: "2.0", 3: "2.2", 4: "3.0", 5: "3.1", 6: "4.0", 7: "5.0", 8: "6.0"}
_TOPOLOGY = {0: "same board", 10: "one PCIe switch", 20: "several PCIe switches",
             30: "PCIe host bridge", 40: "same NUMA node", 50: "across NUMA nodes"}


class PcieLink(TypedDict):
    """A GPU's PCIe link: now, the best of its slot, and the best of the GPU itself. None where
    NVML does not say. The probe sets ``gen`` and ``width`` again as read under load."""

    gen: int | None
    width: int | None
    max_gen: int | None
    max_width: int | None
    gpu_max_gen: int | None
    under_load: NotRequired[bool]  # gen and width were read while copies kept the link busy


class NvLink(TypedDict):
    links: int | None  # active links; None on a GPU without NVLink
    version: str | None


class GpuRecord(TypedDict):
    """One GPU as the probe reports it."""

    index: int  # NVML's
    name: str
    memory_total_bytes: int
    compute_capability: list[int]
    bus_id: str | None
    numa_node: int | None
    pcie: PcieLink
    nvlink: NvLink
    memory_bandwidth_peak_gbs: float | None  # theoretical: bus width x memory clock x 2


class GpuPair(TypedDict):
    """How two GPUs are connected."""

    gpus: list[int]
    link: str  # "NVLink x4", "NVLink x18 through NVSwitch", "PCIe, one PCIe switch", ...
    nvlinks: int
    p2p: bool | None  # whether they can read each other's memory; None where NVML cannot say


class Inventory(TypedDict):
    gpus: list[GpuRecord]
    topology: list[GpuPair]
    gpu_note: str | None  # why there are no GPUs, or why the list is incomplete
    driver_version: str | None
    cuda_driver_version: str | None


def inventory(nv: Any = None) -> Inventory:
    """Every visible GPU and the links between them, through NVML; ``gpu_note`` says in one
    line why there are none."""
    found: Inventory = {"gpus": [], "topology": [], "gpu_note": None,
                        "driver_version": None, "cuda_driver_version": None}
    try:
        nv = nv or nvml.binding()
        nv.nvmlInit()
    except ImportError:
        found["gpu_note"] = "no GPU part: nvidia-ml-py is not installed"
        return found
    except Exception as exc:
        found["gpu_note"] = f"no GPU part: no NVIDIA driver ({exc.__class__.__name__})"
        return found
    try:
        found["driver_version"] = nvml.text(nv.nvmlSystemGetDriverVersion())
        cuda = nvml.call(nv.nvmlSystemGetCudaDriverVersion)
        found["cuda_driver_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None
        handles = {i: nv.nvmlDeviceGetHandleByIndex(i)
                   for i in nvml.visible_indices(nv.nvmlDeviceGetCount())}
        buses: dict[int, str | None] = {}
        for i, h in handles.items():
            bus = nvml.call(nv.nvmlDeviceGetPciInfo, h)
            buses[i] = nvml.text(bus.busId).lower() if bus is not None else None
            found["gpus"].append(_gpu(nv, i, h, buses[i]))
        indices = sorted(handles)
        for n, a in enumerate(indices):
            for b in indices[n + 1:]:
                found["topology"].append(_pair(nv, handles, buses, a, b))
    except Exception as exc:  # a GPU lost or hidden mid-read: keep what was read, say so
        found["gpu_note"] = f"GPU part incomplete: NVML failed ({type(exc).__name__}: {exc})"
        return found
    finally:
        nv.nvmlShutdown()
    if not found["gpus"]:
        found["gpu_note"] = "no GPU part: NVML sees no GPU (CUDA_VISIBLE_DEVICES hides them all?)"
    return found


def _gpu(nv: Any, i: int, h: Any, bus_id: str | None) -> GpuRecord:
    """GPU ``i`` (NVML's index, handle ``h``)."""
    cc = tuple(nv.nvmlDeviceGetCudaComputeCapability(h))
    links = nvml.nvlink_links(nv, h)
    code = nvml.call(nv.nvmlDeviceGetNvLinkVersion, h, 0) if links else None
    version = _NVLINK_VERSIONS.get(code) if code is not None else None
    width = nvml.call(nv.nvmlDeviceGetMemoryBusWidth, h)
    mem_mhz = nvml.call(nv.nvmlDeviceGetMaxClockInfo, h, getattr(nv, "NVML_CLOCK_MEM", 2))
    return {
        "index": i, "name": nvml.text(nv.nvmlDeviceGetName(h)),
        "memory_total_bytes": int(nv.nvmlDeviceGetMemoryInfo(h).total),
        "compute_capability": [int(cc[0]), int(cc[1])], "bus_id": bus_id,
        "numa_node": nvml.call(nv.nvmlDeviceGetNumaNodeId, h),
        "pcie": {"gen": nvml.call(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
                 "width": nvml.call(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
                 "max_gen": nvml.call(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                 "max_width": nvml.call(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
                 "gpu_max_gen": nvml.call(nv.nvmlDeviceGetGpuMaxPcieLinkGeneration, h)},
        "nvlink": {"links": links, "version": version},
        # Theoretical device memory bandwidth: bus width x memory clock x 2 (DDR).
        "memory_bandwidth_peak_gbs": round(width * mem_mhz * 2 / 8 / 1e3, 1)
        if width and mem_mhz else None,
    }


def _pair(nv: Any, handles: dict[int, Any], buses: dict[int, str | None], a: int,
          b: int) -> GpuPair:
    """How GPUs a and b are connected: NVLink (a link of a ends at b) or PCIe's common
    ancestor; whether they can read each other's memory (P2P)."""
    ha, hb = handles[a], handles[b]
    nvlinks = 0
    for i in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        remote = nvml.call(nv.nvmlDeviceGetNvLinkRemotePciInfo, ha, i)
        if remote is not None and nvml.text(remote.busId).lower() == buses[b]:
            nvlinks += 1
    ancestor = nvml.call(nv.nvmlDeviceGetTopologyCommonAncestor, ha, hb)
    status = nvml.call(nv.nvmlDeviceGetP2PStatus, ha, hb, 0)  # 0: NVML_P2P_CAPS_INDEX_READ
    if nvlinks:
        link = f"NVLink x{nvlinks}"
    elif nvml.call(nv.nvmlDeviceGetP2PStatus, ha, hb, 2) == 0:  # 2: ..._INDEX_NVLINK
        # HGX/DGX boards: every link ends at an NVSwitch, none at the peer GPU itself.
        nvlinks = min(nvml.nvlink_links(nv, ha) or 0, nvml.nvlink_links(nv, hb) or 0)
        link = f"NVLink x{nvlinks} through NVSwitch"
    else:
        link = f"PCIe, {_TOPOLOGY.get(ancestor, 'unknown')}"
    return {"gpus": [a, b], "link": link, "nvlinks": nvlinks,
            "p2p": None if status is None else status == 0}
