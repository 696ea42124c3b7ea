from __future__ import annotations

import subprocess
import sys

import pytest

from autotune.errors import UsageError
from autotune.machine.hardware import detect, memory_limit
from autotune.testing.hardware import fake_cpu, fake_gpus


def test_detect_reads_this_machine() -> None:
    hw = detect()
    assert hw.cpu_cores >= 1 and hw.memory_total_bytes > 0
    if not hw.gpus:
        assert hw.device == "cpu" and hw.notes
    fp = hw.fingerprint()
    assert fp["torch_version"] and "memory_available_bytes" not in fp
    assert hw.fingerprint_id() == detect().fingerprint_id()  # stable across calls


def test_the_tuner_reads_torchs_build_without_importing_torch() -> None:
    """The tuner plans trials without torch: the fingerprint's torch and CUDA versions come from
    torch's version file, and must be what torch itself says, or every study would change its
    fingerprint. The built-in workloads resolve without torch too."""
    code = ("import sys; from autotune.machine.hardware import torch_build; "
            "from autotune.workloads "
            "import resolve; found = torch_build(); [resolve(w) for w in ('mlp', 'bert', "
            "'gpt2', 'autotune.testing.workloads:memhog')]; assert 'torch' not in sys.modules; "
            "import torch; assert found == (str(torch.__version__), torch.version.cuda), found")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_memory_limit_defaults() -> None:
    cpu = fake_cpu(memory_gib=24)  # 22 GiB available
    assert memory_limit(None, cpu) == int(22 * 2**30 * 0.8)
    gpu = fake_gpus(1, memory_gib=80)
    assert memory_limit(None, gpu) == int(80 * 2**30 * 0.9)


@pytest.mark.parametrize(("spec", "expected"), [
    ("20GiB", 20 * 2**30), ("512MiB", 512 * 2**20), ("16gb", 16 * 10**9), ("0.5", 11 * 2**30),
    ("1.5 GiB", int(1.5 * 2**30)),
])
def test_memory_limit_sizes_and_fractions(spec: str, expected: int) -> None:
    assert memory_limit(spec, fake_cpu(memory_gib=24)) == expected


@pytest.mark.parametrize(("spec", "message"), [
    ("100GiB", "above this machine's RAM"),
    ("lots", "a size like 20GiB"),
    ("-1", "a size like 20GiB"),
    ("12", "below 1 MiB"),
])
def test_memory_limit_errors_say_the_fix(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        memory_limit(spec, fake_cpu(memory_gib=24))
