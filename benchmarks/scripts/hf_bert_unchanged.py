"""BERT masked-LM pre-training with a Hugging Face Trainer, written as an HF user writes it and
knowing nothing of autotune's tuning: HfArgumentParser over its own and the training arguments,
a plain ``Trainer``, checkpoints and the final model in ``--output_dir``. It borrows the
built-in ``bert`` workload's model and data (``autotune.workloads``) so that its numbers compare
with the built-in study's; nothing else of autotune. The subject of
``benchmarks/script_vs_builtin.py --script unchanged`` and ``benchmarks/trainer_logs.py``.

    autotune run -- python benchmarks/scripts/hf_bert_unchanged.py --output_dir out
    autotune launch profile.yaml -- python benchmarks/scripts/hf_bert_unchanged.py ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from transformers import HfArgumentParser, Trainer, TrainingArguments

from autotune.workloads import resolve


@dataclass
class ModelArguments:
    size: str = field(default="base", metadata={"help": "base or tiny"})
    seq_len: int = field(default=128)


def main() -> None:
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses()
    workload = resolve("bert", {"size": model_args.size, "seq_len": model_args.seq_len})
    trainer = Trainer(model=workload.build_model(), args=training_args,
                      train_dataset=workload.build_dataset())
    result = trainer.train()
    if training_args.process_index == 0:
        print(json.dumps({"steps": result.global_step, "metrics": result.metrics}))


if __name__ == "__main__":
    main()
