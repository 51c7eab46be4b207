"""Resonance RoPE (Wang et al. 2024, arXiv:2403.00071) as `resonance=True` on the static frequency schemes: every
wavelength the scheme gives rounded to an integer. Checked against a reference written from the paper (a natively
configured model of the scheme whose frequencies are then rounded), against the authors' code (sheryc/resonance_rope,
`resonance_register` + `compute_freqs`: the angle of pair i at position t is (t mod λ̃_i)·θ̃_i), with a KV cache and left
padding, composed with logn, saved and reloaded, and refused where the rounding cannot hold."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import ARCHS, WINDOW, logits, native_twin, tiny_model, token_batch

import rope_patch

STATIC = [("default", {"rope_theta": 50_000.0}), ("linear", {"factor": 4.0}), ("ntk", {"factor": 4.0}),
          ("yarn", {"factor": 4.0}), ("llama3", {"factor": 8.0}), ("p_rope", {"partial_rotary_factor": 0.5})]


def rounded(inv_freq: torch.Tensor) -> torch.Tensor:
    """The paper's θ̃_i = 2π / round(2π / θ_i) (θ = 0, a pair that does not rotate, stays 0)."""
    return (2 * math.pi / torch.round(2 * math.pi / inv_freq.double())).float()


@pytest.mark.parametrize("arch", sorted(ARCHS)[:4])
@pytest.mark.parametrize("scheme,params", STATIC)
def test_equals_the_natively_configured_scheme_with_rounded_wavelengths(arch, scheme, params):
    model = tiny_model(arch)
    if scheme == "p_rope" and arch in ("phi", "stablelm"):
        pytest.skip("p_rope is refused on models that slice the head")
    ids = torch.randint(3, 97, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    before = logits(model, ids)
    rope_patch.apply(model, scheme, resonance=True, **params)
    wavelengths = 2 * math.pi / model.model.rotary_emb.inv_freq.double()
    rotating = torch.isfinite(wavelengths)
    assert torch.allclose(wavelengths[rotating], wavelengths[rotating].round(), atol=1e-4)  # integers
    plain = tiny_model(arch)
    rope_patch.apply(plain, scheme, **params)
    twin = native_twin(plain, plain.config.rope_parameters, plain.config.max_position_embeddings)
    for name in ("inv_freq", "original_inv_freq"):
        twin.model.rotary_emb.register_buffer(name, rounded(getattr(twin.model.rotary_emb, name)), persistent=False)
    assert (logits(model, ids) - logits(twin, ids)).abs().max().item() <= 1e-5
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


def authors_angles(inv_freq: torch.Tensor, length: int) -> torch.Tensor:
    """sheryc/resonance_rope, LlamaYaRNScaledResonanceRotaryEmbedding.compute_freqs (written again): pair i at position
    t turns by (t mod λ̃_i)·θ̃_i once the sequence is at least λ̃_i long, else by t·θ̃_i."""
    wavelengths = torch.round(2 * math.pi / inv_freq)
    r_inv_freq = 2 * math.pi / wavelengths
    t = torch.arange(length, dtype=torch.float32)
    columns = []
    for i in range(inv_freq.numel()):
        lam = wavelengths[i].item()
        columns.append((t % lam if length >= lam else t) * r_inv_freq[i])
    return torch.stack(columns, dim=1)


@pytest.mark.parametrize("scheme,params", [("yarn", {"factor": 4.0}), ("default", {})])
def test_cos_sin_equal_the_authors_code(scheme, params):
    model = tiny_model()
    unpatched = model.model.rotary_emb.inv_freq.clone()
    rope_patch.apply(model, scheme, resonance=True, **params)
    length = 8 * WINDOW
    cos, sin = model.model.rotary_emb(torch.zeros(1, length, 16), torch.arange(length)[None])
    plain = tiny_model()
    rope_patch.apply(plain, scheme, **params)
    angles = authors_angles(plain.model.rotary_emb.inv_freq, length) if scheme == "yarn" else authors_angles(unpatched, length)
    scale = model.model.rotary_emb.attention_scaling
    torch.testing.assert_close(cos[0, :, :8], angles.cos() * scale, atol=1e-4, rtol=0)
    torch.testing.assert_close(sin[0, :, :8], angles.sin() * scale, atol=1e-4, rtol=0)


def test_cached_generation_with_left_padding_equals_recomputation():
    model = tiny_model(attn_implementation="sdpa")
    rope_patch.apply(model, "yarn", factor=4.0, resonance=True)
    ids, kw = token_batch(2 * WINDOW, pad=5)
    mask = kw["attention_mask"]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    seq, m = ids, mask
    for step in range(6):
        with torch.no_grad():
            full = model(seq, attention_mask=m, position_ids=(m.cumsum(-1) - 1).masked_fill(m == 0, 1)).logits[:, -1]
        assert (full - out.logits[step]).abs().max().item() <= 1e-4
        seq = torch.cat([seq, out.sequences[:, seq.shape[1]:seq.shape[1] + 1]], dim=1)
        m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)


def test_composes_with_logn_and_saves_with_rope_patch(tmp_path):
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(1))
    rope_patch.apply(model, "yarn:4,resonance=true+logn")
    want = logits(model, ids)
    assert rope_patch.current(model).frequency.resonance
    rope_patch.save_pretrained(model, tmp_path / "m")
    again = rope_patch.from_pretrained(tmp_path / "m", attn_implementation="eager")
    assert rope_patch.current(again) == rope_patch.current(model)
    assert (logits(again, ids) - want).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="resonance"):
        rope_patch.to_rope_parameters("yarn:4,resonance=true", model=tiny_model())


@pytest.mark.parametrize("scheme,params", [("dynamic", {"factor": 4.0}), ("dynamic_yarn", {"factor": 4.0}),
                                           ("longrope", {"factor": 4.0, "short_factor": [1.0] * 8,
                                                         "long_factor": [2.0] * 8})])
def test_length_dependent_schemes_are_refused(scheme, params):
    with pytest.raises(ValueError, match="follow the sequence length at run time"):
        rope_patch.apply(tiny_model(), scheme, resonance=True, **params)


def test_a_rotary_that_recomputes_its_frequencies_is_refused_unchanged():
    model = tiny_model("phimoe")  # its rotary calls rope_init_fn(config) at every forward
    ids = torch.randint(3, 97, (1, WINDOW))
    before, config = logits(model, ids), model.config.to_dict()
    with pytest.raises(ValueError, match="computes its frequencies again from the config"):
        rope_patch.apply(model, "yarn", factor=4.0, resonance=True)
    assert rope_patch.current(model) is None and model.config.to_dict() == config
    assert torch.equal(logits(model, ids), before)


def test_bad_value_is_one_clear_error():
    with pytest.raises(TypeError, match="resonance.*must be True or False"):
        rope_patch.apply(tiny_model(), "yarn", factor=4.0, resonance="yes")
