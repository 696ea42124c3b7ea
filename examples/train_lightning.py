"""A Lightning Trainer run with an autotune profile: Trainer and DataLoader from the profile.

    python examples/train_lightning.py --profile studies/<study>/profile.yaml --max-steps 20
    autotune run -- python examples/train_lightning.py

With a multi-rank profile, Lightning starts the ranks itself (``devices`` and a ``DDPStrategy``
with the profile's bucket size come from the profile). A tiny MLP on generated data, so it runs
anywhere on a CPU in seconds; bring your own LightningModule and dataset. Under `autotune run`
each trial runs this script with a candidate profile; the callback reports the steps and ends
``fit`` when the tuner has measured enough.
"""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl
import torch

import autotune
from autotune.integrations.lightning import AutotuneCallback


class Features(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8192

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, generator=torch.Generator().manual_seed(index))
        return x, torch.tensor(index % 4)


class Classifier(pl.LightningModule):
    def __init__(self, profile: autotune.Profile) -> None:
        super().__init__()
        self.profile = profile
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                       torch.nn.Linear(64, 4))

    def configure_model(self) -> None:
        # The Trainer takes none of the model knobs: compile (and, for a transformers model,
        # attention and checkpointing) are applied here.
        self.net = self.profile.prepare_model(self.net)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, **self.profile.optimizer_kwargs())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="profile.yaml (default: $AUTOTUNE_PROFILE)")
    parser.add_argument("--max-steps", type=int, help="optimizer steps (default: 20; in a "
                        "trial of `autotune run`, until the tuner stops it)")
    args = parser.parse_args()

    profile = autotune.load_profile(args.profile)
    profile.apply_env()  # before Lightning starts the process group
    profile.apply_torch_flags()  # intra-op threads, TF32
    tuned = profile.lightning_trainer_kwargs()  # precision, accumulation, DDP strategy, devices
    max_steps = args.max_steps or (10**9 if autotune.in_trial() else 20)
    trainer = pl.Trainer(max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[AutotuneCallback()],  # a no-op outside `autotune run`
                         **tuned)
    # Lightning adds the DistributedSampler itself when there are several ranks.
    loader = torch.utils.data.DataLoader(Features(), shuffle=True, drop_last=True,
                                         **profile.dataloader_kwargs())
    trainer.fit(Classifier(profile), loader)
    if trainer.global_rank == 0:
        strategy = trainer.strategy
        print(json.dumps({
            "steps": trainer.global_step, "loss": float(trainer.callback_metrics["loss"]),
            "precision": trainer.precision,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "world_size": trainer.world_size,
            "ddp_kwargs": getattr(strategy, "_ddp_kwargs", None),
            "bucket_bytes_cap": getattr(getattr(strategy, "model", None), "bucket_bytes_cap",
                                        None)}))


if __name__ == "__main__":
    main()
