"""Attention functions for the attention-side schemes, registered with transformers' `AttentionInterface`.

Two functions are registered once, under names of our own (no existing key is touched):

    rope_patch_dense    eager-style: one block holding the whole score matrix; returns the attention weights
    rope_patch_blocked  sdpa-style: nothing of size L×L per head is ever held. Two paths:
                        fast (inference on CPU, no padding mask / softcap / dropout): per query block, the keys are
                        split into ranges that each need one fused flash-attention call (torch's CPU kernel, which
                        also returns the log-sum-exp) plus a narrow materialised band where the scheme varies per
                        element; the partial softmaxes are merged by log-sum-exp.
                        materialised (training, padding, softcap, other devices): query blocks of ~BLOCK_ELEMENTS
                        scores that see all their keys at once, so they need no merging and autograd works.

    rope_patch_flex     flex_attention: one `torch.nn.attention.flex_attention` call with a `score_mod` (the bias) under
                        transformers' BlockMask (causal, padding, sliding window), or two calls (near band / far part)
                        merged by log-sum-exp for the two-rotation schemes. Compiled like transformers' own flex.
    rope_patch_fa2      flash-attention-2 with `alibi_slopes` (ALiBi only; `flash_attn` on CUDA). The name avoids the
                        substring "flash": transformers rewrites such names to its kernel fallbacks.

plus the same names in `AttentionMaskInterface` (transformers' own mask function of the backend each one stands in
for: `sdpa_mask`, `flex_attention_mask`, `flash_attention_mask`), without which `create_causal_mask` returns None and
padding would be silently dropped.

The functions hold no scheme state. A patched model carries an `AttnState` on each of its attention modules (set
through the undo log), so two models in one process run different schemes through the same registered name, and a
model that is not patched never reaches these functions. The state's `scores` object (a `ScoreMod`) is the scheme:
it turns one query block into pre-softmax logits (two rotations for ReRoPE/Self-Extend, a bias for ALiBi/T5).

Positions. The KV cache of a patched model holds what the attention layers wrote: keys with the identity rotation.
With a dynamic cache (full or sliding-window layers) the keys are contiguous in position and end with the current
queries, so the relative distance of query row r to key slot j is `k_len − q_len + r − j`, with or without left
padding. Absolute positions (needed by Self-Extend's floor) add a per-row offset read from `position_ids`. Static
caches break the contiguity (keys are padded to the maximum length); the schemes refuse them
(schemes/common.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable

import torch
import transformers
from torch import nn
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, flex_attention_mask, sdpa_mask

from .rotary import unpatched_forward

DENSE = "rope_patch_dense"
BLOCKED = "rope_patch_blocked"
FLEX = "rope_patch_flex"
FA2 = "rope_patch_fa2"
STATE = "_rope_patch_attn"  # attribute on each attention module of a patched model

# Scores per query block in the blocked function (b × heads × block × keys). 2**22 fp32 = 16 MiB: at L = 16384 with
# 4 heads a block is 64 queries, few enough blocks that the Python loop costs nothing next to the matmuls.
BLOCK_ELEMENTS = 1 << 22
FAST_BLOCK: int | None = None  # query rows per block on the fused fast path; None: the scheme's choice
# flex_attention through torch.compile (transformers' compiled singleton), as transformers' own flex backend does.
# False runs flex eagerly: exact, but it materialises the scores (debugging / tests on CPU, where the compiled kernel
# is refused at apply(): schemes/common.py).
FLEX_COMPILE = True
FLASH_DEVICES = ("cuda",)  # devices on which flash_attn's kernels run


class ScoreMod:
    """What a scheme changes in attention: pre-softmax logits for one block of queries.

    `begin(call)` runs once per attention call (rotate the keys once, not once per block).
    `logits(call, rows, start, e)` returns float32 scores (b, Hkv, G, len(rows), e − start) of the query rows `rows`
    (a slice) against key slots [start, e), before the mask: scaling, softcapping and any additive bias applied.
    `fast(call, rows, e)` (optional) returns the same attention as a list of `Partial`s, the long far-away part
    through a fused kernel; None means "use logits"."""

    def begin(self, call: Call) -> None:
        pass

    def logits(self, call: Call, rows: slice, start: int, e: int) -> torch.Tensor:
        raise NotImplementedError

    def fast(self, call: Call, rows: slice, e: int) -> list[Partial] | None:
        return None

    def fast_rows(self, heads: int) -> int:
        """Query rows per block on the fast path (`heads` = batch × query heads)."""
        return 256

    # flex_attention: `flex(call, block_mask)` → out (b, H, q, d). `flex_lse`: whether it merges partial softmaxes,
    # which needs flex's log-sum-exp (not available from the compiled CPU kernel in torch ≤ 2.13).
    flex_lse: bool = False

    def flex(self, call: Call, block_mask) -> torch.Tensor:
        raise NotImplementedError

    def flash_slopes(self, device) -> torch.Tensor | None:
        """(H,) float32 ALiBi slopes for flash_attn's `alibi_slopes`, or None: the scheme has no flash-attention form."""
        return None


