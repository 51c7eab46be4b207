"""The attention schemes on the other backends (flex_attention, flash-attention-2) and on per-layer-type RoPE (Gemma 3):
exact against the plain-math references, refused clearly where they cannot run, reversible."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
from helpers.models import logits, tiny_model
from helpers.reference import alibi_slopes as ref_slopes
from helpers.reference import forward as reference_forward
from helpers.reference import gemma3_forward
from test_attention import PAD, assert_cached_decoding_equals_recomputation, batch, patched_model

import rope_patch
from rope_patch import attention

# ---- flex_attention ----------------------------------------------------------------------------------------------
# scheme, params, compiled. torch 2.13's compiled CPU flex kernel returns no log-sum-exp and miscompiles score_mods
# that change between calls, so rope_patch refuses it on CPU (test below) and the schemes are checked here through
# eager flex (same score_mods, masks and merges; only the kernel differs). `nope` keeps transformers' own flex.
FLEX = [
    ("alibi", {}, False),
    ("relative_bias", {"init": "alibi", "num_buckets": 16, "max_distance": 64}, False),
    ("nope", {}, True),
    ("self_extend", {"group_size": 4, "window_size": 16}, False),
    ("self_extend_logistic", {"group_size": 6, "window_size": 16, "growth_rate": 0.5}, False),
    ("rerope", {"window_size": 16}, False),
    ("leaky_rerope", {"window_size": 16, "factor": 4.0}, False),
    ("string", {"shift_size": 20, "window_size": 6}, False),
    ("dpe", {"group_sizes": [3, 1, 4, 8], "window_size": 16}, False),
    ("sink", {"window_size": 16, "sink_size": 4}, False),
]
FLEX_IDS = [s for s, *_ in FLEX]


@pytest.fixture
def fresh_compile():
    """A clean dynamo cache per test: torch 2.13's CPU inductor miscompiles flex (C++ error 'cur_kvSplitSize0 was not
    declared') once recompiles have made shapes dynamic, also for transformers' own flex backend."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("scheme,params,compiled", FLEX, ids=FLEX_IDS)
def test_flex_matches_reference(scheme, params, compiled, padded, monkeypatch, fresh_compile):
    monkeypatch.setattr(attention.settings, "FLEX_COMPILE", compiled)
    model = patched_model("llama", "flex_attention", scheme, params)
    if scheme != "nope":  # nope keeps transformers' own flex function
        assert model.config._attn_implementation == attention.FLEX
    ids, kw = batch(padded)
    got = logits(model, ids, **kw)
    want = reference_forward(model, ids, scheme, params, kw.get("attention_mask"))
    real = kw["attention_mask"].bool() if padded else torch.ones_like(ids, dtype=torch.bool)
    assert (got - want)[real].abs().max().item() <= 1e-5


FLEX_STEPS = [(s, p) for s, p, _ in FLEX if s != "nope"] + [("dca", {"chunk_size": 48, "local_size": 8}),
                                                             ("ms_poe", {"min_ratio": 1.2, "max_ratio": 1.8})]


@pytest.mark.parametrize("scheme,params", FLEX_STEPS, ids=[s for s, _ in FLEX_STEPS])
def test_flex_decoding_steps_take_the_one_row_path_and_equal_recomputation(scheme, params, monkeypatch):
    """A decoding step on the flex backend reads its BlockMask's rows and takes the blocked function's one-row path (no
    flex call: on a GPU each costs its block masks and its compiled variant's guards); left-padded greedy decoding
    with the cache equals recomputation without it."""
    monkeypatch.setattr(attention.settings, "FLEX_COMPILE", False)
    rows = []
    run = attention.flex.flex_attention
    monkeypatch.setattr(attention.flex, "flex_attention", lambda q, *a, **k: rows.append(q.shape[2]) or run(q, *a, **k))
    assert_cached_decoding_equals_recomputation(patched_model("llama", "flex_attention", scheme, params), n=24)
    assert rows and min(rows) > attention.settings.DECODE_ROWS


def test_flex_remove_restores_model_exactly(fresh_compile, monkeypatch):
    monkeypatch.setattr(attention.settings, "FLEX_COMPILE", False)
    model = tiny_model("llama", attn_implementation="flex_attention")
    ids, _ = batch(False)
    before = logits(model, ids)
    rope_patch.apply(model, "alibi")
    assert not torch.equal(logits(model, ids), before)
    rope_patch.remove(model)
    assert model.config._attn_implementation == "flex_attention"
    assert torch.equal(logits(model, ids), before)


@pytest.mark.parametrize("scheme,params", [(s, p) for s, p, _ in FLEX if s != "nope"],
                         ids=[s for s, *_ in FLEX if s != "nope"])
