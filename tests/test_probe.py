"""The machine probe: the CPU part measured for real, the NVML part against the fake NVML (the
real one runs on a lent GPU machine: scripts/gpu_check.sh), the checks on crafted figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.errors import UsageError
from autotune.machine import probe as probe_mod
from autotune.machine.hardware import detect
from autotune.machine.probe import kernels, peaks
from autotune.machine.probe.cache import MAX_AGE_ENV, cache_path
from autotune.machine.probe.inventory import inventory
from autotune.testing.hardware import fake_cpu
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
    assert set(doc["cpu"]) >= {"model", "cores", "numa_nodes", "memory_total_bytes", "bf16",
                               "vendor", "family", "model_number", "stepping", "isa_flags"}
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
    for name in ("cpu.gemm.fp32", "cpu.gemm.bf16"):
        assert 0 < figs[name]["cpu_share"] <= 1.2, figs[name]  # what the load check read
    # Cached per fingerprint: the human view reads it back without measuring. Unless another
    # test beside this one held the cores while it measured: then it is marked and not cached
    # (the rule itself: test_contention_is_*).
    cache = Path(os.environ["AUTOTUNE_CACHE_DIR"]) / f"probe-{doc['fingerprint_id']}.json"
    if doc["contended"]:
        # Not cached by this probe; but it may be the session's own, read back: conftest caches
        # that one even when taken under load.
        kept = json.loads(cache.read_text()) if cache.exists() else None
        assert kept is None or kept["created"] != doc["created"] \
            or kept.get("contended") == doc["contended"]
        assert any(n.startswith("probe taken under load (") for n in doc["notes"])
        return
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


def test_contention_is_starved_threads_with_no_core_idle() -> None:
    """The load rule on numbers (CPU seconds, wall seconds, threads, idle and others' cores)
    read on the 2-core VM: no timing here, so nothing to flake."""
    load, contended = kernels.Load, kernels.contended
    alone = {"fp32 GEMM": load(9.8, 5.0, 2, 0.02, 0.02),
             # AMX bf16 GEMMs of 512^2 and 1024^2 keep one thread of two busy: a core idles.
             "bf16 GEMM": load(6.3, 5.0, 2, 0.7, 0.04)}
    assert contended(alone) is None
    assert alone["fp32 GEMM"].share == pytest.approx(0.98)
    # The incident: beside one busy process a 2-thread GEMM got one core, none idle, and
    # measured 0.078 TFLOP/s against 0.171 alone.
    assert contended({"fp32 GEMM": load(5.0, 5.0, 2, 0.0, 1.0)}) == (
        "fp32 GEMM got 50% of its 2 thread(s)' CPU time, no core idle, other processes took "
        "1.0 cores")
    # One thread (tests two at a time run OMP_NUM_THREADS=1) beside another test's busy core:
    # it got its core; the machine is full, not contended for it.
    assert contended({"fp32 GEMM": load(4.9, 5.0, 1, 0.0, 1.0)}) is None
    # Starved, but a core stood idle: the library used fewer threads, nothing took them.
    assert contended({"bf16 GEMM": load(2.5, 5.0, 2, 1.0, 0.0)}) is None
    # Each starved block is named; a quiet one is not.
    both = contended({**alone, "bf16 GEMM": load(3.0, 5.0, 2, 0.1, 1.2)})
    assert both is not None and both.startswith("bf16 GEMM got 30% ") and "fp32" not in both
    assert load(1.0, 0.0, 2, 0.0, 0.0).share == 1.0  # nothing timed: nothing to say


def _stub_measure(monkeypatch: pytest.MonkeyPatch, contended: str | None = None,
                  fp32: float = 0.171) -> list[str]:
    """``probe``'s measurement replaced by one that returns at once; the calls it got."""
    calls: list[str] = []

    def measure(hw: Any, gpus: Any, workdir: Any, say: Any, allreduce: bool) -> dict[str, Any]:
        calls.append(hw.fingerprint_id())
        return {"schema": probe_mod.PROBE_SCHEMA, "fingerprint_id": hw.fingerprint_id(),
                "created": datetime.now(UTC).isoformat(timespec="seconds"), "seconds": 9.0,
                "figures": {"cpu.gemm.fp32": kernels._figure(fp32, "TFLOP/s", size=2048)},
                "errors": [], "pcie_under_load": {}, "contended": contended}

    monkeypatch.setattr(probe_mod, "_measure", measure)
    return calls


def test_a_contended_probe_is_used_marked_and_not_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    hw, why = fake_cpu(), "fp32 GEMM got 46% of its 2 thread(s)' CPU time, no core idle"
    calls = _stub_measure(monkeypatch, contended=why, fp32=0.078)
    lines: list[str] = []
    doc = probe_mod.probe(hw, on_step=lines.append)
    assert doc["contended"] == why and not cache_path(hw).exists()
    line = probe_mod.contended_line(doc)
    assert line.startswith(f"probe taken under load ({why}): not cached; numbers may be low")
    assert lines == ["measured under load: not cached (the note says why)"]
    assert f"note    {line}" in probe_mod.render(doc)
    # This run still uses it, marked: the study's summary and the profile carry why.
    found = probe_mod.summary(doc, "cpu")
    assert found["peak_tflops"] == {"fp32": 0.078} and found["contended"] == why
    # The next probe measures again; a quiet one is cached, and a contended --refresh then
    # leaves it in place.
    _stub_measure(monkeypatch)
    assert probe_mod.probe(hw)["contended"] is None and len(calls) == 1
    kept = cache_path(hw).read_text()
    assert "contended" not in probe_mod.summary(probe_mod.probe(hw), "cpu")
    _stub_measure(monkeypatch, contended=why)
    assert probe_mod.probe(hw, refresh=True)["contended"] == why
    assert cache_path(hw).read_text() == kept


def test_a_cached_probe_older_than_the_limit_is_measured_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    hw = fake_cpu()
    old = (datetime.now(UTC) - timedelta(days=40)).isoformat(timespec="seconds")
    cache_path(hw).write_text(json.dumps({
        "schema": probe_mod.PROBE_SCHEMA, "created": old, "fingerprint_id": hw.fingerprint_id(),
        "figures": {"cpu.gemm.fp32": kernels._figure(0.078, "TFLOP/s")}, "errors": []}))
    calls = _stub_measure(monkeypatch)
    assert probe_mod.cached(hw) is None and probe_mod.stale_cache(hw) == \
        "it is 40 days old, more than 30 (AUTOTUNE_PROBE_MAX_AGE_DAYS)"
    lines: list[str] = []
    doc = probe_mod.probe(hw, on_step=lines.append)
    assert len(calls) == 1 and doc["created"] != old and probe_mod.stale_cache(hw) is None
    assert lines == ["the cached probe is not used: it is 40 days old, more than 30 "
                     "(AUTOTUNE_PROBE_MAX_AGE_DAYS); measuring again"]
    assert doc["figures"]["cpu.gemm.fp32"]["value"] == 0.171
    assert json.loads(cache_path(hw).read_text())["created"] == doc["created"]
    # The limit is the environment's where set: 60 days keeps a 40-day-old probe.
    cache_path(hw).write_text(cache_path(hw).read_text().replace(doc["created"], old))
    monkeypatch.setenv(MAX_AGE_ENV, "60")
    assert probe_mod.probe(hw)["created"] == old and len(calls) == 1
    monkeypatch.setenv(MAX_AGE_ENV, "a month")
    with pytest.raises(UsageError, match=r"AUTOTUNE_PROBE_MAX_AGE_DAYS must be a number of "
                                         r"days > 0, got 'a month'"):
        probe_mod.cached(hw)


@pytest.mark.slow  # the real CPU measurement, twice, under load: half a minute
@pytest.mark.serial  # its busy loops hold every core: a test beside it would be starved
def test_a_probe_under_real_load_is_marked_and_not_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real probe beside one busy loop per core and one more, each in a session of its
    own: Linux's autogroups share the cores between sessions, and the probe measures in a
    session of its own, so loops all in this test's session would leave it half the machine (a
    whole core for a one-thread probe). Measured: its threads get 25-40% of their CPU time
    with no core idle, far from the 75% and half a core of the rule."""
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    hw = replace(detect(), device="cpu", gpus=())  # the CPU part only, on a GPU machine too
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                start_new_session=True)
               for _ in range(len(os.sched_getaffinity(0)) + 1)]
    lines: list[str] = []
    try:
        doc = probe_mod.probe(hw, workdir=tmp_path, on_step=lines.append, allreduce=False)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert doc["errors"] == [], doc["errors"]
    why = doc["contended"]
    assert why and why.startswith("on both tries: ") and "no core idle" in why, why
    assert not cache_path(hw).exists()
    assert "measured under load: not cached (the note says why)" in lines
    assert f"note    {probe_mod.contended_line(doc)}" in probe_mod.render(doc)
    assert doc["figures"]["cpu.gemm.fp32"]["value"] > 0  # still measured, for this run
