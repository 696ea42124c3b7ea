"""A Hugging Face Trainer masked-LM script of the usual shape, as a user has it: it knows
nothing of autotune. HfArgumentParser over model, data and training arguments; a word-level
tokenizer and a BERT built locally from a local text file (nothing is downloaded).

    python hf_mlm.py --train_file corpus.txt --output_dir out --per_device_train_batch_size 8
    python hf_mlm.py --hidden_size 768 --num_hidden_layers 12 ...   # BERT-base sized

Its own outputs are those of such scripts: checkpoints and the final model in --output_dir,
and a JSON line of what it trained with on stdout.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertTokenizerFast,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)


@dataclass
class ModelArguments:
    hidden_size: int = field(default=64)
    num_hidden_layers: int = field(default=2)
    num_attention_heads: int = field(default=2)
    intermediate_size: int = field(default=128)
    vocab_size: int = field(default=0, metadata={"help": "0: the tokenizer's"})
    own_optimizer: bool = field(default=False, metadata={"help": "pass Trainer an AdamW"})


@dataclass
class DataArguments:
    train_file: str = field(metadata={"help": "a text file, one example per line"})
    max_seq_length: int = field(default=64)


class LineDataset(torch.utils.data.Dataset):
    def __init__(self, lines: list[str], tokenizer: BertTokenizerFast, length: int) -> None:
        self.encoded = tokenizer(lines, truncation=True, max_length=length,
                                 padding="max_length", return_special_tokens_mask=True)

    def __len__(self) -> int:
        return len(self.encoded["input_ids"])

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {k: v[i] for k, v in self.encoded.items()}


def tokenizer_for(lines: list[str]) -> BertTokenizerFast:
    """A word-level vocabulary of the corpus (a real script loads its tokenizer)."""
    words = sorted({w for line in lines for w in line.lower().split()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    return BertTokenizerFast(vocab_file=path)


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    with open(data_args.train_file) as f:
        lines = [line.strip() for line in f if line.strip()]
    tokenizer = tokenizer_for(lines)
    config = BertConfig(vocab_size=model_args.vocab_size or len(tokenizer),
                        hidden_size=model_args.hidden_size,
                        num_hidden_layers=model_args.num_hidden_layers,
                        num_attention_heads=model_args.num_attention_heads,
                        intermediate_size=model_args.intermediate_size,
                        max_position_embeddings=max(512, data_args.max_seq_length))
    model = BertForMaskedLM(config)
    optimizers = (torch.optim.AdamW(model.parameters(), lr=training_args.learning_rate), None) \
        if model_args.own_optimizer else (None, None)
    trainer = Trainer(model=model, args=training_args, optimizers=optimizers,
                      train_dataset=LineDataset(lines, tokenizer, data_args.max_seq_length),
                      data_collator=DataCollatorForLanguageModeling(tokenizer),
                      processing_class=tokenizer)
    result = trainer.train()
    trainer.save_model()
    if training_args.process_index == 0:
        print(json.dumps({"steps": result.global_step, "metrics": result.metrics,
                          "per_device_train_batch_size":
                              training_args.per_device_train_batch_size,
                          "output_dir": training_args.output_dir}))


if __name__ == "__main__":
    main()
