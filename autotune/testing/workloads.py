"""Small workloads that misbehave on purpose, for testing trial isolation on any machine.

Use them as ``--model autotune.testing.workloads:memhog`` and friends. torch is imported where
it is used, as in the built-in workloads: the tuner resolves a workload without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _this_rank(rank: int | None) -> bool:
    """Whether a misbehaviour aimed at ``rank`` (None: every rank) is meant for this process."""
    return rank is None or int(os.environ.get("RANK", "0")) == rank


class _Numbers:
    def __init__(self, features: int = 16) -> None:
        self.features = features

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> torch.Tensor:
        import torch

        return torch.full((self.features,), float(index % 7))


@dataclass
class Tiny:
    """A linear model; subclasses change one thing."""

    name: str = "tiny"
    default_micro_batch: int = 4
    supports: tuple[str, ...] = ("optimizer_impl", "compile")

    def build_model(self) -> torch.nn.Module:
        import torch

        return torch.nn.Linear(16, 1)

    def build_dataset(self) -> _Numbers:
        return _Numbers()

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        import torch

        # Small enough that the loss stays finite on these inputs (values up to 6 in 16
        # features): at 0.01 it grew without bound and went NaN within a few hundred steps.
        return torch.optim.SGD(model.parameters(), lr=1e-4)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return model(batch).pow(2).mean()

    def flops_per_sample(self) -> float | None:
        return None


class _SlowNumbers(_Numbers):
    def __init__(self, item_s: float) -> None:
        super().__init__()
        self.item_s = item_s

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.item_s)  # the per-sample CPU work of a real pipeline, as a wait
        return super().__getitem__(index)


@dataclass
class SlowData(Tiny):
    """Each sample takes ``item_s`` to load: the step waits for data (input-bound) unless
    loader workers prepare batches ahead."""

    item_s: float = 0.005
    name: str = "slowdata"

    def build_dataset(self) -> _Numbers:
        return _SlowNumbers(self.item_s)


@dataclass
class MemHog(Tiny):
    """Holds ``mib_per_sample`` MiB of real, touched memory per sample of the micro-batch (with
    ``rank``, on that rank of a multi-rank trial only)."""

    mib_per_sample: int = 8
    name: str = "memhog"
    rank: int | None = None

    def build_model(self) -> torch.nn.Module:
        self._held: list[torch.Tensor] = []
        return super().build_model()

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if not self._held and _this_rank(self.rank):
            import torch

            n = batch.shape[0] * self.mib_per_sample * 2**20 // 4
            self._held.append(torch.ones(n))  # ones(): pages are written, so they are resident
        return model(batch).pow(2).mean()


@dataclass
class Hang(Tiny):
    """Starts a child process, then never finishes building: for timeout and cleanup tests.
    With ``rank``, only that rank of a multi-rank trial hangs (the others wait for it)."""

    name: str = "hang"
    rank: int | None = None

    def build_model(self) -> torch.nn.Module:
        if not _this_rank(self.rank):
            return super().build_model()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        path = os.environ["AUTOTUNE_TEST_CHILD_PID_FILE"]
        with open(path + ".tmp", "w") as f:
            f.write(str(child.pid))
        os.replace(path + ".tmp", path)  # whole: a test reads it as soon as it exists
        while True:
            time.sleep(1)


@dataclass
class Diverge(Tiny):
    """Each micro-batch sleeps ``step_s`` (so bigger batches are faster), and from micro-batch
    ``from_batch`` on the loss is NaN: the fastest config does not train."""

    step_s: float = 0.05
    from_batch: int = 8
    name: str = "diverge"

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        time.sleep(self.step_s)
        loss = model(batch).pow(2).mean()
        return loss * float("nan") if batch.shape[0] >= self.from_batch else loss


@dataclass
class Orphan(Tiny):
    """On its first step, starts a grandchild that leaves the trial's session (setsid), ignores
    SIGTERM and drops the environment (so no trial token), writes its pid to ``pid_file``, and
    sleeps; then the step hangs until the trial is ended from outside. With ``quick``, the
    grandchild's parent is a forked middle process that exits at once, so no look at the
    trial's process tree ever sees the grandchild below the trial."""

    pid_file: str = "orphan.pid"
    name: str = "orphan"
    quick: bool = False

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        code = ("import os, signal, time; os.setsid(); "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"tmp = {self.pid_file!r} + '.tmp'; open(tmp, 'w').write(str(os.getpid())); "
                f"os.replace(tmp, {self.pid_file!r}); time.sleep(600)")
        argv = [sys.executable, "-c", code]
        if not self.quick:
            subprocess.Popen(argv, env={})
        elif (middle := os.fork()) == 0:
            if os.fork() == 0:
                os.execve(sys.executable, argv, {})
            os._exit(0)
        else:
            os.waitpid(middle, 0)
        time.sleep(600)
        return model(batch).pow(2).mean()


@dataclass
class Crash(Tiny):
    """Raises ``message`` in the training step, or dies from a signal with ``how="segfault"``.
    With ``rank``, only that rank of a multi-rank trial fails, after ``after`` good micro-steps."""

    how: str = "raise"
    name: str = "crash"
    rank: int | None = None
    after: int = 0
    message: str = "this workload always fails in its training step"

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if not _this_rank(self.rank) or self.after > 0:
            self.after -= 1
            return model(batch).pow(2).mean()
        if self.how == "segfault":
            import ctypes

            ctypes.string_at(0)  # reads address 0: SIGSEGV
        raise ValueError(self.message)


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


@dataclass
class SlowRank(Tiny):
    """Rank ``rank``'s optimizer step sleeps ``extra_s`` more: after the gradient all-reduce,
    where the ranks are not in lockstep, so that rank's windows are measurably the longest."""

    rank: int = 1
    extra_s: float = 0.02
    name: str = "slowrank"

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = super().build_optimizer(model)
        if _this_rank(self.rank):
            step = optimizer.step

            def slower(closure: Any = None) -> Any:
                time.sleep(self.extra_s)
                return step(closure)

            optimizer.step = slower
        return optimizer


def tiny() -> Tiny:
    return Tiny()


def memhog(mib_per_sample: int = 8, rank: int | None = None) -> MemHog:
    return MemHog(mib_per_sample=mib_per_sample, rank=rank)


def hang(rank: int | None = None) -> Hang:
    return Hang(rank=rank)


def crash(how: str = "raise", rank: int | None = None, after: int = 0,
          message: str = "this workload always fails in its training step") -> Crash:
    return Crash(how=how, rank=rank, after=after, message=message)


def slowrank(rank: int = 1, extra_s: float = 0.02) -> SlowRank:
    return SlowRank(rank=rank, extra_s=extra_s)


def orphan(pid_file: str = "orphan.pid", quick: bool = False) -> Orphan:
    return Orphan(pid_file=pid_file, quick=quick)


def diverge(step_s: float = 0.05, from_batch: int = 8) -> Diverge:
    return Diverge(step_s=step_s, from_batch=from_batch)


def slowdata(item_s: float = 0.005) -> SlowData:
    return SlowData(item_s=item_s)


def slow(step_s: float = 1.0, exponent: float = 0.0) -> Slow:
    return Slow(step_s=step_s, exponent=exponent)