def test_compiled_cpu_flex_is_refused_with_what_to_do(scheme, params):
    """One-call schemes: torch 2.13's compiled CPU flex failed with a C++ error ('cur_kvSplitSize') on the second
    score_mod of a process and, compiled with static shapes, returned NaN after recompiles; two-call schemes need
    the log-sum-exp it does not return. Refused at apply(), the model untouched."""
    model = tiny_model("llama", attn_implementation="flex_attention")
    two_calls = ("self_extend", "self_extend_logistic", "rerope", "leaky_rerope", "string", "dpe", "sink")
    why = "log-sum-exp" if scheme in two_calls else "miscompiles"
    with pytest.raises(ValueError, match=f"{scheme}: .*{why}.*found the model on cpu.*'sdpa'"):
        rope_patch.apply(model, scheme, **params)
    assert rope_patch.current(model) is None and model.config._attn_implementation == "flex_attention"
    assert "forward" not in vars(model.model.rotary_emb)


# ---- flash-attention-2 (a fake flash_attn that computes the documented math in torch) -----------------------------
def _flash_math(q, k, v, softmax_scale, causal, alibi_slopes):
    """flash_attn's documented semantics for one sequence: q (sq, H, d), k/v (sk, Hkv, d); GQA by head groups;
    causal aligned bottom-right; ALiBi adds −slope·|i + sk − sq − j|."""
    sq, sk, d = q.shape[0], k.shape[0], q.shape[-1]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * (d**-0.5 if softmax_scale is None else softmax_scale)
    i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None]
    if alibi_slopes is not None:
        s = s - alibi_slopes[:, None, None] * (i - j).abs()
    if causal:
        s = s.masked_fill(j > i, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.float()).to(q.dtype)


@pytest.fixture
def fake_flash(monkeypatch):
    calls = []
    fake = types.ModuleType("flash_attn")

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        alibi_slopes=None, **kw):
        calls.append(dict(fn="dense", softmax_scale=softmax_scale, causal=causal, alibi_slopes=alibi_slopes,
                          window_size=window_size, dropout_p=dropout_p))
        return torch.stack([_flash_math(q[b], k[b], v[b], softmax_scale, causal, alibi_slopes)
                            for b in range(q.shape[0])])

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None, **kw):
        calls.append(dict(fn="varlen", softmax_scale=softmax_scale, causal=causal, alibi_slopes=alibi_slopes,
                          window_size=window_size, dropout_p=dropout_p))
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        return torch.cat([_flash_math(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], softmax_scale,
                                      causal, alibi_slopes) for i in range(len(cq) - 1)])

    fake.flash_attn_func, fake.flash_attn_varlen_func, fake.calls = flash_attn_func, flash_attn_varlen_func, calls
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # transformers probes find_spec
    import transformers.integrations.flash_attention  # noqa: F401  (its import-time availability probe: the real one)

    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    return fake


def flash_model():
    model = tiny_model("llama", attn_implementation="sdpa")
    model.config._attn_implementation_internal = "flash_attention_2"  # as a model loaded with flash-attn reads
    return model


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("params", [{}, {"max_bias": 4.0}], ids=["bias8", "bias4"])
def test_flash_alibi_passes_slopes_and_matches_reference(params, padded, fake_flash, monkeypatch):
    monkeypatch.setattr(attention.settings, "FLASH_DEVICES", ("cuda", "cpu"))  # the fake runs on CPU
    model = flash_model()
    rope_patch.apply(model, "alibi", **params)
    assert model.config._attn_implementation == attention.FA2
    fake_flash.calls.clear()  # the apply-time check's runs (attention/plumbing.py)
    ids, kw = batch(padded)
    got = logits(model, ids, **kw)
    want = reference_forward(model, ids, "alibi", params, kw.get("attention_mask"))
    real = kw["attention_mask"].bool() if padded else torch.ones_like(ids, dtype=torch.bool)
    assert (got - want)[real].abs().max().item() <= 1e-5
    heads, head_dim = model.config.num_attention_heads, model.config.head_dim
    assert len(fake_flash.calls) == model.config.num_hidden_layers
    for c in fake_flash.calls:
        assert c["fn"] == ("varlen" if padded else "dense") and c["causal"] is True and c["dropout_p"] == 0.0
        assert c["softmax_scale"] == head_dim**-0.5
        assert c["alibi_slopes"].dtype == torch.float32
        assert c["alibi_slopes"].tolist() == pytest.approx(ref_slopes(heads, params.get("max_bias", 8.0)))
    rope_patch.remove(model)
    assert model.config._attn_implementation == "flash_attention_2" and rope_patch.current(model) is None


def test_flash_left_padded_row_equals_sequence_alone(fake_flash, monkeypatch):
    monkeypatch.setattr(attention.settings, "FLASH_DEVICES", ("cuda", "cpu"))
    model = flash_model()
    rope_patch.apply(model, "alibi")
    ids, kw = batch(True)
    assert (logits(model, ids, **kw)[:1, PAD:] - logits(model, ids[:1, PAD:])).abs().max().item() <= 1e-5


