"""rope_patch_windowed (attention/windowed.py): sliding-window layers computed per query block over their window only.
Equal to transformers' own path at short lengths (the window smaller than the input), with and without padding and
with a cache; the model switched back exactly; and, by the shapes it hands torch, no L×L mask or score matrix. Patched
models too: every attention-side scheme equal to its own blocked path, its scores asked for the window's keys only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import tiny_model
from transformers.modeling_outputs import CausalLMOutputWithPast

import rope_patch
from rope_patch.attention import windowed as w

CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
HYBRID = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
# (arch, overrides, the reference implementation): Gemma 3 (sdpa), Gemma 2's soft-capped scores (eager: sdpa refuses
# softcap), Qwen2 with a sliding layer (GQA 2:1)
CASES = {
    "gemma3": ("gemma3_text", HYBRID, "sdpa"),
    "gemma2_softcap": ("gemma2", dict(HYBRID, attn_logit_softcapping=5.0), "eager"),
    "qwen2": ("qwen2", dict(HYBRID, use_sliding_window=True, max_window_layers=0), "sdpa"),
}


def _model(case):
    arch, overrides, impl = CASES[case]
    model = tiny_model(arch, attn_implementation=impl, initializer_range=0.1, **overrides)
    assert any(getattr(m, "sliding_window", None) == 8 for m in model.modules()), "the case has no sliding layer"
    return model


@pytest.mark.parametrize("case", CASES)
def test_equal_to_the_default_path(case):
    model = _model(case)
    torch.manual_seed(0)
    ids = torch.randint(3, 97, (2, 80))  # 10 windows, several query blocks
    with torch.no_grad():
        want = model(ids).logits
        with w.windowed(model):
            got = model(ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert model.config._attn_implementation == CASES[case][2]


def test_left_padding_equal_on_the_real_tokens():
    model = _model("gemma3")
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (2, 60))
    mask = torch.ones_like(ids)
    mask[0, :13] = 0  # row 0 left-padded: its mask is transformers' own, sliced per block
    ids[0, :13] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        want = model(ids, attention_mask=mask, position_ids=pos).logits
        with w.windowed(model):
            got = model(ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    assert torch.isfinite(got[real]).all()
    assert (got[real] - want[real]).abs().max().item() <= 1e-5


def test_cached_prefill_then_chunk_and_decoding():
    """A prompt, then a 20-token chunk and single tokens on its cache: the sliding cache layer keeps window − 1 keys,
    the queries are the last slots."""
    model = _model("gemma3")
    torch.manual_seed(2)
    ids = torch.randint(3, 97, (1, 64))

    def run():
        with torch.no_grad():
            out = model(ids[:, :40], use_cache=True)
            cache = {CACHE: getattr(out, CACHE)}  # under the installed transformers' name (cache from 5.24)
            parts = [out.logits, model(ids[:, 40:60], use_cache=True, **cache).logits]
            for t in range(60, 64):
                parts.append(model(ids[:, t:t + 1], use_cache=True, **cache).logits)
        return torch.cat(parts, dim=1)

    want = run()
    with w.windowed(model):
        got = run()
    assert (got - want).abs().max().item() <= 1e-5


def _probe(model, length):
    """Shapes of what one forward hands torch's sdpa (masks, keys) and the masks the attention modules receive."""
    seen = {"sdpa": [], "masks": []}
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen["sdpa"].append((tuple(k.shape), None if attn_mask is None else tuple(attn_mask.shape)))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    def hook(module, args, kwargs):
        m = kwargs.get("attention_mask")
        seen["masks"].append((module.sliding_window, None if m is None else tuple(m.shape)))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    mp = pytest.MonkeyPatch()
    mp.setattr(F, "scaled_dot_product_attention", spy)
    try:
        with torch.no_grad():
            model(torch.randint(3, 97, (1, length)), use_cache=False)
    finally:
        mp.undo()
        for h in handles:
            h.remove()
    return seen


