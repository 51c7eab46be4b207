"""Resonance RoPE (Wang et al. 2024, arXiv:2403.00071) as `resonance=True` on the static frequency schemes: every
wavelength the scheme gives rounded to an integer, and each position reduced modulo it before the angle is computed.
Checked against the authors' code (sheryc/resonance_rope, written again in helpers/reference_resonance.py: whole
forwards up to 32× the window, and the rotary's output on every layout), against a natively configured model of the
scheme whose frequencies are then rounded, with a KV cache and left padding, in bf16, copied, composed with logn and
with a deferred-RoPE scheme, saved and reloaded, and refused where the rounding or the reduction cannot hold."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from helpers import reference_resonance as authors
from helpers.models import (
    ARCHS,
    WINDOW,
    absent_folders,
    logits,
    native_twin,
    rope_folders,
    roundtrip,
    tiny_model,
    token_batch,
)
from test_older_transformers import OLD, REFUSED_BEFORE_5_21
from transformers import AutoConfig, AutoModelForCausalLM

import rope_patch
from rope_patch import serving
from rope_patch.discovery import find_target
from rope_patch.rotary import RESONANCE, unpatched_forward

STATIC = [("default", {"rope_theta": 50_000.0}), ("linear", {"factor": 4.0}), ("ntk", {"factor": 4.0}),
          ("yarn", {"factor": 4.0}), ("llama3", {"factor": 8.0}), ("p_rope", {"partial_rotary_factor": 0.5})]


def rounded(inv_freq: torch.Tensor) -> torch.Tensor:
    """θ̃_i = 2π / round(2π / θ_i) as the authors compute it (θ = 0, a pair that does not rotate, stays 0)."""
    return authors.register(inv_freq)[0]


@pytest.mark.parametrize("arch", sorted(ARCHS)[:4])
@pytest.mark.parametrize("scheme,params", STATIC)
def test_equals_the_natively_configured_scheme_with_rounded_wavelengths(arch, scheme, params):
    model = tiny_model(arch)
    if scheme == "p_rope" and arch in ("phi", "stablelm"):
        pytest.skip("p_rope is refused on models that slice the head")
    if OLD and (arch, scheme) in REFUSED_BEFORE_5_21:
        pytest.skip(f"transformers {transformers.__version__} cannot build it natively: refused "
                    "(test_older_transformers.py)")
    ids = torch.randint(3, 97, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    before = logits(model, ids)
    rope_patch.apply(model, scheme, resonance=True, **params)
    wavelengths = 2 * math.pi / model.model.rotary_emb.inv_freq.double()
    rotating = torch.isfinite(wavelengths)
    assert torch.allclose(wavelengths[rotating], wavelengths[rotating].round(), atol=1e-4)  # integers
    # the native twin multiplies unreduced positions: its angles drift from the reduced ones by p·θ̃·2⁻²⁴ (< 1e-5 here)
    plain = tiny_model(arch)
    rope_patch.apply(plain, scheme, **params)
    twin = native_twin(plain, plain.config.rope_parameters, plain.config.max_position_embeddings)
    for name in ("inv_freq", "original_inv_freq"):
        twin.model.rotary_emb.register_buffer(name, rounded(getattr(twin.model.rotary_emb, name)), persistent=False)
    assert (logits(model, ids) - logits(twin, ids)).abs().max().item() <= 1e-5
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


# (scheme, factor, head size, θ, window L0, tokens): head sizes 16–128, θ up to 1e6, up to 32× the window. The first
# row is issue 40's failing setting: 4.2e-5 here before positions were reduced (the angles p·θ̃ in float32).
AUTHORS_CASES = [
    ("yarn", 8.0, 32, 5e5, 128, 1024),
    ("yarn", 8.0, 32, 5e5, 128, 4096),
    ("yarn", 4.0, 16, 1e4, 32, 1024),
    ("yarn", 16.0, 64, 1e6, 64, 2048),
    ("yarn", 32.0, 128, 1e6, 64, 2048),
    ("default", None, 32, 1e4, 32, 1024),
    ("default", None, 128, 1e6, 64, 2048),
]


def llama(head: int, theta: float, window: int):
    """A tiny Llama of this head size, base and window (one or two heads; positions visible in the logits)."""
    hidden = max(64, head)
    cfg = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=hidden // head, num_key_value_heads=max(1, hidden // head // 2),
                               head_dim=head, vocab_size=97, max_position_embeddings=window, initializer_range=0.1,
                               rope_parameters={"rope_type": "default", "rope_theta": theta})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("scheme,factor,head,theta,window,n", AUTHORS_CASES)
def test_logits_equal_the_authors_code(scheme, factor, head, theta, window, n):
    model = llama(head, theta, window)
    reference = copy.deepcopy(model)
    if scheme == "yarn":
        inv_freq, scaling = authors.yarn_inv_freq(head, theta, factor, window)
        rope_patch.apply(model, "yarn", factor=factor, resonance=True)
    else:
        inv_freq, scaling = authors.default_inv_freq(head, theta), 1.0
        rope_patch.apply(model, "default", resonance=True)
    reference.model.rotary_emb = authors.AuthorsRotary(inv_freq, scaling, n)
    assert torch.equal(model.model.rotary_emb.inv_freq, authors.register(inv_freq)[0])  # θ̃ bit for bit
    ids = torch.arange(n)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, n, head), ids)
    want_cos, want_sin = reference.model.rotary_emb(torch.zeros(1, n, head), ids)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    tokens = torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(0))
    assert (logits(model, tokens) - logits(reference, tokens)).abs().max().item() <= 1e-5


def test_angles_repeat_exactly_every_wavelength():
    model = llama(32, 5e5, 128)
    rope_patch.apply(model, "yarn", factor=8.0, resonance=True)
    rotary = model.model.rotary_emb
    wavelengths = torch.round(2 * torch.pi / rotary.inv_freq.double()).long()
    for i, lam in enumerate(wavelengths.tolist()[:10]):  # the pairs whose wavelengths fit in 32 windows
        ids = torch.tensor([[7, 7 + lam, 7 + 3 * lam]])
        cos, sin = rotary(torch.zeros(1, 3, 32), ids)
        for table in (cos, sin):
            assert torch.equal(table[0, 0, i], table[0, 1, i]) and torch.equal(table[0, 0, i], table[0, 2, i])


def pair_columns(rotary, name: str, x, ids, kwargs) -> list[torch.Tensor]:
    """For each pair i, the output elements (per feature) that θ_i reaches in the rotary class's forward, found by
    doubling θ_i alone: cat / interleave / partial / 3-D / complex layouts alike."""
    probe = copy.deepcopy(rotary)
    base = getattr(probe, name).clone()
    own = type(probe).forward(probe, x, ids, **kwargs)
    masks = []
    for i in range(base.numel()):
        moved = base.clone()
        moved[i] *= 2
        probe._buffers[name] = moved
        out = type(probe).forward(probe, x, ids, **kwargs)
        changed = [(a != b).reshape(-1, a.shape[-1]).any(0) for a, b in zip(_tuple(own), _tuple(out), strict=True)]
        masks.append(changed)
    return masks


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def authors_through_class(rotary, name: str, wavelengths: torch.Tensor, x, ids, kwargs):
    """The authors' angles in this rotary's own layout: pair i's features as the class forward gives them at the
    positions t mod λ̃_i (products of numbers below λ̃_i, as compute_freqs tiles them), pair by pair."""
    masks = pair_columns(rotary, name, x, ids, kwargs)
    out = [o.clone() for o in _tuple(type(rotary).forward(rotary, x, ids, **kwargs))]
    for lam, mask in zip(wavelengths.tolist(), masks, strict=True):
        at = _tuple(type(rotary).forward(rotary, x, torch.remainder(ids, int(lam)) if lam < 2**40 else ids, **kwargs))
        for o, a, m in zip(out, at, mask, strict=True):
            o[..., m] = a[..., m]
    return tuple(out) if len(out) > 1 else out[0]


# a folder the installed transformers lacks, or where it is no RoPE folder yet (helpers.models.NEWER_FOLDERS: ergo
# from 5.25; gptj and codegen hold their sin/cos table in the attention layers before 5.24), is not collected
LAYOUTS = [a for a in ("llama", "cohere", "glm4", "llama4_text", "gemma3_text", "deepseek_v3", "phi", "ergo", "qwen3_5")
           if a not in absent_folders()]
TABLES = [a for a in ("gptj", "codegen") if a not in absent_folders()]  # sin/cos tables (discovery.SinCosTable)


def check_layout(arch: str) -> None:
    model = tiny_model(arch)
    plain = copy.deepcopy(model)
    rope_patch.apply(model, "yarn", factor=4.0, resonance=True)
    rope_patch.apply(plain, "yarn", factor=4.0)
    rotary, unrounded = find_target(model).rotary, find_target(plain).rotary
    resonance = vars(rotary)[RESONANCE]
    n = 40 * WINDOW
    ids = torch.arange(n)[None]
    for layer_type in resonance.wavelengths:
        name = resonance.buffer(layer_type)
        kwargs = {"layer_type": layer_type} if layer_type else {}
        theta, lam = authors.register(getattr(unrounded, name))
        assert torch.equal(getattr(rotary, name), theta)
        want = authors_through_class(rotary, name, lam, torch.zeros(1, n, 2), ids, kwargs)
        got = rotary(torch.zeros(1, n, 2), ids, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(_tuple(got), _tuple(want), strict=True)), (arch, layer_type)
    rope_patch.remove(model)
    assert RESONANCE not in vars(rotary)


@pytest.mark.parametrize("arch", LAYOUTS)
def test_rotary_gives_the_authors_angles_in_every_layout(arch):
    check_layout(arch)


# folder -> the refusal of resonance=True where yarn alone is served
REFUSED = {"phimoe": "computes its frequencies again from the config at every forward"}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(set(rope_folders()) - set(LAYOUTS) - set(TABLES)))
def test_rotary_gives_the_authors_angles_on_every_rope_folder(arch):
    try:
        rope_patch.apply(tiny_model(arch), "yarn", factor=4.0)
    except (ValueError, TypeError) as err:
        pytest.skip(f"yarn itself is refused: {err}"[:200])
    if arch in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[arch]):
            rope_patch.apply(tiny_model(arch), "yarn", factor=4.0, resonance=True)
        return
    check_layout(arch)


@pytest.mark.parametrize("arch", TABLES)
def test_table_rotary_rows_are_the_authors(arch):
    model = tiny_model(arch)
    cfg, site = model.config, find_target(model)
    rope_patch.apply(model, "yarn", factor=4.0, resonance=True)
    inv_freq, scaling = authors.yarn_inv_freq(cfg.rotary_dim, site.table.rope_theta, 4.0, cfg.max_position_embeddings)
    n = 2 * site.table.rows + 5  # past the model's table: grown with the same rule
    want = authors.angles(*authors.register(inv_freq), n)
    sin, cos = site.rotary(torch.zeros(1, n, 2), torch.arange(n)[None])
    assert torch.equal(sin[0], want.sin() * scaling) and torch.equal(cos[0], want.cos() * scaling)


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


def test_deferred_rope_rotates_with_the_reduced_angles():
    """Self-Extend (stacked on Resonance-YaRN) rotates q and k inside attention with the model's rotary: at the
    positions it chooses, the same reduced angles as the rotary's own output."""
    model = tiny_model()
    rope_patch.apply(model, "yarn:4,resonance=true+self_extend:group_size=4,window_size=16")
    rotary = model.model.rotary_emb
    ids = torch.arange(32 * WINDOW)[None]
    x = torch.zeros(1, ids.shape[1], 16)
    cos, sin = unpatched_forward(rotary, x, ids)
    table = authors.AuthorsRotary(_plain_yarn_inv_freq(), rotary.attention_scaling, ids.shape[1])
    assert torch.equal(cos, table.cos_table[ids]) and torch.equal(sin, table.sin_table[ids])


