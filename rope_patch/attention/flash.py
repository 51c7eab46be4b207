"""The flash-attention-2 stand-in: ALiBi through flash_attn's `alibi_slopes` (the only scheme with a flash form).
The registered name avoids the substring "flash": transformers rewrites such names to its kernel fallbacks."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from .calls import stand_in
from .protocol import STATE


def flash_module():
    """The `flash_attn` package (the one already imported, if any), or None when it cannot be imported."""
    try:
        return importlib.import_module("flash_attn")
    except ImportError:
        return None


def _unpad(x: torch.Tensor, keep: torch.Tensor):
    """x (b, n, heads, d), keep (b, n) bool → (rows (Σn, heads, d), flat indices, cu_seqlens int32, max_seqlen)."""
    idx = keep.flatten().nonzero().squeeze(-1)
    lens = keep.sum(-1, dtype=torch.int32)
    cu = nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    return x.reshape(-1, *x.shape[2:])[idx], idx, cu, int(lens.max())


def fa2_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                sliding_window=None, **kwargs):
    """ALiBi through flash-attention-2 (Dao 2023, arXiv:2307.08691; `alibi_slopes` as in flash_attn ≥ 2.4, which adds
    −slope_h·|i + k_len − q_len − j| to the score of query i and key j, i.e. the same −m_h·(i − j) in key slots for
    causal attention). `attention_mask` is transformers' `flash_attention_mask`: None without padding
    (`flash_attn_func`), else the 2-D mask of real tokens (unpadded `flash_attn_varlen_func`, per sequence
    bottom-right aligned, so left and right padding both keep slot distances). Returns (out (b, q, H, d), None)."""
    state = getattr(module, STATE, None)
    if state is None:  # a module the patch leaves alone (no positions): attention as the model has it
        return stand_in("flash_attention_2", module)(module, query, key, value, attention_mask, dropout=dropout,
                                                     scaling=scaling, softcap=softcap, sliding_window=sliding_window,
                                                     **kwargs)
    if state.recorder is not None:  # the apply-time check (plumbing.py)
        state.recorder.seen(query, key, value)
    fa = flash_module()
    b, h, q_len, d = query.shape
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # flash layout (b, n, heads, d)
    common = dict(dropout_p=dropout if module.training else 0.0, softmax_scale=scaling, causal=True,
                  alibi_slopes=state.scores.flash_slopes(query.device, h))
    if sliding_window is not None and key.shape[2] > sliding_window:  # as transformers' flash path
        common["window_size"] = (sliding_window - 1, sliding_window - 1)
    if softcap is not None:
        common["softcap"] = softcap
    if attention_mask is None:
        return fa.flash_attn_func(q, k, v, **common), None
    keep_k = attention_mask[:, -key.shape[2]:].bool()
    q_rows, q_idx, cu_q, max_q = _unpad(q, keep_k[:, -q_len:])
    k_rows, _, cu_k, max_k = _unpad(k, keep_k)
    v_rows = _unpad(v, keep_k)[0]
    out = fa.flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                    max_seqlen_k=max_k, **common)
    full = out.new_zeros(b * q_len, h, d)
    full[q_idx] = out
    return full.view(b, q_len, h, d), None
