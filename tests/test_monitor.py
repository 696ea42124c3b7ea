"""GPU monitoring during trials, against the fake NVML (this machine has no NVIDIA driver)."""

from __future__ import annotations

import time
from pathlib import Path

from autotune.config.knobs import Config
from autotune.machine.monitor import GpuMonitor, summarize
from autotune.testing.nvml import FakeNVML
from autotune.trial.launch import execute, measured_span, plan
from autotune.trial.measurement import classify
from autotune.trial.spec import MeasureSettings, TrialSpec
from autotune.workloads import WorkloadSpec

GPUS = [{"name": "NVIDIA H200", "util": [80, 100], "power_w": [500, 700], "temp_c": [60, 70],
         "mem_used_gib": [40, 44], "pcie_kbs": [2000, 4000]},
        {"name": "NVIDIA H200", "util": [20, 40], "power_w": [200], "temp_c": [50],
         "mem_used_gib": [10], "pcie_kbs": [1000]}]


def test_monitor_samples_every_gpu_at_ten_hertz_at_most() -> None:
    nv = FakeNVML({"gpus": GPUS})
    monitor = GpuMonitor([0, 1], nv=nv).start()
    time.sleep(1.05)
    samples = monitor.stop()
    per_gpu = [s for s in samples if s["gpu"] == 0]
    # After each round of samples the monitor waits out the rest of its interval: rounds are at
    # least 0.1 s apart (a busy machine only spaces them further), so a second holds at most 11.
    stamps = [s["t"] for s in per_gpu]
    assert 2 <= len(per_gpu) <= 11, len(per_gpu)
    assert all(b - a >= 0.095 for a, b in zip(stamps, stamps[1:], strict=False)), stamps
    assert {"gpu_util", "memory_used_bytes", "power_w", "temp_c"} <= set(per_gpu[0])
    # PCIe throughput costs NVML 20 ms a read: read on every tenth sample only.
    assert "pcie_tx_mbs" in per_gpu[0] and "pcie_tx_mbs" not in per_gpu[1]
    assert nv.initialised == 0  # shut down again
    count = len(samples)
    time.sleep(0.3)
    assert len(monitor.samples) == count  # stopped means stopped


def test_summary_covers_the_timed_windows_only() -> None:
    samples = [{"t": float(t), "gpu": g, "gpu_util": u, "power_w": 100.0 * g + t}
               for t, g, u in [(0, 0, 0), (0, 1, 0), (5, 0, 90), (5, 1, 30), (6, 0, 100),
                               (6, 1, 50), (9, 0, 0), (9, 1, 0)]]
    events = [{"event": "built", "t": 1.0}, {"event": "window", "t": 5.5, "seconds": 1.0},
              {"event": "window", "t": 6.5, "seconds": 1.0}]
    span = measured_span(events)
    assert span == (4.5, 6.5)
    s = summarize(samples, span)
    assert s["scope"] == "timed windows" and s["gpus"] == [0, 1] and s["samples"] == 4
    assert s["gpu_util_mean"] == 67.5 and s["gpu_util_max"] == 100
    assert s["per_gpu"]["0"]["gpu_util_mean"] == 95 and s["per_gpu"]["1"]["gpu_util_mean"] == 40
    assert s["gpu_util_min_gpu_mean"] == 40  # the GPU that waits most
    # No windows (a failed trial): the whole trial.
    assert summarize(samples, None)["scope"] == "whole trial"
    assert summarize([], span) == {}


def test_a_trial_carries_its_gpu_summary(tmp_path: Path) -> None:
    """A real (CPU) trial, watched by a monitor reading the fake NVML: the summary reaches the
    measurement, and covers the windows."""
    p = plan(TrialSpec(WorkloadSpec("mlp", {}), Config(micro_batch_size=32), device="cpu",
                       measure=MeasureSettings(min_window_s=0.3, max_seconds=5)),
             workdir=tmp_path, timeout_s=60)
    raw = execute(p, monitor=GpuMonitor([0, 1], nv=FakeNVML({"gpus": GPUS})))
    m = classify(raw)
    assert m.ok, m.reason
    assert m.gpu["scope"] == "timed windows" and m.gpu["gpus"] == [0, 1]
    assert m.gpu["samples"] >= 4
    assert 20 <= m.gpu["gpu_util_mean"] <= 100 and m.gpu["power_w_max"] <= 700
    assert m.gpu["per_gpu"]["1"]["gpu_util_max"] <= 40


def test_a_monitor_without_a_driver_records_nothing_and_says_why() -> None:
    nv = FakeNVML({"no_driver": True, "gpus": GPUS})
    monitor = GpuMonitor([0], nv=nv).start()
    assert monitor.stop() == [] and nv.calls == {}
    assert monitor.error is not None and "Driver Not Loaded" in monitor.error
    # A GPU that is gone: no samples, and NVML shut down again.
    nv = FakeNVML({"gpus": GPUS})
    monitor = GpuMonitor([5], nv=nv).start()
    assert monitor.stop() == [] and monitor.error and nv.initialised == 0


def test_the_sm_clock_and_a_gpu_slowing_itself_down_are_recorded() -> None:
    """The clocks and NVML's clock event reasons, sampled with the rest: the summary's mean
    and lowest SM clock, and the slowdowns seen (heat, a power brake; not the power cap)."""
    nv = FakeNVML({"gpus": [{"sm_clock_mhz": [1980, 1410], "clock_events": [0x4, 0x40],
                             "temp_c": [70, 88]}]})
    monitor = GpuMonitor([0], nv=nv).start()
    time.sleep(0.35)
    samples = monitor.stop()
    assert {"sm_clock_mhz", "clock_events"} <= set(samples[0])
    s = summarize(samples)
    assert s["sm_clock_mhz_max"] == 1980 and s["sm_clock_mhz_min"] == 1410
    assert s["slowdowns"] == ["hardware thermal slowdown"]  # 0x4 (power cap) is not one
    cool = FakeNVML({"gpus": [{"clock_events": [0x1, 0x4]}]})
    monitor = GpuMonitor([0], nv=cool).start()
    time.sleep(0.25)
    assert "slowdowns" not in summarize(monitor.stop())
