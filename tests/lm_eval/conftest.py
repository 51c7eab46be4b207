"""Fixtures of the lm-eval integration tests."""

from __future__ import annotations

import pytest
from helpers.lm_eval import prose, tiny_llama
from helpers.text import bpe_tokenizer


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """{"model": folder of a saved tiny model + tokenizer, "heldout": a text file, "root": their folder}."""
    root = tmp_path_factory.mktemp("lm_eval_assets")
    text = prose()
    heldout = root / "heldout.txt"
    heldout.write_text(text, encoding="utf-8")
    tok = bpe_tokenizer(text)
    model = tiny_llama(tok)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return {"model": root / "model", "heldout": heldout, "root": root}
