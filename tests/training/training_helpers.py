"""Shared by tests/training: a character tokenizer, random prose tokenized with it, and packed rows."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import char_tokenizer

from rope_patch.training import PackedDataset


def prose(n_words: int = 3000, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(n_words)]
    return " ".join(w + ("." if rng.random() < 0.1 else "") for w in words)


def documents(n: int = 12, seed: int = 0) -> list[str]:
    """`n` documents of different lengths (40 .. 400 words)."""
    rng = random.Random(seed)
    return [prose(rng.randint(40, 400), seed=seed * 1000 + i) for i in range(n)]


def packed(seq_len: int = 128, n_docs: int = 12, seed: int = 0):
    tok = char_tokenizer()
    return tok, PackedDataset.from_texts(documents(n_docs, seed), tok, seq_len)


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny models train fastest on one thread on a shared machine; the setting is restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
