"""A Lightning script as a user has it: it knows nothing of autotune. A LightningModule and a
Trainer(...) in main; ``--package pytorch_lightning`` imports the older package instead.

    python lit_unchanged.py [--package lightning|pytorch_lightning] [--precision 32-true]
                            [--epochs N]

It prints a JSON line of what its Trainer trained with.
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--package", default="lightning", choices=["lightning",
                                                                   "pytorch_lightning"])
    parser.add_argument("--precision", help="passed to Trainer(precision=...) when given")
    parser.add_argument("--epochs", type=int, default=50)
    args = parser.parse_args()
    pl = importlib.import_module("lightning.pytorch" if args.package == "lightning"
                                 else "pytorch_lightning")

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                           torch.nn.Linear(256, 1))

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=gen)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    extra = {"precision": args.precision} if args.precision else {}
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **extra)
    trainer.fit(Regression(), loader)
    if trainer.global_rank == 0:
        print(json.dumps({"precision": str(trainer.precision),
                          "accumulate_grad_batches": trainer.accumulate_grad_batches,
                          "steps": trainer.global_step}))


if __name__ == "__main__":
    main()
