"""Passkey prompts with a chat template, shared-haystack cells whose common prefix is prefilled once, Wilson
intervals."""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch
from helpers.models import tiny_model
from helpers.text import char_tokenizer

import rope_patch
from rope_patch.evaluation import retrieval
from rope_patch.evaluation.passkey import (
    LEAD_IN,
    NEEDLE,
    PROMPT_FORMS,
    QUESTION,
    chat_wrap,
    make_passkey_sample,
    prompt_form,
    use_chat_template,
)
from rope_patch.evaluation.retrieval import (
    common_prefix,
    evaluate_passkey,
    greedy_generate,
    make_cell,
    prefill_prefix,
    wilson_interval,
)

# Only characters the char tokenizer knows (no ':' or '|'), so every template token is a real one.
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant {% endif %}")


@pytest.fixture(scope="module")
def chat_tok():
    t = char_tokenizer()
    t.chat_template = TEMPLATE
    return t


@pytest.mark.parametrize("length,depth", [(200, 0.0), (200, 0.5), (240, 1.0), (300, 0.25)])
def test_chat_prompt_is_the_templated_one(chat_tok, filler, length, depth):
    s = make_passkey_sample(chat_tok, filler, length, depth, random.Random(1), chat_template=True)
    ids = s["prompt_ids"]
    assert len(ids) == length  # the template's tokens count in the length
    before, after = chat_wrap(chat_tok)
    lead = chat_tok.encode(LEAD_IN.strip(), add_special_tokens=False)
    assert ids[: len(before)] == before and ids[len(ids) - len(after) - len(lead):] == after + lead and after
    user = chat_tok.decode(ids[len(before): len(ids) - len(after) - len(lead)])
    assert user.endswith(QUESTION)  # the user turn ends with the question, not with the lead-in
    # the lead-in opens the assistant turn: the prompt is the one transformers renders for a continued assistant
    # message, which is how lm-eval's gen_prefix builds RULER's prompts
    turns = [{"role": "user", "content": user}, {"role": "assistant", "content": LEAD_IN.strip()}]
    continued = chat_tok.apply_chat_template(turns, continue_final_message=True)["input_ids"]
    generation = chat_tok.apply_chat_template(turns[:1], add_generation_prompt=True)["input_ids"]
    assert ids == list(continued) == list(generation) + lead
    # the needle sits at `depth` of the haystack (the filler), not of the templated prompt
    needle = chat_tok.encode(NEEDLE.format(passkey=s["passkey"]), add_special_tokens=False)
    assert ids[s["needle_start"]: s["needle_end"]] == needle
    n_filler = s["haystack_end"] - s["haystack_start"] - len(needle)
    assert s["haystack_start"] == len(before)
    assert s["needle_start"] - s["haystack_start"] == round(depth * n_filler)


@pytest.mark.parametrize("chat,form", [(True, "chat"), (False, "plain")])
def test_prompt_form_names_the_layout(chat, form):
    assert prompt_form(chat) == form and form in PROMPT_FORMS


def test_plain_prompt_unchanged_without_template(tok, filler):
    a = make_passkey_sample(tok, filler, 200, 0.5, random.Random(3))
    b = make_passkey_sample(tok, filler, 200, 0.5, random.Random(3), chat_template=False)
    assert a["prompt_ids"] == b["prompt_ids"] and a["prompt_ids"][0] == tok.bos_token_id
    assert tok.decode(a["prompt_ids"]).endswith(" What is the pass key? The pass key is")  # the lead-in ends it


@pytest.mark.parametrize("mode,has,expected", [("auto", True, True), ("auto", False, False), ("on", True, True),
                                                ("off", True, False), (None, True, True), (True, True, True),
                                                (False, True, False)])
def test_chat_template_modes(tok, chat_tok, mode, has, expected):
    assert use_chat_template(chat_tok if has else tok, mode) is expected


@pytest.mark.parametrize("mode,has,match",
                         [("on", False, "has no chat template"), ("yes", True, "one of auto, on, off")])
def test_chat_template_mode_errors(tok, chat_tok, mode, has, match):
    with pytest.raises(ValueError, match=match):
        use_chat_template(chat_tok if has else tok, mode)


def test_chat_template_too_short_says_so(chat_tok, filler):

    with pytest.raises(ValueError, match="with the chat template"):
        make_passkey_sample(chat_tok, filler, 100, 0.5, random.Random(0), chat_template=True)


def test_shared_haystack_cells_share_the_filler_before_the_needle(tok, filler):
    for depth in (0.1, 0.5, 0.9):
        cell = make_cell(tok, filler, 300, depth, 5, 0, shared_haystack=True)
        assert len({s["filler_start"] for s in cell}) == 1 and len({s["answer"] for s in cell}) == 5
        p = common_prefix([s["prompt_ids"] for s in cell])
        assert p >= cell[0]["needle_start"]  # everything before the needle is shared
        assert p < cell[0]["needle_end"]  # and not past it: the keys differ
        independent = make_cell(tok, filler, 300, depth, 5, 0)
        assert len({s["filler_start"] for s in independent}) == 5
        assert common_prefix([s["prompt_ids"] for s in independent]) < retrieval.MIN_SHARED_PREFIX


