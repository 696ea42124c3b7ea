"""A Lightning script of the shape of Lightning's own examples (``examples/pytorch/basics/
transformer.py``), as a user has it: it knows nothing of autotune. Its Trainer keeps
Lightning's defaults for what it writes (the logger's ``lightning_logs/version_N`` and a
checkpoint per epoch, in the working directory) unless told otherwise; after fitting it
tests, and saves a checkpoint of its own.

    python lit_outputs.py [--epochs N] [--logger csv_logs] [--checkpoints DIR]
                          [--resume CKPT] [--save final.ckpt]

It prints, on stderr, the step its training starts from, and on stdout a JSON line of what it
trained.
"""

from __future__ import annotations

import argparse
import json
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 1))

    def loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self) -> None:
        print(f"training from step {self.global_step}", file=sys.stderr, flush=True)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
        self.log("val_loss", self.loss(batch))

    def test_step(self, batch: list[torch.Tensor], index: int) -> None:
        self.log("test_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(n: int, seed: int, shuffle: bool = False) -> torch.utils.data.DataLoader:
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=16, shuffle=shuffle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--logger", help="a CSVLogger's folder (default: Lightning's logger)")
    parser.add_argument("--checkpoints", help="a ModelCheckpoint's folder (default: "
                                              "Lightning's, in the logger's version folder)")
    parser.add_argument("--resume", help="the checkpoint fit resumes from (ckpt_path)")
    parser.add_argument("--save", help="where the model is saved after testing")
    args = parser.parse_args()
    logger = CSVLogger(args.logger) if args.logger else True
    callbacks = [ModelCheckpoint(dirpath=args.checkpoints)] if args.checkpoints else None
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", logger=logger,
                         callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False)
    model = Regression()
    trainer.fit(model, loader(4096, 0, shuffle=True), loader(256, 1), ckpt_path=args.resume)
    trainer.test(model, loader(256, 2))
    if args.save:
        trainer.save_checkpoint(args.save)
    if trainer.global_rank == 0:
        print(json.dumps({"steps": trainer.global_step, "log_dir": trainer.log_dir}))


if __name__ == "__main__":
    main()
