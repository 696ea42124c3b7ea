"""CUDA paths: run where a GPU is present (see scripts/gpu_check.sh); skipped elsewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autotune.config.knobs import Config
from autotune.trial.launch import execute, plan
from autotune.trial.measurement import classify
from autotune.trial.spec import MeasureSettings, TrialSpec
from autotune.workloads import WorkloadSpec
from tests.conftest import ROOT

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("amp", ["off", "fp16", "bf16"])
def test_bert_trial_on_cuda(tmp_path: Path, amp: str) -> None:
    p = plan(TrialSpec(WorkloadSpec("bert", {}), Config(micro_batch_size=32, amp=amp),
                       device="cuda", memory_limit_bytes=40 * 2**30,
                       measure=MeasureSettings(max_seconds=20)),
             workdir=tmp_path, timeout_s=300)
    raw = execute(p)
    m = classify(raw, "cuda")
    assert m.ok, (m.reason, raw.stderr_tail[-2000:])
    assert raw.result is not None
    assert raw.result["memory_source"] == "cuda_max_reserved+nvml_overhead"
    assert m.peak_memory_bytes > 2**30  # bert-base weights, Adam state and activations
    assert len(m.windows) >= 3 and m.samples_per_sec is not None and m.samples_per_sec > 10


def test_the_allocator_cap_turns_an_over_limit_config_into_a_real_oom(tmp_path: Path) -> None:
    p = plan(TrialSpec(WorkloadSpec("bert", {}), Config(micro_batch_size=512), device="cuda",
                       memory_limit_bytes=2 * 2**30, measure=MeasureSettings(max_seconds=20)),
             workdir=tmp_path, timeout_s=300)
    m = classify(execute(p), "cuda")
    assert m.status == "oom" and "OutOfMemoryError" in (m.reason or ""), m.reason


def test_the_tuner_does_not_initialise_cuda() -> None:
    code = ("import torch; from autotune.machine.hardware import detect; h = detect();"
            "assert h.device == 'cuda', h; assert not torch.cuda.is_initialized()")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.multi_gpu
def test_two_ranks_on_nccl_with_the_nccl_knobs(tmp_path: Path) -> None:
    """The nccl path: 2 ranks on 2 GPUs, NCCL_ALGO/NCCL_PROTO set, no_sync accumulation, and the
    all-reduce wait timed with CUDA events. (NCCL refuses two ranks on one GPU.)"""
    config = Config(micro_batch_size=16, grad_accum_steps=2, amp="bf16", world_size=2,
                    nccl_algo="Ring", nccl_proto="Simple", ddp_bucket_cap_mb=50)
    p = plan(TrialSpec(WorkloadSpec("bert", {}), config, device="cuda",
                       measure=MeasureSettings(max_seconds=20)),
             workdir=tmp_path, timeout_s=300)
    assert p.env["NCCL_ALGO"] == "Ring" and p.env["NCCL_PROTO"] == "Simple"
    raw = execute(p)
    m = classify(raw, "cuda")
    assert m.ok, (m.reason, raw.stderr_tail[-2000:])
    assert raw.result is not None and raw.result["backend"] == "nccl"
    assert m.ddp["bucket_cap_bytes"] == 50 * 2**20
    for rank in m.ranks:
        assert sorted(rank["comm"]["calls_by_micro"]) == ["1"]
    assert 0 <= m.breakdown["comm_wait"] < 1


def test_the_probe_measures_the_gpus(tmp_path: Path) -> None:
    """The real NVML and the GPU measurements: copies, memory bandwidth, matmul peaks."""
    import json

    env = {**__import__("os").environ, "AUTOTUNE_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "autotune", "probe", "--json", "--refresh",
                          "--no-allreduce"], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=400)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["gpus"] and doc["errors"] == [], doc["errors"]
    g = doc["gpus"][0]
    assert g["pcie"]["max_gen"] and g["memory_bandwidth_peak_gbs"]
    figs = doc["figures"]
    i = g["index"]
    for name in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "memory_bandwidth", "matmul.bf16",
                 "matmul.fp32"):
        assert figs[f"gpu{i}.{name}"]["value"] > 0, name
    assert figs[f"gpu{i}.matmul.bf16"]["value"] > figs[f"gpu{i}.matmul.fp32"]["value"]


def test_a_cuda_trial_is_monitored_and_counts_flops(tmp_path: Path) -> None:
    from autotune.machine.hardware import detect
    from autotune.machine.monitor import GpuMonitor
    from autotune.trial.spec import COUNTED

    hw = detect()
    p = plan(TrialSpec(WorkloadSpec("bert", {}), Config(micro_batch_size=32, amp="bf16"),
                       device="cuda", count_flops=True, measure=MeasureSettings(max_seconds=20)),
             workdir=tmp_path, timeout_s=300)
    m = classify(execute(p, monitor=GpuMonitor([hw.gpus[0].index])), "cuda")
    assert m.ok, m.reason
    assert m.gpu["scope"] == "timed windows" and m.gpu["gpu_util_mean"] > 0
    assert m.gpu["power_w_max"] > 0 and m.gpu["memory_used_bytes_max"] > 2**30
    assert m.flops_source == COUNTED and m.flops_per_sample and m.flops_per_sample > 5e10
