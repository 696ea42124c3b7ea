"""BERT masked-LM pre-training with a Hugging Face Trainer, as an HF user's script would run it:
the built-in ``bert`` workload's model and data, TrainingArguments from the profile, autotune's
callback. The subject of ``benchmarks/script_vs_builtin.py``.

    autotune run -- python benchmarks/scripts/hf_bert.py --size base
"""

from __future__ import annotations

import argparse
import tempfile

from transformers import Trainer, TrainingArguments

import autotune
from autotune.integrations.hf import AutotuneCallback
from autotune.workloads import resolve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="base", choices=("base", "tiny"))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=1_000_000)
    args = parser.parse_args()

    profile = autotune.load_profile()
    profile.apply_torch_flags()  # intra-op threads (TF32 comes through tf32=)
    workload = resolve("bert", {"size": args.size, "seq_len": args.seq_len})
    model = workload.build_model()
    if profile.attn_implementation:
        model.set_attn_implementation(profile.attn_implementation)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, max_steps=args.max_steps, report_to="none", save_strategy="no",
            logging_strategy="no", dataloader_drop_last=True, learning_rate=1e-4,
            weight_decay=0.01, **profile.hf_training_args())
        Trainer(model=model, args=training_args, train_dataset=workload.build_dataset(),
                callbacks=[AutotuneCallback()]).train()


if __name__ == "__main__":
    main()
