"""Documents of different lengths and packed rows for the rope_patch.training tests."""

from __future__ import annotations

import random

from helpers.text import char_tokenizer, filler_text
from rope_patch.training import PackedDataset


def documents(n: int = 12, seed: int = 0) -> list[str]:
    """`n` documents of different lengths (40 .. 400 words)."""
    rng = random.Random(seed)
    return [filler_text(rng.randint(40, 400), seed=seed * 1000 + i) for i in range(n)]


def packed(seq_len: int = 128, n_docs: int = 12, seed: int = 0):
    tok = char_tokenizer()
    return tok, PackedDataset.from_texts(documents(n_docs, seed), tok, seq_len)
