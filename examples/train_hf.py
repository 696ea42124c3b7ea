"""A Hugging Face Trainer run with an autotune profile: TrainingArguments from the profile.

    python examples/train_hf.py --profile studies/<study>/profile.yaml --max-steps 20
    autotune launch profile.yaml -- torchrun --nproc-per-node 2 examples/train_hf.py
    autotune run -- python examples/train_hf.py

A tiny BERT on generated tokens, so it runs anywhere on a CPU in seconds; bring your own model
and dataset. The profile sets batch size, accumulation, precision, the DataLoader and DDP.
Under `autotune run` each trial runs this script with a candidate profile; the callback
reports the steps and ends training when the tuner has measured enough.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

import autotune
from autotune.integrations.hf import AutotuneCallback


class MaskedTokens(torch.utils.data.Dataset):
    """Generated token ids with 15% masked: the shape of a masked-language-model dataset."""

    def __init__(self, samples: int, seq_len: int, vocab: int) -> None:
        self.samples, self.seq_len, self.vocab = samples, seq_len, vocab

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        ids = torch.randint(5, self.vocab, (self.seq_len,), generator=gen)
        masked = torch.rand(self.seq_len, generator=gen) < 0.15
        labels = ids.masked_fill(~masked, -100)  # loss only on the masked positions
        return {"input_ids": ids.masked_fill(masked, 4), "attention_mask": torch.ones_like(ids),
                "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="profile.yaml (default: $AUTOTUNE_PROFILE)")
    parser.add_argument("--max-steps", type=int, help="optimizer steps (default: 20; in a "
                        "trial of `autotune run`, until the tuner stops it)")
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    profile = autotune.load_profile(args.profile)
    profile.apply_env()  # before the Trainer starts the process group
    profile.apply_torch_flags()  # intra-op threads (TF32 also comes through tf32=)
    model = BertForMaskedLM(BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=args.seq_len))
    if profile.attn_implementation:  # from_pretrained takes attn_implementation= directly
        model.set_attn_implementation(profile.attn_implementation)
    tuned = profile.hf_training_args()
    max_steps = args.max_steps or (10**9 if autotune.in_trial() else 20)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, max_steps=max_steps, report_to="none", save_strategy="no",
            logging_steps=max_steps, dataloader_drop_last=True, **tuned)
        trainer = Trainer(model=model, args=training_args,
                          train_dataset=MaskedTokens(4096, args.seq_len, 1000),
                          callbacks=[AutotuneCallback()])  # a no-op outside `autotune run`
        result = trainer.train()
    if training_args.process_index == 0:
        print(json.dumps({"steps": result.global_step, "loss": result.training_loss,
                          "world_size": training_args.world_size,
                          "args": {k: getattr(training_args, k) for k in tuned}}))


if __name__ == "__main__":
    main()
