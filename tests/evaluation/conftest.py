"""Fixtures of the evaluation tests: a character tokenizer, filler text tokenized with it, a tiny random Llama."""

from __future__ import annotations

import pytest
from helpers.models import tiny_model
from helpers.text import char_tokenizer, filler_text


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def filler(tok):
    return tok.encode(filler_text(), add_special_tokens=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")
