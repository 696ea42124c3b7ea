"""gpt2: GPT-2 small causal-LM training (124M, random init, no download; seq_len 128).

``--param size=`` takes ``small`` (124M), ``tiny`` (a 2-layer, 128-wide model for tests), or a
parameter count such as ``350M`` or ``1.5B``: GPT-2 small's width (768) with as many layers as
make the count (embeddings included). A model too large to train replicated on each rank is what
sharding is for (``sharding`` in docs/ranks.md); its blocks (the decoder layers) are FSDP's units.

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


class PackedTextDataset:
    """Generated text tokenised per sample and cut to exactly seq_len tokens (no padding)."""

    def __init__(self, vocab: list[str], seq_len: int, length: int, seed: int) -> None:
        self.vocab, self.seq_len, self.length, self.seed = vocab, seq_len, length, seed
        self.words = whole_words(vocab)
        self.tokenizer: Any = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        import torch

        if self.tokenizer is None:
            self.tokenizer = wordpiece_tokenizer(self.vocab)
        rng = random.Random(self.seed * 1_000_003 + index)
        ids: list[int] = []
        while len(ids) < self.seq_len:  # keep generating until the window is full, as packing does
            ids += self.tokenizer.encode(sentence_words(self.words, self.seq_len, rng)).ids
        input_ids = torch.tensor(ids[: self.seq_len], dtype=torch.long)
        return {"input_ids": input_ids, "labels": input_ids.clone()}  # the model shifts labels


@dataclass
class GPT2:
    seq_len: int = 128
    size: str = "small"
    name: str = "gpt2"
    default_micro_batch: int = 8
    supports: tuple[str, ...] = ("optimizer_impl", "compile", "attention",
                                 "activation_checkpointing")
    _config: Any = field(default=None, repr=False)

    def config(self) -> Any:
        from transformers import GPT2Config

        if self._config is None:
            kw: dict[str, int] = {}
            if self.size == "tiny":
                kw = dict(n_embd=128, n_layer=2, n_head=2)
            elif self.size != "small":
                kw = dict(n_layer=layers_for(parse_count(self.size)))
            self._config = GPT2Config(n_positions=max(1024, self.seq_len), **kw)
        return self._config

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The decoder layers: each is one FSDP unit when the model is sharded."""
        return list(model.transformer.h)  # type: ignore[union-attr, arg-type]

    def build_model(self) -> torch.nn.Module:
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(self.config())

    def build_dataset(self) -> PackedTextDataset:
        return PackedTextDataset(make_vocab(self.config().vocab_size), self.seq_len, 100_000, 0)

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        import torch

        return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    def flops_per_sample(self) -> float:
        c = self.config()
        params = c.n_layer * 12 * c.n_embd**2 + c.vocab_size * c.n_embd
        return 6.0 * params * self.seq_len + 12.0 * c.n_layer * self.seq_len**2 * c.n_embd


# GPT-2's parameters at width 768: token and position embeddings (the head is tied to the
# token embedding), the final norm, and per layer two norms, attention and the MLP.
_WIDTH, _VOCAB, _POSITIONS = 768, 50257, 1024
_FIXED = (_VOCAB + _POSITIONS) * _WIDTH + 2 * _WIDTH
_PER_LAYER = 12 * _WIDTH**2 + 13 * _WIDTH
_UNITS = {"K": 10**3, "M": 10**6, "B": 10**9}


def parse_count(text: str) -> int:
    """``350M`` -> 350_000_000; ``1.5B``, ``800K`` and plain integers too."""
    raw = text.strip().upper()
    scale = _UNITS.get(raw[-1:], 1)
    number = raw[:-1] if raw[-1:] in _UNITS else raw
    try:
        value = float(number) * scale
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"size must be small, tiny or a parameter count like 350M, got "
                         f"{text!r}")
    return int(value)


def layers_for(count: int) -> int:
    """Decoder layers of width 768 that bring GPT-2 closest to ``count`` parameters."""
    layers = round((count - _FIXED) / _PER_LAYER)
    if layers < 1:
        smallest = (_FIXED + _PER_LAYER) / 1e6
        raise ValueError(f"size {count / 1e6:.0f}M is below one layer of GPT-2's width "
                         f"({smallest:.0f}M with its embeddings); pass size=tiny or at least "
                         f"{smallest:.0f}M")
    if layers > 1000:
        raise ValueError(f"size {count / 1e9:.1f}B needs {layers} layers; at most 1000")
    return layers


def build(seq_len: int = 128, size: str = "small") -> GPT2:
    if seq_len < 8:
        raise ValueError(f"seq_len must be >= 8, got {seq_len}")
    if size not in ("small", "tiny"):
        layers_for(parse_count(str(size)))  # a bad size is said here, not in the trial
    return GPT2(seq_len=seq_len, size=str(size))