FLASH_REFUSED = [
    ("relative_bias", {}, True, ("cuda", "cpu"), "cannot run this scheme"),
    ("self_extend", {"group_size": 2, "window_size": 8}, True, ("cuda", "cpu"), "cannot run this scheme"),
    ("self_extend_logistic", {"group_size": 4, "window_size": 8}, True, ("cuda", "cpu"), "cannot run this scheme"),
    ("rerope", {"window_size": 8}, True, ("cuda", "cpu"), "cannot run this scheme"),
    ("string", {"shift_size": 16, "window_size": 4}, True, ("cuda", "cpu"), "cannot run this scheme"),
    ("alibi", {}, False, ("cuda", "cpu"), "needs the `flash_attn` package"),
    ("alibi", {}, True, ("cuda",), "found the model on cpu"),
]


@pytest.mark.parametrize("scheme,params,installed,devices,words", FLASH_REFUSED,
                         ids=["relative_bias", "self_extend", "self_extend_logistic", "rerope", "string", "no-package",
                              "cpu"])
def test_flash_refusals_name_scheme_backend_and_remedy(scheme, params, installed, devices, words, fake_flash,
                                                       monkeypatch):
    monkeypatch.setattr(attention.settings, "FLASH_DEVICES", devices)
    if not installed:
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn raises ImportError
    model = flash_model()
    ids, _ = batch(False)
    with pytest.raises(ValueError, match=f"{scheme}: attention backend 'flash_attention_2'.*{words}.*sdpa"):
        rope_patch.apply(model, scheme, **params)
    assert rope_patch.current(model) is None and model.config._attn_implementation == "flash_attention_2"
    assert "forward" not in vars(model.model.rotary_emb) and not hasattr(model, "rope_patch_relative_bias")
    model.config._attn_implementation_internal = "sdpa"
    assert torch.equal(logits(model, ids), logits(tiny_model("llama", attn_implementation="sdpa"), ids))


# ---- per-layer-type RoPE (Gemma 3) ---------------------------------------------------------------------------------
GEMMA3 = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)  # rope θ 1e4 / 1e6 per type
GEMMA3_SCHEMES = [
    ("self_extend", {"group_size": 2, "window_size": 4}),  # W < S: the scheme also acts inside the sliding window
    ("self_extend", {"group_size": 4, "window_size": 12}),  # W ≥ S: sliding layers run as vanilla RoPE
    ("self_extend_logistic", {"group_size": 3, "window_size": 4, "growth_rate": 0.5}),  # W < S
    ("self_extend_logistic", {"group_size": 6, "window_size": 12, "growth_rate": 0.5}),  # W ≥ S
    ("rerope", {"window_size": 6}),
    ("leaky_rerope", {"window_size": 12, "factor": 4.0}),
    ("string", {"shift_size": 12, "window_size": 4}),  # S > sliding window: sliding layers run as vanilla RoPE
]
GEMMA3_IDS = [f"{s}-{p['window_size']}" for s, p in GEMMA3_SCHEMES]


@pytest.mark.parametrize("backend,padded", [("eager", True), ("sdpa", True), ("sdpa", False)],
                         ids=["eager-pad", "sdpa-pad", "sdpa-nopad"])
@pytest.mark.parametrize("scheme,params", GEMMA3_SCHEMES, ids=GEMMA3_IDS)
def test_gemma3_each_layer_type_uses_its_own_rope(scheme, params, backend, padded, monkeypatch):
    monkeypatch.setattr(attention.settings, "FUSED_BLOCK", 8)  # several blocks at this length on the fused path
    model = tiny_model("gemma3_text", attn_implementation=backend, **GEMMA3)
    ids, kw = batch(padded, n=40)
    vanilla = logits(model, ids, **kw)
    real = kw["attention_mask"].bool() if padded else torch.ones_like(ids, dtype=torch.bool)
    assert (vanilla - gemma3_forward(model, ids, "rope", {}, kw.get("attention_mask")))[real].abs().max() <= 1e-5
    rope_patch.apply(model, scheme, **params)
    got = logits(model, ids, **kw)
    assert (got - gemma3_forward(model, ids, scheme, params, kw.get("attention_mask")))[real].abs().max() <= 1e-5
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids, **kw), vanilla)


def test_gemma3_cached_decoding_equals_recomputation():
    """Sliding layers keep window − 1 keys in their cache (still contiguous), full layers all of them."""
    model = tiny_model("gemma3_text", attn_implementation="sdpa", **GEMMA3)
    rope_patch.apply(model, "self_extend", group_size=2, window_size=4)
    assert_cached_decoding_equals_recomputation(model)

