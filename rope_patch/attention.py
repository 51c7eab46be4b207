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

plus the same names in `AttentionMaskInterface` (transformers' own `sdpa_mask`: boolean, None when plain causal),
without which `create_causal_mask` returns None and padding would be silently dropped.

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
from collections.abc import Callable

import torch
import transformers
from torch import nn
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

DENSE = "rope_patch_dense"
BLOCKED = "rope_patch_blocked"
STATE = "_rope_patch_attn"  # attribute on each attention module of a patched model

# Scores per query block in the blocked function (b × heads × block × keys). 2**22 fp32 = 16 MiB: at L = 16384 with
# 4 heads a block is 64 queries, few enough blocks that the Python loop costs nothing next to the matmuls.
BLOCK_ELEMENTS = 1 << 22
FAST_BLOCK: int | None = None  # query rows per block on the fused fast path; None: the scheme's choice


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
    """softmax over the union of disjoint key sets: Σ_p e^(lse_p − M)·out_p / Σ_p e^(lse_p − M)."""
    if len(parts) == 1:
        return parts[0][0]
    top = torch.stack([lse for _, lse in parts]).amax(0)  # finite: the diagonal part always has a key
    weights = [torch.exp(lse - top)[..., None] for _, lse in parts]
    return sum(w * o for w, (o, _) in zip(weights, parts, strict=True)) / sum(weights)


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


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                      *, dense: bool, **kwargs):
    """transformers attention-function signature: query (b, H, q, d), key/value (b, Hkv, k, d) →
    (out (b, q, H, d), weights (b, H, q, k) for the dense variant, else None)."""
    state: AttnState | None = getattr(module, STATE, None)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} runs the rope_patch attention function but carries no rope_patch state: the "
            "attention implementation was set by hand. Use rope_patch.apply(model, scheme) / rope_patch.remove(model)."
        )
    b, h, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    if h % hkv:
        raise ValueError(f"{h} query heads cannot share {hkv} key/value heads")
    if attention_mask is not None and attention_mask.shape[-1] != k_len:
        raise ValueError(f"attention mask covers {attention_mask.shape[-1]} keys but there are {k_len}")
    q_slot = torch.arange(k_len - q_len, k_len, device=query.device)
    call = Call(module, query.view(b, hkv, h // hkv, q_len, d), key, value, scaling if scaling is not None else d**-0.5,
                softcap, q_slot, _offsets(kwargs.get("position_ids"), q_slot))
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


# backend the model had -> (our function's name, what it computes like)
BACKENDS = {"eager": DENSE, "sdpa": BLOCKED}


def register() -> None:
    """Register both functions and their mask functions (idempotent; new keys only)."""
    for name, fn in ((DENSE, dense_attention), (BLOCKED, blocked_attention)):
        if transformers.AttentionInterface._global_mapping.get(name) is not fn:
            transformers.AttentionInterface.register(name, fn)
        if AttentionMaskInterface._global_mapping.get(name) is not sdpa_mask:
            AttentionMaskInterface.register(name, sdpa_mask)


# ---- rotation helpers (deferred RoPE) -----------------------------------------------------------------------------
@dataclasses.dataclass
class Rotation:
    """The model's own RoPE, callable at any (also fractional) positions: its unpatched rotary forward (inv_freq,
    attention_scaling, dynamic/longrope updates) and its modeling file's `apply_rotary_pos_emb` (rotate_half or
    interleaved convention, partial rotary)."""

    rotary_forward: Callable
    apply_rotary: Callable

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (b, heads, n, d) rotated to positions (b|1, n)."""
        cos, sin = self.rotary_forward(x, positions)
        return self.apply_rotary(x, x[:, :1], cos, sin)[0]  # the function rotates a (q, k) pair: k is a dummy


def identity_rotary(original: Callable) -> Callable:
    """A rotary forward that returns the identity rotation (cos = 1, sin = 0) in the model's own shapes and dtype, so
    the attention layers (and the KV cache) see un-rotated queries and keys."""

    def forward(x, position_ids, *args, **kwargs):
        cos, sin = original(x, position_ids, *args, **kwargs)
        # broadcast views of one element: the identity costs no (L × d) tensors
        return cos.new_ones(()).expand_as(cos), sin.new_zeros(()).expand_as(sin)

    return forward


def floor_div(x: torch.Tensor, g: int) -> torch.Tensor:
    return torch.div(x, g, rounding_mode="floor")
