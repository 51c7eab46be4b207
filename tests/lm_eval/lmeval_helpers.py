"""Helpers for the lm-eval integration tests: a tiny random LLaMA + a real byte-level BPE tokenizer, and running
lm-eval in-process on them. Test modules import the fixtures `assets` and `one_thread` from here (no conftest.py:
a second `conftest` module would shadow tests/conftest.py for the modules that import from it).

Nothing here needs the shipped rope-tiny model or the hub: the tokenizer is trained in a second on a slice of text,
the model is random (window 64), and tasks read a small held-out file written next to them.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "rope_patch" / "data" / "tasks"
WINDOW = 64
BOS, EOS = "<|bos|>", "<|eos|>"


def prose(n_words: int = 6000, seed: int = 0) -> str:
    """The repository's held-out text when present, else deterministic pseudo-prose (with digits)."""
    held = REPO / "rope_patch" / "data" / "heldout.txt"
    if held.is_file():
        return held.read_text(encoding="utf-8")[:60_000]
    rng = random.Random(seed)
    words = ["the", "of", "and", "to", "a", "her", "was", "in", "it", "she", "that", "not", "be", "as", "had",
             "Anne", "Captain", "letter", "walk", "morning", "sister", "father", "house", "said", "very"]
    return " ".join(rng.choice(words) + ("." if rng.random() < 0.08 else "") for _ in range(n_words))


def train_tokenizer(text: str, vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, BOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([text], trainer=trainer)
    tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                      special_tokens=[(BOS, tk.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=EOS)


def tiny_llama(tokenizer, seed: int = 0, window: int = WINDOW):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=window,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()

def metadata(assets, **extra) -> dict:
    return {"heldout": str(assets["heldout"]), "samples": 2, "tokenizer": str(assets["model"]), **extra}


def evaluate(model, tasks, assets, model_args=None, meta=None, include_path=None, **kw):
    """lm_eval.simple_evaluate with the repository's rope_patch/data/tasks (not lm-eval's own ~15 s task index) and the tiny
    assets; samples are logged."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import rope_patch.integrations.lm_eval.model  # noqa: F401  (registers `rope_patch`)

    tm = TaskManager(include_path=str(include_path or TASKS), include_defaults=False,
                     metadata=metadata(assets, **(meta or {})))
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), task_manager=tm,
                                   log_samples=True, **kw)


def by_doc(samples: list[dict]) -> list[dict]:
    return sorted(samples, key=lambda s: s["doc_id"])


# ---- fixtures (imported by each test module) ----------------------------------------------------------------
@pytest.fixture(scope="session", name="assets")
def assets_fixture(tmp_path_factory):
    """{"model": folder of a saved tiny model + tokenizer, "heldout": a text file}."""
    root = tmp_path_factory.mktemp("lm_eval_assets")
    text = prose()
    heldout = root / "heldout.txt"
    heldout.write_text(text, encoding="utf-8")
    tok = train_tokenizer(text)
    model = tiny_llama(tok)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return {"model": root / "model", "heldout": heldout, "root": root}


@pytest.fixture(scope="session", autouse=True, name="one_thread")
def one_thread_fixture():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