def fit_rows(heads: int, extra: int, cap: int = 1024) -> int:
    """The largest power-of-two block (64 ≤ r ≤ cap) whose materialised band, heads × r × (r + extra) numbers, fits
    in BLOCK_ELEMENTS: big blocks mean few kernel calls, the budget keeps the band small for many heads."""
    r = 64
    while r * 2 <= cap and heads * (r * 2) * (r * 2 + extra) <= BLOCK_ELEMENTS:
        r *= 2
    return r


@dataclasses.dataclass
class AttnState:
    scores: ScoreMod
    block_elements: int | None = None  # None: module-level BLOCK_ELEMENTS (read at call time, tests shrink it)

    def __setstate__(self, state):
        # A patched model unpickled in a fresh process (torch.load) finds its attention functions registered.
        self.__dict__.update(state)
        register()


@dataclasses.dataclass
class Call:
    """One attention call, laid out for GQA without expanding K/V: queries (b, Hkv, G, q, d)."""

    module: nn.Module
    query: torch.Tensor  # (b, Hkv, G, q, d)
    key: torch.Tensor  # (b, Hkv, k, d)
    value: torch.Tensor  # (b, Hkv, k, d)
    scaling: float
    softcap: float | None
    q_slot: torch.Tensor  # (q,) key-slot index of each query row: k_len − q_len + r
    offset: torch.Tensor  # (b|1, 1) true position minus slot index, per row (0 without left padding)
    scratch: dict = dataclasses.field(default_factory=dict)  # per-call values a ScoreMod computes in begin()

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q (b, Hkv, G, r, d) · k (b, Hkv, e, d)ᵀ → float32 (b, Hkv, G, r, e), scaled and softcapped. G is folded
        into the row dimension so the kv heads are never repeated (repeat_kv semantics: head h reads kv head h // G)."""
        b, hkv, g, r, d = q.shape
        s = torch.matmul(q.reshape(b, hkv, g * r, d), k.transpose(-1, -2)).view(b, hkv, g, r, -1)
        s = s.float() * self.scaling
        if self.softcap is not None:  # Gemma 2: logits ← c·tanh(logits / c), before bias and mask
            s = torch.tanh(s / self.softcap) * self.softcap
        return s

    def distance(self, rows: slice, start: int, e: int) -> torch.Tensor:
        """(r, e − start) int64: i − j for query rows `rows` and key slots [start, e) (negative = future)."""
        return self.q_slot[rows, None] - torch.arange(start, e, device=self.q_slot.device)

    def first_slot(self, rows: slice) -> int:
        return self.key.shape[2] - self.query.shape[3] + rows.start


# ---- fast path: partial softmaxes merged by log-sum-exp --------------------------------------------------------------
Partial = tuple  # (out (b, H, r, d) float32, lse (b, H, r) float32): softmax-weighted values over a subset of keys


def merge(parts: list[Partial]) -> torch.Tensor:
    """softmax over the union of disjoint key sets: Σ_p e^(lse_p − M)·out_p / Σ_p e^(lse_p − M). A row that no part
    covers (a padding query under a flex BlockMask: every lse = −inf) comes out 0, not NaN."""
    if len(parts) == 1:
        return parts[0][0]
    top = torch.stack([lse for _, lse in parts]).amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = [torch.exp(lse - top)[..., None] for _, lse in parts]
    total = sum(weights)
    return sum(w * o for w, (o, _) in zip(weights, parts, strict=True)) / total.clamp_min(torch.finfo(total.dtype).tiny)


def _flash_lse_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def flash_partial(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  mask: torch.Tensor | None = None) -> Partial:
    """Fused attention of q (b, Hkv, G, r, d′) over all of k, v (b, Hkv, n, d′): torch's CPU flash kernel, which
    also returns the log-sum-exp. The rows are independent, so the G query heads of a kv head are folded into the
    rows: GQA without repeating K/V. `mask`: additive float (1, Hkv, G, r, n) (−inf = excluded); a row it excludes
    entirely comes back with lse = −inf, i.e. weight 0 in `merge`."""
    b, hkv, g, r, dq = q.shape
    if mask is not None:
        mask = mask.reshape(mask.shape[0], hkv, g * r, -1)
    out, lse = _flash_lse_op()(q.reshape(b, hkv, g * r, dq), k, v, attn_mask=mask,
                               scale=call.scaling if scale is None else scale)[:2]
    out, lse = out.float().reshape(b, hkv * g, r, -1), lse.float().reshape(b, hkv * g, r)
    if mask is not None:  # the kernel reports a fully excluded row as lse = 0, out = 0: make its weight 0
        lse = lse.masked_fill(torch.isneginf(mask).all(-1).reshape(mask.shape[0], hkv * g, r), float("-inf"))
    return out, lse


def flash_causal_partial(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None) -> Partial:
    """As `flash_partial` for the diagonal block (queries and keys are the same r slots): causal, square; the
    kernel's causal mask needs one row per query, so K/V are repeated here (r keys only)."""
    b, hkv, g, r, dq = q.shape
    k, v = _repeat(k, g), _repeat(v, g)
    out, lse = _flash_lse_op()(q.reshape(b, hkv * g, r, dq), k, v, is_causal=True,
                               scale=call.scaling if scale is None else scale)[:2]
    return out.float(), lse.float()


def band_partial(call: Call, s: torch.Tensor, rows: slice, start: int, e: int) -> Partial:
    """Materialised scores s (b, Hkv, G, r, e − start) of a narrow key band, causal-masked, as a Partial."""
    b, hkv, g, r, w = s.shape
    s = s.masked_fill(call.distance(rows, start, e) < 0, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).to(call.value.dtype)
    out = torch.matmul(p.view(b, hkv, g * r, w), call.value[:, :, start:e]).view(b, hkv * g, r, -1)
    return out.float(), lse.reshape(b, hkv * g, r)


def _repeat(x: torch.Tensor, g: int) -> torch.Tensor:
    """repeat_kv: (b, Hkv, n, d) → (b, Hkv·G, n, d), query head h reading kv head h // G."""
    if g == 1:
        return x
    b, hkv, n, d = x.shape
    return x[:, :, None].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)


