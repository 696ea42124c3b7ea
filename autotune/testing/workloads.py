"""Small workloads that misbehave on purpose, for testing trial isolation on any machine.

Use them as ``--model autotune.testing.workloads:memhog`` and friends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch


class _Numbers(torch.utils.data.Dataset):
    def __init__(self, features: int = 16) -> None:
        self.features = features

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.features,), float(index % 7))


@dataclass
class Tiny:
    """A linear model; subclasses change one thing."""

    name: str = "tiny"
    default_micro_batch: int = 4

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Linear(16, 1)

    def build_dataset(self) -> torch.utils.data.Dataset:
        return _Numbers()

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.01)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return model(batch).pow(2).mean()

    def flops_per_sample(self) -> float | None:
        return None


@dataclass
class MemHog(Tiny):
    """Holds ``mib_per_sample`` MiB of real, touched memory per sample of the micro-batch."""

    mib_per_sample: int = 8
    name: str = "memhog"

    def build_model(self) -> torch.nn.Module:
        model = torch.nn.Linear(16, 1)
        self._held: list[torch.Tensor] = []
        return model

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if not self._held:
            n = batch.shape[0] * self.mib_per_sample * 2**20 // 4
            self._held.append(torch.ones(n))  # ones(): pages are written, so they are resident
        return model(batch).pow(2).mean()


@dataclass
class Hang(Tiny):
    """Starts a child process, then never finishes building: for timeout and cleanup tests."""

    name: str = "hang"

    def build_model(self) -> torch.nn.Module:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["AUTOTUNE_TEST_CHILD_PID_FILE"], "w") as f:
            f.write(str(child.pid))
        while True:
            time.sleep(1)


@dataclass
class Crash(Tiny):
    """Raises in the training step, or dies from a signal with ``how="segfault"``."""

    how: str = "raise"
    name: str = "crash"

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if self.how == "segfault":
            import ctypes

            ctypes.string_at(0)  # reads address 0: SIGSEGV
        raise ValueError("this workload always fails in its training step")


@dataclass
class Slow(Tiny):
    """Each micro-batch sleeps ``step_s x (batch / 4) ** exponent`` seconds: for budget tests.

    With ``exponent`` 0.5 a bigger batch takes longer per step but gives more samples/s, as on
    real accelerators."""

    step_s: float = 1.0
    exponent: float = 0.0
    name: str = "slow"

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        time.sleep(self.step_s * (batch.shape[0] / 4) ** self.exponent)
        return model(batch).pow(2).mean()


def tiny() -> Tiny:
    return Tiny()


def memhog(mib_per_sample: int = 8) -> MemHog:
    return MemHog(mib_per_sample=mib_per_sample)


def hang() -> Hang:
    return Hang()


def crash(how: str = "raise") -> Crash:
    return Crash(how=how)


def slow(step_s: float = 1.0, exponent: float = 0.0) -> Slow:
    return Slow(step_s=step_s, exponent=exponent)
