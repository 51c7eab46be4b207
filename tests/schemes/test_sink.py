"""StreamingLLM (`sink`): against the paper's per-query formulation and the authors' pos_shift code, a `SinkCache`
that keeps memory constant while generation equals the reference step by step, and its refusals."""

from __future__ import annotations

import pytest
import torch
from helpers.models import WINDOW, logits, tiny_model, token_batch
from helpers.reference_sink import paper_forward, pos_shift_forward
from helpers.schemes import refused_at_apply

import rope_patch
from rope_patch import attention
from rope_patch.schemes.sink import Sink, SinkCache, SinkLayer

L = 3 * WINDOW
BACKENDS = ["eager", "sdpa"]
SIZES = [(4, 16), (1, 5), (0, 8), (4, 40), (2, 200)]  # (sink_size, window_size); 200: the window covers everything


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several query blocks per call at test lengths (the block loop and the fused key split are what run)."""
    monkeypatch.setattr(attention.settings, "FUSED_BLOCK", 24)


def patched(backend, sink_size, window_size, arch="llama", **cfg):
    model = tiny_model(arch, attn_implementation=backend, **cfg)
    return rope_patch.apply(model, "sink", sink_size=sink_size, window_size=window_size)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sink_size,window_size", SIZES)
def test_prefill_matches_the_paper_and_the_authors_code(sink_size, window_size, backend):
    """One forward over 96 tokens = the per-query reference (≤ 1e-5) = the authors' token-by-token pos_shift loop with
    StartRecentKVCache(start_size=S, recent_size=W − 1) (≤ 1e-4)."""
    model = patched(backend, sink_size, window_size)
    ids, _ = token_batch(L, 0, 0)
    got = logits(model, ids)
    assert (got - paper_forward(model, ids, sink_size, window_size)).abs().max().item() <= 1e-5
    assert (got - pos_shift_forward(model, ids, sink_size, window_size - 1)).abs().max().item() <= 1e-4


def test_the_scheme_changes_the_model_past_the_window_only():
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, _ = token_batch(L, 0, 0)
    before = logits(model, ids)
    rope_patch.apply(model, "sink:16")
    after = logits(model, ids)
    assert (after[:, :16] - before[:, :16]).abs().max() <= 1e-5  # every key is in the window: plain RoPE
    assert (after[:, 40:] - before[:, 40:]).abs().max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generation_through_a_sink_cache_equals_the_reference_at_every_step(arch, backend):
    """Greedy generation of 30 tokens after a 40-token prompt (S + W = 20: the prefill and every step evict): each
    step's logits equal the per-query reference on the final sequence, and the cache stays at S + W − 1 keys."""
    s, w = 4, 16
    model = patched(backend, s, w, arch)
    ids, _ = token_batch(40, 1, 0)
    cache = SinkCache.for_model(model)
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=30, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    ref = paper_forward(model, out.sequences, s, w)
    steps = [(got - ref[:, 39 + t]).abs().max().item() for t, got in enumerate(out.logits)]
    assert max(steps) <= 1e-5, steps
    sizes = {layer.keys.shape[-2] for layer in cache.layers}
    assert sizes == {s + w - 1} and cache.get_seq_length() == 69  # the last token generated is not fed back
    assert all(isinstance(layer, SinkLayer) for layer in cache.layers)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_equals_decoding_chunk_by_chunk_through_the_evicting_cache(backend):
    """The same 96 tokens in one forward, and through a SinkCache in chunks of 10, 7, 1, 1, 23, ... (multi-token
    queries on an evicted cache: the middle of the chunk's own past is hidden, the kept keys are sinks + window)."""
    s, w = 3, 12
    model = patched(backend, s, w)
    ids, _ = token_batch(L, 2, 0)
    full = logits(model, ids)
    cache, parts, start = SinkCache.for_model(model), [], 0
    with torch.no_grad():
        for size in [10, 7, 1, 1, 23, 2, 30, 1, 1, 1, 19]:
            parts.append(model(ids[:, start:start + size], cache=cache, use_cache=True).logits)
            start += size
    assert start == L
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-5
    assert (torch.cat(parts, dim=1) - pos_shift_forward(model, ids, s, w - 1)).abs().max().item() <= 1e-4


