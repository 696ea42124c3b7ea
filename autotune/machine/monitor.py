"""Watching the GPUs while a trial runs: NVML sampled at about 10 Hz from the tuner process.

The tuner never creates a CUDA context; NVML reads the devices from outside, as nvidia-smi and
DCGM do. Samples cover the whole trial; the summary stored on the trial covers the timed windows
only (start-up, model build and warm-up would drag every average down).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, NotRequired, TypedDict

from autotune.machine import nvml

INTERVAL_S = 0.1
PCIE_EVERY = 10  # a PCIe throughput read samples for 20 ms inside NVML: once a second is enough

# What a sample may hold; a GPU or driver that lacks a query leaves its field out.
Field = Literal["gpu_util", "power_w", "temp_c", "memory_used_bytes", "pcie_tx_mbs",
                "pcie_rx_mbs", "sm_clock_mhz"]
_FIELDS: tuple[Field, ...] = ("gpu_util", "power_w", "temp_c", "memory_used_bytes",
                              "pcie_tx_mbs", "pcie_rx_mbs", "sm_clock_mhz")
NVML_CLOCK_SM = 1
# NVML's clock event (throttle) reasons that slow a GPU down for its own sake: heat, a power
# brake, a hardware slowdown. Not the software power cap (a GPU at full load often runs at
# its cap; the clocks show what it costs), not idle or the application clock setting.
SLOWDOWNS = {0x8: "hardware slowdown", 0x20: "software thermal slowdown",
             0x40: "hardware thermal slowdown", 0x80: "hardware power brake"}


class Sample(TypedDict):
    """One GPU read once."""

    t: float  # time.time()
    gpu: int  # NVML's index
    gpu_util: NotRequired[float]  # % of the time a kernel ran
    memory_used_bytes: NotRequired[int]
    power_w: NotRequired[float]
    temp_c: NotRequired[float]
    pcie_tx_mbs: NotRequired[float]  # read every PCIE_EVERY-th sample only
    pcie_rx_mbs: NotRequired[float]
    sm_clock_mhz: NotRequired[float]
    clock_events: NotRequired[int]  # NVML's clock event (throttle) reasons, a bit mask


class GpuMonitor:
    """Samples GPU utilisation (NVML's ``utilization.gpu`` as nvidia-smi shows it: the share
    of time a kernel ran, not SM occupancy), memory used, power, temperature and PCIe
    throughput of the GPUs ``indices`` (NVML's) in a thread, from ``start`` to ``stop``. A GPU
    or driver that lacks a query leaves that field out; a monitor that cannot start records
    nothing."""

    def __init__(self, indices: list[int], interval_s: float = INTERVAL_S, nv: Any = None) -> None:
        self.indices, self.interval_s, self._nv = list(indices), interval_s, nv
        self.samples: list[Sample] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuMonitor:
        try:
            self._nv = self._nv or nvml.binding()
            self._nv.nvmlInit()
        except Exception as exc:  # no driver, no binding: the trial runs unwatched
            self.error = f"{type(exc).__name__}: {exc}"
            return self
        try:
            handles = {i: self._nv.nvmlDeviceGetHandleByIndex(i) for i in self.indices}
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                self._nv.nvmlShutdown()
            return self
        self._thread = threading.Thread(target=self._run, args=(handles,), daemon=True,
                                        name="autotune-gpu-monitor")
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        """Stop sampling; the samples, as the plain dicts the trial's launcher takes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            with contextlib.suppress(Exception):
                self._nv.nvmlShutdown()
            self._thread = None
        return [dict(s) for s in self.samples]

    def summary(self, span: tuple[float, float] | None) -> dict[str, Any]:
        """The samples' statistics over ``span`` (the trial's timed windows): ``summarize``."""
        return summarize(self.samples, span)

    def _run(self, handles: dict[int, Any]) -> None:
        nv, tick = self._nv, 0
        while not self._stop.is_set():
            t = time.time()
            for index, h in handles.items():
                self.samples.append(_sample(nv, h, t, index, pcie=tick % PCIE_EVERY == 0))
            tick += 1
            self._stop.wait(max(0.0, self.interval_s - (time.time() - t)))


def _sample(nv: Any, h: Any, t: float, index: int, pcie: bool) -> Sample:
    """GPU ``index`` (handle ``h``) read once; its PCIe throughput too when ``pcie``."""
    s: Sample = {"t": t, "gpu": index}
    util = nvml.call(nv.nvmlDeviceGetUtilizationRates, h)
    if util is not None:
        s["gpu_util"] = float(util.gpu)
    mem = nvml.call(nv.nvmlDeviceGetMemoryInfo, h)
    if mem is not None:
        s["memory_used_bytes"] = int(mem.used)
    power = nvml.call(nv.nvmlDeviceGetPowerUsage, h)
    if power is not None:
        s["power_w"] = power / 1000.0
    temp = nvml.call(nv.nvmlDeviceGetTemperature, h, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
    if temp is not None:
        s["temp_c"] = float(temp)
    clock = nvml.call(nv.nvmlDeviceGetClockInfo, h, getattr(nv, "NVML_CLOCK_SM", NVML_CLOCK_SM))
    if clock is not None:
        s["sm_clock_mhz"] = float(clock)
    # The reasons' call was renamed (clocks "throttle" -> "event" reasons) in newer NVMLs.
    reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    events = nvml.call(reasons, h) if reasons is not None else None
    if events is not None:
        s["clock_events"] = int(events)
    if pcie:
        # NVML reports KB/s.
        tx = nvml.call(nv.nvmlDeviceGetPcieThroughput, h,
                       getattr(nv, "NVML_PCIE_UTIL_TX_BYTES", 0))
        if tx is not None:
            s["pcie_tx_mbs"] = tx / 1000.0
        rx = nvml.call(nv.nvmlDeviceGetPcieThroughput, h,
                       getattr(nv, "NVML_PCIE_UTIL_RX_BYTES", 1))
        if rx is not None:
            s["pcie_rx_mbs"] = rx / 1000.0
    return s


def summarize(samples: Sequence[Sample],
              span: tuple[float, float] | None = None) -> dict[str, Any]:
    """Statistics of the samples inside ``span`` (all of them when there is no span, or too few
    inside it): per GPU and over all GPUs, the mean and maximum of each field (minimum too for
    GPU utilisation: the GPU that waits most)."""
    inside = [s for s in samples if span and span[0] <= s["t"] <= span[1]]
    scope = "timed windows"
    if len(inside) < 2:
        inside, scope = list(samples), "whole trial"
    if not inside:
        return {}

    def stats(group: list[Sample]) -> dict[str, float]:
        out: dict[str, float] = {"samples": len(group)}
        for f in _FIELDS:
            values = [s[f] for s in group if f in s]
            if values:
                out[f"{f}_mean"] = round(statistics.fmean(values), 2)
                out[f"{f}_max"] = round(max(values), 2)
        return out

    gpus = sorted({s["gpu"] for s in inside})
    per_gpu = {str(g): stats([s for s in inside if s["gpu"] == g]) for g in gpus}
    total = stats(inside)
    clocks = [s["sm_clock_mhz"] for s in inside if "sm_clock_mhz" in s]
    if clocks:
        total["sm_clock_mhz_min"] = round(min(clocks), 2)
    seen = 0
    for s in inside:
        seen |= s.get("clock_events", 0)
    slowdowns = [name for bit, name in SLOWDOWNS.items() if seen & bit]
    means = [p["gpu_util_mean"] for p in per_gpu.values() if "gpu_util_mean" in p]
    if means:
        total["gpu_util_min_gpu_mean"] = min(means)
    return {"scope": scope, "gpus": gpus, **total, "per_gpu": per_gpu,
            **({"slowdowns": slowdowns} if slowdowns else {})}