def _offsets(position_ids: torch.Tensor | None, q_slot: torch.Tensor) -> torch.Tensor:
    """Per row: true position − slot index. Read at the row's largest position id (a real token under left padding,
    where generate gives pads position 1, and under right padding)."""
    if position_ids is None:
        return torch.zeros(1, 1, dtype=torch.long, device=q_slot.device)
    pos = position_ids.long().reshape(-1, position_ids.shape[-1])
    r = pos.argmax(-1, keepdim=True)
    return pos.gather(-1, r) - q_slot[r]


def _mask_block(attention_mask, call: Call, rows: slice, e: int):
    """(b|1, 1, 1, r, e) bool 'may attend' or float additive mask for one block; causal when no mask was built."""
    if attention_mask is None:
        return (call.distance(rows, 0, e) >= 0).view(1, 1, 1, -1, e)
    m = attention_mask[:, :, rows, :e]
    return m.unsqueeze(2)


def _state(module) -> AttnState:
    state: AttnState | None = getattr(module, STATE, None)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} runs the rope_patch attention function but carries no rope_patch state: the "
            "attention implementation was set by hand. Use rope_patch.apply(model, scheme) / rope_patch.remove(model)."
        )
    return state


def _call(module, query, key, value, scaling, softcap, position_ids) -> Call:
    b, h, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    if h % hkv:
        raise ValueError(f"{h} query heads cannot share {hkv} key/value heads")
    q_slot = torch.arange(k_len - q_len, k_len, device=query.device)
    return Call(module, query.view(b, hkv, h // hkv, q_len, d), key, value, scaling if scaling is not None else d**-0.5,
                softcap, q_slot, _offsets(position_ids, q_slot))


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                      *, dense: bool, **kwargs):
    """transformers attention-function signature: query (b, H, q, d), key/value (b, Hkv, k, d) →
    (out (b, q, H, d), weights (b, H, q, k) for the dense variant, else None)."""
    state = _state(module)
    b, h, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    if attention_mask is not None and attention_mask.shape[-1] != k_len:
        raise ValueError(f"attention mask covers {attention_mask.shape[-1]} keys but there are {k_len}")
    call = _call(module, query, key, value, scaling, softcap, kwargs.get("position_ids"))
    state.scores.begin(call)

    budget = state.block_elements or BLOCK_ELEMENTS
    # The fused fast path (log-sum-exp merging) serves inference without padding mask, softcap or dropout on CPU;
    # everything else takes the materialised-block path, which autograd can differentiate.
    fast = (not dense and attention_mask is None and softcap is None and not (dropout and module.training)
            and not torch.is_grad_enabled() and query.device.type == "cpu" and _flash_lse_op() is not None)
    if dense:
        block = q_len
    elif fast:  # only a narrow band is materialised per block: the scheme picks the block that balances the two
        block = min(q_len, FAST_BLOCK or state.scores.fast_rows(b * h))
    else:
        block = max(1, min(q_len, budget // max(1, b * h * k_len)))
    out = query.new_empty(b, hkv, h // hkv, q_len, d)
    weights = []
    for r0 in range(0, q_len, block):
        rows = slice(r0, min(q_len, r0 + block))
        e = call.first_slot(rows) + (rows.stop - rows.start)  # causal: later keys are masked for the whole block
        parts = state.scores.fast(call, rows, e) if fast else None
        if parts is not None:
            out[:, :, :, rows] = merge(parts).view(b, hkv, h // hkv, -1, d)
            continue
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            e = k_len  # a custom additive mask may open any key
        s = state.scores.logits(call, rows, 0, e)
        m = _mask_block(attention_mask, call, rows, e)
        if m.dtype == torch.bool:
            # finfo.min rather than -inf: a fully masked row (a left-pad query) stays finite, as in transformers
            s = s.masked_fill(~m, torch.finfo(s.dtype).min)
        else:
            s = s + m.float()
        p = torch.softmax(s, dim=-1).to(value.dtype)
        if dropout and module.training:
            p = nn.functional.dropout(p, p=dropout, training=True)
        pv = p.view(b, hkv, -1, e)  # (b, Hkv, G·r, e)
        block_out = torch.matmul(pv, value[:, :, :e]).view(b, hkv, h // hkv, -1, d)
        if dense:
            out = block_out  # one block: no copy (and autograd sees no in-place write)
            weights.append(p.reshape(b, h, -1, e))
        else:
            out[:, :, :, rows] = block_out
        del s, p, pv
    out = out.reshape(b, h, q_len, d).transpose(1, 2).contiguous()
    return out, (weights[0] if dense else None)


def dense_attention(module, query, key, value, attention_mask, **kwargs):
    return attention_forward(module, query, key, value, attention_mask, dense=True, **kwargs)


def blocked_attention(module, query, key, value, attention_mask, **kwargs):
    return attention_forward(module, query, key, value, attention_mask, dense=False, **kwargs)


# ---- flex_attention ---------------------------------------------------------------------------------------------
def flex_available() -> bool:
    return transformers.utils.is_torch_flex_attn_available()


def flex_call(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, score_mod=None,
              lse: bool = False):
    """flex_attention of q (b, H, q, d) over k, v (b, Hkv, k, d) (GQA inside the kernel) with the call's scale and
    softcap (before `score_mod`, as in `Call.qk`). Compiled through transformers' singleton (the same compiled
    function its own flex backend uses) unless FLEX_COMPILE is off. Returns out (b, H, q, d), or the Partial
    (out float32, lse float32) when `lse`; a row the mask excludes entirely comes back with out 0, lse −inf."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations.flex_attention import compile_friendly_flex_attention, get_flex_attention_lse_kwargs

    softcap = call.softcap

    def mod(score, b, h, qi, kv):
        if softcap is not None:  # Gemma 2: c·tanh(s / c) before any bias, as the eager path
            score = torch.tanh(score / softcap) * softcap
        return score if score_mod is None else score_mod(score, b, h, qi, kv)

    kwargs = dict(score_mod=mod, block_mask=block_mask, scale=call.scaling, enable_gqa=q.shape[1] != k.shape[1],
                  **get_flex_attention_lse_kwargs(lse))
    if FLEX_COMPILE:
        result = compile_friendly_flex_attention(q, k, v, training=call.module.training, **kwargs)
    else:
        result = flex_attention(q, k, v, **kwargs)
    if not lse:
        return result
    out, aux = result
    aux_lse = getattr(aux, "lse", aux)  # torch ≥ 2.9: AuxOutput(lse=...); before: the tensor itself
    return out.float(), aux_lse.float()


def causal_block_mask(call: Call):
    """The BlockMask transformers would build for plain causal attention (queries are the last q slots)."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_len, k_len = call.query.shape[3], call.key.shape[2]
    first = torch.tensor(k_len - q_len, device=call.key.device)

    def causal(b, h, qi, kv):
        return qi + first >= kv

    return create_block_mask(causal, None, None, q_len, k_len, device=call.key.device)


def restrict_block_mask(block_mask, call: Call, window: int, near: bool):
    """`block_mask` ∧ (i − j < W if near else i − j ≥ W), i − j in key slots. The element rule is the mask_mod;
    the block list is the original one minus the blocks that hold no element of the region (judged from each
    block's smallest / largest distance), so the near call only visits the diagonal band and the far call the
    rest. All kept blocks are partial (mask_mod evaluated): a block that was full may now be cut by the band."""
    from torch.nn.attention.flex_attention import BlockMask

    q_len, k_len = call.query.shape[3], call.key.shape[2]
    dev = call.key.device
    first, w = torch.tensor(k_len - q_len, device=dev), torch.tensor(window, device=dev)
    base = block_mask.mask_mod

    def mask_mod(b, h, qi, kv):
        dist = qi + first - kv
        return base(b, h, qi, kv) & ((dist < w) if near else (dist >= w))

    qb, kb = block_mask.BLOCK_SIZE
    dense = block_mask.to_dense().bool()  # (B, H, q blocks, kv blocks): partial ∪ full
    q0 = torch.arange(dense.shape[-2], device=dev)[:, None] * qb + (k_len - q_len)
    k0 = torch.arange(dense.shape[-1], device=dev)[None, :] * kb
    region = (q0 - (k0 + kb - 1) < window) if near else (q0 + qb - 1 - k0 >= window)
    dense = dense & region
    num = dense.sum(-1, dtype=torch.int32)
    order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(num, order, BLOCK_SIZE=block_mask.BLOCK_SIZE, mask_mod=mask_mod,
                                    seq_lengths=(q_len, k_len))


def flex_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """transformers attention-function signature on top of flex_attention: `attention_mask` is transformers' BlockMask
    (causal, padding, sliding window) from `flex_attention_mask`. Returns (out (b, q, H, d), None)."""
    from torch.nn.attention.flex_attention import BlockMask

    state = _state(module)
    if dropout and module.training:
        raise ValueError("flex_attention does not support attention dropout (as in transformers): use model.eval() or "
                         "set the config's attention_dropout to 0.")
    if attention_mask is not None and not isinstance(attention_mask, BlockMask):
        raise ValueError(f"the flex_attention backend expects a BlockMask, got {type(attention_mask).__name__}: pass "
                         "a 2-D padding mask and let transformers build it, or use the sdpa backend for custom masks.")
    call = _call(module, query, key, value, scaling, softcap, kwargs.get("position_ids"))
    state.scores.begin(call)
    block_mask = attention_mask if attention_mask is not None else causal_block_mask(call)
    out = state.scores.flex(call, block_mask)
    return out.to(value.dtype).transpose(1, 2).contiguous(), None


# ---- flash-attention-2 (ALiBi) ---------------------------------------------------------------------------------
def flash_module():
    """The `flash_attn` package, or None when it cannot be imported."""
    if "flash_attn" in sys.modules:
        return sys.modules["flash_attn"]
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
    state = _state(module)
    fa = flash_module()
    slopes = state.scores.flash_slopes(query.device)
    b, h, q_len, d = query.shape
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # flash layout (b, n, heads, d)
    common = dict(dropout_p=dropout if module.training else 0.0, softmax_scale=scaling, causal=True, alibi_slopes=slopes)
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


# backend the model had -> our function's name
BACKENDS = {"eager": DENSE, "sdpa": BLOCKED, "flex_attention": FLEX, "flash_attention_2": FA2}
_FUNCTIONS = {DENSE: (dense_attention, sdpa_mask), BLOCKED: (blocked_attention, sdpa_mask),
              FLEX: (flex_forward, flex_attention_mask), FA2: (fa2_forward, flash_attention_mask)}


def register() -> None:
    """Register our functions and their mask functions (idempotent; new keys only)."""
    for name, (fn, mask) in _FUNCTIONS.items():
        if transformers.AttentionInterface._global_mapping.get(name) is not fn:
            transformers.AttentionInterface.register(name, fn)
        if AttentionMaskInterface._global_mapping.get(name) is not mask:
            AttentionMaskInterface.register(name, mask)


# ---- rotation helpers (deferred RoPE) -----------------------------------------------------------------------------
@dataclasses.dataclass
class Rotation:
    """The model's own RoPE, callable at any (also fractional) positions: its rotary module's own (class) forward
    (inv_freq, attention_scaling, dynamic/longrope updates) and its modeling file's `apply_rotary_pos_emb`
    (rotate_half or interleaved convention, partial rotary). Holds the module, not a bound method of an instance
    override, so a copied or pickled model rotates with its own rotary."""

    rotary: nn.Module
    apply_rotary: Callable
    layer_type: str | None = None  # per-layer-type rotaries (Gemma 3): which frequencies

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (b, heads, n, d) rotated to positions (b|1, n)."""
        extra = () if self.layer_type is None else (self.layer_type,)
        cos, sin = unpatched_forward(self.rotary, x, positions, *extra)
        return self.apply_rotary(x, x[:, :1], cos, sin)[0]  # the function rotates a (q, k) pair: k is a dummy


def floor_div(x: torch.Tensor, g: int) -> torch.Tensor:
    return torch.div(x, g, rounding_mode="floor")
