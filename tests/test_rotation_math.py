"""The seeds' properties of RoPE, checked on the rotation the patched model actually applies."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import tiny_model
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb as apply_interleaved
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as apply_half_split

import rope_patch

X = torch.tensor([1.0, 0.5, -0.5, 1.5])


def _rotate(x, position, base=10000.0, interleaved=False):
    """Straightforward RoPE on one vector: pair i rotated by position·base^(−2i/d)."""
    d = x.numel()
    out = x.clone()
    for i in range(d // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
        angle = position * base ** (-2 * i / d)
        out[a] = x[a] * math.cos(angle) - x[b] * math.sin(angle)
        out[b] = x[a] * math.sin(angle) + x[b] * math.cos(angle)
    return out


def test_textbook_example_interleaved_pairs():
    # RoFormer's pairs (x0, x1), (x2, x3) at position 1: angles 1 and 1e-2. (A widely shared write-up prints
    # −0.5100, 1.4900 for the second pair: an arithmetic slip; the correct values are below.)
    torch.testing.assert_close(_rotate(X, 1, interleaved=True), torch.tensor([0.11957, 1.11162, -0.51497, 1.49493]),
                               atol=5e-5, rtol=0)


def test_textbook_example_half_split_pairs():
    # transformers' rotate_half pairs (x0, x2) and (x1, x3) instead
    torch.testing.assert_close(_rotate(X, 1), torch.tensor([0.96104, 0.48498, 0.57132, 1.50493]), atol=5e-5, rtol=0)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split(llama)", "interleaved(cohere)"])
def test_transformers_rotation_matches_the_straightforward_one(interleaved):
    arch, apply_fn = ("cohere", apply_interleaved) if interleaved else ("llama", apply_half_split)
    model = tiny_model(arch)
    rope_patch.apply(model, "default", rope_theta=10000.0)
    rot = model.model.rotary_emb
    x = torch.randn(1, 1, 5, 16, generator=torch.Generator().manual_seed(0))
    cos, sin = rot(x, torch.arange(5)[None])
    got, _ = apply_fn(x, x, cos, sin)
    for m in range(5):
        torch.testing.assert_close(got[0, 0, m], _rotate(x[0, 0, m], m, interleaved=interleaved), atol=1e-5, rtol=1e-5)


SCHEMES = [("default", {}), ("linear", dict(factor=4)), ("yarn", dict(factor=8)), ("llama3", dict(factor=8)),
           ("p_rope", dict(partial_rotary_factor=0.5))]


@settings(max_examples=30, deadline=None)
@given(m=st.integers(0, 500), n=st.integers(0, 500), shift=st.integers(0, 2000), which=st.integers(0, len(SCHEMES) - 1),
       seed=st.integers(0, 1000))
@example(m=259, n=320, shift=1862, which=0, seed=315)  # off by 1.26e-4 (float32 angles): failed a fixed 1e-4
def test_score_depends_only_on_relative_position_and_rotation_preserves_norm(m, n, shift, which, seed):
    model = _MODELS[which]
    rot = model.model.rotary_emb
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64)

    def rotated(x, pos):
        cos, sin = rot(x, torch.tensor([[pos]]))
        scale = rot.attention_scaling  # YaRN scales cos/sin: remove it for the pure rotation
        return apply_half_split(x, x, cos.double() / scale, sin.double() / scale)[0]

    score = (rotated(q, m) * rotated(k, n)).sum()
    shifted = (rotated(q, m + shift) * rotated(k, n + shift)).sum()
    # The rotary computes its angles p·θ in float32, as the model does: θ and the product each round by up to 2^-24
    # relative, so an angle is off by up to 2·p·2^-24 (1.3e-4 rad at p = 2,182), and a score, which reads two angles,
    # moves by at most |q|·|k| times their errors.
    tol = q.norm().item() * k.norm().item() * 4 * (max(m, n) + shift + 1) * 2.0**-24
    assert math.isclose(score.item(), shifted.item(), rel_tol=0, abs_tol=tol)
    assert math.isclose(rotated(q, m).norm().item(), q.norm().item(), rel_tol=1e-6)


def _models():
    out = []
    for name, params in SCHEMES:
        model = tiny_model()
        rope_patch.apply(model, name, **params)
        out.append(model)
    return out


_MODELS = _models()
