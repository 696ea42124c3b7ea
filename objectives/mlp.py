"""mlp: a tiny multilayer perceptron on generated features; a trial takes ~2 s (for tests).

torch is imported where it is used: the tuner resolves a workload to plan trials and needs no
torch for that (the trial processes do the training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class FeatureDataset:
    """Each sample is computed on access (a small decode-like transform), like real input.
    Map-style: a DataLoader needs only ``__len__`` and ``__getitem__``."""

    def __init__(self, features: int, classes: int, length: int) -> None:
        self.features, self.classes, self.length = features, classes, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        gen = torch.Generator().manual_seed(index)
        raw = torch.randn(self.features, generator=gen)
        x = (raw - raw.mean()) / (raw.std() + 1e-6)  # per-sample normalisation
        return x, torch.tensor(index % self.classes)


@dataclass
class MLP:
    features: int = 64
    hidden: int = 256
    classes: int = 10
    name: str = "mlp"
    default_micro_batch: int = 32
    supports: tuple[str, ...] = ("optimizer_impl", "compile")

    def build_model(self) -> torch.nn.Module:
        import torch

        return torch.nn.Sequential(
            torch.nn.Linear(self.features, self.hidden), torch.nn.GELU(),
            torch.nn.Linear(self.hidden, self.hidden), torch.nn.GELU(),
            torch.nn.Linear(self.hidden, self.classes))

    def build_dataset(self) -> FeatureDataset:
        return FeatureDataset(self.features, self.classes, length=100_000)

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        import torch

        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        import torch

        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    def flops_per_sample(self) -> float:
        f, h, c = self.features, self.hidden, self.classes
        return 6.0 * (f * h + h * h + h * c)


def build(features: int = 64, hidden: int = 256, classes: int = 10) -> MLP:
    return MLP(features=features, hidden=hidden, classes=classes)
