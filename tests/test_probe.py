"""The machine probe: the CPU part measured for real, the NVML part against the fake NVML (the
real one runs on a lent GPU machine: scripts/gpu_check.sh), the checks on crafted figures."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.machine import probe as probe_mod
from autotune.machine.probe import kernels, peaks
from autotune.machine.probe.inventory import inventory
from autotune.testing.nvml import FAKE_NVML_ENV, FakeNVML
from tests.conftest import autotune

FIGURE_KEYS = {"value", "unit", "peak", "basis", "share", "low"}


def machine(**over: Any) -> dict[str, Any]:
    """Four H200s: 0-1 over NVLink, 2-3 behind one PCIe switch, the rest across sockets. GPU 2
    sits in a Gen4 slot (the GPU can run Gen5); GPU 3's link trained at Gen3 x8."""
    gpu = {"name": "NVIDIA H200", "memory_gib": 141, "cc": [9, 0], "nvlink": None,
           "pcie": {"gen": 5, "width": 16, "max_gen": 5, "gpu_max_gen": 5, "max_width": 16}}
    gpus = [{**gpu, "bus": f"0000:{0x1b + i:02X}:00.0", "numa": i // 2} for i in range(4)]
    gpus[0]["nvlink"] = gpus[1]["nvlink"] = 18
    gpus[2]["pcie"] = {"gen": 4, "width": 16, "max_gen": 4, "gpu_max_gen": 5, "max_width": 16}
    gpus[3]["pcie"] = {"gen": 3, "width": 8, "max_gen": 4, "gpu_max_gen": 4, "max_width": 16}
    return {"driver": "580.159.04", "cuda_driver": 13000, "gpus": gpus,
            "links": {"0-1": "nvlink", "2-3": "switch", "0-2": "node", "1-3": "node"}, **over}


def test_cpu_probe_measures_for_real_and_caches(workdir: Path) -> None:
    """The session's probe cache (conftest): measured by the first study of the session, or
    here when this test runs first. Either way a real measurement of this CPU."""
    out = autotune("probe", "--json", cwd=workdir)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema"] == "autotune.probe/v1" and doc["errors"] == []
    assert set(doc["cpu"]) >= {"model", "cores", "numa_nodes", "memory_total_bytes", "bf16"}
    figs = doc["figures"]
    assert set(figs) >= {"cpu.gemm.fp32", "cpu.gemm.bf16", "cpu.memory_bandwidth"}
    for name in ("cpu.gemm.fp32", "cpu.gemm.bf16", "cpu.memory_bandwidth"):
        assert set(figs[name]) >= FIGURE_KEYS and figs[name]["value"] > 0
    assert figs["cpu.gemm.fp32"]["unit"] == "TFLOP/s"
    assert figs["cpu.memory_bandwidth"]["unit"] == "GB/s"
    if not torch.cuda.is_available():
        assert doc["gpus"] == [] and doc["gpu_note"].startswith("no GPU part: ")
        assert "\n" not in doc["gpu_note"]
    # Units and scale, without timing anything again here (the machine may be busy now): the
    # GEMM figure against this CPU's theoretical peak (a unit slip would be 1000x off), the
    # copy bandwidth within what any memory system does.
    gemm = figs["cpu.gemm.fp32"]
    if gemm["peak"]:
        assert 0.01 < gemm["share"] < 5, gemm
    assert 0.1 < figs["cpu.memory_bandwidth"]["value"] < 10_000
    # Cached per fingerprint: the human view reads it back without measuring.
    cache = Path(os.environ["AUTOTUNE_CACHE_DIR"]) / f"probe-{doc['fingerprint_id']}.json"
    assert json.loads(cache.read_text())["figures"].keys() == figs.keys()
    again = autotune("probe", cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert "measurements cached from" in again.stdout and "CPU GEMM fp32" in again.stdout
    assert "measuring" not in again.stderr


def test_nvml_inventory_links_topology_and_p2p() -> None:
    found = inventory(FakeNVML(machine()))
    assert found["gpu_note"] is None and found["driver_version"] == "580.159.04"
    assert found["cuda_driver_version"] == "13.0"
    g0, g1, g2, g3 = found["gpus"]
    assert g0["name"] == "NVIDIA H200" and g0["memory_total_bytes"] == 141 * 2**30
    assert g0["nvlink"] == {"links": 18, "version": "4.0"} and g2["nvlink"]["links"] is None
    assert g3["pcie"] == {"gen": 3, "width": 8, "max_gen": 4, "max_width": 16, "gpu_max_gen": 4}
    assert g0["numa_node"] == 0 and g3["numa_node"] == 1
    # Bus width x memory clock x 2: 6144 bits x 3201 MHz x 2 / 8.
    assert g0["memory_bandwidth_peak_gbs"] == pytest.approx(6144 * 3201 * 2 / 8 / 1e3, abs=0.1)
    pairs = {tuple(p["gpus"]): p for p in found["topology"]}
    assert len(pairs) == 6
    assert pairs[(0, 1)]["link"] == "NVLink x18" and pairs[(0, 1)]["p2p"] is True
    assert pairs[(2, 3)]["link"] == "PCIe, one PCIe switch" and pairs[(2, 3)]["p2p"] is True
    assert pairs[(0, 2)]["link"] == "PCIe, same NUMA node" and pairs[(0, 2)]["p2p"] is False
    assert pairs[(0, 3)]["link"] == "PCIe, across NUMA nodes"


def test_nvswitch_boards_count_as_nvlink() -> None:
    """On HGX boards every NVLink ends at an NVSwitch, none at a peer GPU: NVML's P2P status
    over NVLink says they are connected."""
    gpu = {"name": "NVIDIA H100 80GB HBM3", "nvlink": 18,
           "pcie": {"gen": 5, "width": 16, "max_gen": 5, "gpu_max_gen": 5, "max_width": 16}}
    links = {f"{a}-{b}": "nvswitch" for a in range(4) for b in range(a + 1, 4)}
    found = inventory(FakeNVML({"gpus": [dict(gpu) for _ in range(4)],
                                          "links": links}))
    assert {p["link"] for p in found["topology"]} == {"NVLink x18 through NVSwitch"}
    assert all(p["p2p"] for p in found["topology"])
    doc = {**found, "cpu": {}, "flags": [],
           "figures": {f"allreduce.default.{256 * 2**20}": kernels._figure(360.0, "GB/s")}}
    peaks.check(doc)
    fig = doc["figures"][f"allreduce.default.{256 * 2**20}"]
    assert fig["peak"] == 450.0 and fig["share"] == 0.8 and not fig["low"]


def test_degraded_links_are_named() -> None:
    doc = {"gpus": inventory(FakeNVML(machine()))["gpus"], "figures": {},
           "flags": [], "cpu": {}}
    peaks.check(doc)
    assert "GPU 3 runs PCIe Gen3 x8; it can run Gen4 x16" in doc["flags"]
    assert any(f.startswith("GPU 2 sits in a PCIe Gen4 slot; the GPU can run Gen5")
               for f in doc["flags"])
    assert not any(f.startswith(("GPU 0", "GPU 1")) for f in doc["flags"])
    # An idle GPU trains its link down: a lower generation at full width is not flagged unless
    # it was read under load.
    idle = {"index": 5, "pcie": {"gen": 1, "width": 16, "max_gen": 5, "max_width": 16}}
    assert peaks.degraded_link(idle) is None
    idle["pcie"]["under_load"] = True
    assert peaks.degraded_link(idle) == "GPU 5 runs PCIe Gen1 x16; it can run Gen5 x16"


def test_no_driver_is_one_line() -> None:
    found = inventory(FakeNVML(machine(no_driver=True)))
    assert found["gpus"] == [] and found["gpu_note"] == \
        "no GPU part: no NVIDIA driver (NVMLError)"


def test_figures_against_theoretical_peaks() -> None:
    gpus = inventory(FakeNVML(machine()))["gpus"][:2]
    fig = kernels._figure
    doc: dict[str, Any] = {
        "cpu": {"cores": 2, "max_mhz": None}, "gpus": gpus, "flags": [],
        "topology": [{"gpus": [0, 1], "nvlinks": 18}],
        "figures": {"gpu0.h2d_pinned": fig(12.0, "GB/s"), "gpu0.h2d_pageable": fig(9.0, "GB/s"),
                    "gpu1.h2d_pinned": fig(55.0, "GB/s"),
                    "gpu0.matmul.bf16": fig(300.0, "TFLOP/s"),
                    "gpu1.matmul.bf16": fig(760.0, "TFLOP/s"),
                    "gpu0.memory_bandwidth": fig(4100.0, "GB/s"),
                    f"allreduce.Ring.{2**20}": fig(20.0, "GB/s"),
                    f"allreduce.Ring.{256 * 2**20}": fig(120.0, "GB/s")}}
    peaks.check(doc)
    f = doc["figures"]
    assert f["gpu0.h2d_pinned"]["peak"] == pytest.approx(63.0) and f["gpu0.h2d_pinned"]["low"]
    assert f["gpu0.h2d_pinned"]["basis"] == "PCIe Gen5 x16"
    assert not f["gpu0.h2d_pageable"]["low"]  # staged through a pinned buffer by design
    assert not f["gpu1.h2d_pinned"]["low"] and f["gpu1.h2d_pinned"]["share"] == 0.873
    assert f["gpu0.matmul.bf16"]["peak"] == 989.4 and f["gpu0.matmul.bf16"]["low"]
    assert not f["gpu1.matmul.bf16"]["low"]
    assert not f["gpu0.memory_bandwidth"]["low"]
    # 18 NVLink4 links x 25 GB/s one way; only the largest message is held to it.
    big = f[f"allreduce.Ring.{256 * 2**20}"]
    assert big["peak"] == 450.0 and big["low"]
    assert not f[f"allreduce.Ring.{2**20}"]["low"]
    assert any(line.startswith("GPU 0 host-to-device (pinned): 12 GB/s is 19% of the 63 GB/s")
               for line in doc["flags"])
    summary = probe_mod.summary(doc, "cuda")
    assert summary["peak_tflops"] == {"bf16": 300.0}  # the slowest GPU's
    assert summary["h2d_pinned_gbs"] == 12.0 and summary["allreduce_busbw_gbs"] == 120.0
    assert probe_mod.peak_for(summary, "bf16", "cuda") == 300.0
    assert probe_mod.peak_for(summary, "off", "cuda") is None  # no fp32 figure measured


def test_cpu_fp32_peak_per_cycle_follows_the_vector_unit() -> None:
    per_cycle = peaks.fp32_flops_per_cycle
    avx512 = {"avx", "fma", "avx512f"}
    assert per_cycle(avx512, "GenuineIntel", 6) == (64, "AVX-512")
    # Zen 4 has AVX-512 but runs it on 256-bit units: AVX2's peak; Zen 5 (family 26) is wider.
    assert per_cycle(avx512, "AuthenticAMD", 25) == (32, "AVX-512 on Zen 4's 256-bit units")
    assert per_cycle(avx512, "AuthenticAMD", 26)[0] == 64
    assert per_cycle({"avx", "fma"}, "AuthenticAMD", 25) == (32, "AVX2")  # Zen 3
    assert per_cycle({"avx"}, None, None) == (16, "AVX")
    assert per_cycle(set(), None, None) == (0, "")


def test_probe_cli_reads_gpus_through_nvml(workdir: Path) -> None:
    """`autotune probe` on a machine whose NVML (the fake) shows four GPUs. The links are read
    every time; the measurements come from the session's cache."""
    path = workdir / "machine.json"
    path.write_text(json.dumps(machine()))
    out = autotune("probe", cwd=workdir, env={FAKE_NVML_ENV: str(path)})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "GPU 3   NVIDIA H200, 141.00 GiB, driver 580.159.04 (CUDA 13.0); PCIe Gen3 x8 now, " \
        "Gen4 x16 at best; NUMA 1" in text
    assert "link    GPU 0 - GPU 1: NVLink x18, P2P" in text
    assert "flag    GPU 3 runs PCIe Gen3 x8; it can run Gen4 x16" in text
    if not torch.cuda.is_available():
        assert "this torch build has no CUDA" in text


def test_allreduce_ranks_agree_on_their_calls(tmp_path: Path) -> None:
    """Ranks that time their own calls would disagree on the count of a 1 MiB all-reduce and
    hang; they agree on it first. (On GPUs this runs on nccl; here on gloo, through torchrun.)"""
    from autotune.trial.launch import run_tool

    out, why = run_tool([probe_mod.KERNELS, "allreduce", "default"], tmp_path / "ar.json",
                        timeout_s=120, nproc=2)
    assert out is not None, why
    figs = out["figures"]
    assert set(figs) == {f"allreduce.default.{n}" for n in kernels.ALLREDUCE_BYTES}
    for fig in figs.values():
        assert fig["ranks"] == 2 and fig["value"] > 0
        assert fig["value"] == pytest.approx(fig["algbw"] * 2 * (2 - 1) / 2, rel=0.01)
