"""Fixtures of the lm-eval integration tests."""

from __future__ import annotations

import shutil

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


CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>{% endfor %}"
                 "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def chat_model(assets, tmp_path_factory):
    """A copy of the assets' model whose tokenizer has a chat template (CHAT_TEMPLATE)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(assets["model"], folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    return folder
