"""Frequency schemes: exact against transformers' native implementation, on every supported architecture."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from helpers.models import ARCHS, INPUTS, PARTIAL, PHI3_ONLY, WINDOW, absent_folders, logits, native_twin, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_older_transformers import OLD, REFUSED_BEFORE_5_21

import rope_patch

L = WINDOW
HEAD_DIM = 16
# scheme, params, window that the native twin must be built with (None: the patched config's window)
NATIVE = [
    ("default", dict(rope_theta=50_000.0), None),
    ("linear", dict(factor=4.0), None),
    ("dynamic", dict(factor=4.0), L),  # transformers' dynamic starts scaling at max_position_embeddings
    ("yarn", dict(factor=4.0), None),
    ("yarn",
     dict(factor=8.0, beta_fast=16.0, beta_slow=2.0, attention_factor=1.2, original_max_position_embeddings=16), None),
    ("llama3", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0), None),
    ("longrope", dict(factor=4.0, short_factor=[1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
                      long_factor=[1.0 + 0.5 * i for i in range(HEAD_DIM // 2)]), None),
    ("p_rope", dict(partial_rotary_factor=0.5), None),  # transformers' `proportional`
    ("p_rope", dict(partial_rotary_factor=0.7), None),  # ⌊0.7·16/2⌋ = 5 pairs (round would keep 6)
]


def _supported(arch, scheme):
    if arch == "phi3":
        return scheme in PHI3_ONLY
    if scheme == "longrope" and arch in PARTIAL:
        return False  # covered separately with lists of the partial length
    if scheme == "p_rope" and arch in PARTIAL:
        return False  # refused there (test_p_rope_is_refused_on_models_that_slice_the_head)
    return True


CASES = [(a, s, p, w) for a in ARCHS for s, p, w in NATIVE if _supported(a, s)]


@pytest.mark.parametrize("arch,scheme,params,native_window", CASES,
                         ids=[f"{a}-{s}-{i}" for i, (a, s, _, _) in enumerate(CASES)])
def test_matches_native_transformers(arch, scheme, params, native_window):
    if OLD and (arch, scheme) in REFUSED_BEFORE_5_21:
        pytest.skip(f"transformers {transformers.__version__} cannot build it natively: refused "
                    "(test_older_transformers.py)")
    model = tiny_model(arch)
    ids = torch.randint(3, 97, (1, 3 * L), generator=torch.Generator().manual_seed(0))  # 3× past the window
    rope_patch.apply(model, scheme, **params)
    got = logits(model, ids)
    twin = native_twin(model, model.config.rope_parameters, native_window or model.config.max_position_embeddings)
    assert (got - logits(twin, ids)).abs().max().item() <= 1e-5
    rope_patch.remove(model)


@pytest.mark.parametrize("arch", sorted(PARTIAL))
def test_partial_rotary_longrope_matches_native(arch):
    model = tiny_model(arch)
    rotary = model.model.rotary_emb if hasattr(model, "model") else model.gpt_neox.rotary_emb
    pairs = rotary.inv_freq.numel()
    rope_patch.apply(model, "longrope", factor=2.0, short_factor=[1.0] * pairs, long_factor=[2.0] * pairs)
    ids = torch.randint(3, 97, (1, 3 * L), generator=torch.Generator().manual_seed(0))
    twin = native_twin(model, model.config.rope_parameters, model.config.max_position_embeddings)
    assert (logits(model, ids) - logits(twin, ids)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text", "phi"])
@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_ntk_equals_default_with_scaled_base(arch, factor):
    """NTK-aware = vanilla RoPE with b′ = b·s^(d/(d−2)) (bloc97), d the rotary dimension."""
    model = tiny_model(arch)
    contexts = rope_patch.discovery.find_target(model).contexts()
    rope_patch.apply(model, "ntk", factor=factor)
    native = {}
    for lt, ctx in contexts.items():
        d = ctx.rotary_dim
        native[lt] = {**ctx.rope_parameters, "rope_type": "default",
                      "rope_theta": ctx.rope_theta * factor ** (d / (d - 2))}
    native = native[None] if None in native else native
    twin = native_twin(model, native, model.config.max_position_embeddings)
    ids = torch.randint(3, 97, (1, 2 * L), generator=torch.Generator().manual_seed(1))
    assert (logits(model, ids) - logits(twin, ids)).abs().max().item() <= 1e-5


def test_ntk_alpha_is_factor():
    a, b = tiny_model(), tiny_model()
    rope_patch.apply(a, "ntk", alpha=4)
    rope_patch.apply(b, "ntk", factor=4)
    assert torch.equal(a.model.rotary_emb.inv_freq, b.model.rotary_emb.inv_freq)


def test_dynamic_is_vanilla_inside_window_and_scales_beyond():
    model = tiny_model()
    short = torch.randint(3, 97, (1, L), generator=torch.Generator().manual_seed(2))
    before = logits(model, short)
    rope_patch.apply(model, "dynamic", factor=4.0)
    # transformers' native dynamic form: scaling starts at config.max_position_embeddings, so the config keeps L
    # (a plain save_pretrained reloads to this very model); the served window is s·L
    assert model.config.max_position_embeddings == L and rope_patch.context_window(model) == 4 * L
    assert torch.equal(logits(model, short), before)  # ℓ ≤ L: unchanged
    long = torch.randint(3, 97, (1, 3 * L), generator=torch.Generator().manual_seed(2))
    logits(model, long)
    d = 16
    ell = 3 * L
    base = 10000.0 * ((4.0 * ell / L) - 3.0) ** (d / (d - 2))  # emozilla's formula at the current length
    expected = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected, rtol=1e-6, atol=0)


def test_p_rope_zeroes_lowest_frequencies():
    model = tiny_model()
    original = model.model.rotary_emb.inv_freq.clone()
    rope_patch.apply(model, "p_rope", partial_rotary_factor=0.75)
    got = model.model.rotary_emb.inv_freq
    assert torch.equal(got[:6], original[:6]) and torch.all(got[6:] == 0)
    rope_patch.apply(model, "p_rope", partial_rotary_factor=1.0)
    assert torch.equal(model.model.rotary_emb.inv_freq, original)


def _p_rope_reference_scores(q, k, inv_freq, keep):
    """Straightforward p-RoPE: rotate pair i (half-split coordinates i, i+d/2) by m·θ_i for i < keep only."""
    d = q.shape[-1]
    out = torch.empty(q.shape[0], k.shape[0])
    for m in range(q.shape[0]):
        for n in range(k.shape[0]):
            s = 0.0
            for i in range(d // 2):
                a = (m - n) * inv_freq[i].item() if i < keep else 0.0
                # R(mθ)q · R(nθ)k = q·R((n−m)θ)k for the pair (x1, x2) = (coordinate i, coordinate i + d/2)
                s += (q[m, i] * k[n, i] + q[m, i + d // 2] * k[n, i + d // 2]) * math.cos(a)
                s += (q[m, i] * k[n, i + d // 2] - q[m, i + d // 2] * k[n, i]) * math.sin(a)
            out[m, n] = s
    return out


def test_p_rope_matches_reference_rotation():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model()
    rope_patch.apply(model, "p_rope", partial_rotary_factor=0.5)
    rot = model.model.rotary_emb
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 6, 16), torch.randn(1, 1, 6, 16)
    cos, sin = rot(q, torch.arange(6)[None])
    qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
    ref = _p_rope_reference_scores(q[0, 0], k[0, 0], 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16), keep=4)
    torch.testing.assert_close(qr[0, 0] @ kr[0, 0].T, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme,params", [(s, p) for s, p, _ in NATIVE] + [("ntk", dict(factor=4.0))])
def test_generate_with_cache_equals_full_recomputation(scheme, params):
    model = tiny_model()
    rope_patch.apply(model, scheme, **params)
    prompt = torch.randint(3, 97, (1, 2 * L + 5), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    ids, full = prompt, []
    for _ in range(8):  # no cache: every step recomputes the whole sequence
        step = logits(model, ids)[:, -1]
        full.append(step)
        ids = torch.cat([ids, step.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, ids)
    drift = max((a - b).abs().max().item() for a, b in zip(out.logits, full, strict=True))
    if scheme == "dynamic":
        # Promised: same greedy tokens. Not promised: equal logits. Each decoding step past L rescales the base for
        # the new length while cached keys keep the base they were rotated with (transformers issue #25104).
        assert drift > 0
    else:
        assert drift <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_frequencies_stay_fp32_on_low_precision_models(dtype):
    model = tiny_model().to(dtype)
    rope_patch.apply(model, "yarn", factor=4.0)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    twin = tiny_model()
    rope_patch.apply(twin, "yarn", factor=4.0)
    assert torch.equal(model.model.rotary_emb.inv_freq, twin.model.rotary_emb.inv_freq)


@settings(max_examples=25, deadline=None)
@given(factor=st.floats(1.0, 64.0), theta=st.floats(100.0, 1e7), half=st.integers(2, 64))
def test_frequency_invariants_property(factor, theta, half):
    """For any factor/base/head_dim: θ′ ≤ θ (schemes only slow rotations), the highest frequency kept by NTK and
    NTK-by-parts schemes, the lowest divided by s for linear/ntk (and llama3 when its wavelength exceeds L)."""
    from rope_patch.discovery import RopeContext

    d = 2 * half
    ctx = RopeContext(head_dim=d, rotary_dim=d, rope_theta=theta, max_position_embeddings=4096,
                      rope_parameters={"rope_theta": theta})
    base, _ = rope_patch.as_scheme("default").inv_freq(ctx)
    for name in ("linear", "ntk", "yarn", "llama3"):
        scheme = rope_patch.as_scheme(name, factor=factor)
        if name in ("yarn", "llama3"):
            scheme = scheme.replace(original_max_position_embeddings=4096)
        got, _ = scheme.inv_freq(ctx)
        assert torch.all(got <= base * (1 + 1e-6)), name
        lowest_is_long = 2 * math.pi / base[-1].item() > 4096  # Llama 3 interpolates only λ > L/low_freq_factor
        if name in ("linear", "ntk") or (name == "llama3" and lowest_is_long):
            assert math.isclose(got[-1].item(), base[-1].item() / factor, rel_tol=1e-4), name
        if name in ("ntk", "yarn", "llama3"):
            assert math.isclose(got[0].item(), base[0].item(), rel_tol=1e-5), name


# ---- p_rope = transformers' `proportional` --------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
@pytest.mark.parametrize("fraction", [0.25, 0.7, 1.0])
def test_p_rope_equals_natively_configured_proportional(arch, fraction):
    """The twin is built by transformers from {"rope_type": "proportional", ...} written by hand, not from the
    patched config: p_rope is that rope type, with transformers' pair count ⌊p·d/2⌋."""
    model = tiny_model(arch)
    ctxs = rope_patch.discovery.find_target(model).contexts()
    rope_patch.apply(model, "p_rope", partial_rotary_factor=fraction)
    native = {lt: {"rope_type": "proportional", "rope_theta": ctx.rope_theta, "partial_rotary_factor": fraction}
              for lt, ctx in ctxs.items()}
    native = native[None] if None in native else native
    twin = native_twin(model, native, model.config.max_position_embeddings)
    ids = torch.randint(3, 97, (1, 3 * L), generator=torch.Generator().manual_seed(4))
    assert (logits(model, ids) - logits(twin, ids)).abs().max().item() <= 1e-5
    rot = model.model.rotary_emb
    for name, buf in rot.named_buffers():
        if name.endswith("inv_freq") and not name.endswith("original_inv_freq"):
            kept = int(fraction * HEAD_DIM // 2)
            assert torch.all(buf[kept:] == 0) and torch.all(buf[:kept] > 0), name
            assert torch.equal(buf, getattr(twin.model.rotary_emb, name)), name


@pytest.mark.parametrize("name", ["p_rope", "proportional"])
def test_p_rope_exports_and_plain_saves_as_proportional(name, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model()
    rope_patch.apply(model, name, partial_rotary_factor=0.5)
    assert rope_patch.current(model).name == "p_rope"
    want = {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    assert rope_patch.to_rope_parameters(None, model=model) == want
    assert rope_patch.to_rope_parameters("proportional:0.5", rope_theta=1e4) == want
    assert model.config.rope_parameters == want
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no rope_patch involved
    ids = torch.randint(3, 97, (1, 3 * L), generator=torch.Generator().manual_seed(5))
    assert rope_patch.current(plain) is None and plain.config.rope_parameters["rope_type"] == "proportional"
    assert (logits(plain, ids) - logits(model, ids)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", sorted(PARTIAL))
def test_p_rope_is_refused_on_models_that_slice_the_head(arch):
    """phi / stablelm / gpt-neox / glm use `partial_rotary_factor` for another thing (rotate the first p·d coordinates
    with a re-spread spectrum, fixed when the model is built): p_rope would have to write the same key."""
    model = tiny_model(arch)
    ids = torch.randint(3, 97, (1, L), generator=torch.Generator().manual_seed(6))
    before, config = logits(model, ids), model.config.to_dict()
    with pytest.raises(ValueError, match=r"p_rope: .* rotates only part of each head .*partial_rotary_factor"):
        rope_patch.apply(model, "p_rope", partial_rotary_factor=0.5)
    assert rope_patch.current(model) is None and model.config.to_dict() == config
    assert torch.equal(logits(model, ids), before)


# ---- dynamic_yarn ----------------------------------------------------------------------------------------------------
def _yarn_native(model, unpatched: dict, factor: float):
    """transformers' own yarn ×factor on the unpatched RoPE (phi & co. keep their partial_rotary_factor)."""
    rope = {**unpatched, "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": L}
    return native_twin(model, rope, model.config.max_position_embeddings)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "phi", "cohere"])
def test_dynamic_yarn_is_vanilla_inside_the_window_and_static_yarn_at_each_length(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 97, (2, 5 * L), generator=torch.Generator().manual_seed(7))
    vanilla = {n: logits(model, ids[:, :n]) for n in (L // 2, L)}
    unpatched = dict(model.config.rope_parameters)
    rope_patch.apply(model, "dynamic_yarn", factor=4.0)
    for n, want in vanilla.items():  # ℓ ≤ L: s = 1, bit for bit
        assert torch.equal(logits(model, ids[:, :n]), want)
    for n, s in ((3 * L, 3.0), (L + 8, (L + 8) / L), (5 * L, 4.0)):  # s = ℓ/L, capped at factor
        got = logits(model, ids[:, :n])
        assert (got - logits(_yarn_native(model, unpatched, s), ids[:, :n])).abs().max().item() <= 1e-5, n
    assert torch.equal(logits(model, ids[:, : L // 2]), vanilla[L // 2])  # back to s = 1 after longer inputs


def test_dynamic_yarn_keeps_yarn_parameters_and_per_layer_type_rope():
    model = tiny_model("gemma3_text")
    ids = torch.randint(3, 97, (1, 3 * L), generator=torch.Generator().manual_seed(8))
    ctxs = rope_patch.discovery.find_target(model).contexts()
    rope_patch.apply(model, "dynamic_yarn", factor=8.0, beta_fast=16.0, attention_factor=1.1)
    native = {lt: {"rope_type": "yarn", "rope_theta": ctx.rope_theta, "factor": 3.0, "beta_fast": 16.0,
                   "attention_factor": 1.1, "original_max_position_embeddings": L} for lt, ctx in ctxs.items()}
    twin = native_twin(model, native, model.config.max_position_embeddings)
    assert (logits(model, ids) - logits(twin, ids)).abs().max().item() <= 1e-5


def test_dynamic_yarn_window_export_and_config():
    model = tiny_model()
    rope_patch.apply(model, "dynamic_yarn", factor=4.0)
    assert rope_patch.context_window(model) == 4 * L  # the cap × L
    assert model.config.max_position_embeddings == L and model.config.rope_parameters["rope_type"] == "default"
    for scheme in (rope_patch.current(model), "dynamic_yarn:4"):
        with pytest.raises(ValueError, match="dynamic_yarn has no native transformers/vLLM `rope_parameters` form"):
            rope_patch.to_rope_parameters(scheme)
    with pytest.raises(ValueError, match="no native"):
        rope_patch.native_config(model)


def test_dynamic_yarn_analysis_frequencies_are_the_installed_ones():
    from rope_patch.discovery import RopeContext

    model = tiny_model()
    rope_patch.apply(model, "dynamic_yarn", factor=4.0)
    scheme, rot = rope_patch.current(model), model.model.rotary_emb
    ctx = RopeContext(head_dim=HEAD_DIM, rotary_dim=HEAD_DIM, rope_theta=1e4, max_position_embeddings=L,
                      rope_parameters={"rope_theta": 1e4})
    for n in (L, 3 * L, 9 * L):
        logits(model, torch.ones(1, n, dtype=torch.long))
        inv_freq, scaling = scheme.inv_freq(ctx, type(rot), seq_len=n)
        assert torch.equal(rot.inv_freq, inv_freq) and rot.attention_scaling == scaling, n
    assert rot.attention_scaling == 0.1 * math.log(4.0) + 1


@pytest.mark.parametrize("prompt,new", [(L // 2, 8), (4 * L + 3, 8)], ids=["inside-window", "beyond-cap"])
def test_dynamic_yarn_cached_decoding_equals_recomputation_while_s_is_fixed(prompt, new):
    """ℓ ≤ L for the whole generation (s = 1), or ℓ ≥ factor·L from the prompt on (s = factor)."""
    model = tiny_model()
    rope_patch.apply(model, "dynamic_yarn", factor=4.0)
    ids, full = _greedy_without_cache(model, prompt, new)
    out = _greedy_with_cache(model, prompt, new)
    assert torch.equal(out.sequences, ids)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, full, strict=True)) <= 1e-5


def test_dynamic_yarn_cached_decoding_across_the_window_uses_stale_keys():
    """Documented, not hidden: crossing L, cached keys keep the frequencies of the step that wrote them, so cached
    logits differ from recomputation (which re-rotates every key with the current s)."""
    model = tiny_model()
    rope_patch.apply(model, "dynamic_yarn", factor=4.0)
    _, full = _greedy_without_cache(model, L - 2, 8)
    out = _greedy_with_cache(model, L - 2, 8)
    drift = [(a - b).abs().max().item() for a, b in zip(out.logits, full, strict=True)]
    assert max(drift[:3]) <= 1e-5  # steps at ℓ = L − 2 … L: s = 1 throughout
    assert min(drift[3:]) > 1e-5 and max(drift[3:]) > 1e-4  # from ℓ = L + 1 on, the cache holds stale keys


def _prompt(n):
    return torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(9))


def _greedy_with_cache(model, n, new):
    return model.generate(_prompt(n), max_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)


def _greedy_without_cache(model, n, new):
    ids, full = _prompt(n), []
    for _ in range(new):
        step = logits(model, ids)[:, -1]
        full.append(step)
        ids = torch.cat([ids, step.argmax(-1, keepdim=True)], dim=1)
    return ids, full


def test_dynamic_yarn_save_and_reload(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model()
    ids = torch.randint(3, 97, (1, 3 * L), generator=torch.Generator().manual_seed(10))
    vanilla = logits(model, ids)
    rope_patch.apply(model, "dynamic_yarn", factor=4.0, beta_slow=2.0)
    rope_patch.save_pretrained(model, tmp_path)
    again = rope_patch.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert rope_patch.current(again) == rope_patch.current(model)
    assert torch.equal(logits(again, ids), logits(model, ids))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()  # not native: RoPE
    assert torch.equal(logits(plain, ids), vanilla)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dynamic_yarn_frequencies_stay_fp32_after_a_cast_and_remove_is_exact(dtype):
    model, twin = tiny_model(), tiny_model()
    ids = torch.randint(3, 97, (1, 3 * L), generator=torch.Generator().manual_seed(11))
    rope_patch.apply(model, "dynamic_yarn", factor=4.0)
    logits(model, ids)  # s = 3 installed
    model.to(dtype)
    twin.to(dtype)
    loaded = tiny_model()  # weights in `dtype`, frequencies fp32: as from_pretrained(dtype=...) loads
    for p in loaded.parameters():
        p.data = p.data.to(dtype)
    rope_patch.apply(loaded, "dynamic_yarn", factor=4.0)
    assert torch.equal(logits(model, ids), logits(loaded, ids))
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    rope_patch.remove(model)
    for name, buf in twin.model.rotary_emb._buffers.items():
        assert torch.equal(model.model.rotary_emb._buffers[name], buf), name
    assert model.model.rotary_emb.attention_scaling == 1.0
    assert torch.equal(logits(model, ids), logits(twin, ids))


@pytest.mark.parametrize("scheme,params", [("yarn", {"factor": 4.0}), ("default", {"rope_theta": 5e4})])
def test_model_keys_of_rope_parameters_stay_and_the_rotary_recomputes_with_the_patched_type(scheme, params):
    """PhiMoE ships LongRoPE with short_mscale / long_mscale, keys no transformers rope type defines: its config
    requires them beside any scaling type and its rotary multiplies cos/sin by them, recomputing its frequencies with
    `self.rope_init_fn` at every forward. A patch keeps the model's keys and swaps that function, as a natively
    configured model has them; remove() restores both."""
    model = tiny_model("phimoe")
    ids = torch.randint(0, model.config.vocab_size, (1, 3 * WINDOW // 2))
    before, shipped = logits(model, ids), dict(model.config.rope_parameters)
    init_fn = model.model.rotary_emb.rope_init_fn
    rope_patch.apply(model, scheme, **params)
    rope = model.config.rope_parameters
    assert rope["rope_type"] == scheme and {k: rope[k] for k in ("short_mscale", "long_mscale")} == {
        "short_mscale": shipped["short_mscale"], "long_mscale": shipped["long_mscale"]}
    twin = native_twin(model, rope, model.config.max_position_embeddings)
    assert torch.equal(logits(model, ids), logits(twin, ids))
    rope_patch.remove(model)
    assert model.config.rope_parameters == shipped and model.model.rotary_emb.rope_init_fn is init_fn
    assert torch.equal(logits(model, ids), before)


def test_a_rotary_that_fails_under_the_patched_config_is_refused_at_apply():
    """PhiMoE's rotary reads `original_max_position_embeddings` from rope_parameters for every type but default;
    `linear` has none, so a natively configured model fails at its first forward: refused at apply(), unchanged."""
    model = tiny_model("phimoe")
    ids = torch.randint(0, model.config.vocab_size, (1, WINDOW))
    before, config = logits(model, ids), model.config.to_dict()
    with pytest.raises(ValueError, match=r"linear: phimoe's rotary module fails under this RoPE "
                                         r"configuration \(KeyError"):
        rope_patch.apply(model, "linear", factor=2.0)
    assert rope_patch.current(model) is None and model.config.to_dict() == config
    assert torch.equal(logits(model, ids), before)


# ---- refused at apply where transformers' computation cannot run, read from the model's structure -------------------
# (folder, spec as suggest(model, 4·L) writes it, the refusal's phrase). Before, each raised a raw error (at apply a
# ZeroDivisionError, gemma4's AmbiguousGlobalPerLayerAttributeError; mimo_v2_flash, lfm3: a RuntimeError, shape
# mismatch, at the first forward) or was refused without saying why (deepseek_v4's dynamic).
REFUSED_AT_APPLY = [
    # one rotated pair (the tiny DeepSeek-V4: head_dim 16 × partial 0.125, rotary dim 2): θ_0 = b^0 = 1 whatever the
    # base, and NTK's b·s^(d/(d−2)) divides by d − 2 = 0 (transformers' dynamic NTK computes the same exponent)
    ("deepseek_v4", "ntk:factor=4", r"ntk: .*rotates one coordinate pair per head \(rotary dim d = 2\).* Use linear"),
    ("deepseek_v4", "dynamic:factor=4", r"dynamic: .*rotates one coordinate pair per head \(rotary dim d = 2\)"),
    # dynamic_yarn computes yarn ×s with transformers' function per length past L: that computation is tried at apply
    # (the tiny MiMo-V2-Flash rotates int(16 × 0.334) = 5 coordinates, where transformers' yarn fails: 3 vs 2 pairs)
    ("mimo_v2_flash", "dynamic_yarn:factor=4,beta_fast=2",
     r"dynamic_yarn: past the original window it computes 'yarn' frequencies .*fails on mimo_v2_flash's config for its "
     r"full_attention layers \(RuntimeError"),
    ("mimo_v2_flash", "dynamic_yarn:factor=4", r"dynamic_yarn: past the original window .*fails on mimo_v2_flash's"),
    # and its frequencies' width against what the attention rotates (`proportional` global layers: full-width
    # frequencies, where yarn gives the partial set)
    ("lfm3", "dynamic_yarn:factor=4,beta_fast=2",
     r"dynamic_yarn: lfm3's rotary module for its full_attention layers \('proportional'\) gives 8 frequencies"),
    ("lfm3", "dynamic_yarn:factor=4", r"dynamic_yarn: lfm3's rotary module .*\('proportional'\) gives 8 frequencies"),
    # a heterogeneous config (per-layer head_dim) answers through its layer type's view, then the width refuses
    ("gemma4", "dynamic_yarn:factor=4,beta_fast=2",
     r"dynamic_yarn: gemma4_text's rotary module for its full_attention layers \('proportional'\) gives 16"),
    # Granite-SWA builds one rotary per base of its per-layer base list (layer_rope_theta), each from a copy of the
    # config with that rope_theta, and looks them up by that base at every forward: a new base has no native form
    # there (the rope_parameters' rope_theta never reaches those rotaries); before, a KeyError at the first forward
    *((folder, spec, rf"{spec.split(':')[0]}: changes the RoPE base \(rope_theta 10000 -> .*\), and {folder}'s "
                     r"\w+RotaryEmbedding is built from a config the model's code derives for it .* Use a scheme that "
                     r"keeps each rotary's base")
      for folder in ("granite_swa", "granitemoe_swa")
      for spec in ("ntk:factor=4", "default:rope_theta=50000", "yarn:factor=4,rope_theta=50000")),
    # dynamic_yarn runs one s per forward on every rotary, from the tokens' positions: Blt's rotaries belong to separate
    # transformers (sub-configs), its global one numbering patches, not bytes (before: yarn ×s of another length there)
    ("blt", "dynamic_yarn:factor=4", r"dynamic_yarn: .* one scale for every rotary module of the model, and blt's "
                                     r"rotary modules are built from sub-configs of its config \(Blt\w+Config, "),
]
# a folder the installed transformers lacks (helpers.models.NEWER_FOLDERS: lfm3 from 5.23) is not collected
REFUSED_AT_APPLY = [row for row in REFUSED_AT_APPLY if row[0] not in absent_folders()]


@pytest.mark.parametrize("folder,spec,phrase", REFUSED_AT_APPLY, ids=[f"{f}-{s}" for f, s, _ in REFUSED_AT_APPLY])
def test_refused_at_apply_with_the_model_untouched(folder, spec, phrase):
    model = tiny_model(folder)
    ids = torch.randint(3, 97, (1, 3 * L), generator=torch.Generator().manual_seed(9))  # past the window
    kw = INPUTS.get(folder, {})
    before, config = logits(model, ids, **kw), model.config.to_dict()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.raises(ValueError, match=phrase):
        rope_patch.apply(model, spec)
    assert rope_patch.current(model) is None and model.config.to_dict() == config
    assert buffers.keys() == dict(model.named_buffers()).keys()
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(logits(model, ids, **kw), before)


# ---- models with several rotary modules -----------------------------------------------------------------------------
# Granite-SWA's rotaries, one per base of its per-layer base list (0: a layer without RoPE): every scheme that keeps
# the bases (a new base is refused above) against the model transformers builds from the patched rope_parameters
PER_BASE = dict(num_hidden_layers=3, layer_rope_theta=[10_000.0, 0, 500_000.0])
PER_BASE_CASES = [(f, s, p, w) for f in ("granite_swa", "granitemoe_swa") if f not in absent_folders()
                  for s, p, w in NATIVE if s != "default"]


@pytest.mark.parametrize("folder,scheme,params,native_window", PER_BASE_CASES,
                         ids=[f"{f}-{s}-{i}" for i, (f, s, _, _) in enumerate(PER_BASE_CASES)])
def test_rotaries_per_base_match_native_transformers(folder, scheme, params, native_window):
    model = tiny_model(folder, **PER_BASE)
    ids = torch.randint(3, 97, (1, 3 * L), generator=torch.Generator().manual_seed(12))
    before = logits(model, ids)
    rope_patch.apply(model, scheme, **params)
    got = logits(model, ids)
    twin = native_twin(model, model.config.rope_parameters, native_window or model.config.max_position_embeddings)
    assert (got - logits(twin, ids)).abs().max().item() <= 1e-5
    assert (got - before).abs().max().item() > 1e-3  # the scheme reached the rotaries the layers use
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


# dynamic_yarn at length ℓ is yarn ×s(ℓ) on every rotary of the model: also where the attention layers hold rotaries of
# their own that rotate memory entries at positions of their making (DeepSeek-V4's compressor and indexer: entry w at
# w·m), whose largest position is not ℓ. Before, each of those measured its own ℓ and ran another s (inexact).
_V4_HALF = {lt: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5}
            for lt, theta in (("main", 10_000.0), ("compress", 160_000.0))}
DYNAMIC_YARN_EVERY_ROTARY = [
    ("deepseek_v4", {}),  # one rotated pair per head (partial 0.125 of 16)
    ("deepseek_v4", dict(rope_parameters=_V4_HALF)),  # four pairs
    ("granite_swa", PER_BASE),  # one rotary per base, all rotating the tokens
]


@pytest.mark.parametrize("folder,overrides", DYNAMIC_YARN_EVERY_ROTARY,
                         ids=[f"{f}-{i}" for i, (f, _) in enumerate(DYNAMIC_YARN_EVERY_ROTARY)])
def test_dynamic_yarn_is_static_yarn_of_the_forwards_length_on_every_rotary(folder, overrides):
    model = tiny_model(folder, **overrides)
    ids = torch.randint(3, 97, (1, 5 * L), generator=torch.Generator().manual_seed(13))
    vanilla = logits(model, ids[:, :L])
    unpatched = dict(model.config.rope_parameters)
    rope_patch.apply(model, "dynamic_yarn", factor=4.0)
    assert torch.equal(logits(model, ids[:, :L]), vanilla)  # ℓ ≤ L: s = 1 everywhere, bit for bit
    for n, s in ((3 * L, 3.0), (L + 8, (L + 8) / L), (5 * L, 4.0)):  # s = ℓ/L, capped at factor
        yarn = {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L}
        native = ({lt: {**entry, **yarn} for lt, entry in unpatched.items()} if "main" in unpatched
                  else {**unpatched, **yarn})
        twin = native_twin(model, native, model.config.max_position_embeddings)
        assert (logits(model, ids[:, :n]) - logits(twin, ids[:, :n])).abs().max().item() <= 1e-5, n
    assert torch.equal(logits(model, ids[:, :L]), vanilla)  # back to s = 1 after longer inputs


def test_dynamic_yarn_is_refused_where_no_rotary_rotates_the_tokens(monkeypatch):
    """Were every rotary a memory one, none would measure ℓ from the tokens' positions and each would run an s of its
    own: refused at apply, the model untouched (no such model ships: DeepSeek-V4 seen so)."""
    from rope_patch.schemes import rotary_install

    model = tiny_model("deepseek_v4")
    every = rope_patch.discovery.find_target(model).rotaries
    monkeypatch.setattr(rotary_install.attention, "memory_rotaries", lambda module: list(every))
    before, config = logits(model, torch.ones(1, 3 * L, dtype=torch.long)), model.config.to_dict()
    with pytest.raises(ValueError, match=r"dynamic_yarn: its frequencies follow the sequence length .* no rotary "
                                         r"measures ℓ\. Use the static yarn"):
        rope_patch.apply(model, "dynamic_yarn:4")
    assert rope_patch.current(model) is None and model.config.to_dict() == config
    assert torch.equal(logits(model, torch.ones(1, 3 * L, dtype=torch.long)), before)
    rope_patch.apply(model, "yarn:4")  # a static scheme needs no ℓ


def test_ntk_export_refuses_one_rotated_pair():
    """to_rope_parameters without a model: a head_dim of 2 (one pair) is refused as at apply, not divided by zero."""
    with pytest.raises(ValueError, match=r"ntk: .*one coordinate pair per head \(rotary dim d = 2\)"):
        rope_patch.to_rope_parameters("ntk:4", head_dim=2, rope_theta=1e4)
    assert rope_patch.to_rope_parameters("ntk:4", head_dim=4, rope_theta=1e4)["rope_theta"] == pytest.approx(1.6e5)


@pytest.mark.parametrize("folder", [f for f in ("deepseek_v4", "gemma4", "lfm3", "mimo_v2_flash")
                                    if f not in absent_folders()])
def test_every_suggested_frequency_spec_is_refused_at_apply_or_runs_past_the_window(folder):
    """The frequency schemes suggest's rules give for 4·L on the folders above (untried: `verify=False`; suggest itself
    leaves out what apply refuses): each one is refused at apply() (model untouched) or runs forwards past L and up
    to the cap; none fails later (the reviewer's sweep, kept as a test)."""
    model = tiny_model(folder)
    ids = torch.randint(3, 97, (1, 4 * L + 8), generator=torch.Generator().manual_seed(10))
    before = logits(model, ids[:, :L])
    kinds = {"linear", "ntk", "dynamic", "yarn", "dynamic_yarn", "llama3"}
    specs = [s.spec for s in rope_patch.suggest(model, 4 * L, verify=False) if s.scheme in kinds]
    assert {spec.split(":")[0] for spec in specs} == kinds
    for spec in specs:
        try:
            rope_patch.apply(model, spec)
        except ValueError:
            assert rope_patch.current(model) is None and torch.equal(logits(model, ids[:, :L]), before), spec
            continue
        for n in (L // 2, 3 * L, 4 * L + 8):
            assert torch.isfinite(logits(model, ids[:, :n])).all(), (spec, n)
        rope_patch.remove(model)
    assert torch.equal(logits(model, ids[:, :L]), before)
