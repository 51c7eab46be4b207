"""Dual Chunk Attention (`dca`): exact against a reference written from the paper, on every backend, with and without
left padding; cached = recomputed; gradients; degenerate settings = vanilla RoPE; config-dict defaults; refusals."""

from __future__ import annotations

import pytest
import torch
from helpers.models import WINDOW, logits, tiny_config, tiny_model
from helpers.reference_dca import forward as dca_reference
from helpers.reference_dca import relative_matrix
from test_attention import PAD, assert_cached_decoding_equals_recomputation, batch

import rope_patch
from rope_patch import attention
from rope_patch.schemes.chunked import DualChunk

# (chunk_size, local_size, length): chunks of c = chunk_size − local_size tokens
CASES = [
    (12, 3, 96),  # c = 9: 11 chunks, inter region everywhere
    (24, 4, 96),  # the defaults for WINDOW = 32 (¾·L, L/8): c = 20, 5 chunks
    (16, 10, 60),  # c = 6: 2c − 1 = 11 < 16, the code's clipped inter position
    (20, 2, 50),  # c = 18: 3 chunks, a long local window across the boundary
    (7, 6, 40),  # c = 1: every key in its own chunk
]
CASE_IDS = [f"s{s}-l{local}-n{n}" for s, local, n in CASES]
BACKENDS = ["eager", "sdpa"]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several uneven query blocks per call, crossing chunk boundaries, on the fused and the materialised path."""
    monkeypatch.setattr(attention.settings, "BLOCK_ELEMENTS", 2 * 4 * 96 * 11)
    monkeypatch.setattr(attention.settings, "FUSED_BLOCK", 24)


def dca_model(arch="llama", backend="sdpa", seed=0, **params):
    model = tiny_model(arch, seed=seed, attn_implementation=backend)
    rope_patch.apply(model, "dca", **params)
    return model


def max_diff(a, b, real=None):
    d = (a - b).abs()
    return (d[real] if real is not None else d).max().item()


# ---- the reference itself -------------------------------------------------------------------------------------------
def test_reference_matrix_is_the_papers_figure_2():
    """Figure 2 (c) of the paper: s = 6, c = 10, w = 4, i.e. chunk_size 9, local_size 3: P_q^Succ = [6, 7, 8, 9, 9, 9],
    query 6 (first of chunk 1) against key 5 (last of chunk 0) is at distance 1, query 9 against key 0 at 9."""
    m = relative_matrix(12, chunk_size=9, local_size=3)
    assert m[6, 5] == 1 and m[9, 0] == 9 and m[11, 0] == 9 and m[11, 5] == 9 - 5
    assert m[7, 6] == 1 and m[11, 6] == 5  # intra-chunk: exact
    assert m[:6, :6].equal(torch.tril(torch.arange(6)[:, None] - torch.arange(6)[None, :]).float())


# ---- exactness ----------------------------------------------------------------------------------------------------
SETUPS = [("llama", b, p) for b in BACKENDS for p in (False, True)] + [("qwen2", "sdpa", True),
                                                                       ("mistral", "eager", True)]


@pytest.mark.parametrize("arch,backend,padded", SETUPS,
                         ids=[f"{a}-{b}-{'pad' if p else 'nopad'}" for a, b, p in SETUPS])
@pytest.mark.parametrize("chunk_size,local_size,n", CASES, ids=CASE_IDS)
def test_matches_reference(chunk_size, local_size, n, arch, backend, padded):
    model = dca_model(arch, backend, chunk_size=chunk_size, local_size=local_size)
    ids, kw = batch(padded, n=n)
    want = dca_reference(model, ids, chunk_size, local_size, kw.get("attention_mask"))
    real = kw["attention_mask"].bool() if padded else None
    assert max_diff(logits(model, ids, **kw), want, real) <= 1e-5


def test_defaults_are_three_quarters_and_an_eighth_of_the_window():
    model = dca_model()
    assert rope_patch.current(model) == DualChunk(chunk_size=3 * WINDOW // 4, local_size=WINDOW // 8)
    ids, _ = batch(False)
    assert max_diff(logits(model, ids), dca_reference(model, ids, 24, 4)) <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("chunk_size,local_size,n", CASES[:3], ids=CASE_IDS[:3])
def test_eager_and_sdpa_agree(chunk_size, local_size, n, arch):
    """gemma2: softcapping, the model's own scale (transformers has no sdpa for it: the blocked function is set on an
    eager model, as the sdpa backend would)."""
    ids, kw = batch(True, n=n)
    outs = []
    for backend in BACKENDS:
        model = dca_model(arch, "eager", seed=1, chunk_size=chunk_size, local_size=local_size)
        if backend == "sdpa":
            model.set_attn_implementation(attention.BLOCKED)
        outs.append(logits(model, ids, **kw))
    assert max_diff(*outs, kw["attention_mask"].bool()) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_size,local_size,n", CASES, ids=CASE_IDS)
def test_left_padded_row_equals_sequence_alone(chunk_size, local_size, n, backend):
    model = dca_model("qwen2", backend, chunk_size=chunk_size, local_size=local_size)
    ids, kw = batch(True, n=n)
    alone = logits(model, ids[:1, PAD:])
    assert max_diff(logits(model, ids, **kw)[:1, PAD:], alone) <= 1e-5


VANILLA = [("llama", "eager"), ("llama", "sdpa"), ("qwen2", "sdpa"), ("gemma2", "eager"), ("cohere", "eager")]


@pytest.mark.parametrize("arch,backend", VANILLA, ids=[f"{a}-{b}" for a, b in VANILLA])
@pytest.mark.parametrize("chunk_size,local_size", [(40, 20), (64, 8)], ids=["2c=N", "wide"])
def test_chunks_covering_the_sequence_equal_vanilla_rope(chunk_size, local_size, arch, backend):
    """chunk_size ≥ N and 2·(chunk_size − local_size) ≥ N: at most two chunks and no clipping, i.e. RoPE (cohere:
    interleaved pairs, through the model's own apply_rotary_pos_emb)."""
    model = tiny_model(arch, attn_implementation=backend)
    ids, kw = batch(True, n=40)
    want = logits(model, ids, **kw)
    rope_patch.apply(model, "dca", chunk_size=chunk_size, local_size=local_size)
    assert max_diff(logits(model, ids, **kw), want, kw["attention_mask"].bool()) <= 1e-5


def test_chunk_size_covering_the_sequence_is_not_enough_for_vanilla():
    """chunk_size ≥ N but 2·(chunk_size − local_size) < N: a third chunk reads its older keys at the inter position."""
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, _ = batch(False, n=40)
    want = logits(model, ids)
    rope_patch.apply(model, "dca", chunk_size=40, local_size=22)  # c = 18: positions 36 … 39 in a third chunk
    got = logits(model, ids)
    assert max_diff(got[:, :36], want[:, :36]) <= 1e-5 and max_diff(got[:, 36:], want[:, 36:]) > 1e-3


# ---- decoding, gradients --------------------------------------------------------------------------------------------
GEN = [("llama", "eager", 12, 3), ("llama", "eager", 9, 4), ("qwen2", "sdpa", 12, 3), ("gemma2", "eager", 9, 4)]


@pytest.mark.parametrize("arch,backend,chunk_size,local_size", GEN,
                         ids=[f"{a}-{b}-c{s - local}" for a, b, s, local in GEN])
def test_generate_with_cache_equals_recomputation(arch, backend, chunk_size, local_size):
    """Left-padded prompts of 24 tokens, 6 new ones: the decode steps cross chunk boundaries."""
    assert_cached_decoding_equals_recomputation(dca_model(arch, backend, chunk_size=chunk_size,
                                                          local_size=local_size), n=24)


def test_unpadded_decoding_on_the_fused_path_equals_eager():
    ids, _ = batch(False, n=24)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    runs = []
    for backend in BACKENDS:
        with torch.no_grad():
            runs.append(dca_model("llama", backend, chunk_size=9, local_size=4).generate(ids, use_cache=True, **gen))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert max(max_diff(a, b) for a, b in zip(runs[0].logits, runs[1].logits, strict=True)) <= 1e-5


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_backward_is_finite_and_eager_equals_sdpa(padded):
    ids, kw = batch(padded, n=60)
    labels = ids.clone()
    if padded:  # a pad row's output is arbitrary (it attends to nothing): no label may be predicted from one
        labels[:, 1:] = labels[:, 1:].masked_fill(kw["attention_mask"][:, :-1] == 0, -100)
    grads = []
    for backend in BACKENDS:
        model = dca_model("llama", backend, chunk_size=12, local_size=3).train()
        model(ids, labels=labels, **kw).loss.backward()
        g = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert g and all(torch.isfinite(t).all() for t in g.values())
        assert g["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
        grads.append(g)
    assert grads[0].keys() == grads[1].keys()
    assert max(max_diff(grads[0][n], grads[1][n]) for n in grads[0]) <= 1e-5


# ---- flex_attention -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size,local_size,n,padded", [(12, 3, 60, False), (16, 10, 60, True)],
                         ids=["s12-l3-n60-nopad", "s16-l10-n60-pad"])
def test_flex_matches_reference(chunk_size, local_size, n, padded, monkeypatch):
    """Three flex calls merged by log-sum-exp; on CPU through eager flex (the compiled CPU kernel has no lse)."""
    monkeypatch.setattr(attention.settings, "FLEX_COMPILE", False)
    model = dca_model("llama", "flex_attention", chunk_size=chunk_size, local_size=local_size)
    assert model.config._attn_implementation == attention.FLEX
    ids, kw = batch(padded, n=n)
    want = dca_reference(model, ids, chunk_size, local_size, kw.get("attention_mask"))
    assert max_diff(logits(model, ids, **kw), want, kw["attention_mask"].bool() if padded else None) <= 1e-5


def test_flex_is_refused_where_compiled_flex_has_no_lse():
    model = tiny_model("llama", attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="dca: .*log-sum-exp.*found the model on cpu.*'sdpa'"):
        rope_patch.apply(model, "dca")
    assert rope_patch.current(model) is None and model.config._attn_implementation == "flex_attention"


# ---- parameters: config dict, persistence, refusals -----------------------------------------------------------------
def test_dual_chunk_attention_config_gives_the_parameters():
    """Qwen2.5-1M's config.json carries dual_chunk_attention_config (with sparse-attention keys, not read here)."""
    dca_config = {"chunk_size": 12, "local_size": 3, "original_max_position_embeddings": WINDOW,
                  "sparse_attention_enabled": True, "sparse_attention_threshold": 64}
    model = tiny_model("qwen2", attn_implementation="sdpa", dual_chunk_attention_config=dca_config)
    rope_patch.apply(model, "dca")
    assert rope_patch.current(model) == DualChunk(chunk_size=12, local_size=3)
    ids, _ = batch(False)
    assert max_diff(logits(model, ids), dca_reference(model, ids, 12, 3)) <= 1e-5
    rope_patch.apply(model, "dca", local_size=5)  # a given parameter wins over the config's
    assert rope_patch.current(model) == DualChunk(chunk_size=12, local_size=5)
    assert DualChunk.from_dual_chunk_attention_config(dca_config) == DualChunk(chunk_size=12, local_size=3)
    only_window = tiny_model("qwen2", dual_chunk_attention_config={"original_max_position_embeddings": 64})
    rope_patch.apply(only_window, "dca")
    assert rope_patch.current(only_window) == DualChunk(chunk_size=48, local_size=8)


def test_save_and_reload_keeps_the_scheme(tmp_path):
    model = dca_model(chunk_size=12, local_size=3)
    ids, _ = batch(False, n=60)
    rope_patch.save_pretrained(model, tmp_path)
    again = rope_patch.from_pretrained(tmp_path).eval()
    assert rope_patch.current(again) == rope_patch.current(model)
    assert torch.equal(logits(again, ids), logits(model, ids))


def test_to_rope_parameters_raises_clearly():
    with pytest.raises(ValueError, match="dca has no native transformers/vLLM `rope_parameters` form.*attention"):
        rope_patch.to_rope_parameters("dca")
    with pytest.raises(ValueError, match="no native"):
        rope_patch.to_rope_parameters(DualChunk(chunk_size=12, local_size=3))


def test_remove_restores_model_exactly():
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, kw = batch(True)
    before = logits(model, ids, **kw)
    rope_patch.apply(model, "chunkllama", chunk_size=12, local_size=3)
    assert rope_patch.current(model).name == "dca" and not torch.equal(logits(model, ids, **kw), before)
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids, **kw), before) and model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, attention.STATE) for m in model.modules())


