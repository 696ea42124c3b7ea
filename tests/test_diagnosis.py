"""MFU and what limits a config: FLOPs counted against a hand count, MFU through a real study,
and the diagnosis rules on crafted measurements."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
import yaml

from autotune.config.knobs import Config
from autotune.trial.bench.flops import count_flops, flops_for
from autotune.trial.launch import execute, plan
from autotune.trial.measurement import Measurement, classify
from autotune.trial.spec import COUNTED, MeasureSettings, TrialSpec
from autotune.tuner.diagnosis import KINDS, MemoryWall, diagnose, mfu
from autotune.tuner.record import TrialRecord, read_trial
from autotune.tuner.snapshot import larger_over_limit
from autotune.workloads import WorkloadSpec, resolve

GIB = 2**30


def mlp_flops(features: int = 64, hidden: int = 256, classes: int = 10) -> float:
    """By hand: each Linear(i, o) costs 2io per sample forward, 2io for its weight gradient and
    2io for its input gradient, except the first layer, whose input needs no gradient."""
    f, h, c = features, hidden, classes
    return 6.0 * (f * h + h * h + h * c) - 2.0 * f * h


@pytest.mark.parametrize("shape", [{}, {"features": 32, "hidden": 128, "classes": 5}])
def test_counted_flops_of_mlp_match_the_hand_count(shape: dict[str, int]) -> None:
    w = resolve("mlp", shape)
    counted = count_flops(w, w.build_model(), w.build_dataset(), torch.device("cpu"))
    assert counted == mlp_flops(**shape)
    # Under autocast the count is the same: MFU then divides by the bf16 peak instead.
    assert count_flops(w, w.build_model(), w.build_dataset(), torch.device("cpu"),
                       torch.bfloat16) == mlp_flops(**shape)


def test_a_trial_counts_flops_when_asked_and_reuses_a_given_figure(tmp_path: Path) -> None:
    spec = TrialSpec(WorkloadSpec("mlp", {}), Config(micro_batch_size=32), "cpu",
                     MeasureSettings(min_window_s=0.05, max_seconds=1.5))
    counted = classify(execute(plan(replace(spec, count_flops=True), workdir=tmp_path / "a",
                                    timeout_s=60)))
    assert counted.ok and counted.flops_source == COUNTED
    assert counted.flops_per_sample == mlp_flops()
    assert counted.tflops == pytest.approx(counted.samples_per_sec * mlp_flops() / 1e12)
    # The study's figure wins: nothing is counted again.
    w = resolve("mlp")
    given = replace(spec, count_flops=True, flops_per_sample=1e6, flops_source=COUNTED)
    result = flops_for(given, w, None, None, torch.device("cpu"), None)
    assert result == {"flops_per_sample": 1e6, "flops_source": COUNTED}
    # Not asked to count, or counting failed: the workload's own estimate.
    result = flops_for(spec, w, w.build_model(), w.build_dataset(), torch.device("cpu"), None)
    assert result == {"flops_per_sample": w.flops_per_sample(),
                      "flops_source": "workload.flops_per_sample"}
    result = flops_for(replace(spec, count_flops=True), w, None, w.build_dataset(),
                       torch.device("cpu"), None)
    assert result["flops_source"] == "workload.flops_per_sample"
    assert "NoneType" in result["flops_count_error"]


def test_profile_mfu_is_rate_times_counted_flops_over_the_measured_peak(tuned_mlp: Path) -> None:
    doc = yaml.safe_load(tuned_mlp.read_text())
    r, base = doc["result"], doc["baseline"]
    assert r["flops_per_sample"] == mlp_flops() and r["flops_source"] == COUNTED
    dtype = doc["config"]["amp"] if doc["config"]["amp"] in ("bf16", "fp16") else "fp32"
    peak = doc["probe"]["peak_tflops"][dtype]
    assert r["peak_tflops"] == peak and doc["probe"]["peak_basis"].startswith("measured")
    assert r["mfu"] == pytest.approx(r["samples_per_sec"] * mlp_flops() / (peak * 1e12),
                                     abs=1e-4)
    assert base["mfu"] == pytest.approx(base["samples_per_sec"] * mlp_flops() / (
        doc["probe"]["peak_tflops"]["fp32"] * 1e12), abs=1e-4)
    assert doc["diagnosis"] and {d["kind"] for d in doc["diagnosis"]} <= set(KINDS)


def test_mfu_counts_every_gpu_but_one_shared_cpu() -> None:
    assert mfu(100.0, 1e12, 400.0, 4, "cuda") == pytest.approx(100 * 1e12 / (4 * 400e12))
    assert mfu(100.0, 1e9, 0.5, 2, "cpu") == pytest.approx(100 * 1e9 / 0.5e12)
    assert mfu(100.0, None, 0.5, 1, "cpu") is None


def kinds(findings: list[Any]) -> list[str]:
    return [f.kind for f in findings]


def test_input_bound_names_the_loader_settings_and_the_gpu_idling() -> None:
    m = Measurement("ok", breakdown={"data_wait": 0.71, "compute": 0.29},
                    peak_memory_bytes=10 * GIB, gpu={"gpu_util_mean": 23.0}, mfu=0.05,
                    peak_tflops=700.0)
    (inp, low) = diagnose(m, Config(micro_batch_size=128, amp="bf16"), device="cuda",
                          limit=120 * GIB)
    assert inp.kind == "input-bound" and low.kind == "low-mfu"
    assert "71% of its time" in inp.text and "num_workers 0" in inp.text
    assert "GPU utilisation averaged 23%" in inp.text and "pin_memory makes" in inp.text
    assert inp.evidence["data_wait_share"] == 0.71
    assert "5% of the measured bf16 peak (35 of 700 TFLOP/s): see above" in low.text


def test_communication_bound_quotes_the_probe_bus_bandwidth() -> None:
    m = Measurement("ok", breakdown={"data_wait": 0.01, "comm_wait": 0.4, "compute": 0.59},
                    peak_memory_bytes=GIB)
    probe = {"allreduce_busbw_gbs": 12.5, "flags": []}
    found = diagnose(m, Config(world_size=2, ddp_bucket_cap_mb=25), device="cuda",
                     limit=80 * GIB, probe=probe)
    assert kinds(found) == ["communication-bound"]
    assert "40% of its time" in found[0].text and "12.5 GB/s" in found[0].text
    assert found[0].evidence["world_size"] == 2


def test_memory_bound_by_share_or_by_a_larger_batch_over_the_limit() -> None:
    m = Measurement("ok", breakdown={"data_wait": 0.0}, peak_memory_bytes=18 * GIB)
    found = diagnose(m, Config(micro_batch_size=64), device="cuda", limit=20 * GIB)
    assert kinds(found) == ["memory-bound"] and "90% of the 20.00 GiB limit" in found[0].text
    m = replace(m, peak_memory_bytes=10 * GIB)
    assert kinds(diagnose(m, Config(micro_batch_size=64), device="cuda",
                          limit=20 * GIB)) == ["compute-bound"]
    found = diagnose(m, Config(micro_batch_size=64), device="cuda", limit=20 * GIB,
                     larger_over_limit=MemoryWall(7, 128, measured=True))
    assert kinds(found) == ["memory-bound"]
    assert "micro-batch 128 passed it (trial 7)" in found[0].text
    assert "(test: the next micro-batch with a larger --memory-limit" in found[0].text
    # A wall the memory model only predicted is named as a prediction, and is no finding.
    (only,) = diagnose(m, Config(micro_batch_size=64), device="cuda", limit=20 * GIB,
                       larger_over_limit=MemoryWall(7, 128, measured=False))
    assert only.kind == "compute-bound"
    assert "micro-batch 128 is predicted to pass it (trial 7, not run)" in only.text
    assert only.evidence["predicted_over_limit"] == {"trial": 7, "micro_batch": 128}


def test_probe_flags_of_this_device_become_findings() -> None:
    probe = {"flags": ["GPU 3 runs PCIe Gen3 x8; it can run Gen4 x16",
                       "GPU 0 matmul bf16: 300 TFLOP/s is 30% of the 989.4 TFLOP/s theoretical",
                       "CPU GEMM fp32: 0.01 TFLOP/s is 4% of the 0.269 TFLOP/s theoretical"]}
    m = Measurement("ok", breakdown={}, peak_memory_bytes=GIB)
    found = diagnose(m, Config(), device="cuda", limit=80 * GIB, probe=probe)
    assert kinds(found) == ["degraded-link", "slow-device"]
    assert found[0].text == ("degraded link: GPU 3 runs PCIe Gen3 x8; it can run Gen4 x16 "
                             "(test: `autotune probe --refresh` after checking the machine)")
    on_cpu = diagnose(m, Config(), device="cpu", limit=80 * GIB, probe=probe)
    assert kinds(on_cpu) == ["slow-device"] and "CPU GEMM" in on_cpu[0].text


def test_compute_bound_when_nothing_else_holds_it_back() -> None:
    m = Measurement("ok", breakdown={"data_wait": 0.02, "compute": 0.98},
                    peak_memory_bytes=4 * GIB, mfu=0.62, peak_tflops=0.6)
    (only,) = diagnose(m, Config(amp="bf16"), device="cpu", limit=16 * GIB)
    assert only.kind == "compute-bound"
    assert only.text.startswith("compute-bound: MFU 62% of the measured bf16 peak; data wait 2%")
    assert only.evidence["mfu"] == 0.62
    # What would test it: a larger effective batch, by accumulation.
    assert "(test: grad_accum_steps 2 with micro-batch 8)" in only.text


def test_larger_over_limit_finds_the_smallest_larger_batch_that_failed_on_memory() -> None:
    def trial(number: int, micro: int, status: str, peak: int, **attrs: Any) -> TrialRecord:
        t = optuna.trial.create_trial(value=1.0, user_attrs={
            "config": Config(micro_batch_size=micro).to_dict(), "status": status,
            "measurement": {"peak_memory_bytes": peak}, **attrs})
        t.number = number
        found = read_trial(t)
        assert found is not None
        return found

    trials = [trial(0, 32, "ok", 5 * GIB), trial(1, 64, "ok", 9 * GIB),
              trial(2, 256, "oom", 0), trial(3, 128, "ok", 11 * GIB),
              trial(4, 512, "pruned", 0, predicted=True, reason="predicted-oom: peak 40.00 GiB"),
              trial(5, 1024, "timeout", 0, predicted=True, predicted_kind="too_slow"),
              trial(6, 2048, "timeout", 0)]
    # 128 passed a 10 GiB limit right above 64: the wall, measured.
    assert larger_over_limit(trials, Config(micro_batch_size=64), 10 * GIB) == \
        MemoryWall(3, 128, measured=True)
    assert larger_over_limit(trials, Config(micro_batch_size=128), 12 * GIB) == \
        MemoryWall(2, 256, measured=True)
    # Ruled out by the memory model: a wall, but a predicted one.
    assert larger_over_limit(trials, Config(micro_batch_size=256), 12 * GIB) == \
        MemoryWall(4, 512, measured=False)
    # Too slow to measure (measured or predicted) says nothing about memory.
    assert larger_over_limit(trials, Config(micro_batch_size=512), 12 * GIB) is None
    assert larger_over_limit(trials, Config(micro_batch_size=64, amp="bf16"), GIB) is None
    # 32 won although 64 and 128 fit: throughput stopped growing before the wall at 256.
    assert larger_over_limit(trials, Config(micro_batch_size=32), 12 * GIB) is None


def test_an_unmeasured_wait_is_no_evidence_of_compute_bound() -> None:
    # A script that reports no data wait: its breakdown has none, and nothing rules it out.
    m = Measurement("ok", breakdown={"compute": 1.0}, peak_memory_bytes=GIB,
                    script={"name": "t.py"})
    (only,) = diagnose(m, Config(micro_batch_size=16), device="cpu", limit=16 * GIB)
    assert only.kind == "unexplained"
    assert only.text.startswith("not diagnosed: no MFU (a script's FLOPs are not counted); ")
    assert "data wait unknown (not reported)" in only.text
    assert "(test: num_workers 2" not in only.text and "test: num_workers 2" in only.text
    assert only.evidence["data_wait_share"] is None
    # Two ranks of a script: the all-reduce wait is unknown too, though the data wait is not.
    m2 = Measurement("ok", breakdown={"data_wait": 0.01, "compute": 0.99},
                     peak_memory_bytes=GIB)
    (only,) = diagnose(m2, Config(world_size=2), device="cpu", limit=16 * GIB)
    assert only.kind == "unexplained" and "communication unknown (not reported)" in only.text


def test_a_test_the_script_cannot_run_says_so() -> None:
    m = Measurement("ok", breakdown={"data_wait": 0.0}, peak_memory_bytes=GIB)
    why = "train.py never uses accumulation_steps(): grad_accum_steps is not searched"
    (only,) = diagnose(m, Config(), device="cpu", limit=16 * GIB,
                       unapplied={"grad_accum_steps": why})
    assert f"test: grad_accum_steps 2 with micro-batch 8; not run by this study: {why}" \
        in only.text


def test_a_rate_beyond_the_machine_s_peak_is_not_a_measurement() -> None:
    from autotune.tuner.diagnosis import BEYOND_PEAK, with_efficiency

    probe = {"peak_tflops": {"fp32": 0.2, "bf16": 0.6}}
    # 1e9 FLOPs per sample: 200 samples/s is 0.2 TFLOP/s, the whole fp32 peak.
    at_peak = Measurement("ok", None, samples_per_sec=200.0, flops_per_sample=1e9, tflops=0.2)
    m = with_efficiency(at_peak, Config(), "cpu", probe)
    assert m.ok and m.mfu == pytest.approx(1.0)
    beyond = replace(at_peak, samples_per_sec=200.0 * (BEYOND_PEAK + 0.5),
                     tflops=0.2 * (BEYOND_PEAK + 0.5))
    m = with_efficiency(beyond, Config(), "cpu", probe)
    assert m.status == "error" and "beyond what this machine can do" in (m.reason or "")
    assert "2.0x the measured fp32 peak of 0.2 TFLOP/s" in (m.reason or "")
    # Against a probe taken under load the peak may be several times low: not refused.
    m = with_efficiency(beyond, Config(), "cpu", {**probe, "contended": "fp32 GEMM got 25%"})
    assert m.ok and m.mfu == pytest.approx(BEYOND_PEAK + 0.5)
    # Without FLOPs (a script's trial) nothing is known, nothing refused.
    m = with_efficiency(replace(beyond, flops_per_sample=None, tflops=None), Config(), "cpu",
                        probe)
    assert m.ok and m.mfu is None
