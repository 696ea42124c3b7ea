"""A user's own workload, as a file: `autotune run --model tests/data/custom_workload.py`."""

from __future__ import annotations

import torch


class Regression:
    name = "regression"
    default_micro_batch = 16

    def __init__(self, width: int = 32) -> None:
        self.width = width

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(self.width, self.width), torch.nn.ReLU(),
                                   torch.nn.Linear(self.width, 1))

    def build_dataset(self) -> torch.utils.data.Dataset:
        x = torch.randn(4096, self.width)
        return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-3)

    def loss(self, model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    def flops_per_sample(self) -> float:
        return 6.0 * (2 * self.width * self.width)


def build(width: int = 32) -> Regression:
    return Regression(width)
