"""Fixtures for the whole suite. Shared code (model builder, tokenizers, references) lives in tests/helpers/."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.models import VOCAB, WINDOW, tiny_model

# Nothing is downloaded at test time: a test that reaches for the hub fails at once instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tiny models run fastest on one thread: on a shared 2-core machine a second thread makes every small
    matmul wait for a core. Tests that spawn processes set their own thread counts."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def ids():
    torch.manual_seed(123)
    return torch.randint(3, VOCAB, (2, 3 * WINDOW))


@pytest.fixture
def llama():
    return tiny_model("llama")
