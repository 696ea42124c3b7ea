"""Synthetic text for the built-in language workloads: no download, real tokenizer work.

A vocabulary is generated from syllables; sentences mix vocabulary words with unseen words that
WordPiece must split into pieces, so each sample costs the CPU what tokenising real text costs.
"""

from __future__ import annotations

import random
from typing import Any

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "z", "br", "ch", "st", "tr", "pl", "gr", "sh", "th"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "st"]
_PUNCT = [".", ",", ";", "!", "?"]


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)


def make_vocab(size: int, seed: int = 0) -> list[str]:
    """Special tokens, single characters (so nothing is ever [UNK]), then words and ##pieces."""
    rng = random.Random(seed)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = SPECIAL + letters + ["##" + c for c in letters] + _PUNCT
    seen = set(vocab)
    while len(vocab) < size:
        word = "".join(_syllable(rng) for _ in range(rng.randint(1, 3)))
        token = ("##" + word) if rng.random() < 0.25 else word
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    return vocab[:size]


def wordpiece_tokenizer(vocab: list[str]) -> Any:
    """A BERT-style WordPiece tokenizer (normaliser, pre-tokeniser, [CLS]/[SEP] template)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    tok = Tokenizer(WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = vocab.index("[CLS]"), vocab.index("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def whole_words(vocab: list[str]) -> list[str]:
    """The vocabulary entries that are words (not specials, characters, ##pieces or punctuation)."""
    return [w for w in vocab[len(SPECIAL) + 52:] if not w.startswith("##") and w not in _PUNCT]


def sentence_words(words: list[str], n_words: int, rng: random.Random) -> str:
    """Generated text: mostly known words, some unseen ones, capitals and punctuation."""
    out = []
    for i in range(n_words):
        if rng.random() < 0.8:
            word = rng.choice(words)
        else:
            word = "".join(_syllable(rng) for _ in range(rng.randint(2, 4)))
        if i == 0 or rng.random() < 0.05:
            word = word.capitalize()
        out.append(word)
        if rng.random() < 0.08:
            out.append(rng.choice(_PUNCT))
    return " ".join(out)