CASES = [("llama", s) for s in (None, "yarn:2", "dynamic:2", "dynamic_yarn:2", "self_extend:group_size=2,window_size=8",
                                "alibi",
                                # the attention-side schemes whose prompts the 16k runs feed through this cache
                                "dca:chunk_size=64,local_size=16", "rerope:window_size=32",
                                "leaky_rerope:window_size=32,factor=4", "string:shift_size=40,window_size=16")]
CASES += [(arch, None) for arch in ("gemma3_text", "qwen3", "cohere2")]  # sliding-window caches, q/k norms, NoPE layers


@pytest.mark.parametrize("arch,scheme", CASES)
def test_prefix_cache_equals_full_prefill(tok, filler, arch, scheme):
    """First-step logits from the shared prefix's cache + the suffix equal one full prefill; greedy answers equal."""
    cell = make_cell(tok, filler, 200, 0.6, 3, 0, shared_haystack=True)
    ids = torch.tensor([s["prompt_ids"] for s in cell])
    p = common_prefix(ids.tolist())
    assert p > 60
    model = tiny_model(arch)
    with rope_patch.patched(model, scheme) if scheme else contextlib.nullcontext():
        with retrieval.at_length(model, 206):
            full = model(input_ids=ids, use_cache=False).logits[:, -1]
            cache = prefill_prefix(model, ids[:1, :p], 206)
            before = [layer.keys.clone() for layer in cache.layers]
            rest = retrieval.copy.deepcopy(cache)
            rest.batch_repeat_interleave(3)
            split = model(input_ids=ids[:, p:], attention_mask=torch.ones_like(ids), **{retrieval.CACHE: rest},
                          use_cache=True).logits[:, -1]
        torch.testing.assert_close(split, full, atol=1e-5, rtol=1e-5)
        a = greedy_generate(model, ids, 6)
        b = greedy_generate(model, ids, 6, prefix_cache=cache, prefix_len=p)
        assert all(torch.equal(x, y) for x, y in zip(before, [layer.keys for layer in cache.layers], strict=True))
    assert torch.equal(a, b)


def test_evaluate_passkey_cached_equals_uncached(model, tok, filler):
    kw = dict(lengths=[200], depths=[0.2, 0.9], n_samples=4, shared_haystack=True)
    a = evaluate_passkey(model, tok, filler, reuse_prefix=False, **kw)
    b = evaluate_passkey(model, tok, filler, **kw)
    assert [r["outputs"] for r in a] == [r["outputs"] for r in b]
    assert [r["shared_prefix"] for r in a] == [0, 0]
    assert b[0]["shared_prefix"] >= 0.2 * 100 and b[1]["shared_prefix"] > b[0]["shared_prefix"]


def test_evaluate_passkey_chat_prompts_and_budget(model, chat_tok, filler, monkeypatch):
    seen = []
    real = retrieval.greedy_generate

    def spy(m, ids, new, **kw):
        seen.append((ids.clone(), new))
        return real(m, ids, new, **kw)

    monkeypatch.setattr(retrieval, "greedy_generate", spy)
    evaluate_passkey(model, chat_tok, filler, [220], [0.5], 2, chat_template=True)
    (ids, new), = seen
    before, after = chat_wrap(chat_tok)
    tail = after + chat_tok.encode("The pass key is", add_special_tokens=False)
    assert ids.shape == (2, 220) and ids[0, : len(before)].tolist() == before and ids[0, -len(tail):].tolist() == tail
    lead = len(chat_tok.encode(" The pass key is", add_special_tokens=False))
    assert new == len(" 48213") + 1 + lead  # the key with its space, one more, and the restated lead


@pytest.mark.parametrize("k,n,low,high", [
    (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (5, 10, 0.2366, 0.7634), (1, 4, 0.0456, 0.6994), (0, 0, 0.0, 1.0),
    (92, 100, 0.8500, 0.9589),
])
def test_wilson_interval_reference_values(k, n, low, high):
    """Reference values of the closed form (0/10: upper 0.278, the textbook example of a non-empty interval at
    p = 0)."""
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)
    assert 0.0 <= lo <= (k / n if n else 0) <= hi <= 1.0 or n == 0


def test_cells_carry_n_and_interval(model, tok, filler):
    (r,) = evaluate_passkey(model, tok, filler, [200], [0.5], 3)
    assert r["n"] == 3 and (r["ci_low"], r["ci_high"]) == wilson_interval(r["correct"], 3)
    assert not math.isnan(r["accuracy"])
