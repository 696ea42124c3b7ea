"""A fake NVML: the part of ``pynvml`` autotune calls, answering from a machine description.

This machine has no NVIDIA driver, so the NVML code paths (inventory, links, topology, P2P and
sampling during trials) run against this fake in the tests. A machine is a dict, or a JSON file:
tests hand the fake to ``autotune.machine.nvml.use()``, and ``python -m autotune.testing ...``
runs the CLI with the fake of the file ``AUTOTUNE_FAKE_NVML`` names:

    {"driver": "580.1", "cuda_driver": 13000,
     "gpus": [{"name": "NVIDIA H200", "memory_gib": 141, "cc": [9, 0], "bus": "0000:1B:00.0",
               "pcie": {"gen": 5, "width": 16, "max_gen": 5, "gpu_max_gen": 5, "max_width": 16},
               "nvlink": 18, "numa": 0, "mem_bus_width": 6144, "mem_clock_mhz": 3201,
               "util": [90, 95], "power_w": [600, 640], "temp_c": [60, 62],
               "mem_used_gib": [40, 42], "pcie_kbs": [1000, 2000],
               "sm_clock_mhz": [1980, 1755], "clock_events": [0, 64]}],
     "links": {"0-1": "nvlink"}}

Per-GPU sample lists are read in turn, one value per call, wrapping around. ``links`` gives the
topology of a GPU pair: ``nvlink`` (NVLinks between them, P2P ok), ``nvswitch`` (NVLinks to an
NVSwitch, as on HGX boards: no link ends at the peer, P2P over NVLink ok), ``switch`` (one PCIe
switch), ``hostbridge``, ``node`` (same NUMA node) or ``system`` (across sockets, no P2P);
unlisted pairs are ``system``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAKE_NVML_ENV = "AUTOTUNE_FAKE_NVML"  # read by `python -m autotune.testing` only
NVML_NVLINK_MAX_LINKS = 18
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_SYSTEM = 50
NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_NOT_SUPPORTED = 5

_TOPOLOGY = {"nvlink": NVML_TOPOLOGY_SINGLE, "nvswitch": NVML_TOPOLOGY_NODE,
             "switch": NVML_TOPOLOGY_SINGLE,
             "multiswitch": NVML_TOPOLOGY_MULTIPLE, "hostbridge": NVML_TOPOLOGY_HOSTBRIDGE,
             "node": NVML_TOPOLOGY_NODE, "system": NVML_TOPOLOGY_SYSTEM}


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    pass


@dataclass
class _Memory:
    total: int
    free: int
    used: int


@dataclass
class _Utilization:
    gpu: int
    memory: int


@dataclass
class _PciInfo:
    busId: str  # noqa: N815 - pynvml's name


class FakeNVML:
    """Module-like: ``nv.nvmlInit()``, ``nv.nvmlDeviceGetHandleByIndex(0)``, ... Handles are
    GPU indices. ``calls`` counts every query, so tests can see what was asked."""

    NVMLError = NVMLError

    def __init__(self, machine: dict[str, Any]) -> None:
        self.machine = machine
        self.gpus: list[dict[str, Any]] = list(machine.get("gpus", []))
        self.calls: dict[str, int] = {}
        self._turn: dict[tuple[int, str], int] = {}
        self.initialised = 0
        for name, value in globals().items():
            if name.startswith("NVML_"):
                setattr(self, name, value)

    @classmethod
    def from_file(cls, path: str | Path) -> FakeNVML:
        return cls(json.loads(Path(path).read_text()))

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _gpu(self, handle: int) -> dict[str, Any]:
        return self.gpus[handle]

    def _next(self, handle: int, key: str, default: float) -> float:
        values = self._gpu(handle).get(key) or [default]
        i = self._turn.get((handle, key), 0)
        self._turn[(handle, key)] = i + 1
        return float(values[i % len(values)])

    def _link(self, a: int, b: int) -> str:
        links = self.machine.get("links", {})
        return str(links.get(f"{a}-{b}") or links.get(f"{b}-{a}") or "system")

    # -- system ---------------------------------------------------------------------------------

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names, here and below
        if self.machine.get("no_driver"):
            raise NVMLError("Driver Not Loaded")
        self.initialised += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return str(self.machine.get("driver", "580.1"))

    def nvmlSystemGetCudaDriverVersion(self) -> int:  # noqa: N802
        return int(self.machine.get("cuda_driver", 13000))

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        if not 0 <= index < len(self.gpus):
            raise NVMLError("Invalid Argument")
        return index

    # -- inventory ------------------------------------------------------------------------------

    def nvmlDeviceGetName(self, h: int) -> str:  # noqa: N802
        return str(self._gpu(h).get("name", "NVIDIA H200"))

    def nvmlDeviceGetMemoryInfo(self, h: int) -> _Memory:  # noqa: N802
        self._count("memory")
        total = int(self._gpu(h).get("memory_gib", 141) * 2**30)
        used = int(self._next(h, "mem_used_gib", 0.5) * 2**30)
        return _Memory(total=total, free=total - used, used=used)

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:  # noqa: N802
        cc = self._gpu(h).get("cc", [9, 0])
        return int(cc[0]), int(cc[1])

    def nvmlDeviceGetPciInfo(self, h: int) -> _PciInfo:  # noqa: N802
        return _PciInfo(busId=str(self._gpu(h).get("bus", f"0000:{h + 1:02X}:00.0")))

    def _pcie(self, h: int, key: str) -> int:
        pcie = self._gpu(h).get("pcie")
        if not pcie or key not in pcie:
            raise NVMLError_NotSupported(key)
        return int(pcie[key])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:  # noqa: N802
        return self._pcie(h, "gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:  # noqa: N802
        return self._pcie(h, "width")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:  # noqa: N802
        return self._pcie(h, "max_gen")

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, h: int) -> int:  # noqa: N802
        return self._pcie(h, "gpu_max_gen")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:  # noqa: N802
        return self._pcie(h, "max_width")

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:  # noqa: N802
        links = self._gpu(h).get("nvlink")
        if links is None:
            raise NVMLError_NotSupported("nvlink")
        return int(link < int(links))

    def nvmlDeviceGetNvLinkVersion(self, h: int, link: int) -> int:  # noqa: N802
        return int(self._gpu(h).get("nvlink_version", 6))  # nvmlNvlinkVersion_t: 6 is 4.0

    def nvmlDeviceGetNumaNodeId(self, h: int) -> int:  # noqa: N802
        return int(self._gpu(h).get("numa", 0))

    def nvmlDeviceGetMemoryBusWidth(self, h: int) -> int:  # noqa: N802
        return int(self._gpu(h).get("mem_bus_width", 6144))

    def nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:  # noqa: N802
        return int(self._gpu(h).get("mem_clock_mhz", 3201))

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:  # noqa: N802
        self._count("clock")
        if clock != NVML_CLOCK_SM:
            raise NVMLError_NotSupported("only the SM clock is described")
        return int(self._next(h, "sm_clock_mhz", 1980))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:  # noqa: N802
        self._count("clock_events")
        return int(self._next(h, "clock_events", 0))

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:  # noqa: N802
        return _TOPOLOGY[self._link(a, b)]

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:  # noqa: N802
        over = ("nvlink", "nvswitch") if index == 2 else (  # 2: NVML_P2P_CAPS_INDEX_NVLINK
            "nvlink", "nvswitch", "switch", "multiswitch", "hostbridge")
        return NVML_P2P_STATUS_OK if self._link(a, b) in over else NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> _PciInfo:  # noqa: N802
        """Where one of GPU ``h``'s NVLinks goes: links are dealt out to its NVLink peers."""
        if link >= int(self._gpu(h).get("nvlink") or 0):
            raise NVMLError_NotSupported("nvlink")
        peers = [j for j in range(len(self.gpus)) if j != h and self._link(h, j) == "nvlink"]
        if not peers:
            return _PciInfo(busId="0000:F0:00.0")  # an NVSwitch
        return self.nvmlDeviceGetPciInfo(peers[link % len(peers)])

    # -- sampling -------------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, h: int) -> _Utilization:  # noqa: N802
        self._count("utilization")
        return _Utilization(gpu=int(self._next(h, "util", 0)), memory=0)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:  # noqa: N802
        return int(self._next(h, "power_w", 70) * 1000)  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:  # noqa: N802
        return int(self._gpu(h).get("power_limit_w", 700) * 1000)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:  # noqa: N802
        return int(self._next(h, "temp_c", 35))

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:  # noqa: N802
        self._count("pcie_throughput")
        return int(self._next(h, "pcie_kbs", 0))  # KB/s
