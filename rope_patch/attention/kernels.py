"""The fused-attention kernels the backends and the rules share: torch's CPU flash kernel, which also returns the
log-sum-exp, over a range of keys (`flash_partial`, `flash_causal_partial` for the diagonal block,
`flash_distance_partial` with a bias of the distance alone), each as a `Partial` for `merge`."""

from __future__ import annotations

import torch
from torch import nn

from .protocol import AttentionCall, Partial


def _flash_lse_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _padded(v: torch.Tensor, d: int) -> torch.Tensor:
    """Values zero-padded to the query/key head size d: torch's CPU flash kernel wants one head size (MLA's values
    are narrower than its queries and keys); the padded output columns are 0 and are cut off again."""
    return v if v.shape[-1] == d else nn.functional.pad(v, (0, d - v.shape[-1]))


def flash_partial(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None = None, dead: torch.Tensor | None = None) -> Partial:
    """Fused attention of q (b, Hkv, G, r, d) over all of k (b, Hkv, n, d), v (b, Hkv, n, dv): torch's CPU flash
    kernel, which also returns the log-sum-exp. The rows are independent, so the G query heads of a kv head are folded
    into the rows: GQA without repeating K/V. `mask`: additive float (1, Hkv|1, G|1, r, n) (−inf = excluded; the
    kernel broadcasts a mask of one head over the heads). A row it excludes entirely comes back with lse = −inf, i.e.
    weight 0 in `merge`; `dead`, (r,) bool, names those rows where the caller knows them (else they are read from
    the mask)."""
    b, hkv, g, r, dq = q.shape
    dv = v.shape[-1]
    if mask is not None:
        if dead is None:
            dead = torch.isneginf(mask).all(-1).expand(-1, hkv, g, r).reshape(-1, hkv * g, r)
        mask = mask.expand(*mask.shape[:2], g, r, mask.shape[-1]).reshape(mask.shape[0], mask.shape[1], g * r, -1)
    out, lse = _flash_lse_op()(q.reshape(b, hkv, g * r, dq), k, _padded(v, dq), attn_mask=mask, scale=call.scaling)[:2]
    out, lse = out[..., :dv].float().reshape(b, hkv * g, r, -1), lse.float().reshape(b, hkv * g, r)
    if mask is not None:  # the kernel reports a fully excluded row as lse = 0, out = 0: make its weight 0
        lse = lse.masked_fill(dead, float("-inf"))
    return out, lse


def flash_causal_partial(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
    """As `flash_partial` for the diagonal block (queries and keys are the same r slots): causal, square; the
    kernel's causal mask needs one row per query, so K/V are repeated here (r keys only)."""
    b, hkv, g, r, dq = q.shape
    dv = v.shape[-1]
    k, v = _repeat(k, g), _repeat(_padded(v, dq), g)
    out, lse = _flash_lse_op()(q.reshape(b, hkv * g, r, dq), k, v, is_causal=True, scale=call.scaling)[:2]
    return out[..., :dv].float(), lse.float()


def flash_distance_partial(call: AttentionCall, rows: slice, end: int, by_distance: torch.Tensor,
                           start: int = 0) -> Partial:
    """Fused attention of the query rows `rows` over key slots [start, end) with an additive bias of the distance alone:
    `by_distance` (H, q_len − 1 + k_len), contiguous, holds b_h(i − j) at column q_len − 1 + i − j (−inf for the
    future). Such a bias is a Toeplitz matrix; over the keys in reverse order it is a Hankel one, whose entry depends
    on row + column, so the kernel's additive mask is a view of the vector with row and column strides 1: nothing of
    size rows × keys is materialised and the kernel runs at the model's head size, the bias one add per score. The
    keys and values are reversed once per call; each of the G query heads of a kv head is one kernel call (its mask
    rows are another head's)."""
    q = call.query[:, :, :, rows]
    b, hkv, g, r, dq = q.shape
    dv = call.value.shape[-1]
    if "reversed" not in call.scratch:
        call.scratch["reversed"] = (call.key.flip(2), _padded(call.value, dq).flip(2))
    k_rev, v_rev = call.scratch["reversed"]
    n, width = k_rev.shape[2], by_distance.stride(0)
    k_rev, v_rev = k_rev[:, :, n - end:n - start], v_rev[:, :, n - end:n - start]  # key j at reversed index end − 1 − j
    # mask[a, t] = b(i − j) with i = c + a, j = end − 1 − t: column q_len − 1 + c − end + 1 + a + t of the vector
    first = by_distance.storage_offset() + call.query.shape[3] + call.first_slot(rows) - end
    outs, lses = [], []
    for group in range(g):
        mask = by_distance.as_strided((1, hkv, r, end - start), (0, g * width, 1, 1), first + group * width)
        out, lse = _flash_lse_op()(q[:, :, group], k_rev, v_rev, attn_mask=mask, scale=call.scaling)[:2]
        outs.append(out[..., :dv])
        lses.append(lse)
    return (torch.stack(outs, 2).float().reshape(b, hkv * g, r, dv),
            torch.stack(lses, 2).float().reshape(b, hkv * g, r))


def _repeat(x: torch.Tensor, g: int) -> torch.Tensor:
    """repeat_kv: (b, Hkv, n, d) → (b, Hkv·G, n, d), query head h reading kv head h // G."""
    if g == 1:
        return x
    b, hkv, n, d = x.shape
    return x[:, :, None].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)