BAD = [
    (dict(chunk_size=0), {}, ValueError, r"`chunk_size` must be an integer in \[2, "),
    (dict(local_size=0), {}, ValueError, r"`local_size` must be an integer in \[1, "),
    (dict(chunk_size=8, local_size=8), {}, ValueError, "larger than `local_size`.*chunk_size=8, local_size=8"),
    (dict(chunk_size=3), {}, ValueError, "chunk_size=3, local_size=4 .*chunk_size given, local_size the default"),
    (dict(chunk_size=2.5), {}, TypeError, "`chunk_size` must be an integer"),
    (dict(local_size=True), {}, TypeError, "`local_size` must be an integer"),
    (dict(chunk_size="24"), {}, TypeError, "`chunk_size` must be an integer"),
    (dict(chunk_size=float("inf")), {}, TypeError, "`chunk_size` must be an integer"),
    (dict(chunk_size=1 << 40), {}, ValueError, "`chunk_size` must be an integer in"),
    (dict(window_size=8), {}, TypeError, "unknown parameter 'window_size'"),
    ({}, dict(dual_chunk_attention_config={"chunk_size": "big"}), TypeError,
     "`chunk_size \\(from the model config's dual_chunk_attention_config\\)` must be an integer"),
    ({}, dict(dual_chunk_attention_config={"chunk_size": 4, "local_size": 4}), ValueError,
     "chunk_size from the model config's dual_chunk_attention_config"),
    ({}, dict(dual_chunk_attention_config=[24, 4]), TypeError, "dual_chunk_attention_config must be a dict"),
]