def test_no_length_squared_mask_or_scores():
    window, length = 64, 4096
    model = tiny_model("gemma3_text", attn_implementation="sdpa", **dict(HYBRID, sliding_window=window))
    # the probe sees the problem on the default path: the sliding layer's (1, 1, L, L) mask
    default = _probe(model, 256)
    assert (64, (1, 1, 256, 256)) in default["masks"]
    with w.windowed(model):
        seen = _probe(model, length)
    assert seen["masks"] == [(window, None), (None, None)]  # no mask at all: the window is rebuilt per block
    rows = w.block_rows(1, 4, length, window)
    sliding = [(k, m) for k, m in seen["sdpa"] if m is not None]
    assert len(sliding) == -(-length // rows)  # one call per query block
    for k_shape, m_shape in sliding:
        assert k_shape[2] <= rows + window - 1 and m_shape[-1] == k_shape[2] and m_shape[-2] <= rows
    full = [(k, m) for k, m in seen["sdpa"] if m is None]
    assert full == [((1, 2, length, 16), None)]  # the global layer: one is_causal call (GQA kept), no mask
    biggest = max(m[-1] * m[-2] for _, m in sliding)
    assert biggest * 4 < length * length * 4 / 100  # each block's mask < 1 % of an L×L one


def test_refusals_leave_the_model_alone():
    model = tiny_model("gemma3_text", attn_implementation="sdpa", **HYBRID)
    rope_patch.apply(model, "logn")  # wraps the attention function: not switched
    impl = model.config._attn_implementation
    with pytest.raises(ValueError, match=f"implementation is '{impl}', expected one of sdpa, eager, "
                                         "rope_patch_blocked"):
        with w.windowed(model):
            pass
    assert model.config._attn_implementation == impl
    plain = tiny_model("gemma3_text", attn_implementation="sdpa", **HYBRID)
    with pytest.raises(RuntimeError, match="inside"):
        with w.windowed(plain):
            assert plain.config._attn_implementation == w.WINDOWED
            raise RuntimeError("inside")
    assert plain.config._attn_implementation == "sdpa"  # put back on error too


# Schemes at settings for the tiny model's window (32), past the sliding window (8) and the input (80 tokens)
PATCHED = {
    "yarn": {"factor": 4.0},  # a frequency scheme: the model stays on sdpa, switched as an unpatched one
    "alibi": {},
    "relative_bias": {"init": "alibi", "num_buckets": 16, "max_distance": 64},
    "self_extend": {"group_size": 4, "window_size": 16},
    "self_extend_logistic": {"group_size": 4, "window_size": 16, "growth_rate": 0.01},
    "rerope": {"window_size": 16},
    "leaky_rerope": {"window_size": 16, "factor": 16.0},
    "string": {"shift_size": 20, "window_size": 6},
    "dca": {"chunk_size": 24, "local_size": 4},
    "dpe": {"group_sizes": [4] * 8, "window_size": 8},
    "ms_poe": {},
    "sink": {"sink_size": 4, "window_size": 28},
    "nope": {},
}


@pytest.mark.parametrize("scheme", PATCHED)
def test_patched_equal_to_its_blocked_path(scheme):
    """A patched model windowed: its scheme's scores over each block's window only, equal to the scheme on its own
    path (the L×L mask) to 1e-5; the implementation it had afterwards."""
    model = tiny_model("gemma3_text", attn_implementation="sdpa", initializer_range=0.1, **HYBRID)
    rope_patch.apply(model, scheme, **PATCHED[scheme])
    impl = model.config._attn_implementation
    torch.manual_seed(4)
    ids = torch.randint(3, 97, (2, 80))
    with torch.no_grad():
        want = model(ids).logits
        with w.windowed(model):
            assert model.config._attn_implementation == w.SWITCH[impl]
            got = model(ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert model.config._attn_implementation == impl


@pytest.mark.parametrize("scheme", ["rerope", "dca", "sink"])
def test_patched_scores_span_the_window_only(monkeypatch, scheme):
    """The scheme's scores are asked for the key slots of each block's window only (the L×L mask's path asks for
    every key up to the block's last)."""
    model = tiny_model("gemma3_text", attn_implementation="sdpa", initializer_range=0.1, **HYBRID)
    rope_patch.apply(model, scheme, **PATCHED[scheme])
    spans = []
    for module in model.modules():
        state = getattr(module, w.STATE, None)
        if state is not None and getattr(module, "sliding_window", None):
            real = state.scores.logits

            def logits(call, rows, start, end, real=real):
                spans.append((rows.stop - rows.start, end - start))
                return real(call, rows, start, end)

            monkeypatch.setattr(state.scores, "logits", logits)
    assert spans == [] and any(getattr(m, w.STATE, None) is not None for m in model.modules())
    with torch.no_grad(), w.windowed(model):
        model(torch.randint(3, 97, (1, 80)))
    if not spans:
        pytest.skip(f"{scheme} leaves the sliding layers alone (they run windowed_attention)")
    assert all(keys <= rows + 8 - 1 for rows, keys in spans) and max(k for _, k in spans) < 80


@pytest.mark.parametrize("scheme", ["rerope", "alibi"])
def test_patched_cached_decoding(scheme):
    model = tiny_model("gemma3_text", attn_implementation="sdpa", initializer_range=0.1, **HYBRID)
    rope_patch.apply(model, scheme, **PATCHED[scheme])
    torch.manual_seed(5)
    ids = torch.randint(3, 97, (1, 48))

    def run():
        with torch.no_grad():
            out = model(ids[:, :40], use_cache=True)
            cache = {CACHE: getattr(out, CACHE)}
            parts = [out.logits] + [model(ids[:, t:t + 1], use_cache=True, **cache).logits for t in range(40, 48)]
        return torch.cat(parts, dim=1)

    want = run()
    with w.windowed(model):
        got = run()
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch, overrides, patch, switched", [
    ("gemma3_text", HYBRID, None, True),
    ("gemma3_text", HYBRID, "rerope", True),
    ("gemma3_text", HYBRID, "logn", False),  # wraps the attention function: left as it is
    ("llama", {}, None, False),  # no sliding layer
    ("gpt_oss", {}, None, False),  # attention sinks: not run by the windowed functions
])
def test_maybe_windowed(arch, overrides, patch, switched):
    model = tiny_model(arch, attn_implementation="eager" if arch == "gpt_oss" else "sdpa", **overrides)
    if patch:
        rope_patch.apply(model, patch, **PATCHED.get(patch, {}))
    impl = model.config._attn_implementation
    with w.maybe_windowed(model):
        assert (model.config._attn_implementation != impl) == switched
    assert model.config._attn_implementation == impl


def test_attention_sinks_are_refused():
    model = tiny_model("gpt_oss", attn_implementation="eager")  # its model refuses sdpa
    with pytest.raises(ValueError, match="GptOssAttention adds attention sinks"):
        with w.windowed(model):
            pass
    assert model.config._attn_implementation == "eager"
