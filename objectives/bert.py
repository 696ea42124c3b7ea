"""bert: BERT-base masked-language-model pre-training (random init, no download; seq_len 128).

torch is imported where it is used: the tuner resolves a workload to plan trials and needs no
torch for that (the trial processes do the training).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.synthetic import make_vocab, sentence_words, whole_words, wordpiece_tokenizer

if TYPE_CHECKING:
    import torch


class MaskedTextDataset:
    """Each item is generated text, tokenised by a real WordPiece tokenizer, then 15% masked.

    The work happens in __getitem__, per sample, like a real pipeline reading and tokenising text,
    so the loader knobs (workers, prefetch) have real CPU work to overlap with compute.
    """

    def __init__(self, vocab: list[str], seq_len: int, length: int, seed: int) -> None:
        self.vocab, self.seq_len, self.length, self.seed = vocab, seq_len, length, seed
        self.words = whole_words(vocab)
        self.tokenizer: Any = None  # built lazily: once per loader worker, not pickled across
        self.special_ids: Any = None  # ids 0..4, [PAD] [UNK] [CLS] [SEP] [MASK]: with the tokenizer
        self.mask_id = vocab.index("[MASK]")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        import torch

        if self.tokenizer is None:
            self.tokenizer = wordpiece_tokenizer(self.vocab)
            self.tokenizer.enable_truncation(self.seq_len)
            self.tokenizer.enable_padding(length=self.seq_len, pad_id=0, pad_token="[PAD]")
            self.special_ids = torch.arange(5)
        rng = random.Random(self.seed * 1_000_003 + index)
        # ~0.8 words per token: most samples fill the sequence, some are padded.
        text = sentence_words(self.words, rng.randint(self.seq_len // 2, self.seq_len), rng)
        enc = self.tokenizer.encode(text)
        input_ids = torch.tensor(enc.ids, dtype=torch.long)
        attention_mask = torch.tensor(enc.attention_mask, dtype=torch.long)

        # BERT masking: choose 15% of real tokens; of those 80% -> [MASK], 10% random, 10% kept.
        gen = torch.Generator().manual_seed(self.seed * 7919 + index)
        maskable = ~torch.isin(input_ids, self.special_ids)
        chosen = (torch.rand(self.seq_len, generator=gen) < 0.15) & maskable
        labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
        roll = torch.rand(self.seq_len, generator=gen)
        input_ids = torch.where(chosen & (roll < 0.8), self.mask_id, input_ids)
        random_ids = torch.randint(5, len(self.vocab), (self.seq_len,), generator=gen)
        input_ids = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, input_ids)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@dataclass
class Bert:
    seq_len: int = 128
    size: str = "base"
    name: str = "bert"
    default_micro_batch: int = 8  # Hugging Face Trainer's per-device default
    supports: tuple[str, ...] = ("optimizer_impl", "compile", "attention",
                                 "activation_checkpointing")
    _config: Any = field(default=None, repr=False)

    def config(self) -> Any:
        from transformers import BertConfig

        if self._config is None:
            # bert-base: 12 layers, hidden 768, 12 heads, vocab 30522. "tiny" is for quick checks.
            kw = {} if self.size == "base" else dict(
                hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)
            self._config = BertConfig(max_position_embeddings=max(512, self.seq_len), **kw)
        return self._config

    def build_model(self) -> torch.nn.Module:
        from transformers import BertForMaskedLM

        return BertForMaskedLM(self.config())  # random init: nothing is downloaded

    def build_dataset(self) -> MaskedTextDataset:
        vocab = make_vocab(self.config().vocab_size)
        return MaskedTextDataset(vocab, self.seq_len, length=100_000, seed=0)

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        import torch

        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    def flops_per_sample(self) -> float:
        # 6 x parameters x tokens (matmuls, forward + backward) plus attention scores:
        # 12 x layers x seq^2 x hidden. The parameter count of BERT-base is ~110M.
        c = self.config()
        h, layers, v = c.hidden_size, c.num_hidden_layers, c.vocab_size
        params = layers * 12 * h * h + v * h
        return 6.0 * params * self.seq_len + 12.0 * layers * self.seq_len**2 * h


def build(seq_len: int = 128, size: str = "base") -> Bert:
    if seq_len < 8:
        raise ValueError(f"seq_len must be >= 8, got {seq_len}")
    if size not in ("base", "tiny"):
        raise ValueError(f"size must be 'base' or 'tiny', got {size!r}")
    return Bert(seq_len=seq_len, size=size)
