"""recipes/pretrain_tiny.py: the passkey curriculum and the rows it builds (the training itself is too slow for CI)."""

from __future__ import annotations

import random
import sys

import pytest
import yaml
from helpers.scripts import ROOT, load_script
from transformers import AutoTokenizer

TINY = ROOT / "rope_patch" / "data" / "rope-tiny"


@pytest.fixture(scope="module")
def pretrain():
    sys.path.insert(0, str(ROOT / "recipes"))  # the script imports its sibling check_tiny / corpus modules
    return load_script("recipes/pretrain_tiny.py")


@pytest.fixture(scope="module")
def sampler_parts():
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    text = (ROOT / "rope_patch" / "data" / "heldout.txt").read_text(encoding="utf-8")[:200_000]
    return tokenizer, tokenizer.encode(text, add_special_tokens=False)


CURRICULUM = [
    {"until_step": 10, "fraction": 1.0, "min_tokens": 48, "max_tokens": 64},
    {"until_step": 20, "fraction": 0.0, "min_tokens": 48, "max_tokens": 64},
    {"until_step": 30, "fraction": 1.0, "min_tokens": 200, "max_tokens": 248},
]


def _cfg(**overrides):
    return {"seq_len": 256, "batch_size": 4, "passkey_curriculum": CURRICULUM, "answer_loss_weight": 10.0, **overrides}


@pytest.mark.parametrize(
    ("step", "phase_index"), [(1, 0), (10, 0), (11, 1), (20, 1), (21, 2), (30, 2), (31, 2), (10_000, 2)]
)
def test_phase_by_step(pretrain, sampler_parts, step, phase_index):
    sampler = pretrain.BatchSampler(*sampler_parts, _cfg(), random.Random(0))
    assert sampler.phase(step) is CURRICULUM[phase_index]


@pytest.mark.parametrize(
    ("step", "min_answers", "max_answers"),
    [
        (1, 3, 5),  # prompts of 48-64 tokens + 7 answer/EOS tokens: 3-4 samples packed in 256 tokens
        (15, 0, 0),  # fraction 0: prose only
        (25, 1, 1),  # prompts of 200+ tokens: one per row
    ],
)
def test_rows_follow_the_phase(pretrain, sampler_parts, step, min_answers, max_answers):
    tokenizer, _ = sampler_parts
    ids, weights = pretrain.BatchSampler(*sampler_parts, _cfg(), random.Random(0))(step)
    assert ids.shape == weights.shape == (4, 256)
    question = tokenizer.encode(" What is the pass key?", add_special_tokens=False)
    for row_ids, row_weights in zip(ids.tolist(), weights.tolist(), strict=True):
        # Each answer is a space and five digits, weighted 10x; nothing else is up-weighted.
        heavy = [i for i, w in enumerate(row_weights) if w == 10.0]
        assert len(heavy) % 6 == 0 and min_answers <= len(heavy) // 6 <= max_answers
        for start in heavy[::6]:
            answer = tokenizer.decode(row_ids[start : start + 6])
            assert answer.startswith(" ") and answer[1:].isdigit() and len(answer) == 6
            assert row_ids[start + 6] == tokenizer.eos_token_id
        n_questions = sum(row_ids[i : i + len(question)] == question for i in range(len(row_ids)))
        assert n_questions == len(heavy) // 6


def test_same_seed_same_batches(pretrain, sampler_parts):
    batches = [pretrain.BatchSampler(*sampler_parts, _cfg(), random.Random(7))(1) for _ in range(2)]
    assert all((a == b).all() for a, b in zip(batches[0], batches[1], strict=True))


def test_shipped_config_curriculum_fits_the_window(pretrain):
    """Every phase's prompts fit a row with their answer, ascend to the whole window, and hold the needle."""
    cfg = yaml.safe_load((ROOT / "recipes" / "configs" / "pretrain_tiny.yaml").read_text())["train"]
    phases = cfg["passkey_curriculum"]
    assert [p["until_step"] for p in phases] == sorted(p["until_step"] for p in phases)
    assert phases[-1]["until_step"] >= cfg["steps"]
    assert all(42 <= p["min_tokens"] <= p["max_tokens"] <= cfg["seq_len"] - 8 for p in phases)
    assert phases[-1]["max_tokens"] == cfg["seq_len"] - 8  # needles as far back as the window allows
