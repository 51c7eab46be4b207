"""cache_rotation="consistent" (schemes/cached.py): keys cached un-rotated and rotated with each step's frequencies."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import VOCAB, WINDOW, logits, tiny_config, tiny_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

import rope_patch
from rope_patch.discovery import find_target

L = WINDOW
PAIRS = 8  # tiny llama: head_dim 16
LONGROPE = dict(short_factor=[1.0 + i / 8 for i in range(PAIRS)], long_factor=[1.0 + i for i in range(PAIRS)],
                factor=4.0)
SCHEMES = [("dynamic", dict(factor=4.0)), ("dynamic_yarn", dict(factor=4.0)), ("longrope", LONGROPE)]
PROMPT, STEPS = L - 3, 8  # decoding crosses the window: lengths L − 2 … L + 5


def _ids(n, seed=7):
    torch.manual_seed(seed)
    return torch.randint(3, VOCAB, (2, n))


def _frequencies(scheme, params, length):
    """(inv_freq, cos/sin scale) of a length-`length` forward, computed without the patched model: transformers'
    own dynamic init function for dynamic NTK, the scheme's standalone computation for the other two."""
    if scheme == "dynamic":
        cfg = tiny_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": params["factor"]})
        seq = {"seq_len": torch.tensor(length)} if length > L else {}
        inv_freq, scale = ROPE_INIT_FUNCTIONS["dynamic"](cfg, None, **seq)
        return inv_freq.float(), float(scale)
    ctx = next(iter(find_target(tiny_model()).contexts().values()))
    obj = rope_patch.as_scheme(scheme, **params).resolve(find_target(tiny_model()))
    return obj.inv_freq(ctx, seq_len=length)


def _rotate(x, positions, inv_freq, scale):
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * scale)[None], (emb.sin() * scale)[None]
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


class Projections:
    """Forward hooks on every layer's q_proj / k_proj: per layer, the un-rotated queries of every call (a list) and
    all keys so far, as (b, heads, n, d)."""

    def __init__(self, model):
        self.q, self.k = {}, {}
        d = model.config.hidden_size // model.config.num_attention_heads
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.q_proj.register_forward_hook(self._hook(self.q, i, d, keys=False))
            layer.self_attn.k_proj.register_forward_hook(self._hook(self.k, i, d, keys=True))

    @staticmethod
    def _hook(store, i, d, keys):
        def hook(module, args, out):
            b, n, _ = out.shape
            x = out.view(b, n, -1, d).transpose(1, 2)
            if keys:
                store[i] = torch.cat([store[i], x], dim=2) if i in store else x
            else:
                store.setdefault(i, []).append(x)
        return hook


def _decode_scores(model, ids):
    """Prefill PROMPT tokens, then decode STEPS tokens (teacher-forced): per step, the cache and the attention
    weights of the new query in every layer (eager backend → rope_patch_dense returns them)."""
    steps = []
    with torch.no_grad():
        out = model(ids[:, :PROMPT], use_cache=True)
        cache = out.cache
        for t in range(PROMPT, PROMPT + STEPS):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True, output_attentions=True)
            cache = out.cache
            steps.append((t + 1, [a[:, :, -1].clone() for a in out.attentions]))
    return steps, cache


def _reference(q, k, length, scheme, params, groups):
    """softmax(q·kᵀ/√d) of the step's query (position length − 1) against all keys 0 … length − 1, both rotated
    with the frequencies of this step's length."""
    inv_freq, scale = _frequencies(scheme, params, length)
    pos = torch.arange(length)
    qr = _rotate(q[:, :, -1:], pos[-1:], inv_freq, scale)
    kr = repeat_kv(_rotate(k[:, :, :length], pos, inv_freq, scale), groups)
    s = (qr @ kr.transpose(-1, -2)).squeeze(2) * q.shape[-1] ** -0.5
    return torch.softmax(s.float(), dim=-1)


@pytest.mark.parametrize("scheme,params", SCHEMES)
def test_every_step_attends_with_that_steps_frequencies_over_unrotated_cached_keys(scheme, params):
    model = tiny_model(attn_implementation="eager")
    rope_patch.apply(model, scheme, **params, cache_rotation="consistent")
    proj = Projections(model)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    steps, cache = _decode_scores(model, _ids(PROMPT + STEPS))
    for layer, cached in enumerate(cache.layers):
        assert torch.equal(cached.keys, proj.k[layer])  # the cache holds the un-rotated keys
    worst = 0.0
    for step, (length, weights) in enumerate(steps):
        for layer, got in enumerate(weights):
            ref = _reference(proj.q[layer][step + 1], proj.k[layer], length, scheme, params, groups)
            worst = max(worst, (got - ref).abs().max().item())
    assert worst <= 1e-5


def test_native_mode_mixes_rotations_once_the_length_crosses_the_window():
    """The same reference on transformers' native behaviour: keys cached with the base of their own step differ."""
    model = tiny_model(attn_implementation="eager")
    rope_patch.apply(model, "dynamic", factor=4.0)
    assert model.config._attn_implementation == "eager"  # the default stays transformers' own attention
    proj = Projections(model)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    ids = _ids(PROMPT + STEPS)
    with torch.no_grad():
        out = model(ids[:, :PROMPT], use_cache=True)
        cache = out.cache
        drift = []
        for t in range(PROMPT, PROMPT + STEPS):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True, output_attentions=True)
            cache = out.cache
            ref = _reference(proj.q[0][-1], proj.k[0], t + 1, "dynamic", dict(factor=4.0), groups)
            drift.append((out.attentions[0][:, :, -1] - ref).abs().max().item())
    assert max(drift[:2]) <= 1e-5  # ℓ ≤ L: one base
    assert min(drift[3:]) > 1e-4  # ℓ > L: the prompt's keys keep the unscaled base


