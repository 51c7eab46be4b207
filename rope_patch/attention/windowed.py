"""Sliding-window layers that compute only their window: `rope_patch_windowed`, an attention function and a mask
function registered with transformers under a name of our own, switched on per model instance by `windowed(model)`.

transformers' sdpa path hands a sliding-window layer a (b, 1, L, L) boolean mask: torch computes all L² scores and
makes a float copy of the mask (about 4 + 17 GB for Gemma 3 at L = 65,536, window 512). Here each block of query rows
[r0, r1) meets only the key slots its window reaches, [r0 − window + 1, r1): one sdpa call over a (block,
block + window − 1) mask. Full-attention layers run transformers' own sdpa function; with soft-capped scores
(Gemma 2), which sdpa refuses, they take the blocks too, causal over all keys.

The mask function returns None for a sliding layer whose mask would be only "causal within the window" (no padding,
packing or overlays, keys contiguous with the queries): the attention function builds it per block. Anything else
gets transformers' sdpa mask, sliced per block.

A model patched with an attention-side scheme on the blocked path is switched to `rope_patch_windowed_blocked`: its
sliding layers take the scheme's scores over the window's key slots only (blocked.py); the layers the scheme leaves
alone run the function above. A model patched with a frequency scheme is switched like an unpatched one.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, fast_all, prepare_padding_mask, sdpa_mask

from .blocked import attention_forward, block_rows, in_window
from .protocol import STATE
from .registration import BLOCKED
from .registration import register as register_blocked

WINDOWED = "rope_patch_windowed"
WINDOWED_BLOCKED = "rope_patch_windowed_blocked"  # a model patched on the blocked path (attention-side schemes)
# what `windowed` switches from, and to: the implementations whose sliding layers get the L×L mask
SWITCH = {"sdpa": WINDOWED, "eager": WINDOWED, BLOCKED: WINDOWED_BLOCKED}


def window_of(module, kwargs) -> int | None:
    """The layer's sliding window: the `sliding_window` the model passes to attention, else the module's attribute;
    None for a full-attention layer."""
    window = kwargs.get("sliding_window")
    return window if window is not None else getattr(module, "sliding_window", None)


def windowed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """transformers attention-function signature: query (b, H, q, d), key/value (b, Hkv, k, d) → (out (b, q, H, d),
    None). Full-attention layers: transformers' sdpa function. Sliding layers: per query block, only the keys of its
    window (module docstring)."""
    window = window_of(module, kwargs)
    if window is None and softcap is not None:  # sdpa refuses softcap: causal over all keys, in blocks, as below
        window = key.shape[2]
    if window is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      softcap=softcap, **kwargs)
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{type(module).__name__} adds attention sinks (s_aux); {WINDOWED} does not run them")
    b, h, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    if attention_mask is not None and attention_mask.shape[-1] != k_len:
        raise ValueError(f"attention mask covers {attention_mask.shape[-1]} keys but there are {k_len}")
    if scaling is None:
        scaling = d ** -0.5
    p_drop = dropout if module.training else 0.0
    offset = k_len - q_len  # query row r sits at key slot offset + r
    rows = block_rows(b, h, q_len, window)
    out = query.new_empty(b, h, q_len, value.shape[-1])
    for r0 in range(0, q_len, rows):
        r1 = min(q_len, r0 + rows)
        lo, hi = max(0, offset + r0 - window + 1), offset + r1  # the keys this block's windows reach
        if attention_mask is None:  # the causal window: (1, 1, r, hi − lo)
            m = in_window(torch.arange(offset + r0, hi, device=query.device), lo, hi, window)[None, None]
        else:  # transformers' mask (padding & co.), window included: its slice for this block
            m = attention_mask[:, :, r0:r1, lo:hi]
        q, k, v = query[:, :, r0:r1], key[:, :, lo:hi], value[:, :, lo:hi]
        if h != hkv:  # GQA: query head h reads kv head h // G (the block's keys only are repeated)
            k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
        if softcap is None:
            out[:, :, r0:r1] = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p_drop, scale=scaling)
            continue
        # soft-capped scores (Gemma 2), as the model's eager function computes them, for this block only
        s = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scaling / softcap) * softcap
        s = s.masked_fill(~m, torch.finfo(s.dtype).min) if m.dtype == torch.bool else s + m
        p = torch.softmax(s.float(), dim=-1).to(v.dtype)
        p = F.dropout(p, p=p_drop, training=p_drop > 0)
        out[:, :, r0:r1] = torch.matmul(p, v)
    return out.transpose(1, 2).contiguous(), None


def windowed_blocked(module, query, key, value, attention_mask, **kwargs):
    """The blocked function (attention/blocked.py) of a model patched with an attention-side scheme, its sliding
    layers over their window only: a patched layer runs its scheme's scores on the key slots each query block's window
    reaches; a layer the scheme leaves alone runs `windowed_attention`."""
    if getattr(module, STATE, None) is None:
        return windowed_attention(module, query, key, value, attention_mask, **kwargs)
    window = window_of(module, kwargs) if attention_mask is None else None  # a built mask holds the window itself
    return attention_forward(module, query, key, value, attention_mask, dense=False, window=window, **kwargs)


def windowed_mask(**kwargs):
    """The mask function of `rope_patch_windowed`: transformers' sdpa mask, except None for a sliding layer whose mask
    would be only the causal window (the attention function builds it per block)."""
    return None if _window_only(**kwargs) else sdpa_mask(**kwargs)


def _window_only(*, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, local_size=None,
                 allow_is_causal_skip=True, **_) -> bool:
    """Whether the mask `windowed_mask` is asked for is only "causal within the window": a sliding layer (not full
    attention; no packing or overlays, which make the pattern richer; no static cache, whose offsets are tensors)
    whose keys are contiguous in position and end with the queries (no cache, a dynamic or sliding cache layer),
    without padding."""
    static = not isinstance(q_offset, torch.Tensor) and not isinstance(kv_offset, torch.Tensor)
    if local_size is None or not allow_is_causal_skip or not static or kv_length - q_length != q_offset - kv_offset:
        return False
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    return padding is None or bool(fast_all(padding[:, kv_offset:kv_offset + kv_length]))


def register() -> None:
    """Register the functions and their mask function under WINDOWED / WINDOWED_BLOCKED (idempotent)."""
    register_blocked()
    for name, fn in ((WINDOWED, windowed_attention), (WINDOWED_BLOCKED, windowed_blocked)):
        transformers.AttentionInterface.register(name, fn)  # a dict update: registering again changes nothing
        AttentionMaskInterface.register(name, windowed_mask)


def attention_modules(model):
    """The modules that read the model's attention implementation: the ones with a `sliding_window` attribute or
    a layer type (every decoder attention module of the hybrid families)."""
    return [m for m in model.modules() if hasattr(m, "sliding_window") and hasattr(m, "config")]


def check(model) -> None:
    """ValueError unless `model` can run windowed: its implementation is sdpa or eager (unpatched, or patched with a
    frequency scheme) or rope_patch's blocked one (an attention-side scheme on sdpa); flex and flash build no L×L
    mask; and every sliding layer its config declares exposes its window."""
    impl = model.config._attn_implementation
    if impl in SWITCH.values():
        return
    if impl not in SWITCH:
        hint = ("flex and flash already skip what the window hides" if not str(impl).startswith("rope_patch")
                else "a scheme that wraps the attention function (logn) or runs the dense path")
        raise ValueError(f"windowed(): the model's attention implementation is {impl!r}, expected one of "
                         f"{', '.join(SWITCH)} ({hint}). Evaluate it without windowed().")
    sinks = [type(m).__name__ for m in attention_modules(model) if getattr(m, "sinks", None) is not None]
    if sinks:  # gpt-oss: a learned sink logit per head joins each softmax
        raise ValueError(f"windowed(): {sinks[0]} adds attention sinks, which the windowed functions do not run. "
                         "Evaluate it without windowed().")
    cfg = model.config.get_text_config()
    window = getattr(cfg, "sliding_window", None)
    types = list(getattr(cfg, "layer_types", None) or [])
    declared = sum(t == "sliding_attention" for t in types) if types else (window is not None)
    exposed = sliding_layers(model)
    if declared and exposed < declared:
        raise ValueError(f"windowed(): {type(model).__name__} declares {declared} sliding-window layer(s) (window "
                         f"{window}) but {exposed} attention module(s) expose a `sliding_window`: their window could "
                         "not be read. Evaluate it without windowed().")


@contextlib.contextmanager
def windowed(model):
    """Run `model` (this instance only) with WINDOWED for the duration of the block, then put its attention
    implementation back, also on error. A model without sliding layers runs exactly as with sdpa."""
    check(model)
    previous = model.config._attn_implementation
    register()
    model.set_attn_implementation(SWITCH.get(previous, previous))
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def sliding_layers(model) -> int:
    """How many attention modules of `model` attend within a sliding window (their `sliding_window` is set)."""
    return sum(getattr(m, "sliding_window", None) is not None for m in attention_modules(model))


def maybe_windowed(model):
    """`windowed(model)` where it applies (sliding layers, an implementation it switches), else a no-op context: the
    hook for an evaluation's forwards (perplexity, compare), which then run every model they can windowed and any other
    as it is."""
    if not sliding_layers(model):
        return contextlib.nullcontext(model)
    try:
        check(model)
    except ValueError:
        return contextlib.nullcontext(model)
    return windowed(model)
