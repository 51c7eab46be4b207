"""Issue 39: training through the log-sum-exp merge of partial softmaxes (`rope_patch.attention.merge`), which the
multi-region flex paths use and which on CUDA receives flex's log-sum-exp *with* its gradient.

1. `torch.autograd.gradcheck` of `merge` in float64 over 2 and 3 partials, with a row where one partial's
   log-sum-exp is −inf (a region that sees no key of that row) and a row where all are (a padding query): the latter
   comes out 0 with finite (zero) gradients.
2. End to end: loss.backward() of a tiny model on the flex_attention backend (uncompiled) under a declared scheme
   (self_extend, lm_infinite) gives the gradients of the same model on the eager backend (rope_patch_dense, whose
   materialised scores autograd differentiates), within 1e-5 relative.

   torch 2.13's CPU flex_attention refuses backward ("FlexAttention does not support backward on CPU"), eager or
   compiled, so the CPU cannot run the flex path's backward through torch's kernel. The test runs it with the CPU
   kernel substituted: `differentiable_flex`, flex_attention's math materialised in torch ops (the score_mod and the
   BlockMask's mask_mod evaluated on index grids; out and log-sum-exp, both differentiable), checked against torch's
   own kernel in the forward here. Everything else is the real path: the band BlockMasks, the region calls, the
   merge. With torch's kernel the same test runs where it can (a torch whose CPU flex has a backward) and is skipped,
   with the reason, where it cannot.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_model
from helpers.schemes import BY_NAME

import rope_patch
from rope_patch.attention import flex, merge, settings


# ---- 1. gradcheck of merge ----------------------------------------------------------------------------------------
def _partials(n: int, seed: int = 0):
    """n partials (out (1, 2, 5, 3), lse (1, 2, 5)) float64 requiring grad; row 3: one partial's lse −inf (two of
    them with three partials), row 4: every lse −inf (and its outs 0, as flex returns them)."""
    g = torch.Generator().manual_seed(seed)
    outs, lses = [], []
    for p in range(n):
        out = torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64)
        lse = 3 * torch.randn(1, 2, 5, generator=g, dtype=torch.float64)
        if p > 0:
            lse[:, :, 3] = float("-inf")
            out[:, :, 3] = 0
        lse[:, :, 4] = float("-inf")
        out[:, :, 4] = 0
        outs.append(out.requires_grad_())
        lses.append(lse.requires_grad_())
    return outs, lses


def _merged(n):
    def fn(*tensors):
        return merge(list(zip(tensors[:n], tensors[n:], strict=True)))

    return fn


@pytest.mark.parametrize("n", [2, 3])
def test_merge_passes_gradcheck_in_float64(n):
    outs, lses = _partials(n)
    assert torch.autograd.gradcheck(_merged(n), (*outs, *lses), eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("n", [2, 3])
def test_merge_is_the_softmax_over_the_union(n):
    """Each partial a softmax over its own keys: the merge equals one softmax over all of them (row 3: the partials
    with lse −inf see no key; row 4: no partial sees any, which comes out 0)."""
    g = torch.Generator().manual_seed(1)
    scores = [torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(n)]
    values = [torch.randn(1, 2, 5, 4, 3, generator=g, dtype=torch.float64) for _ in range(n)]
    for p, s in enumerate(scores):
        s[:, :, 4] = float("-inf")
        if p > 0:
            s[:, :, 3] = float("-inf")
    parts = []
    for s, v in zip(scores, values, strict=True):
        lse = torch.logsumexp(s, -1)
        w = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(s))
        parts.append(((w[..., None] * v).sum(-2), lse))
    s_all, v_all = torch.cat(scores, -1), torch.cat(values, -2)
    want = (torch.softmax(s_all, -1)[..., None] * v_all).sum(-2)
    got = merge(parts)
    assert torch.allclose(got[:, :, :4], want[:, :, :4], atol=1e-12)
    assert torch.equal(got[:, :, 4], torch.zeros_like(got[:, :, 4]))


@pytest.mark.parametrize("n", [2, 3])
def test_rows_no_partial_covers_come_out_zero_with_finite_gradients(n):
    outs, lses = _partials(n, seed=2)
    got = merge(list(zip(outs, lses, strict=True)))
    assert torch.equal(got[:, :, 4], torch.zeros_like(got[:, :, 4]))
    assert torch.isfinite(got).all()
    got.pow(2).sum().backward(torch.tensor(1.0, dtype=torch.float64))
    for t in (*outs, *lses):
        assert torch.isfinite(t.grad).all(), t.grad
        assert torch.equal(t.grad[:, :, 4], torch.zeros_like(t.grad[:, :, 4]))  # the covered-by-none row
    for t in (*outs[1:], *lses[1:]):
        assert torch.equal(t.grad[:, :, 3], torch.zeros_like(t.grad[:, :, 3]))  # a partial that sees no key


# ---- 2. end to end: flex backward equals eager backward ----------------------------------------------------------
def differentiable_flex(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
                        return_aux=None, **kwargs):
    """flex_attention's math, materialised, differentiable: q (b, H, q, d), k, v (b, Hkv, k, d); score_mod and the
    BlockMask's mask_mod on broadcast index grids (their tensor ops vectorise); a row whose mask hides every key
    comes back with out 0 and lse −inf, as torch's kernel returns it."""
    b, h, q_len, d = q.shape
    k_len = k.shape[2]
    if enable_gqa:
        k, v = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
    bi = torch.arange(b)[:, None, None, None]
    hi = torch.arange(h)[None, :, None, None]
    qi = torch.arange(q_len)[None, None, :, None]
    ki = torch.arange(k_len)[None, None, None, :]
    if score_mod is not None:
        s = score_mod(s, bi, hi, qi, ki)
    if block_mask is not None:
        s = s.masked_fill(~block_mask.mask_mod(bi, hi, qi, ki).expand_as(s), float("-inf"))
    lse = torch.logsumexp(s, -1)
    seen = torch.isfinite(lse)
    weights = torch.exp(s - torch.where(seen, lse, torch.zeros_like(lse))[..., None])
    out = torch.matmul(weights, v)
    if return_lse or return_aux is not None:
        return out, lse
    return out


