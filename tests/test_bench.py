"""The in-trial loop's set-up, on paths this machine can only reach with CUDA recorded instead
of made (autotune.testing.cuda); the loop itself runs for real in test_launch and test_ddp."""

from __future__ import annotations

import pytest
import torch

from autotune.config.knobs import Config
from autotune.testing.cuda import recorded_cuda
from autotune.trial.bench.build import build
from autotune.trial.bench.device import Memory
from autotune.trial.spec import TrialSpec
from autotune.workloads import WorkloadSpec


class _Joined(Exception):
    """Raised where the trial would join its ranks: everything before it is device set-up."""


class _Ranks:
    world = 1

    def start(self, device: torch.device) -> None:
        raise _Joined


def test_a_cuda_trial_sets_its_device_and_limit_before_resetting_its_peak() -> None:
    # The peak's reset needs the CUDA context set_device creates: reset first, and every CUDA
    # trial failed with "Invalid device argument" (a reordering once did this).
    cuda = torch.device("cuda", 0)
    spec = TrialSpec(WorkloadSpec("mlp", {}), Config(), "cuda", memory_limit_bytes=40 * 2**30)
    with recorded_cuda(total_memory=80 * 2**30) as calls, pytest.raises(_Joined):
        build(spec, cuda, _Ranks(), {}, Memory(cuda))  # type: ignore[arg-type]
    assert calls == [("set_device", cuda), ("set_per_process_memory_fraction", 0.5, cuda),
                     ("reset_peak_memory_stats", cuda)]