def test_keys_are_cached_once_rotated_at_their_own_positions():
    """No re-rotation per step: the cache holds one key set (the model's key heads), rotated as the unpatched model
    rotates it (the sinks and the window keep their true positions; only the query moves). Layer 0's keys depend on
    the embeddings alone, so they are the vanilla model's keys at the kept slots."""
    s, w = 4, 16
    ids, _ = token_batch(L, 3, 0)
    plain = tiny_model("llama", attn_implementation="sdpa")
    with torch.no_grad():
        vanilla = plain(ids, use_cache=True).cache
    model = patched("sdpa", s, w)
    cache = SinkCache.for_model(model)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    for mine, theirs in zip(cache.layers, vanilla.layers, strict=True):
        assert mine.keys.shape == (*theirs.keys.shape[:2], s + w - 1, theirs.keys.shape[-1])
    mine, theirs = cache.layers[0].keys, vanilla.layers[0].keys
    assert (mine - torch.cat([theirs[:, :, :s], theirs[:, :, L - (w - 1):]], dim=2)).abs().max().item() <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padding_with_the_default_cache_is_exact(backend):
    """A DynamicCache keeps every key (the rule hides the middle): left-padded generation equals recomputation and each
    row equals the reference of its real tokens."""
    s, w = 4, 16
    model = patched(backend, s, w)
    ids, kw = token_batch(40, 4, 7)
    kw.pop("position_ids")
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
               return_dict_in_generate=True, **kw)
    with torch.no_grad():
        cached, full = (model.generate(ids, use_cache=c, **gen) for c in (True, False))
    assert torch.equal(cached.sequences, full.sequences)
    mask = torch.cat([kw["attention_mask"], torch.ones(2, 8, dtype=torch.long)], dim=1)
    ref = paper_forward(model, cached.sequences, s, w, mask)
    assert max((got - ref[:, 39 + t]).abs().max().item() for t, got in enumerate(cached.logits)) <= 1e-5


def test_a_sink_cache_refuses_padding_other_sizes_and_unpatched_models():
    model = patched("sdpa", 4, 16)
    ids, kw = token_batch(40, 0, 5)
    with pytest.raises(ValueError, match="SinkCache takes unpadded rows.*DynamicCache"):
        model(ids, attention_mask=kw["attention_mask"], cache=SinkCache.for_model(model), use_cache=True)
    with pytest.raises(ValueError, match="sink_size=2, window_size=16 but the model runs sink_size=4"):
        model(ids, cache=SinkCache(model.config, sink_size=2, window_size=16), use_cache=True)
    with pytest.raises(ValueError, match="carries no `sink` scheme"):
        SinkCache.for_model(tiny_model("llama"))
    with pytest.raises(TypeError, match="window_size"):
        SinkCache(model.config)


BAD = [
    (dict(window_size=0), ValueError, "window_size"),
    (dict(sink_size=4), TypeError, "missing required parameter `window_size`"),
    (dict(window_size=16, sink_size=-1), ValueError, "sink_size"),
    (dict(window_size=16, sink_size=2.5), TypeError, "sink_size"),
    (dict(window_size=16, recent_size=15), TypeError, "unknown parameter"),
]


@pytest.mark.parametrize("params,error,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_fails_at_apply_and_leaves_the_model_unchanged(params, error, words):
    refused_at_apply("sink", params, error, words)


def test_relative_position_is_the_cache_index_difference():
    """Sink.relative_position against the index difference in the authors' cache, from the visible set directly."""
    s, w = 4, 8
    scheme = Sink(window_size=w, sink_size=s)
    for i in range(40):
        visible = [j for j in range(i + 1) if j < s or i - j < w]
        for j in range(i + 1):
            r = scheme.relative_position(torch.tensor(i), torch.tensor(j)).item()
            if j in visible:
                assert r == len(visible) - 1 - visible.index(j)
            else:
                assert r != r  # NaN: hidden


def test_suggestion_is_four_sinks_and_the_window():
    model = tiny_model("llama")
    spec = next(s for s in rope_patch.suggest(model, 4 * WINDOW) if s.scheme == "sink")
    assert spec.params == {"sink_size": 4, "window_size": WINDOW - 4}
    assert Sink.suggestion(WINDOW, WINDOW) is None


def test_sliding_layers_keep_transformers_cache_layer():
    """olmo3 (a sliding layer of window 8 < W, a full layer): the sliding layers run as the model has them and
    keep transformers' sliding cache layer; cached generation through the SinkCache equals recomputation."""
    model = patched("eager", 2, 10, "olmo3")
    ids, _ = token_batch(30, 5, 0)
    cache = SinkCache.for_model(model)
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert "SinkLayer" in kinds and "DynamicSlidingWindowLayer" in kinds
    gen = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        streamed = model.generate(ids, cache=cache, **gen)
        full = model.generate(ids, use_cache=False, **gen)
    assert torch.equal(streamed.sequences, full.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(streamed.logits, full.logits, strict=True)) <= 1e-5