def _plain_yarn_inv_freq() -> torch.Tensor:
    plain = tiny_model()
    rope_patch.apply(plain, "yarn", factor=4.0)
    return plain.model.rotary_emb.inv_freq


def test_bf16_model_keeps_float32_angles():
    model = tiny_model()
    rope_patch.apply(model, "yarn", factor=4.0, resonance=True)
    ids = torch.arange(16 * WINDOW)[None]
    want = model.model.rotary_emb(torch.zeros(1, ids.shape[1], 16), ids)
    model.to(torch.bfloat16)
    got = model.model.rotary_emb(torch.zeros(1, ids.shape[1], 16, dtype=torch.bfloat16), ids)
    assert all(torch.equal(g, w.to(torch.bfloat16)) for g, w in zip(got, want, strict=True))
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_keep_the_reduction_and_remove_is_exact(how):
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 8 * WINDOW), generator=torch.Generator().manual_seed(2))
    before = logits(model, ids)
    rope_patch.apply(model, "yarn", factor=4.0, resonance=True)
    want = logits(model, ids)
    copy_ = roundtrip(model, how)
    assert RESONANCE in vars(copy_.model.rotary_emb)
    assert torch.equal(logits(copy_, ids), want)
    rope_patch.remove(copy_)
    assert RESONANCE not in vars(copy_.model.rotary_emb)
    assert torch.equal(logits(copy_, ids), before)


