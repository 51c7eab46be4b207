"""LM-Infinite (`lm_infinite`, Han et al. 2024): against the authors' lambda-mask code
(helpers/reference_lm_infinite.py, checked here against the paper's per-pair formulation) on every backend, cached
generation across the local window's edge, chunked prefill on the cache, left padding, removal and the refusals at
apply()."""

from __future__ import annotations

import pytest
import torch
from helpers.models import WINDOW, logits, tiny_model, token_batch
from helpers.reference_lm_infinite import lambda_chunked_logits, lambda_forward, lambda_generate_logits, paper_forward
from helpers.schemes import refused_at_apply
from transformers import DynamicCache

import rope_patch
from rope_patch import attention

N = 3 * WINDOW
PAD = 7
BACKENDS = ["eager", "sdpa", "flex_attention"]
# (global_size, local_size, max_distance)
SIZES = [
    (4, 16, 16),
    (1, 8, 8),
    (8, 24, 12),  # D < L: the global keys nearer than the local band's farthest
    (0, 16, 16),  # no global branch: a sliding window of plain RoPE
    (3, 2, 2),  # each query sees itself, the token before it and the first 3 tokens
    (5, 40, 40),  # L > the fused block
    (120, 40, 40),  # G > n: every far key is global, at distance D (the authors' long_seq fails here; see the helper)
]
SIZE_IDS = [f"G{g}-L{w}-D{d}" for g, w, d in SIZES]
# the references also take L = 1 (each query sees itself and the first G tokens), which the scheme refuses (BAD)
REF_SIZES = SIZES + [(3, 1, 1)]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several query blocks per call at test lengths (the block loop and the fused key split are what run); flex
    eagerly (torch's compiled CPU flex kernel is refused by rope_patch: tests/schemes/test_backends.py)."""
    monkeypatch.setattr(attention.settings, "FUSED_BLOCK", 24)
    monkeypatch.setattr(attention.settings, "FLEX_COMPILE", False)


def plain(backend, arch="llama"):
    if backend == "flex_attention" and not attention.flex_available():
        pytest.skip("flex_attention is not available in this torch / transformers")
    return tiny_model(arch, attn_implementation=backend)


def patched(backend, g, w, d, arch="llama"):
    return rope_patch.apply(plain(backend, arch), "lm_infinite", global_size=g, local_size=w, max_distance=d)


def diff(a, b) -> float:
    return (a - b).abs().max().item()


# ---- the references on their own ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("g,w,d", REF_SIZES, ids=[f"G{g}-L{w}-D{d}" for g, w, d in REF_SIZES])
def test_the_authors_code_equals_the_paper(g, w, d, arch):
    """The lambda path (prefill: short_seq / long_seq; decoding: single_query; a chunk after G + L tokens: cached)
    against the per-pair formulation, on the unpatched model's weights."""
    model = tiny_model(arch)
    ids, _ = token_batch(N, 0, 0)
    paper = paper_forward(model, ids, g, w, d)
    assert diff(lambda_forward(model, ids, g, w, d), paper) <= 1e-5
    assert diff(lambda_generate_logits(model, ids, 10, g, w, d), paper) <= 1e-5
    if g + w < N:
        assert diff(lambda_chunked_logits(model, ids, [g + w, N - g - w], g, w, d), paper) <= 1e-5


def test_the_references_are_plain_rope_inside_the_window_only():
    """L >= n (any G): the unpatched model. L < n: the first L positions unchanged, the later ones not."""
    model = tiny_model("llama")
    ids, _ = token_batch(N, 1, 0)
    vanilla = logits(model, ids)
    for g in (0, 4, N):
        for ref in (lambda_forward, paper_forward):
            assert diff(ref(model, ids, g, N, N), vanilla) <= 1e-5
            assert diff(ref(model, ids, g, N + 50, N), vanilla) <= 1e-5
            got = ref(model, ids, g, 16, 16)
            assert diff(got[:, :16], vanilla[:, :16]) <= 1e-5 and diff(got[:, 40:], vanilla[:, 40:]) > 1e-3
    # the global branch matters: G = 4 differs from G = 0 once i >= L
    assert diff(paper_forward(model, ids, 4, 16)[:, 16:], paper_forward(model, ids, 0, 16)[:, 16:]) > 1e-2


def test_the_authors_cached_mode_only_takes_a_chunk_after_g_plus_l_tokens():
    """A transcribed quirk: `Lambda_Attention_Matrix` asserts q_len + L + G == kv_len for a multi-token chunk."""
    model = tiny_model("llama")
    ids, _ = token_batch(40, 0, 0)
    with pytest.raises(AssertionError, match="q_len \\+ L \\+ G == kv_len"):
        lambda_chunked_logits(model, ids, [10, 30], 4, 16, 16)


# ---- the scheme -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("g,w,d", SIZES, ids=SIZE_IDS)
def test_prefill_matches_the_authors_code(g, w, d, backend):
    """One forward over 96 tokens = the lambda path (≤ 1e-5)."""
    model = patched(backend, g, w, d)
    ids, _ = token_batch(N, 0, 0)
    assert diff(logits(model, ids), lambda_forward(model, ids, g, w, d)) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("g,w,d", [(4, 16, 16), (8, 24, 12)], ids=["G4-L16-D16", "G8-L24-D12"])
def test_qwen2_prefill_matches_the_authors_code(g, w, d, backend):
    """qwen2: q/k/v biases (the key bias is rotated with the key, and un-rotated in the global branch)."""
    model = patched(backend, g, w, d, "qwen2")
    ids, _ = token_batch(N, 1, 0)
    assert diff(logits(model, ids), lambda_forward(model, ids, g, w, d)) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("g", [0, 4, N + 10])
def test_a_local_window_larger_than_the_input_is_the_unpatched_model(g, backend):
    ids, _ = token_batch(N, 2, 0)
    vanilla = logits(plain(backend), ids)
    for w in (N, N + 100):
        assert diff(logits(patched(backend, g, w, w), ids), vanilla) <= 1e-5


def test_max_distance_defaults_to_local_size():
    ids, _ = token_batch(N, 3, 0)
    a = rope_patch.apply(tiny_model("llama", attn_implementation="sdpa"), "lm_infinite", global_size=4, local_size=16)
    b = patched("sdpa", 4, 16, 16)
    assert torch.equal(logits(a, ids), logits(b, ids))
    assert diff(logits(a, ids), logits(patched("sdpa", 4, 16, 8), ids)) > 1e-3  # D is used


GEN = [("llama", b, s) for b in BACKENDS for s in [(4, 16, 16), (2, 12, 6)]]
GEN += [("qwen2", b, (4, 16, 16)) for b in BACKENDS]


@pytest.mark.parametrize("arch,backend,sizes", GEN, ids=[f"{a}-{b}-G{s[0]}-L{s[1]}-D{s[2]}" for a, b, s in GEN])
def test_cached_generation_across_the_window_edge_equals_the_authors_loop_and_recomputation(arch, backend, sizes):
    """A 10-token prompt (< L), 30 greedy tokens (past L and past G + L): each step's logits equal the authors'
    token-by-token loop (prompt as one forward, then single_query steps on the cache of raw keys) and a full forward
    on the final sequence; generation without the cache picks the same tokens."""
    g, w, d = sizes
    model = patched(backend, g, w, d, arch)
    ids, _ = token_batch(10, 1, 0)
    gen = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **gen)
        full = model.generate(ids, use_cache=False, **gen)
    seq = cached.sequences
    assert seq.shape[1] == 40 > g + w and torch.equal(seq, full.sequences)
    authors = lambda_generate_logits(model, seq, 10, g, w, d)
    recomputed = logits(model, seq)
    steps = [diff(got, authors[:, 9 + t]) for t, got in enumerate(cached.logits)]
    assert max(steps) <= 1e-4, steps
    assert max(diff(got, recomputed[:, 9 + t]) for t, got in enumerate(cached.logits)) <= 1e-4
    assert max(diff(a, b) for a, b in zip(cached.logits, full.logits, strict=True)) <= 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_in_chunks_on_the_cache_equals_one_forward(backend):
    """The cache keeps every key: chunks of 10, 7, 1, 1, 23, ... equal one forward; a chunk after exactly G + L tokens
    equals the authors' `cached` mode."""
    g, w, d = 3, 12, 10
    model = patched(backend, g, w, d)
    ids, _ = token_batch(N, 2, 0)
    full = logits(model, ids)
    assert diff(full, lambda_forward(model, ids, g, w, d)) <= 1e-5
    for chunks in ([10, 7, 1, 1, 23, 2, 30, 1, 1, 1, 19], [g + w, N - g - w]):
        cache, parts, start = DynamicCache(config=model.config), [], 0
        with torch.no_grad():
            for size in chunks:
                parts.append(model(ids[:, start:start + size], cache=cache, use_cache=True).logits)
                start += size
        assert diff(torch.cat(parts, dim=1), full) <= 1e-5, chunks
    assert diff(torch.cat(parts, dim=1), lambda_chunked_logits(model, ids, [g + w, N - g - w], g, w, d)) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padded_rows_equal_their_unpadded_reference(backend):
    """Positions are true positions (pads skipped: the global branch is the first G real tokens): a padded batch's
    real rows equal the authors' code on the unpadded rows, in a forward and in cached generation, which equals
    recomputation."""
    g, w, d = 4, 16, 16
    model = patched(backend, g, w, d)
    ids, kw = token_batch(48, 4, PAD)
    got = logits(model, ids, **kw)
    assert diff(got[0, PAD:], lambda_forward(model, ids[:1, PAD:], g, w, d)[0]) <= 1e-5
    assert diff(got[1], lambda_forward(model, ids[1:], g, w, d)[0]) <= 1e-5
    assert diff(got[kw["attention_mask"].bool()],
                paper_forward(model, ids, g, w, d, kw["attention_mask"])[kw["attention_mask"].bool()]) <= 1e-5

    prompt, kw = token_batch(12, 5, PAD)  # row 0: 5 real tokens; with 16 new ones both rows pass L and G + L
    kw.pop("position_ids")
    gen = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
               **kw)
    with torch.no_grad():
        cached, full = (model.generate(prompt, use_cache=c, **gen) for c in (True, False))
    assert torch.equal(cached.sequences, full.sequences)
    assert max(diff(a, b) for a, b in zip(cached.logits, full.logits, strict=True)) <= 1e-5
    for row, skip in ((0, PAD), (1, 0)):
        real = cached.sequences[row:row + 1, skip:]
        authors = lambda_generate_logits(model, real, 12 - skip, g, w, d)
        steps = [diff(got[row], authors[0, 11 - skip + t]) for t, got in enumerate(cached.logits)]
        assert max(steps) <= 1e-4, (row, steps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_remove_restores_the_model_exactly(backend):
    model = plain(backend)
    ids, _ = token_batch(N, 6, 0)
    before = logits(model, ids)
    rope_patch.apply(model, "lm_infinite", global_size=4, local_size=16)
    assert diff(logits(model, ids), before) > 1e-2
    rope_patch.remove(model)
    assert rope_patch.current(model) is None and model.config._attn_implementation == backend
    assert torch.equal(logits(model, ids), before)


BAD = [
    (dict(global_size=4), TypeError, "missing required parameter `local_size`"),
    (dict(local_size=16.5), TypeError, "local_size"),
    (dict(local_size=16, global_size=2.5), TypeError, "global_size"),
    (dict(local_size=16, max_distance=8.5), TypeError, "max_distance"),
    (dict(local_size="16"), TypeError, "local_size"),
    (dict(local_size=16, max_distance=17), ValueError, "max_distance"),
    (dict(local_size=16, global_size=-1), ValueError, "global_size"),
    (dict(local_size=1), ValueError, "local_size"),
    (dict(local_size=16, globl_size=4), TypeError, "unknown parameter 'globl_size'. Did you mean 'global_size'"),
    (dict(local_size=16, limit_distance=8), TypeError, "unknown parameter 'limit_distance'"),
]


@pytest.mark.parametrize("params,error,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_fails_at_apply_and_leaves_the_model_unchanged(params, error, words):
    refused_at_apply("lm_infinite", params, error, words)
