"""Helpers for the lm-eval integration tests: a tiny random LLaMA + a real byte-level BPE tokenizer, and running
lm-eval in-process on them (the `assets` fixture is in tests/lm_eval/conftest.py).

Nothing here needs the shipped rope-tiny model or the hub: the tokenizer is trained in a second on a slice of text,
the model is random (window 64), and tasks read a small held-out file written next to them.
"""

from __future__ import annotations

from pathlib import Path

from helpers.models import tiny_model

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "rope_patch" / "data" / "tasks"
WINDOW = 64


def prose() -> str:
    """The shipped held-out text (package data, so always present), 60k characters of it."""
    return (REPO / "rope_patch" / "data" / "heldout.txt").read_text(encoding="utf-8")[:60_000]


def tiny_llama(tokenizer, seed: int = 0, window: int = WINDOW):
    """The one model builder (helpers.models) sized for lm-eval: vocab from the tokenizer, sdpa like a user's model."""
    return tiny_model("llama", seed, attn_implementation="sdpa", hidden_size=32, intermediate_size=64,
                      vocab_size=len(tokenizer), max_position_embeddings=window, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      tie_word_embeddings=False)


def metadata(assets, **extra) -> dict:
    return {"heldout": str(assets["heldout"]), "samples": 2, "tokenizer": str(assets["model"]), **extra}


def evaluate(model, tasks, assets, model_args=None, meta=None, include_path=None, **kw):
    """lm_eval.simple_evaluate with the repository's rope_patch/data/tasks (not lm-eval's own ~15 s task index) and the
    tiny assets; samples are logged."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import rope_patch.integrations.lm_eval.model  # noqa: F401  (registers `rope_patch`)

    tm = TaskManager(include_path=str(include_path or TASKS), include_defaults=False,
                     metadata=metadata(assets, **(meta or {})))
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), task_manager=tm,
                                   log_samples=True, **kw)


def by_doc(samples: list[dict]) -> list[dict]:
    return sorted(samples, key=lambda s: s["doc_id"])
