"""The examples as trials of `autotune run -- CMD`: each reports its optimizer steps (plain loop,
Hugging Face callback, Lightning callback) and stops at the step the tuner names; outside a
trial they write nothing. Real processes, real frameworks, tiny models on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autotune.config.knobs import Config
from autotune.machine.hardware import detect
from autotune.profile import Profile
from tests.conftest import EXAMPLE_FRAMEWORKS, EXAMPLES, ROOT, needs_framework

pytestmark = pytest.mark.slow
MICRO, ACCUM, STOP_AT = 4, 2, 6
HUGE = ["--max-steps", "1000000"]
# Per example: the arguments of a run the tuner stops.
EXAMPLE_RUNS = {
    "train_plain.py": [*HUGE, "--seconds", "1e9", "--warmup-steps", "1"],
    "train_hf.py": [*HUGE, "--seq-len", "16"],
    "train_lightning.py": HUGE,
}


def write_candidate(path: Path, spec: str = "mlp") -> Path:
    """The profile the tuner writes for a trial (a candidate: nothing measured yet), valid for
    this machine: ``MICRO`` samples per micro-batch, ``ACCUM`` micro-batches per optimizer step,
    fp32, no loader workers (the quickest start)."""
    config = Config(micro_batch_size=MICRO, grad_accum_steps=ACCUM, amp="off", num_workers=0)
    Profile(workload={"name": spec, "spec": spec, "params": {}}, config=config, env={},
            result={"samples_per_sec": 0.0}, baseline={}, speedup=None,
            fingerprint=detect().fingerprint(),
            provenance={"study": "s", "trial": "t", "candidate": True}).save(path)
    return path


def run_example(name: str, argv: list[str], cwd: Path, env: dict[str, str],
                ) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")
            or k in ("AUTOTUNE_CACHE_DIR", "AUTOTUNE_LOCK_DIR")}
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *argv], cwd=cwd,
                         capture_output=True, text=True, timeout=120,
                         env={**base, "PYTHONPATH": str(ROOT), **env})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def step_lines(trial: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The first line of rank 0's steps file, and its step lines."""
    lines = [json.loads(line) for line in (trial / "steps.rank0.jsonl").read_text().splitlines()]
    return lines[0], [line for line in lines if "s" in line]


@pytest.mark.parametrize("name", list(EXAMPLE_RUNS))
def test_an_example_reports_its_steps_and_stops_where_the_tuner_says(tmp_path: Path,
                                                                     name: str) -> None:
    needs_framework(name)
    argv = EXAMPLE_RUNS[name]
    trial = tmp_path / "trial"
    trial.mkdir()
    (trial / "stop.json").write_text(json.dumps({"at_step": STOP_AT}))
    # The plain loop under a profile tuned on a command: it trains its default workload (mlp).
    profile = write_candidate(tmp_path / "p.yaml",
                              "command" if name == "train_plain.py" else "mlp")
    run_example(name, argv, tmp_path, {"AUTOTUNE_PROFILE": str(profile),
                                       "AUTOTUNE_TRIAL_DIR": str(trial),
                                       "AUTOTUNE_SAMPLES_PER_STEP": str(MICRO * ACCUM)})

    first, steps = step_lines(trial)
    assert first["rank"] == 0 and "start" in first
    assert [s["s"] for s in steps] == list(range(1, STOP_AT + 1))
    times = [s["t"] for s in steps]
    assert times == sorted(times) and len(set(times)) == len(times)
    # The plain loop's count is the tuned config's (the environment's); the callbacks count
    # their own: the Trainer's batch x accumulation, Lightning's batches' leading dimension.
    assert {s["n"] for s in steps} == {MICRO * ACCUM}
    # The callbacks count, not the default; and measure the wait for data from step 2 on.
    if EXAMPLE_FRAMEWORKS[name]:
        assert "default" not in steps[0] and "d" not in steps[0]
        assert all(s["d"] >= 0 for s in steps[1:])


# Outside a trial, each example runs as before and writes no steps: test_script_trials.py's
# test_each_example_is_tuned_as_it_is_and_runs_its_profile runs each with its tuned profile.


def test_importing_autotune_imports_no_framework() -> None:
    code = ("import sys, autotune, autotune.integrations; "
            "print([m for m in ('transformers', 'lightning', 'pytorch_lightning') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_script_on_the_older_pytorch_lightning_gets_that_packages_strategy() -> None:
    """A Trainer takes only its own package's callbacks and strategies: a script that imported
    pytorch_lightning alone gets both from it, and its Trainer takes them."""
    pytest.importorskip("pytorch_lightning")
    fixture = ROOT / "tests" / "data" / "profile_v1_ddp.yaml"  # two ranks: a DDP strategy
    code = ("import sys, pytorch_lightning as pl; from autotune import load_profile; "
            "from autotune.integrations.lightning import AutotuneCallback; "
            f"kwargs = load_profile({str(fixture)!r}, check_fingerprint=False)"
            ".lightning_trainer_kwargs(); "
            "pl.Trainer(logger=False, enable_checkpointing=False, accelerator='cpu', "
            "callbacks=[AutotuneCallback()], **kwargs); "
            "print(type(kwargs['strategy']).__module__, 'lightning.pytorch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["pytorch_lightning.strategies.ddp", "False"], out.stdout


def test_the_lightning_callback_counts_a_batchs_leading_dimension() -> None:
    pytest.importorskip("lightning")
    import torch

    from autotune.integrations.lightning import batch_size

    x, y = torch.zeros(5, 3), torch.zeros(5)
    assert batch_size(x) == 5
    assert batch_size((x, y)) == batch_size([x, y]) == 5
    assert batch_size({"ids": x, "mask": torch.zeros(7)}) == 5
    assert batch_size({"meta": "text", "inputs": [x]}) == 5  # the first tensor, depth first
    assert batch_size({"meta": "text"}) is None and batch_size(torch.tensor(1.0)) is None