def _greedy_logits(model, ids, new, cached):
    """Per-step last logits of greedy decoding, with a KV cache or recomputing the whole sequence each step."""
    seq, out_logits = ids, []
    with torch.no_grad():
        cache = None
        for _ in range(new):
            if cached:
                out = model(seq if cache is None else seq[:, -1:], cache=cache, use_cache=True)
                cache = out.cache
            else:
                out = model(seq, use_cache=False)
            last = out.logits[:, -1]
            out_logits.append(last)
            seq = torch.cat([seq, last.argmax(-1, keepdim=True)], dim=1)
    return torch.stack(out_logits, 1)


@pytest.mark.parametrize("scheme,params", SCHEMES)
def test_one_layer_consistent_decoding_equals_recomputation_two_layers_do_not(scheme, params):
    """A token's key and value in layer 1 depend on its embedding only, so with one layer re-rotating the cached
    keys is full recomputation; from layer 2 on the cached keys/values come from hidden states computed under
    the frequencies of their own step (documented in schemes/cached.py and docs/guides/kv-cache.md)."""
    prompt = _ids(PROMPT)
    one = tiny_model(num_hidden_layers=1)
    rope_patch.apply(one, scheme, **params, cache_rotation="consistent")
    full = _greedy_logits(one, prompt, STEPS, cached=False)
    assert (_greedy_logits(one, prompt, STEPS, cached=True) - full).abs().max() <= 1e-5
    rope_patch.apply(one, scheme, **params)  # native: stale keys after the crossing
    assert (_greedy_logits(one, prompt, STEPS, cached=True) - full).abs().max() > 1e-4
    two = tiny_model(num_hidden_layers=2)
    rope_patch.apply(two, scheme, **params, cache_rotation="consistent")
    gap = (_greedy_logits(two, prompt, STEPS, cached=True) - _greedy_logits(two, prompt, STEPS, cached=False))
    assert gap.abs().max() > 1e-5


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("scheme,params", SCHEMES)
def test_without_a_cache_consistent_equals_native_and_remove_is_exact(scheme, params, impl):
    model = tiny_model(attn_implementation=impl)
    ids = _ids(3 * L)
    vanilla = logits(model, ids)
    rope_patch.apply(model, scheme, **params)
    native = [logits(model, ids[:, :n]) for n in (L // 2, 3 * L)]
    rope_patch.apply(model, scheme, **params, cache_rotation="consistent")
    assert model.config._attn_implementation.startswith("rope_patch_")
    assert rope_patch.current(model).cache_rotation == "consistent"
    for n, ref in zip((L // 2, 3 * L), native, strict=True):
        assert (logits(model, ids[:, :n]) - ref).abs().max() <= 1e-5
    twin = copy.deepcopy(model)
    assert torch.equal(logits(twin, ids), logits(model, ids))
    rope_patch.remove(model)
    assert model.config._attn_implementation == impl
    assert torch.equal(logits(model, ids), vanilla)


def test_native_is_the_default_and_bad_values_are_refused():
    assert rope_patch.as_scheme("dynamic:4") == rope_patch.as_scheme("dynamic", factor=4, cache_rotation="native")
    assert "cache_rotation" not in rope_patch.as_scheme("dynamic", factor=4, cache_rotation="native").params()
    assert rope_patch.as_scheme("dynamic:factor=4,cache_rotation=consistent").cache_rotation == "consistent"
    with pytest.raises(ValueError, match=r"`cache_rotation` must be one of 'native', 'consistent', got 'recompute'"):
        rope_patch.as_scheme("dynamic", factor=4, cache_rotation="recompute")
    with pytest.raises(TypeError, match="`cache_rotation` must be one of"):
        rope_patch.as_scheme("longrope", **LONGROPE, cache_rotation=True)
    with pytest.raises(TypeError, match="yarn: unknown parameter 'cache_rotation'"):
        rope_patch.as_scheme("yarn", factor=4, cache_rotation="consistent")


def test_backends_that_cannot_rotate_inside_attention_are_refused_before_the_model_is_touched():
    model = tiny_model(attn_implementation="sdpa")
    model.generation_config.cache_implementation = "static"
    ids = _ids(L)
    before = logits(model, ids)
    with pytest.raises(ValueError, match="dynamic: generation_config.cache_implementation='static' is not supported"):
        rope_patch.apply(model, "dynamic", factor=4.0, cache_rotation="consistent")
    assert rope_patch.current(model) is None and torch.equal(logits(model, ids), before)


def test_consistent_survives_save_and_reload(tmp_path):
    model = tiny_model()
    rope_patch.apply(model, "dynamic_yarn", factor=4.0, cache_rotation="consistent")
    ids = _ids(2 * L)
    ref = logits(model, ids)
    rope_patch.save_pretrained(model, tmp_path)
    loaded = rope_patch.from_pretrained(tmp_path)
    assert rope_patch.current(loaded).cache_rotation == "consistent"
    # from_pretrained picks sdpa (rope_patch_blocked), the original ran eager (rope_patch_dense): rounding only
    assert (logits(loaded.eval(), ids) - ref).abs().max() <= 1e-5
