from __future__ import annotations

import subprocess
import sys

from autotune.machine.hardware import detect


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
