"""The examples train for real with a profile: plain PyTorch, Hugging Face Trainer, Lightning,
on one rank and on two (gloo), started directly, through torchrun and through `autotune launch`."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.config.knobs import Config
from autotune.profile import load_profile
from tests.conftest import ROOT, autotune

pytestmark = pytest.mark.slow
EXAMPLES = ROOT / "examples"
DATA = Path(__file__).parent / "data"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2"]


def run_json(argv: list[str], cwd: Path, timeout: float = 240) -> dict:
    """Run an example (or `autotune launch`); its last stdout line is its JSON report."""
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_plain_loop_reproduces_the_profiles_throughput(tuned_mlp: Path,
                                                           tmp_path: Path) -> None:
    """Tune mlp, then train it with the profile in the example's loop: the loop's samples/sec is
    within 15% of the profile's.

    The profile's figure comes from trial processes (the confirmation's median). On the shared
    2-core machine CI runs on, throughput drifts by up to ~30% within minutes (measured: loops
    right after a study at 0.80x and at 1.29x its figure), so a single comparison with a figure
    taken a minute earlier fails often for reasons outside the code. The tight check is made
    the way such drift is handled in benchmarks, interleaved: loop runs alternate with
    `autotune profile check` rounds, which measure the profile's config exactly as its figure
    was measured, and the best of each must agree within 15%. The best, not the median: other
    load on a shared machine only ever slows a run down, so the fastest run of each kind is the
    least disturbed (medians of three failed the check once in CI with every loop run and every
    check round moving by up to 1.8x within a minute). The check itself builds the trial from
    the config, not through the Profile methods the loop uses, so a profile misapplied by the
    loop (batch size, precision, loader) shows. The recorded figure must still be the same kind
    of number (within 40%)."""
    profile = load_profile(tuned_mlp)
    exported = yaml.safe_load(tuned_mlp.read_text())
    assert Config.from_dict(exported["config"]) == profile.config
    assert profile.confirmation is not None  # the figure is the interleaved re-measurement's
    loops, trials = [], []
    for _ in range(3):
        # The check passes on the machine that tuned the profile; its threshold checks the
        # mechanics, not this machine's run-to-run noise.
        out = autotune("profile", "check", str(tuned_mlp), "--rounds", "1", "--threshold",
                       "0.5", cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "ratio" in out.stdout and "PASS" in out.stdout
        found = re.search(r"round 1/1: ([\d,.]+) samples/s", out.stdout)
        assert found, out.stdout
        trials.append(float(found.group(1).replace(",", "")))
        report = run_json([sys.executable, str(EXAMPLES / "train_plain.py"), "--profile",
                           str(tuned_mlp), "--seconds", "5"], tmp_path)
        assert report["profile_samples_per_sec"] == pytest.approx(profile.samples_per_sec)
        loops.append(report["samples_per_sec"])
    ratio = max(loops) / max(trials)
    assert abs(ratio - 1) <= 0.15, (loops, trials)
    assert abs(statistics.median(loops) / profile.samples_per_sec - 1) <= 0.4, \
        (loops, profile.samples_per_sec)


def test_the_plain_loop_on_two_ranks_through_autotune_launch(tmp_path: Path) -> None:
    report = run_json([sys.executable, "-m", "autotune", "launch",
                       str(DATA / "profile_v1_ddp.yaml"), "--", *TORCHRUN,
                       str(EXAMPLES / "train_plain.py"), "--seconds", "2"], tmp_path)
    assert report["steps"] >= 3 and report["samples_per_sec"] > 0
    assert report["loss"] == report["loss"]  # not NaN under bf16 + accumulation + DDP


def test_hugging_face_trainer_trains_with_the_profile_on_two_ranks(tmp_path: Path) -> None:
    report = run_json([sys.executable, "-m", "autotune", "launch",
                       str(DATA / "profile_v1_ddp.yaml"), "--", *TORCHRUN,
                       str(EXAMPLES / "train_hf.py"), "--max-steps", "4"], tmp_path)
    assert report["steps"] == 4 and report["world_size"] == 2
    assert report["args"]["per_device_train_batch_size"] == 32
    assert report["args"]["gradient_accumulation_steps"] == 2 and report["args"]["bf16"]
    assert report["args"]["ddp_bucket_cap_mb"] == 10


def test_hugging_face_trainer_trains_with_a_tuned_profile(tuned_mlp: Path,
                                                          tmp_path: Path) -> None:
    report = run_json([sys.executable, str(EXAMPLES / "train_hf.py"), "--profile",
                       str(tuned_mlp), "--max-steps", "3"], tmp_path)
    profile = load_profile(tuned_mlp)
    assert report["steps"] == 3 and report["world_size"] == 1
    assert report["args"]["per_device_train_batch_size"] == profile.micro_batch_size


@pytest.mark.parametrize("fixture, world", [("profile_v1.yaml", 1), ("profile_v1_ddp.yaml", 2)])
def test_lightning_trains_with_the_profile(tmp_path: Path, fixture: str, world: int) -> None:
    profile = load_profile(DATA / fixture, check_fingerprint=False)
    report = run_json([sys.executable, str(EXAMPLES / "train_lightning.py"), "--profile",
                       str(DATA / fixture), "--max-steps", "4"], tmp_path)
    assert report["steps"] == 4 and report["world_size"] == world
    assert report["precision"] == "bf16-mixed"
    assert report["accumulate_grad_batches"] == profile.accumulation_steps
    if world > 1:
        assert report["ddp_kwargs"] == {"bucket_cap_mb": 10, "gradient_as_bucket_view": True}


def test_profile_check_fails_below_its_threshold(tuned_mlp: Path, tmp_path: Path) -> None:
    # Passing on the machine that tuned it: the reproduction test's check rounds. Here a
    # threshold no re-measurement can meet: the check fails with exit 1 and says why.
    out = autotune("profile", "check", str(tuned_mlp), "--rounds", "1", "--threshold", "5",
                   cwd=tmp_path)
    assert out.returncode == 1 and "FAIL: ratio below 5" in out.stderr, out.stdout + out.stderr
    assert "error" not in out.stderr, out.stderr
