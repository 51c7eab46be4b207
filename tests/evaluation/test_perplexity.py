"""Perplexity evaluation on tiny random models: chunked loss, windows, buckets, determinism, dynamic-RoPE state."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.models import VOCAB, WINDOW, record_implementations, tiny_hybrid, tiny_model

import rope_patch
from rope_patch.evaluation import common
from rope_patch.evaluation.common import prepare_rotary, token_nll
from rope_patch.evaluation.perplexity import (
    default_buckets,
    evaluate_perplexity,
    perplexity_work,
    scored_tokens,
    windows,
)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def stream():
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, VOCAB, (2000,), generator=g).tolist()


# the output steps `_head` knows (Gemma 2's soft-capping, Cohere's scale, Granite's division), and those it does not,
# where the model's own forward runs instead: FalconH1's lm_head_multiplier, RecurrentGemma's logits_soft_cap, a
# decoder that does not run alone (Llama 4's, inside its multimodal wrapper)
HEADS = [("llama", {}), ("gemma2", {}), ("cohere", {}), ("granite", {}), ("falcon_h1", {"lm_head_multiplier": 0.25}),
         ("recurrent_gemma", {}), ("llama4", {})]


@pytest.mark.parametrize("arch,overrides", HEADS, ids=[a for a, _ in HEADS])
def test_chunked_nll_and_continuations_equal_the_models_own_logits(monkeypatch, arch, overrides):
    """token_nll (perplexity) and continuation_loglikelihoods (lm-eval's long requests) give the model's own
    forward's numbers, a slice of positions at a time where the decoder and the output step reproduce the forward,
    the forward itself where they do not (checked once per model: `common.sliced_head`)."""
    m = tiny_model(arch, **overrides)
    ids = torch.randint(3, VOCAB, (2, 50))
    with torch.no_grad():
        full = F.cross_entropy(m(ids).logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    monkeypatch.setattr(common, "LOGITS_BUDGET_BYTES", 4 * VOCAB * 2 * 7)  # 7 positions per chunk
    got = token_nll(m, ids)
    assert got.shape == (2, 49)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    # two one-token continuations after one input, and a longer one: lm-eval's (sum of log p, greedy) from full logits
    with torch.no_grad():
        logp = F.log_softmax(m(ids[:1]).logits.float(), dim=-1)[0]
    options = [[int(logp[-1].argmax())], [5], ids[0, 40:].tolist()]
    answers = common.continuation_loglikelihoods(m, ids[:1], options)
    for (total, greedy), option in zip(answers, options, strict=True):
        part = logp[50 - len(option):]
        assert abs(total - float(part.gather(-1, torch.tensor(option)[:, None]).sum())) <= 1e-4
        assert greedy == bool((part.argmax(-1) == torch.tensor(option)).all())
    assert answers[0][1] and (common.sliced_head(m, ids) is None) == (arch in ("falcon_h1", "recurrent_gemma",
                                                                                 "llama4"))


def test_windows_are_consecutive_and_non_overlapping(stream):
    w = windows(stream, 64, 300)
    assert w.shape == (4, 64)
    assert w.flatten().tolist() == stream[:256]
    with pytest.raises(ValueError, match="at least 64 tokens"):
        windows(stream[:10], 64, 300)


def test_default_buckets():
    assert default_buckets(2048, 256) == [(0, 256), (256, 512), (512, 1024), (1024, 2048)]
    assert default_buckets(1000, 256) == [(0, 256), (256, 512), (512, 1000)]
    assert default_buckets(256, 256) == [(0, 64), (64, 128), (128, 192), (192, 256)]


@pytest.mark.parametrize("length,count,windows_at_longest,n_tokens,want", [
    (256, 100_000, 2, None, 4096),  # every length up to 2048 reads the first 2 x 2048 tokens
    (2048, 100_000, 2, None, 4096),
    (300, 100_000, 2, None, 13 * 300),  # whole windows of its length
    (4096, 100_000, 2, None, 8192),  # a longer one: 2 windows of its own
    (16384, 100_000, 1, None, 16384),
    (256, 2000, 2, None, 1792),  # a shorter text: all of it, in whole windows
    (256, 100_000, 2, 1000, 768),  # n_tokens: the first n at every length
])
def test_scored_tokens_depend_on_the_length_alone(length, count, windows_at_longest, n_tokens, want):
    assert scored_tokens(length, count, windows_at_longest, n_tokens) == want


def test_evaluate_perplexity_shapes_and_consistency(model, stream):
    done = []
    res = evaluate_perplexity(model, stream, [32, 64, 128], windows_at_longest=3, progress=done.append)
    rows = {r["length"]: r for r in res["lengths"]}
    assert sorted(rows) == [32, 64, 128]
    for L, r in rows.items():  # 3 x 2048 tokens wanted, the stream's 2000 read
        assert r["n_windows"] == 2000 // L and r["n_tokens"] == (2000 // L) * (L - 1)
        assert math.isclose(r["perplexity"], math.exp(r["nll"]))
        assert 1 < r["perplexity"] < 10 * VOCAB  # a random model: around the vocab size
    assert sum(done) == perplexity_work(len(stream), [32, 64, 128], windows_at_longest=3) == 1984 + 1984 + 1920
    # buckets of the longest window cover its predictions exactly once: their token-weighted NLL is the total
    assert [(b["start"], b["end"]) for b in res["buckets"]] == [(0, 32), (32, 64), (64, 128)]
    tot = sum(b["nll"] * b["n_tokens"] for b in res["buckets"]) / sum(b["n_tokens"] for b in res["buckets"])
    assert math.isclose(tot, rows[128]["nll"], rel_tol=1e-9)
    again = evaluate_perplexity(model, stream, [128, 32, 64], windows_at_longest=3)
    assert again == res  # deterministic, independent of the order lengths are given in


def test_dynamic_does_not_depend_on_what_ran_before(model, stream):
    with rope_patch.patched(model, "dynamic", factor=4):
        fresh = evaluate_perplexity(model, stream, [64], n_tokens=128)
        evaluate_perplexity(model, stream, [128], n_tokens=128)  # grows the dynamic base to 128
        after = evaluate_perplexity(model, stream, [64], n_tokens=128)
    assert fresh == after
    plain = evaluate_perplexity(model, stream, [64], n_tokens=128)
    assert plain["lengths"][0]["nll"] != fresh["lengths"][0]["nll"]  # dynamic does act beyond the window


def test_prepare_rotary_sets_the_base_of_the_final_length(model):
    with rope_patch.patched(model, "dynamic", factor=4):
        rot = model.model.rotary_emb
        prepare_rotary(model, 3 * WINDOW)
        at_96 = rot.inv_freq.clone()
        prepare_rotary(model, 2 * WINDOW)
        assert not torch.equal(rot.inv_freq, at_96)
        prepare_rotary(model, 3 * WINDOW)
        assert torch.equal(rot.inv_freq, at_96)
        prepare_rotary(model, WINDOW // 2)
        assert torch.equal(rot.inv_freq, rot.original_inv_freq) and rot.max_seq_len_cached == WINDOW
    before = model.model.rotary_emb.inv_freq.clone()
    prepare_rotary(model, 3 * WINDOW)  # vanilla: a no-op
    assert torch.equal(model.model.rotary_emb.inv_freq, before)


def _enter(context):
    with context:
        pass


# A table rotary (GPT-J, CodeGen: sin/cos rows by position id, no rope_type) holds one fixed set of frequencies, as
# "default" does: unpatched (compare's "loaded" row) it has nothing to prepare, the way lengths.fix_length has nothing
# to fix on a patched one. Its table (4 x WINDOW rows) is read past the window too.
@pytest.mark.parametrize("folder", ["gptj", "codegen"])
@pytest.mark.parametrize("run", [
    lambda model, ids: prepare_rotary(model, 3 * WINDOW),
    lambda model, ids: _enter(common.at_length(model, 3 * WINDOW)),
    lambda model, ids: evaluate_perplexity(model, ids, [WINDOW, 3 * WINDOW], n_tokens=3 * WINDOW),
], ids=["prepare_rotary", "at_length", "evaluate_perplexity"])
def test_an_unpatched_table_rotary_has_nothing_to_prepare(stream, folder, run):
    model = tiny_model(folder)
    ids = torch.tensor([stream[:3 * WINDOW]])
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with torch.no_grad():
        before = model(ids).logits
    run(model, stream)
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("scheme", [None, "yarn:2", "self_extend:group_size=4,window_size=16"])
def test_long_windows_of_a_hybrid_model_run_its_sliding_layers_windowed(monkeypatch, scheme):
    """From WINDOWED_FROM on, a hybrid model's perplexity windows run through attention.windowed (no L×L mask): the
    same NLL as the default path, which shorter windows keep; the model's own implementation back afterwards."""
    from rope_patch.evaluation import common, perplexity

    model = tiny_hybrid()
    if scheme:
        rope_patch.apply(model, scheme)
    own = model.config._attn_implementation
    stream = torch.randint(3, VOCAB, (256,), generator=torch.Generator().manual_seed(3)).tolist()
    seen = []
    monkeypatch.setattr(perplexity, "token_nll", lambda m, ids: seen.append(m.config._attn_implementation)
                        or token_nll(m, ids))
    default = perplexity.window_nll(model, stream, 64, 128)
    assert seen == [own]  # shorter than WINDOWED_FROM: the default path
    monkeypatch.setattr(common, "WINDOWED_FROM", 64)
    windowed = perplexity.window_nll(model, stream, 64, 128)
    assert seen[1].startswith("rope_patch_windowed")
    assert model.config._attn_implementation == own
    assert (windowed - default).abs().max().item() <= 1e-5


@pytest.mark.parametrize("scheme", [None, "yarn:2", "self_extend:group_size=4,window_size=16"])
def test_long_prompts_of_a_hybrid_model_decode_with_its_sliding_layers_windowed(monkeypatch, scheme):
    """Greedy decoding (passkey, RULER through lm-eval) from WINDOWED_FROM on: the prompt's prefill and the cached
    steps run windowed, and give the default path's tokens; the model's own implementation is back afterwards."""
    from rope_patch.evaluation import common, retrieval

    model = tiny_hybrid()
    if scheme:
        rope_patch.apply(model, scheme)
    own = model.config._attn_implementation
    ids = torch.randint(3, VOCAB, (2, 72), generator=torch.Generator().manual_seed(4))
    seen = record_implementations(monkeypatch, model)
    default = retrieval.greedy_generate(model, ids, 6)
    assert set(seen) == {own}
    monkeypatch.setattr(common, "WINDOWED_FROM", 64)
    seen.clear()
    windowed = retrieval.greedy_generate(model, ids, 6)
    assert len(seen) == 6 and all(s.startswith("rope_patch_windowed") for s in seen)
    assert torch.equal(windowed, default) and model.config._attn_implementation == own


@pytest.mark.parametrize("kw, message", [
    # a bucket beyond the longest length: its row said positions 32-100 for what was 32-64
    ({"buckets": [(0, 32), (32, 100)]}, r"0 <= start < end <= 64; got \(32, 100\)"),
    ({"buckets": [(16, 16)]}, r"got \(16, 16\)"),
    # too few tokens for one window at the longest length: it failed after the shorter lengths had run
    ({"n_tokens": 48}, "length 64 needs at least one window.*48 are read"),
])
def test_bad_buckets_and_lengths_without_a_window_fail_before_any_forward(model, stream, monkeypatch, kw, message):
    from rope_patch.evaluation import perplexity

    monkeypatch.setattr(perplexity, "window_nll", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(ValueError, match=message):
        evaluate_perplexity(model, stream, [32, 64], **kw)
