from __future__ import annotations

import platform
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from autotune.machine.hardware import (
    CPU_IDENTITY,
    compare_fingerprints,
    cpu_flags,
    cpu_identity,
    describe_fingerprint,
    detect,
    isa_flags,
)
from autotune.testing.hardware import fake_cpu


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


# Three 2-core, 24 GiB VMs that /proc/cpuinfo names alike, 2x apart in GEMM speed.
ZEN3 = {"cpu_model": "AMD EPYC", "cpu_vendor": "AuthenticAMD", "cpu_family": 25,
        "cpu_model_number": 1, "cpu_stepping": 1, "cpu_flags": ("avx2", "fma")}
ZEN4 = {**ZEN3, "cpu_model_number": 17, "cpu_flags": (
    "avx2", "avx512_bf16", "avx512bw", "avx512f", "fma")}
ZEN5 = {**ZEN4, "cpu_family": 26, "cpu_model_number": 2}


def test_cpus_of_one_name_are_different_machines() -> None:
    """A fleet of "AMD EPYC" VMs mixed Zen 3, 4 and 5: their fingerprints (the study's name and
    resume guard, the probe cache's key) tell them apart, and so does the one-line view."""
    zen3, zen4, zen5 = (replace(fake_cpu(), **cpu) for cpu in (ZEN3, ZEN4, ZEN5))
    assert len({hw.fingerprint_id() for hw in (zen3, zen4, zen5)}) == 3
    assert compare_fingerprints(zen3.fingerprint(), zen4.fingerprint()).differs == [
        "cpu_flags: ['avx2', 'fma'] vs ['avx2', 'avx512_bf16', 'avx512bw', 'avx512f', 'fma'] "
        "here", "cpu_model_number: 1 vs 17 here"]
    assert zen4.describe() == "CPU AMD EPYC (family 25 model 17), 2 cores, bf16"
    assert describe_fingerprint(zen5.fingerprint()) == \
        "CPU AMD EPYC (family 26 model 2), 2 cores, bf16"
    assert describe_fingerprint(replace(zen3, cpu_bf16=False).fingerprint()) == \
        "CPU AMD EPYC (family 25 model 1), 2 cores, no native bf16"
    # A fingerprint stored before these fields: the plain view it always had.
    old = {k: v for k, v in zen3.fingerprint().items() if k not in CPU_IDENTITY}
    assert describe_fingerprint(old) == "CPU AMD EPYC, 2 cores"
    # The test doubles leave them unread, and keep working.
    assert fake_cpu().fingerprint()["cpu_family"] is None
    assert fake_cpu().describe() == "CPU Fake CPU, 2 cores, bf16"
    assert describe_fingerprint(fake_cpu().fingerprint()) == "CPU Fake CPU, 2 cores"


def test_a_fingerprint_from_before_the_cpu_fields_is_unverified_not_different() -> None:
    here = replace(fake_cpu(), **ZEN4).fingerprint()
    old = {k: v for k, v in here.items() if k not in CPU_IDENTITY}
    match = compare_fingerprints(old, here)
    assert match.same and match.differs == [] and match.unverified == list(CPU_IDENTITY)
    assert match.unverified_words() == "vendor, family, model, stepping, ISA flags"
    # Fields present in both must match; the missing ones do not hide a real difference.
    other = compare_fingerprints({**old, "cpu_cores": 4}, here)
    assert other.differs == ["cpu_cores: 4 vs 2 here"] and other.unverified
    # Recorded on both: compared like any field, None included.
    assert compare_fingerprints({**old, "cpu_family": None, "cpu_vendor": None,
                                 "cpu_model_number": None, "cpu_stepping": None,
                                 "cpu_flags": []}, here).differs == [
        "cpu_family: None vs 25 here", "cpu_flags: [] vs ['avx2', 'avx512_bf16', 'avx512bw', "
        "'avx512f', 'fma'] here", "cpu_model_number: None vs 17 here",
        "cpu_stepping: None vs 1 here", "cpu_vendor: None vs 'AuthenticAMD' here"]
    # A field the stored one has and this machine lacks still differs.
    assert compare_fingerprints({**here, "extra": 1}, here).differs == ["extra: 1 vs None here"]


def test_only_the_isa_flags_that_decide_speed_are_kept() -> None:
    x86 = {"fpu", "sse2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16",
           "avx_vnni", "smep", "smap", "hypervisor", "constant_tsc", "rdrand"}
    assert isa_flags(x86) == ("amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512f",
                              "avx_vnni", "fma")
    arm = {"fp", "asimd", "aes", "sve", "sve2", "svebf16", "i8mm", "bf16", "sme", "sme2",
           "atomics", "cpuid"}
    assert isa_flags(arm) == ("bf16", "i8mm", "sme", "sme2", "sve", "sve2", "svebf16")


def test_this_machines_cpu_identity_is_read() -> None:
    hw = detect()
    identity = cpu_identity()
    assert {k: getattr(hw, k) for k in identity} == identity
    if Path("/proc/cpuinfo").exists() and platform.machine() in ("x86_64", "AMD64"):
        assert hw.cpu_vendor and hw.cpu_family is not None and hw.cpu_model_number is not None
        assert set(hw.cpu_flags) <= cpu_flags() and list(hw.cpu_flags) == sorted(hw.cpu_flags)
        assert f"(family {hw.cpu_family} model {hw.cpu_model_number})" in hw.describe()
