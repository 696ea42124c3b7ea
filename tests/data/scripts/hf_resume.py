"""A Hugging Face Trainer script that resumes in code, as many do after a preemption: it knows
nothing of autotune. A small regression model (no tokenizer, nothing downloaded), checkpoints
in --output_dir, and ``trainer.train(resume_from_checkpoint=...)``.

    python hf_resume.py --output_dir out --max_steps 4 --save_steps 2
    python hf_resume.py --output_dir out --resume true        # the last checkpoint in out
    python hf_resume.py --output_dir out --resume out/checkpoint-2

It prints a JSON line of what it trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments


@dataclass
class ResumeArguments:
    resume: str | None = field(default=None, metadata={
        "help": "true: the last checkpoint in --output_dir; else a checkpoint's folder"})


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 32, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.x[i].sum(0, keepdim=True)}


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


def main() -> None:
    parser = HfArgumentParser((ResumeArguments, TrainingArguments))
    resume_args, training_args = parser.parse_args_into_dataclasses()
    trainer = Trainer(model=Regression(), args=training_args, train_dataset=Pairs(4096))
    resume = True if resume_args.resume == "true" else resume_args.resume
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    if training_args.process_index == 0:
        print(json.dumps({"steps": result.global_step, "output_dir": training_args.output_dir}))


if __name__ == "__main__":
    main()