def test_without_resonance_nothing_is_put_on_the_rotary():
    model = tiny_model()
    rope_patch.apply(model, "yarn", factor=4.0)
    assert RESONANCE not in vars(model.model.rotary_emb)


class _ShiftedRotary(torch.nn.Module):
    """A rotary class whose angles are (p + ½)·θ: not position × buffer, so reduced angles cannot be handed to it."""

    def forward(self, x, position_ids):
        freqs = (position_ids[..., None].float() + 0.5) * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def test_a_rotary_that_does_not_multiply_position_by_its_buffer_is_refused_unchanged():
    model = tiny_model()
    rotary = model.model.rotary_emb
    rotary.__class__ = type("ShiftedRotaryEmbedding", (_ShiftedRotary, type(rotary)),
                            {"forward": _ShiftedRotary.forward})
    ids = torch.randint(3, 97, (1, WINDOW))
    before, config = logits(model, ids), model.config.to_dict()
    with pytest.raises(ValueError, match=r"resonance=True reduces each position modulo .* cannot be driven that way"):
        rope_patch.apply(model, "yarn", factor=4.0, resonance=True)
    assert rope_patch.current(model) is None and model.config.to_dict() == config
    assert RESONANCE not in vars(rotary)
    assert torch.equal(logits(model, ids), before)
    rope_patch.apply(model, "yarn", factor=4.0)  # without resonance the class's own forward serves it


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_export_refuses_it_for_the_engines(engine, tmp_path):
    """An engine multiplies unreduced positions by its own frequencies: it cannot serve the reduced angles."""
    model = tiny_model()
    rope_patch.apply(model, "yarn", factor=4.0, resonance=True)
    rope_patch.save_pretrained(model, tmp_path / "m")
    with pytest.raises(ValueError, match="cannot serve yarn .*each position reduced modulo"):
        serving.export(tmp_path / "m", engine, write=False)