@pytest.mark.parametrize("params,config,error,words", BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_bad_input_fails_at_apply_and_leaves_model_unchanged(params, config, error, words):
    model = tiny_model("llama", attn_implementation="sdpa", **config)
    ids, _ = batch(False)
    before = logits(model, ids)
    with pytest.raises(error, match=words):
        rope_patch.apply(model, "dca", **params)
    assert rope_patch.current(model) is None and model.config._attn_implementation == "sdpa"
    assert "forward" not in vars(model.model.rotary_emb)
    assert torch.equal(logits(model, ids), before)


def test_incomplete_config_dict_is_refused():
    with pytest.raises(ValueError, match="lacks local_size"):
        DualChunk.from_dual_chunk_attention_config({"chunk_size": 24})
    config = tiny_config("qwen2", dual_chunk_attention_config={"chunk_size": 24})
    assert config.dual_chunk_attention_config == {"chunk_size": 24}


def test_sliding_window_cache_and_per_layer_type_rope():
    """mistral with a sliding window: its cache keeps window − 1 keys, so key slot 0 is no longer position 0 (chunks
    follow true positions through the offset); gemma3_text: per-layer-type frequencies and sliding layers."""
    mistral = tiny_model("mistral", attn_implementation="sdpa", sliding_window=8)
    rope_patch.apply(mistral, "dca", chunk_size=9, local_size=4)
    assert_cached_decoding_equals_recomputation(mistral)
    ids, kw = batch(True, n=20)
    kw.pop("position_ids")
    blocked = logits(mistral, ids, **kw)
    mistral.set_attn_implementation(attention.DENSE)
    assert max_diff(logits(mistral, ids, **kw), blocked, kw["attention_mask"].bool()) <= 1e-5
    gemma3 = tiny_model("gemma3_text", attn_implementation="sdpa", layer_types=["sliding_attention", "full_attention"],
                        sliding_window=8)
    rope_patch.apply(gemma3, "dca", chunk_size=9, local_size=4)
    assert_cached_decoding_equals_recomputation(gemma3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_in_pieces_with_the_cache_equals_one_forward(backend):
    """Several new tokens per cached call (chunked prefill): the chunks still follow true positions."""
    from transformers import DynamicCache

    model = dca_model("llama", backend, chunk_size=12, local_size=3)
    ids, _ = batch(False, n=60)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        pieces = [model(ids[:, a:z], cache=cache, use_cache=True).logits for a, z in ((0, 25), (25, 31), (31, 60))]
    assert max_diff(torch.cat(pieces, dim=1), logits(model, ids)) <= 1e-5
