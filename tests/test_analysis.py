"""rope_patch.analysis against independent loop-over-pairs implementations, against the buffers a patched model
actually uses, and against the RoFormer decay figure."""

from __future__ import annotations

import cmath
import dataclasses
import math

import pytest
import torch
from helpers.models import WINDOW, tiny_model

import rope_patch
from rope_patch import analysis as A
from rope_patch.schemes.base import Scheme
from rope_patch.schemes.logn import ATTN_SCALE, FLOOR_SCALE


# ------------------------------------------------------------------------------------------------------------------
# Straightforward references: one Python loop over pairs each, formulas from the papers.
def ref_default(d, b):
    return [b ** (-2 * i / d) for i in range(d // 2)]


def ref_linear(d, b, s):
    return [t / s for t in ref_default(d, b)]


def ref_ntk(d, b, s):
    return ref_default(d, b * s ** (d / (d - 2)))


def ref_dynamic(d, b, s, L, ell):
    return ref_default(d, b if ell <= L else b * (s * ell / L - (s - 1)) ** (d / (d - 2)))


def ref_yarn(d, b, s, L, beta_fast=32.0, beta_slow=1.0):
    """YaRN with transformers' dimension-space ramp (find_correction_dim, truncate=True)."""

    def pair_of(rotations):  # pair index where L/λ_i = rotations
        return d * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(b))

    low, high = max(math.floor(pair_of(beta_fast)), 0), min(math.ceil(pair_of(beta_slow)), d - 1)
    out = []
    for i in range(d // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep θ, 1: θ/s
        theta = b ** (-2 * i / d)
        out.append(ramp * theta / s + (1 - ramp) * theta)
    return out


def ref_llama3(d, b, s, L, low=1.0, high=4.0):
    out = []
    for theta in ref_default(d, b):
        lam = 2 * math.pi / theta
        if lam < L / high:
            out.append(theta)
        elif lam > L / low:
            out.append(theta / s)
        else:
            t = (L / lam - low) / (high - low)
            out.append((1 - t) * theta / s + t * theta)
    return out


def ref_prope(d, b, p):
    n = d // 2
    return [t if i < round(p * n) else 0.0 for i, t in enumerate(ref_default(d, b))]


def ref_decay(thetas, delta):
    total, partial = 0.0, 0j
    for theta in thetas:  # S_j = Σ_{i<j} e^{iΔθ_i}, j = 1..n
        partial += cmath.exp(1j * delta * theta)
        total += abs(partial)
    return total / len(thetas)


def press_slopes(n):
    """Press et al.'s reference `get_slopes` (github.com/ofirpress/attention_with_linear_biases)."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    c = 2 ** math.floor(math.log2(n))
    return power_of_2(c) + press_slopes(2 * c)[0::2][: n - c]


def assert_close(actual, expected, rtol=2e-6):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), rtol=rtol, atol=0.0)


# ------------------------------------------------------------------------------------------------------------------
# frequencies: table of (spec, head_dim, base, L, reference θ′, reference cos/sin scale)
FREQ_CASES = [
    ("default", 128, 10000.0, 4096, lambda: ref_default(128, 1e4), 1.0),
    ("default:500000", 128, 10000.0, 8192, lambda: ref_default(128, 5e5), 1.0),
    ("linear:4", 64, 10000.0, 2048, lambda: ref_linear(64, 1e4, 4), 1.0),
    ("ntk:8", 128, 10000.0, 4096, lambda: ref_ntk(128, 1e4, 8), 1.0),
    ("ntk:factor=2,rope_theta=100000", 64, 10000.0, 4096, lambda: ref_ntk(64, 1e5, 2), 1.0),
    ("yarn:8", 128, 10000.0, 4096, lambda: ref_yarn(128, 1e4, 8, 4096), 0.1 * math.log(8) + 1),
    ("yarn:factor=16,beta_fast=16,beta_slow=2", 64, 500000.0, 8192, lambda: ref_yarn(64, 5e5, 16, 8192, 16, 2),
     0.1 * math.log(16) + 1),
    ("yarn:factor=4,original_max_position_embeddings=1024", 128, 10000.0, 4096, lambda: ref_yarn(128, 1e4, 4, 1024),
     0.1 * math.log(4) + 1),
    ("llama3:8", 128, 500000.0, 8192, lambda: ref_llama3(128, 5e5, 8, 8192), 1.0),
    ("llama3:factor=32,low_freq_factor=2,high_freq_factor=8", 64, 10000.0, 2048,
     lambda: ref_llama3(64, 1e4, 32, 2048, 2, 8), 1.0),
    ("dynamic:4", 128, 10000.0, 4096, lambda: ref_default(128, 1e4), 1.0),  # at load time (ℓ ≤ L): unchanged
    ("p_rope:0.25", 64, 10000.0, 4096, lambda: ref_prope(64, 1e4, 0.25), 1.0),
]


@pytest.mark.parametrize("spec,d,b,L,ref,scale", FREQ_CASES, ids=[c[0] for c in FREQ_CASES])
def test_frequencies_match_loop_reference(spec, d, b, L, ref, scale):
    f = A.frequencies(spec, d, b, max_position_embeddings=L)
    assert_close(f.inv_freq, ref())
    assert f.attention_scaling == pytest.approx(scale, rel=1e-12)
    assert f.logit_scale == pytest.approx(scale**2, rel=1e-12)
    assert_close(f.base_inv_freq, ref_default(d, b))
    assert f.inv_freq.dtype == torch.float32 and f.inv_freq.shape == (d // 2,)


@pytest.mark.parametrize("ell", [1000, 4096, 4097, 8192, 50000])
def test_dynamic_at_length_matches_reference(ell):
    f = A.frequencies("dynamic:4", 128, 10000.0, max_position_embeddings=4096, seq_len=ell)
    assert_close(f.inv_freq, ref_dynamic(128, 1e4, 4, 4096, ell), rtol=1e-5)  # base computed in fp32 as in the model


def test_longrope_switches_factor_sets_at_the_window():
    short, long = [1.0] * 32, [1.0 + i / 4 for i in range(32)]
    spec = dict(factor=8, short_factor=short, long_factor=long)
    inside = A.frequencies("longrope", 64, 1e4, max_position_embeddings=4096, seq_len=4096, **spec)
    beyond = A.frequencies("longrope", 64, 1e4, max_position_embeddings=4096, seq_len=4097, **spec)
    base = ref_default(64, 1e4)
    assert_close(inside.inv_freq, [t / f for t, f in zip(base, short, strict=True)])
    assert_close(beyond.inv_freq, [t / f for t, f in zip(base, long, strict=True)])
    assert inside.attention_scaling == pytest.approx(math.sqrt(1 + math.log(8) / math.log(4096)))


def test_yarn_follows_the_papers_rule_at_the_ramp_ends():
    """Peng et al. 2023: pairs with r_i = L/λ_i > β keep θ_i, pairs with r_i < α get θ_i/s."""
    w = A.wavelengths("default", 128, 1e4, max_position_embeddings=4096)
    f = A.frequencies("yarn:8", 128, 1e4, max_position_embeddings=4096)
    kept, interpolated = w.base_ratio > 32, w.base_ratio < 1
    assert kept.sum() > 10 and interpolated.sum() > 10
    torch.testing.assert_close(f.inv_freq[kept], f.base_inv_freq[kept], rtol=0, atol=0)
    torch.testing.assert_close(f.inv_freq[interpolated].double(), f.base_inv_freq[interpolated].double() / 8,
                               rtol=1e-6, atol=0)
    assert f.interpolation[kept].eq(1).all()
    assert torch.allclose(f.interpolation[interpolated], torch.tensor(8.0, dtype=torch.float64))


@pytest.mark.parametrize("spec,rotates", [("alibi", False), ("nope", False), ("sinusoidal", False),
                                          ("relative_bias", False), ("rerope:512", True),
                                          ("self_extend:group_size=4,window_size=64", True),
                                          ("leaky_rerope:window_size=64,factor=8", True)])
def test_attention_schemes_keep_or_remove_the_rotation(spec, rotates):
    f = A.frequencies(spec, 64, 1e4)
    assert f.rotates is rotates and f.attention_scaling == 1.0
    expected = ref_default(64, 1e4) if rotates else [0.0] * 32
    assert_close(f.inv_freq, expected) if rotates else torch.testing.assert_close(f.inv_freq, torch.zeros(32))


# ------------------------------------------------------------------------------------------------------------------
# The same numbers as a patched model
def _specs_for(pairs: int):
    longrope = (f"longrope:factor=4,short_factor={'/'.join(['1'] * pairs)},"
                f"long_factor={'/'.join(str(1 + i) for i in range(pairs))}")
    return ["default", "default:500000", "linear:4", "ntk:4", "dynamic:4", "yarn:4",
            "yarn:factor=8,beta_fast=16,beta_slow=2", "llama3:8", "p_rope:0.5", longrope]


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_model(arch) for arch in ("llama", "phi", "qwen3")}


@pytest.mark.parametrize("arch", ["llama", "phi", "qwen3"])
def test_frequencies_equal_the_patched_models_buffers(models, arch):
    model = models[arch]
    rot = model.model.rotary_emb
    prf = model.config.rope_parameters.get("partial_rotary_factor")
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    for spec in _specs_for(rot.inv_freq.numel()):
        scheme = A.as_spec(spec).scheme
        if scheme.name == "p_rope" and prf:
            continue  # refused on head-slicing partial-rotary models (tests/schemes/test_frequency.py)
        plain = A.frequencies(spec, head_dim, model.config.rope_parameters["rope_theta"],
                              max_position_embeddings=WINDOW, partial_rotary_factor=prf)
        unpatched_model = A.frequencies(spec, model=model)  # explicit scheme, read from the unpatched model
        with rope_patch.patched(model, scheme):
            buf, scale = rot.inv_freq, rot.attention_scaling
            applied = A.frequencies(model=model)  # the applied scheme, via rope_patch.current
            assert rot.inv_freq is buf  # reading a patched model leaves its very buffers in place
            for f in (plain, unpatched_model, applied):
                assert torch.equal(f.inv_freq, buf), (arch, spec)
                assert f.attention_scaling == scale, (arch, spec)
        assert applied.name == scheme.name and applied.original_window == WINDOW


@pytest.mark.parametrize("where, match", [
    ("gemma3", "not one of this model's RoPE layer types.*Did you mean 'full_attention'"),
    ("llama", "one for all layers"), ("plain", "one for all layers"), ("gemma3_config", "Did you mean")])
def test_layer_types_are_checked_as_apply_checks_them(where, match):
    """An analysis (rope-patch explain) of a scheme whose layer_types the model does not have says so, as apply()
    does, instead of reporting the layers as unchanged."""
    gemma3 = tiny_model("gemma3_text", layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    kwargs = {"gemma3": dict(model=gemma3), "llama": dict(model=tiny_model("llama")),
              "plain": dict(head_dim=64, rope_theta=1e4, max_position_embeddings=4096),
              "gemma3_config": dict(config=gemma3.config)}[where]
    spec = "yarn:factor=2,layer_types=" + ("ful_attention" if where.startswith("gemma3") else "full_attention")
    with pytest.raises(ValueError, match=match):
        A.frequencies(spec, **kwargs)


@pytest.mark.parametrize("spec", ["default", "yarn:2", "linear:2", "yarn:2,layer_types=full_attention"])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_frequencies_of_a_per_layer_type_model_equal_its_buffers(spec, layer_type):
    """Gemma 3's rotary computes its default RoPE from config.rope_parameters[layer_type]: read for each layer type,
    the analysis gives the patched model's buffers of that type (it failed with KeyError: None)."""
    model = tiny_model("gemma3_text", layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    rot = model.model.rotary_emb
    read = A.frequencies(spec, model=model, layer_type=layer_type)
    with rope_patch.patched(model, spec):
        assert torch.equal(read.inv_freq, rot._buffers[f"{layer_type}_inv_freq"].float()), (spec, layer_type)
        assert read.attention_scaling == getattr(rot, f"{layer_type}_attention_scaling")


@pytest.mark.parametrize("spec",
                         ["dynamic:4", "longrope:factor=4,short_factor=1/1/1/1/1/1/1/1,long_factor=1/1/2/2/3/4/8/16"])
def test_length_dependent_frequencies_equal_the_models_after_a_long_forward(models, spec, ids):
    model = models["llama"]
    rot = model.model.rotary_emb
    with rope_patch.patched(model, A.as_spec(spec).scheme), torch.no_grad():
        model(ids)  # 3 × WINDOW tokens: transformers' dynamic_rope_update installs the long-length frequencies
        f = A.frequencies(spec, 16, 10000.0, max_position_embeddings=WINDOW, seq_len=ids.shape[1])
        assert torch.equal(f.inv_freq, rot.inv_freq)
        assert torch.equal(A.frequencies(model=model, seq_len=ids.shape[1]).inv_freq, rot.inv_freq)
        assert f.attention_scaling == rot.attention_scaling
        assert not torch.equal(f.inv_freq, A.frequencies(spec, 16, 10000.0, max_position_embeddings=WINDOW).inv_freq)


def test_reading_a_patched_model_leaves_its_outputs_unchanged(models, ids):
    model = models["llama"]
    with rope_patch.patched(model, "yarn", factor=4), torch.no_grad():
        before = model(ids).logits
        scheme = rope_patch.current(model)
        A.decay_bound(model=model, distances=[0, 5, 50])
        assert rope_patch.current(model) is scheme
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("scheme,params,far", [("rerope", {"window_size": 8}, 8.0),
                                                ("self_extend", {"group_size": 4, "window_size": 8}, 100 // 4 + 8 - 2),
                                                ("alibi", {}, 100.0)])
def test_attention_schemes_read_from_a_patched_model(models, scheme, params, far):
    model = models["llama"]
    vanilla = model.model.rotary_emb.inv_freq.clone()
    with rope_patch.patched(model, scheme, **params):
        f = A.frequencies(model=model)
        assert f.name == scheme and f.original_window == WINDOW
        assert torch.equal(f.inv_freq, vanilla if f.rotates else torch.zeros_like(vanilla))
        assert A.effective_distance(rope_patch.current(model), [100]).item() == far
        if scheme == "alibi":
            bias = A.attention_bias(model=model, distances=[0, 10])
            assert bias.shape == (model.config.num_attention_heads, 2) and bias[0, 1].item() == -10 * 2 ** -2


def test_expected_score_equals_the_models_rotation(models):
    """q = k = ones rotated by the model's own cos/sin (attention scaling included) and apply_rotary_pos_emb."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = models["llama"]
    distances = [0, 1, 3, 10, 31, 90]
    with rope_patch.patched(model, "yarn", factor=4), torch.no_grad():
        e = A.expected_score(model=model, distances=distances)
        x = torch.ones(1, 1, 1, 16)
        for delta, got in zip(distances, e.ones, strict=True):
            cos, sin = model.model.rotary_emb(x, torch.tensor([[delta, 0]]))
            q, k = apply_rotary_pos_emb(x.expand(1, 1, 2, 16), x.expand(1, 1, 2, 16), cos, sin)
            assert got.item() == pytest.approx((q[0, 0, 0] @ k[0, 0, 1]).item(), rel=1e-5, abs=1e-4)


# ------------------------------------------------------------------------------------------------------------------
# Wavelengths
def test_wavelengths_and_ratios_match_loops():
    w = A.wavelengths("yarn:8", 128, 1e4, max_position_embeddings=4096)
    thetas = ref_yarn(128, 1e4, 8, 4096)
    assert_close(w.wavelength, [2 * math.pi / t for t in thetas], rtol=1e-6)
    assert_close(w.ratio, [4096 * t / (2 * math.pi) for t in thetas], rtol=1e-6)
    assert_close(w.base_wavelength, [2 * math.pi / t for t in ref_default(128, 1e4)], rtol=1e-6)
    first_long = next(i for i, t in enumerate(ref_default(128, 1e4)) if 2 * math.pi / t > 4096)
    assert w.critical_pair == first_long == 46
    assert w.full_period.tolist() == [2 * math.pi / t <= 4096 for t in thetas]


def test_wavelengths_window_override_and_position_free():
    w = A.wavelengths("default", 64, 1e4, window=1000)
    assert w.window == 1000 and torch.allclose(w.ratio, 1000 / w.wavelength)
    n = A.wavelengths("nope", 64, 1e4, max_position_embeddings=2048)
    assert torch.isinf(n.wavelength).all() and n.ratio.eq(0).all() and not n.full_period.any()


# ------------------------------------------------------------------------------------------------------------------
# Long-term decay (RoFormer §3.4.3)
def test_vanilla_decay_matches_the_roformer_figure():
    d = torch.arange(0, 4097)
    bound = A.decay_bound("default", 128, d, rope_theta=10000.0)
    assert bound[0].item() == pytest.approx(32.5, abs=1e-12)  # (d/2 + 1)/2
    far = bound[256:]
    assert far.max().item() < 0.36 * 32.5  # measured 11.39 = 0.3505 × 32.5 (at Δ = 2009)
    assert far.mean().item() < 0.2 * 32.5  # measured 5.27
    assert bound.argmax().item() == 0
    normalized = A.decay_bound("default", 128, d, rope_theta=10000.0, normalize=True)
    assert normalized[0].item() == pytest.approx(1.0) and torch.allclose(normalized, bound / 32.5)


DECAY_CASES = [("default", 64, lambda: ref_default(64, 1e4)), ("linear:8", 64, lambda: ref_linear(64, 1e4, 8)),
               ("yarn:8", 128, lambda: ref_yarn(128, 1e4, 8, 4096)),
               ("p_rope:0.5", 32, lambda: ref_prope(32, 1e4, 0.5)),
               ("ntk:4", 16, lambda: ref_ntk(16, 1e4, 4))]


@pytest.mark.parametrize("spec,d,ref", DECAY_CASES, ids=[c[0] for c in DECAY_CASES])
def test_decay_bound_matches_loop_reference(spec, d, ref):
    deltas = [0, 1, 2, 7, 100, 1234, 40000]
    got = A.decay_bound(spec, d, deltas, rope_theta=1e4, max_position_embeddings=4096)
    # The summation, exactly, on the model's fp32 θ′ (checked against the loop references above) ...
    thetas = A.frequencies(spec, d, 1e4, max_position_embeddings=4096).inv_freq.tolist()
    expected = [ref_decay(thetas, delta) for delta in deltas]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    # ... and on the float64 formula θ′ (fp32 rounding of θ moves the phase by up to Δ·θ·6e-8 rad).
    exact = [ref_decay(ref(), delta) for delta in deltas]
    torch.testing.assert_close(got, torch.tensor(exact, dtype=torch.float64), rtol=1e-3, atol=1e-6)


def test_decay_of_position_free_and_remapped_schemes():
    d = torch.tensor([0, 10, 100, 511, 512, 5000, 60000])
    for spec in ("nope", "alibi"):
        assert torch.allclose(A.decay_bound(spec, 64, d), torch.full((7,), 16.5, dtype=torch.float64))
    rerope = A.decay_bound("rerope:512", 64, d)
    vanilla = A.decay_bound("default", 64, d)
    assert torch.equal(rerope[:5], vanilla[:5]) and torch.allclose(rerope[4:], vanilla[4].expand(3))
    se = A.decay_bound("self_extend:group_size=8,window_size=512", 64, d)
    thetas = A.frequencies("default", 64).inv_freq.tolist()
    expected = [ref_decay(thetas, (x if x < 512 else x // 8 + 512 - 64)) for x in d.tolist()]
    torch.testing.assert_close(se, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------------------------------
# Effective distances
def test_rerope_and_leaky_rerope_distances_match_loops():
    d = list(range(0, 3000, 7))
    assert A.rerope_distance(d, 512).tolist() == [min(x, 512) for x in d]
    assert torch.allclose(A.leaky_rerope_distance(d, 512, 16.0),
                          torch.tensor([x if x < 512 else 512 + (x - 512) / 16 for x in d], dtype=torch.float64))
    assert torch.equal(A.effective_distance("leaky_rerope:window_size=512,factor=16", d),
                       A.leaky_rerope_distance(d, 512, 16))
    assert torch.equal(A.effective_distance("yarn:8", d), torch.tensor(d, dtype=torch.float64))


@pytest.mark.parametrize("G,W", [(4, 16), (3, 10), (8, 512), (2, 3)])
def test_self_extend_distance_matches_the_papers_positions(G, W):
    """Jin et al. 2024: q at ⌊i/G⌋ + W − ⌊W/G⌋, k at ⌊j/G⌋ beyond the neighbour window; checked for every (i, j)."""
    for i in (0, 5, W, 3 * W + 1, 1000):
        d = list(range(0, i + 1))
        got = A.self_extend_distance(d, G, W, query_position=i).tolist()
        expected = [i - j if i - j < W else (i // G + W - W // G) - (j // G) for j in (i - x for x in d)]
        assert got == expected
    default = A.self_extend_distance(list(range(4 * W)), G, W)  # query at Δ, key at 0
    assert default.tolist() == [x if x < W else x // G + W - W // G for x in range(4 * W)]
    assert default[W].item() == W  # the two regions join at Δ = W for a key at 0


def test_alibi_slopes_match_press_reference_and_the_scheme():
    from rope_patch.schemes.bias import alibi_slopes as scheme_slopes

    for n in range(1, 41):
        torch.testing.assert_close(A.alibi_slopes(n), torch.tensor(press_slopes(n), dtype=torch.float64),
                                   rtol=1e-12, atol=0)
    for n, mb in [(8, 8.0), (12, 8.0), (9, 4.0), (32, 16.0)]:
        torch.testing.assert_close(A.alibi_slopes(n, mb), torch.tensor(scheme_slopes(n, mb), dtype=torch.float64),
                                   rtol=1e-12, atol=0)


def test_attention_bias():
    d = [0, 1, 10, 100]
    b = A.attention_bias("alibi", d, num_heads=8)
    assert b.shape == (8, 4)
    assert torch.allclose(b, -torch.tensor(press_slopes(8), dtype=torch.float64)[:, None]
                          * torch.tensor(d, dtype=torch.float64))
    assert A.attention_bias("nope", d).abs().sum() == 0 and A.attention_bias("yarn:4", d, num_heads=4).shape == (4, 4)


# ------------------------------------------------------------------------------------------------------------------
# Angles and expected scores
def test_angles_are_distance_times_theta():
    a = A.angles("linear:4", 32, [0, 3, 1000])
    assert a.shape == (3, 16)
    assert_close(a[2], [1000 * float(torch.tensor(t, dtype=torch.float32)) for t in ref_linear(32, 1e4, 4)], rtol=3e-7)
    r = A.angles("rerope:64", 32, [1000])
    assert torch.allclose(r[0], 64 * A.frequencies("default", 32).inv_freq.double())


def _rotate(x, angle_per_pair):
    """Rotate pair (x_i, x_{i+n}) by the angle (transformers' rotate_half layout), loop over pairs."""
    n = len(angle_per_pair)
    y = list(x)
    for i, phi in enumerate(angle_per_pair):
        a, b = x[i], x[i + n]
        y[i], y[i + n] = a * math.cos(phi) - b * math.sin(phi), a * math.sin(phi) + b * math.cos(phi)
    return y


@pytest.mark.parametrize("spec", ["default", "yarn:8", "p_rope:0.5", "rerope:100"])
def test_expected_score_ones_matches_explicit_rotation(spec):
    d = 16
    f = A.frequencies(spec, d, 1e4, max_position_embeddings=512)
    deltas = [0, 1, 5, 99, 100, 4000]
    e = A.expected_score(spec, d, deltas, max_position_embeddings=512)
    a = f.attention_scaling
    for delta, got in zip(deltas, e.ones.tolist(), strict=True):
        eff = min(delta, 100) if spec.startswith("rerope") else delta
        q = _rotate([a] * d, [eff * float(t) for t in f.inv_freq])  # query at eff, key at 0
        k = [a] * d
        assert got == pytest.approx(sum(x * y for x, y in zip(q, k, strict=True)), rel=1e-9, abs=1e-9)


def test_expected_score_random_vectors_agree_with_their_expectation():
    e = A.expected_score("default", 64, list(range(0, 2000, 37)), num_samples=4000, seed=1)
    err = (e.random - e.random_exact).abs()
    assert (err <= 5 * e.random_std / math.sqrt(4000) + 1e-12).all()
    assert e.random[0].item() == pytest.approx(1.0) and e.random_exact[0].item() == pytest.approx(1.0)
    again = A.expected_score("default", 64, list(range(0, 2000, 37)), num_samples=4000, seed=1)
    assert torch.equal(e.random, again.random)  # seeded


def test_expected_score_partial_rotary_and_logits():
    e = A.expected_score("default", 32, [0, 50], partial_rotary_factor=0.5)
    base = A.frequencies("default", 32, partial_rotary_factor=0.5)
    assert base.rotary_dim == 16 and e.ones[0].item() == pytest.approx(32.0)
    assert e.ones[1].item() == pytest.approx(2 * sum(math.cos(50 * float(t)) for t in base.inv_freq) + 16, rel=1e-9)
    lo = A.expected_score("alibi", 64, [0, 10], logits=True, num_heads=4)
    slopes = torch.tensor(press_slopes(4), dtype=torch.float64)
    assert lo.ones[1].item() == pytest.approx(64 / 8 - 10 * slopes.mean().item())
    assert lo.bias.shape == (4, 2)


# ------------------------------------------------------------------------------------------------------------------
# Scheme forms
@pytest.mark.parametrize("form", [
    lambda: A.frequencies("yarn:8", 64, max_position_embeddings=1024),
    lambda: A.frequencies("yarn", 64, max_position_embeddings=1024, factor=8),
    lambda: A.frequencies("YaRN:factor=8", 64, max_position_embeddings=1024),
    lambda: A.frequencies(rope_patch.as_scheme("yarn", factor=8), 64, max_position_embeddings=1024),
    lambda: A.frequencies(rope_patch.as_scheme("yarn", factor=8, original_max_position_embeddings=1024), 64),
])
def test_scheme_forms_agree(form):
    ref = A.frequencies("yarn", 64, max_position_embeddings=1024, factor=8)
    got = form()
    assert torch.equal(got.inv_freq, ref.inv_freq) and got.attention_scaling == ref.attention_scaling


def test_spec_parsing_positional_values_aliases_and_labels():
    assert A.as_spec("default:500000").params == {"rope_theta": 500000}
    assert A.as_spec("pi:4").name == "linear"
    assert A.as_spec("rerope:512").params == {"window_size": 512}
    assert A.as_spec("yarn:8").label == "yarn (s=8)"
    assert A.as_spec("leaky_rerope:window_size=64,factor=8").label == "leaky_rerope (W=64, k=8)"


def _string_reference(d, S, W):
    return [x if x < S else x - S + W for x in d]


def _dca_reference(i, j, chunk, local):
    """Written from the paper's three cases (An et al. 2024, §3) with the authors' code's positions."""
    c = chunk - local
    gap = i // c - j // c
    q = i % c if gap == 0 else (min(i % c + c, chunk) if gap == 1 else min(2 * c - 1, chunk))
    return q - j % c


def test_distances_come_from_the_schemes_and_match_their_formulas():
    d = list(range(300))
    assert A.string_distance(d, 100, 16).tolist() == _string_reference(d, 100, 16)
    assert A.effective_distance("string:shift_size=100,window_size=16", d).tolist() == _string_reference(d, 100, 16)
    i = 299
    got = A.dca_distance(d, 96, 16, query_position=i).tolist()
    assert got == [_dca_reference(i, i - x, 96, 16) for x in d]
    assert max(got) <= 96 and min(got) >= 0
    assert (A.leaky_rerope_distance([1000], 512, 16).item()
            == A.effective_distance("leaky_rerope:window_size=512,factor=16", [1000]).item())
    with pytest.raises(TypeError, match="unknown parameter 'group_sise'. Did you mean 'group_size'"):
        A.as_spec("self_extend:window_size=5,group_sise=3")
    with pytest.raises(TypeError, match="missing required parameter `window_size`"):
        A.effective_distance("rerope", [3])
    with pytest.raises(TypeError, match="dca: needs the original training window L"):
        A.frequencies("dca", head_dim=64)
    assert A.frequencies("dca", head_dim=64, max_position_embeddings=256).rotates


# ------------------------------------------------------------------------------------------------------------------
# Bad input → clear errors
@dataclasses.dataclass(frozen=True)
class _Mystery(Scheme):
    """A user's own attention scheme: the analysis reads what it declares (no registry of its own)."""

    name = "mystery_analysis_test"
    kind = "attention"
    keeps_rotation = False

    def relative_position(self, i, j):
        return (i - j) // 2


def test_a_user_scheme_is_analysed_through_what_it_declares():
    f = A.frequencies(_Mystery(), 64)
    assert not f.rotates and bool((f.inv_freq == 0).all())
    assert A.effective_distance(_Mystery(), [0, 1, 5, 8]).tolist() == [0, 0, 2, 4]


ERRORS = [
    (lambda: A.frequencies("default", 127), ValueError, "head_dim` must be even"),
    (lambda: A.frequencies("default", 0), ValueError, "head_dim"),
    (lambda: A.frequencies("default", 64.5), TypeError, "head_dim"),
    (lambda: A.frequencies("default"), TypeError, "head_dim is required"),
    (lambda: A.decay_bound("default", 64, [-1, 2]), ValueError, "must be >= 0"),
    (lambda: A.decay_bound("default", 64, [1.0, float("nan")]), ValueError, "finite"),
    (lambda: A.decay_bound("default", 64, [[1, 2], [3, 4]]), ValueError, "1-D"),
    (lambda: A.decay_bound("default", 64, []), ValueError, "empty"),
    (lambda: A.decay_bound("default", 64, "100"), TypeError, "number"),
    (lambda: A.decay_bound("default", 64), TypeError, "distances"),
    (lambda: A.effective_distance("rerope:8", [-3]), ValueError, "must be >= 0"),
    (lambda: A.frequencies("yran:8", 64), ValueError, "Did you mean 'yarn'"),
    (lambda: A.frequencies("not_a_scheme", 64), ValueError, "Unknown position-encoding scheme"),
    (lambda: A.frequencies(3.5, 64), TypeError, "scheme must be"),
    (lambda: A.frequencies("yarn:8", 64), TypeError, "original training window"),
    (lambda: A.frequencies("yarn", 64, max_position_embeddings=512, fator=8), TypeError, "Did you mean 'factor'"),
    (lambda: A.frequencies("yarn:8", 64, max_position_embeddings=512, factor=8), TypeError, "both"),
    (lambda: A.frequencies("linear:0.5", 64), ValueError, "factor"),
    (lambda: A.frequencies("default", 64, rope_theta=1.0), ValueError, "rope_theta"),
    (lambda: A.frequencies("default", 64, seq_len=0), ValueError, "seq_len"),
    (lambda: A.frequencies("longrope:factor=4,short_factor=1/1,long_factor=1/1", 64, max_position_embeddings=512),
     ValueError, "rotary_dim/2 = 32"),
    (lambda: A.wavelengths("default", 64), TypeError, "original window"),
    (lambda: A.attention_bias("alibi", [1, 2]), TypeError, "num_heads"),
    (lambda: A.alibi_slopes(0), ValueError, "num_heads"),
    (lambda: A.leaky_rerope_distance([1], 8, 0.5), ValueError, "factor"),
    (lambda: A.self_extend_distance([5], 4, 16, query_position=3), ValueError, "query_position"),
    (lambda: A.frequencies("default", model=object()), TypeError, "expects a transformers PreTrainedModel"),
]


@pytest.mark.parametrize("call,exc,match", ERRORS, ids=[f"{i}-{e[2][:24]}" for i, e in enumerate(ERRORS)])
def test_bad_input_raises_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_model_and_numbers_are_exclusive(models):
    with pytest.raises(TypeError, match="come from its config"):
        A.frequencies("default", 16, model=models["llama"])
    with pytest.raises(TypeError, match="model= or config="):
        A.frequencies("default", model=models["llama"], config=models["llama"].config)


def test_config_input_reads_rope_numbers(models):
    cfg = models["phi"].config
    f = A.frequencies("default", config=cfg)
    assert f.head_dim == 16 and f.rotary_dim == 8 and f.original_window == WINDOW
    assert torch.equal(f.inv_freq, models["phi"].model.rotary_emb.inv_freq)


# ------------------------------------------------------------------------------------------------------------------
# Stacks: analysed as the model runs them (θ′ from the frequency part, distances from the attention part)
STACKS = [  # stack, its frequency part (None: the model's θ), its attention part (None: true distances)
    ("yarn:4+string:shift_size=20,window_size=6", "yarn:4", "string:shift_size=20,window_size=6"),
    ("linear:2+self_extend:group_size=4,window_size=8", "linear:2", "self_extend:group_size=4,window_size=8"),
    ("dynamic_yarn:4+rerope:window_size=8+logn", "dynamic_yarn:4", "rerope:window_size=8"),
    ("ntk:4+logn", "ntk:4", None),
    ("dca:chunk_size=48,local_size=8+logn", None, "dca:chunk_size=48,local_size=8"),
]
D = [0, 1, 5, 19, 20, 21, 47, 48, 100, 250]


@pytest.mark.parametrize("stack,frequency,attention", STACKS)
def test_a_stack_takes_its_frequencies_and_distances_from_its_parts(stack, frequency, attention):
    layout = dict(head_dim=16, rope_theta=1e4, max_position_embeddings=WINDOW)
    got, want = A.frequencies(stack, **layout), A.frequencies(frequency or "default", **layout)
    assert torch.equal(got.inv_freq, want.inv_freq) and got.attention_scaling == want.attention_scaling
    assert got.original_window == WINDOW and got.rotates
    assert torch.equal(A.effective_distance(stack, D), A.effective_distance(attention or "default", D))
    for query in (None, 260):
        assert torch.equal(A.effective_distance(stack, D, query_position=query),
                           A.effective_distance(attention or "default", D, query_position=query))
    # the score combines both: θ′ of the frequency part (at the length the distances need: dynamic_yarn follows it)
    # at the attention part's distances
    score = A.expected_score(stack, distances=D, **layout)
    at = A.frequencies(frequency or "default", seq_len=max(D) + 1, **layout)
    delta = A.effective_distance(attention or "default", D).tolist()
    a2 = at.attention_scaling ** 2
    for k, eff in enumerate(delta):
        expected = a2 * 2 * sum(math.cos(eff * float(t)) for t in at.inv_freq)
        assert score.ones[k].item() == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_a_stack_read_from_a_patched_model_equals_its_buffers(models):
    model = models["llama"]
    rot = model.model.rotary_emb
    with rope_patch.patched(model, "yarn:4+string:shift_size=20,window_size=6"):
        f = A.frequencies(model=model)
        assert torch.equal(f.inv_freq, rot.inv_freq) and f.attention_scaling == rot.attention_scaling
        assert f.name == "stack" and f.scheme == "yarn (s=4) + string (S=20, W=6)"
        assert A.effective_distance(rope_patch.current(model), [30]).item() == 30 - 20 + 6


def test_explain_a_stack_and_its_query_temperature():
    layout = dict(head_dim=16, rope_theta=1e4, max_position_embeddings=WINDOW)
    e, yarn = A.explain("yarn:4+string:shift_size=20,window_size=6+logn", **layout), A.explain("yarn:4", **layout)
    for field in ("turns", "unchanged", "interpolated", "longest_wavelength", "attention_scaling"):
        assert getattr(e, field) == getattr(yarn, field), field  # the frequency part's
    assert e.decay_mean != yarn.decay_mean  # over STRING's distances
    (label, points), = e.temperatures
    assert label.startswith("logn") and [n for n, _ in points] == [WINDOW, 2 * WINDOW, 4 * WINDOW, 8 * WINDOW]
    for n, t in points:  # Su's max(1, log_L(p + 1)) at p + 1 = n
        assert t == pytest.approx(max(1.0, math.log(n) / math.log(WINDOW)), rel=1e-6)
    assert "query temperature (logn" in "\n".join(e.lines()) and "×1.6 at 8L" in e.lines()[-1]  # log(8·32)/log(32)
    (_, llama4), = A.explain("logn:kind=llama4,attn_scale=0.5,floor_scale=32", **layout).temperatures
    assert [t for _, t in llama4] == pytest.approx([1 + 0.5 * math.log(n // 32 + 1) for n, _ in llama4], rel=1e-6)
    assert A.explain("yarn:4", **layout).temperatures == ()


@pytest.mark.parametrize("config_scales, expected", [(None, (ATTN_SCALE, FLOOR_SCALE)), ((0.25, 16), (0.25, 16))],
                         ids=["defaults", "the config's"])
def test_explain_reads_llama4_temperature_scales_as_the_model_runs_them(config_scales, expected):
    from transformers import LlamaConfig

    extra = {} if config_scales is None else {"attn_scale": config_scales[0], "floor_scale": config_scales[1]}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=WINDOW, **extra)
    (_, points), = A.explain("logn:kind=llama4", config=config).temperatures
    scale, floor = expected
    assert [t for _, t in points] == pytest.approx([1 + scale * math.log(n // floor + 1) for n, _ in points], rel=1e-6)
