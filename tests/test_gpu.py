"""CUDA paths: run where a GPU is present (see scripts/gpu_check.sh); skipped elsewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autotune.knobs import Config
from autotune.launch import execute, plan
from autotune.measurement import classify
from tests.conftest import ROOT

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("amp", ["off", "fp16", "bf16"])
def test_bert_trial_on_cuda(tmp_path: Path, amp: str) -> None:
    p = plan(workload={"spec": "bert", "params": {}}, config=Config(micro_batch_size=32, amp=amp),
             device="cuda", workdir=tmp_path, timeout_s=300, measure={"max_seconds": 20},
             memory_limit_bytes=40 * 2**30)
    raw = execute(p)
    m = classify(raw, "cuda")
    assert m.ok, (m.reason, raw.stderr_tail[-2000:])
    assert raw.result is not None
    assert raw.result["memory_source"] == "cuda_max_reserved+nvml_overhead"
    assert m.peak_memory_bytes > 2**30  # bert-base weights, Adam state and activations
    assert len(m.windows) >= 3 and m.samples_per_sec is not None and m.samples_per_sec > 10


def test_the_allocator_cap_turns_an_over_limit_config_into_a_real_oom(tmp_path: Path) -> None:
    p = plan(workload={"spec": "bert", "params": {}}, config=Config(micro_batch_size=512),
             device="cuda", workdir=tmp_path, timeout_s=300, measure={"max_seconds": 20},
             memory_limit_bytes=2 * 2**30)
    m = classify(execute(p), "cuda")
    assert m.status == "oom" and "OutOfMemoryError" in (m.reason or ""), m.reason


def test_the_tuner_does_not_initialise_cuda() -> None:
    code = ("import torch; from autotune.hardware import detect; h = detect();"
            "assert h.device == 'cuda', h; assert not torch.cuda.is_initialized()")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