def test_the_substituted_kernel_equals_torchs_in_the_forward():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 200, 16, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]

    def band(b, h, qi, kv):  # a band with rows that see no key (qi < 40)
        return (qi - kv >= 40) & (qi - kv < 90)

    def bias(score, b, h, qi, kv):
        return score - 0.1 * (h + 1) * (qi - kv)

    mask = create_block_mask(band, None, None, 200, 200, device="cpu")
    kw = dict(score_mod=bias, block_mask=mask, enable_gqa=True, return_lse=True)
    want_out, want_lse = flex_attention(q, k, v, **kw)
    got_out, got_lse = differentiable_flex(q, k, v, **kw)
    assert torch.allclose(got_out, want_out, atol=1e-5)
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
    seen = torch.isfinite(want_lse)
    assert torch.allclose(got_lse[seen], want_lse[seen], atol=1e-5)


def _gradients(backend: str, scheme: str, monkeypatch):
    monkeypatch.setattr(settings, "FLEX_COMPILE", False)
    model = tiny_model("llama", attn_implementation=backend)
    rope_patch.apply(model, scheme, **BY_NAME[scheme].params)
    model.train()  # attention_dropout is 0: the flex function runs in training mode
    ids = torch.randint(3, 97, (2, 96), generator=torch.Generator().manual_seed(0))  # 3 windows: every region
    model(ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kernel", ["substituted", "torch"])
@pytest.mark.parametrize("scheme", ["self_extend", "lm_infinite"])
def test_flex_gradients_equal_eager_gradients(scheme, kernel, monkeypatch):
    calls = []
    run = differentiable_flex if kernel == "substituted" else flex.flex_attention

    def counting(q, *args, **kwargs):
        calls.append(kwargs.get("return_lse") or kwargs.get("return_aux") is not None)
        return run(q, *args, **kwargs)

    want = _gradients("eager", scheme, monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(flex, "flex_attention", counting)
        try:
            got = _gradients("flex_attention", scheme, monkeypatch)
        except NotImplementedError as e:
            if kernel == "torch" and "does not support backward on CPU" in str(e):
                pytest.skip(f"torch {torch.__version__}: {e}")
            raise
    assert calls and all(calls)  # the regions' calls, each with its log-sum-exp, merged
    assert set(got) == set(want) and len(want) > 0
    for name, g in want.items():
        rel = ((got[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert rel <= 1e-5, (name, rel)


def _lora_gradients(backend: str, monkeypatch):
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(settings, "FLEX_COMPILE", False)
    model = tiny_model("llama", attn_implementation=backend)
    rope_patch.apply(model, "self_extend", **BY_NAME["self_extend"].params)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    lora.train()
    ids = torch.randint(3, 97, (2, 96), generator=torch.Generator().manual_seed(1))
    lora(ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in lora.named_parameters() if p.requires_grad}


def test_a_lora_step_with_checkpointing_through_flex_equals_eager(monkeypatch):
    """The GPU check's LoRA row on the CPU (bench/gpu_check.py): peft LoRA (B ≠ 0, so every adapter gets a gradient)
    and gradient checkpointing, which re-runs the flex path in the backward: the adapters' gradients equal the eager
    backend's. The kernel substituted as above."""
    pytest.importorskip("peft")
    want = _lora_gradients("eager", monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(flex, "flex_attention", differentiable_flex)
        got = _lora_gradients("flex_attention", monkeypatch)
    assert set(got) == set(want) and len(want) == 2 * 4 * 2  # A and B of q/k/v/o in 2 layers
    for name, g in want.items():
        assert g is not None and got[name] is not None, name
        rel = ((got[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert rel <= 1e-5, (name, rel)
