"""A character-level tokenizer (a real PreTrainedTokenizerFast, vocab < 97) and filler text for tiny random models."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import CHARS, char_tokenizer  # noqa: F401  (re-exported for the evaluation tests)


def filler_text(n_words: int = 3000, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(n_words)]
    return " ".join(w + ("." if rng.random() < 0.1 else "") for w in words)


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny models run fastest on one thread; with two on a busy machine every small matmul waits for a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
