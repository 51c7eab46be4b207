"""The sdpa and eager stand-ins: `blocked_attention` (nothing of size L×L per head is ever held) and
`dense_attention` (the same function with one block holding the whole score matrix, returning the weights as eager
attention does).

Two paths in the blocked function:
    fused         inference on CPU, no padding mask / softcap / dropout: per query block, the keys are split into
                  ranges that each need one fused flash-attention call (torch's CPU kernel, which also returns the
                  log-sum-exp) plus a narrow materialised band where the scheme varies per element; the partial
                  softmaxes are merged by log-sum-exp (`AttentionRule.fused`).
    materialised  training, padding, softcap, other devices: query blocks of ~BLOCK_ELEMENTS scores that see all their
                  keys at once, so they need no merging and autograd works (`AttentionRule.logits`).
"""

from __future__ import annotations

import torch
from torch import nn

from . import settings
from .copies import Identity, NotProven
from .protocol import STATE, AttentionCall, Partial, begin, make_call, merge, own_rows, placeholder, restack, stand_in


def _flash_lse_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _padded(v: torch.Tensor, d: int) -> torch.Tensor:
    """Values zero-padded to the query/key head size d: torch's CPU flash kernel wants one head size (MLA's values
    are narrower than its queries and keys); the padded output columns are 0 and are cut off again."""
    return v if v.shape[-1] == d else nn.functional.pad(v, (0, d - v.shape[-1]))


def flash_partial(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  mask: torch.Tensor | None = None, dead: torch.Tensor | None = None) -> Partial:
    """Fused attention of q (b, Hkv, G, r, d) over all of k (b, Hkv, n, d), v (b, Hkv, n, dv): torch's CPU flash
    kernel, which also returns the log-sum-exp. The rows are independent, so the G query heads of a kv head are folded
    into the rows: GQA without repeating K/V. `mask`: additive float (1, Hkv|1, G|1, r, n) (−inf = excluded; the
    kernel broadcasts a mask of one head over the heads); a row it excludes entirely comes back with lse = −inf,
    i.e. weight 0 in `merge`. `dead`: those rows, (r,) bool, when the caller knows them (else read from the mask)."""
    b, hkv, g, r, dq = q.shape
    dv = v.shape[-1]
    if mask is not None:
        if dead is None:
            dead = torch.isneginf(mask).all(-1)
        mask = mask.expand(*mask.shape[:2], g, r, mask.shape[-1]).reshape(mask.shape[0], mask.shape[1], g * r, -1)
    out, lse = _flash_lse_op()(q.reshape(b, hkv, g * r, dq), k, _padded(v, dq), attn_mask=mask,
                               scale=call.scaling if scale is None else scale)[:2]
    out, lse = out[..., :dv].float().reshape(b, hkv * g, r, -1), lse.float().reshape(b, hkv * g, r)
    if mask is not None:  # the kernel reports a fully excluded row as lse = 0, out = 0: make its weight 0
        lse = lse.masked_fill(dead.expand(-1, hkv, g, r).reshape(-1, hkv * g, r) if dead.dim() > 1 else dead,
                              float("-inf"))
    return out, lse


def flash_causal_partial(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None) -> Partial:
    """As `flash_partial` for the diagonal block (queries and keys are the same r slots): causal, square; the
    kernel's causal mask needs one row per query, so K/V are repeated here (r keys only)."""
    b, hkv, g, r, dq = q.shape
    dv = v.shape[-1]
    k, v = _repeat(k, g), _repeat(_padded(v, dq), g)
    out, lse = _flash_lse_op()(q.reshape(b, hkv * g, r, dq), k, v, is_causal=True,
                               scale=call.scaling if scale is None else scale)[:2]
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


def band_partial(call: AttentionCall, s: torch.Tensor, rows: slice, start: int, e: int) -> Partial:
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


def _mask_block(attention_mask, call: AttentionCall, rows: slice, e: int, lo: int = 0, window: int | None = None):
    """(b|1, 1|Hkv, 1|G, r, e − lo) bool 'may attend' or float additive mask for one block over key slots [lo, e);
    causal when no mask was built (within `window` slots when one is given). A mask per query head (Doge's dynamic
    mask, (b, H, q, k)) is laid out as the scores: kv head, then group."""
    if attention_mask is None:  # causal in slots (the order of the tokens; gapped ids do not change it)
        d = call.q_slot[rows, None] - torch.arange(lo, e, device=call.q_slot.device)
        allowed = d >= 0 if window is None else (d >= 0) & (d < window)
        return allowed.view(1, 1, 1, -1, e - lo)
    m = attention_mask[:, :, rows, lo:e]
    if m.shape[1] == 1:
        return m.unsqueeze(2)
    return m.view(m.shape[0], call.query.shape[1], call.query.shape[2], *m.shape[2:])


def with_indices(attention_mask, indices: torch.Tensor, k_len: int, dtype) -> torch.Tensor:
    """The mask of a sparse-attention layer that hands its indexer's top-k keys (b, q, k) as `indices` to backends
    other than eager/sdpa: the keys not chosen are masked, as the model's own eager/sdpa path does (it merges the same
    `index_mask` into its mask). Without a mask the causal one is the base."""
    b, q_len = indices.shape[:2]
    chosen = torch.zeros(b, q_len, k_len, dtype=torch.bool, device=indices.device).scatter(-1, indices.long(), True)
    chosen = chosen[:, None]  # (b, 1, q, k)
    if attention_mask is None:
        i = torch.arange(k_len - q_len, k_len, device=indices.device)[:, None]
        return chosen & (torch.arange(k_len, device=indices.device)[None, :] <= i)
    if attention_mask.dtype == torch.bool:
        return attention_mask & chosen
    return attention_mask.masked_fill(~chosen, torch.finfo(attention_mask.dtype).min)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                      *, dense: bool, window: int | None = None, **kwargs):
    """transformers attention-function signature: query (b, H, q, d), key/value (b, Hkv, k, d) →
    (out (b, q, H, d), weights (b, H, q, k) for the dense variant, else None).

    `window`: a sliding-window layer whose mask was not built (attention/windowed.py): each query block meets only the
    key slots its window reaches, on the materialised path."""
    state = getattr(module, STATE, None)
    if state is None:  # a module the patch leaves alone (no positions): attention as the model has it
        return stand_in("eager" if dense else "sdpa", module)(module, query, key, value, attention_mask, dropout=dropout,
                                                              scaling=scaling, softcap=softcap, **kwargs)
    waiting = placeholder(module, query, key, value)  # a copy that runs before copy 0 (attention/copies.py)
    if waiting is not None:
        return waiting, None
    attention_mask = own_rows(module, attention_mask)
    if kwargs.get("indices") is not None:  # a sparse-attention indexer's choice of keys (DeepSeek-V3.2 & co.)
        attention_mask = with_indices(attention_mask, own_rows(module, kwargs["indices"]), key.shape[2], query.dtype)
        current = state.current if state is not None else None
        if current is not None and not isinstance(current.layout.maps[0], Identity):
            # copy 0's indexer chose these keys at copy 0's positions; DCA's copy 0 is chunk positions, not the tokens'
            raise NotProven("hands its sparse-attention indexer's choice of keys to attention, and this scheme moves "
                            "every copy's positions, so no copy is the tokens' own to choose keys at")
    call = make_call(module, query, key, value, scaling, softcap, kwargs.get("position_ids"), kwargs.get("indices"))
    query, key, value = call.query, call.key, call.value
    b, hkv, _, q_len, _ = query.shape
    h, d, k_len = hkv * query.shape[2], value.shape[-1], key.shape[2]
    if attention_mask is not None and attention_mask.shape[-1] != k_len:
        raise ValueError(f"attention mask covers {attention_mask.shape[-1]} keys but there are {k_len}")
    call.scratch["attention_mask"] = attention_mask  # a rule that reads the mask itself (ms_poe's head order)
    begin(state, call)  # the rule's, then a prompt's cache store it picks for
    # gpt-oss attention sinks (transformers passes `s_aux=self.sinks`): one learned logit per head that joins the
    # softmax denominator, i.e. a key with value 0, as gpt-oss's own eager function and transformers' flex have it
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.float().view(1, hkv, h // hkv, 1, 1)  # query head kv·G + g, as in the score layout

    budget = state.block_elements or settings.BLOCK_ELEMENTS
    # The fused path (log-sum-exp merging) serves inference without padding mask, softcap or dropout on CPU;
    # everything else takes the materialised-block path, which autograd can differentiate.
    if window is not None and (attention_mask is not None or call.gapped or call.values or call.memory or dense):
        raise NotImplementedError(f"{type(module).__name__}: a sliding window without its mask is served for plain "
                                  "token keys only (no padding mask, gapped ids, values per key set or memory keys)")
    fused = (window is None and not dense and attention_mask is None and softcap is None
             and not (dropout and module.training)
            and not torch.is_grad_enabled() and query.device.type == "cpu" and _flash_lse_op() is not None
            and not call.gapped  # gapped ids: regions by id differences, per element (the materialised path)
            and not call.values  # values per key set (copies.SPLIT): the output split by query copy, materialised
            and q_len > settings.DECODE_ROWS)  # a step of decoding: one row of scores per head costs less than kernels
    if dense:
        block = q_len
    elif window is not None:  # a block meets at most block + window − 1 keys
        block = max(16, window)
        while block > 16 and b * h * block * (block + window) > budget:
            block //= 2
        block = min(q_len, block)
    elif fused:  # only a narrow band is materialised per block: the scheme picks the block that balances the two
        block = min(q_len, settings.FUSED_BLOCK or state.scores.fused_rows(b * h))
    else:
        block = max(1, min(q_len, budget // max(1, b * h * k_len)))
    out = query.new_empty(b, hkv, h // hkv, q_len, d)
    weights = []
    # values rotating with their keys (copies.SPLIT): each query copy's part of the output, from its pairs' key sets
    split = query.new_zeros(len(call.queries), b, hkv, h // hkv, q_len, d) if call.values else None
    for r0 in range(0, q_len, block):
        rows = slice(r0, min(q_len, r0 + block))
        end = call.first_slot(rows) + (rows.stop - rows.start)  # causal: later keys are masked for the whole block
        parts = state.scores.fused(call, rows, end) if fused else None
        if parts is not None:
            if sinks is not None:  # the sink as one more partial softmax: log-sum-exp = the sink logit, output 0
                lse = parts[0][1]
                parts = [*parts, (torch.zeros_like(parts[0][0]), sinks.reshape(1, h, 1).expand_as(lse).to(lse.dtype))]
            out[:, :, :, rows] = merge(parts).view(b, hkv, h // hkv, -1, d)
            continue
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            end = k_len  # a custom additive mask may open any key
        lo = 0 if window is None else max(0, call.first_slot(rows) - window + 1)  # the keys the windows reach
        s = state.scores.logits(call, rows, lo, end)
        # a block of one row (a decoding step) sees every key before `end`: no causal mask to build and apply
        m = _mask_block(attention_mask, call, rows, end, lo, window) \
            if attention_mask is not None or rows.stop - rows.start > 1 or window is not None else None
        same = call.segments(rows, lo, end)
        if same is not None:  # a packed row that restarts its ids: no key of an earlier segment
            if m is None or m.dtype == torch.bool:
                m = same if m is None else m & same
            else:
                m = m.masked_fill(~same, torch.finfo(m.dtype).min)
        if m is None:
            pass
        elif m.dtype == torch.bool:
            # finfo.min rather than -inf: a fully masked row (a left-pad query) stays finite, as in transformers
            s = s.masked_fill(~m, torch.finfo(s.dtype).min)
        elif m.dtype == torch.float64:
            # a float64 model's additive mask holds finfo(float64).min, -inf in the float32 scores: a fully masked row
            # (a left-pad query) would be NaN, and through the next layer's values every token of its row. Clamped to
            # float32's own minimum it stays finite, as a float32 model's row does (transformers' eager code casts
            # the same mask to float32 for its softmax and gives NaN there)
            s = s + m.clamp_min(torch.finfo(torch.float32).min).float()
        else:
            s = s + m.float()
        if sinks is None:
            p = torch.softmax(s, dim=-1).to(value.dtype)
        else:  # softmax over [scores, sink], the sink's column dropped (its value is 0)
            sink = sinks.to(s.dtype).expand(*s.shape[:-1], 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1].to(value.dtype)
        if dropout and module.training:
            p = nn.functional.dropout(p, p=dropout, training=True)
        pv = p.view(b, hkv, -1, end - lo)  # (b, Hkv, G·r, end − lo)
        if split is not None:
            for copy, key_set, where in state.scores.regions(call, rows, 0, end):
                share = pv if where is None else (p * where.to(p.dtype)).view(b, hkv, -1, end)
                split[copy, :, :, :, rows] += torch.matmul(share, call.values[key_set][:, :, :end]).view(
                    b, hkv, h // hkv, -1, d)
            block_out = split[0, :, :, :, rows]
        else:
            block_out = torch.matmul(pv, value[:, :, lo:end]).view(b, hkv, h // hkv, -1, d)
        if dense:
            out = block_out  # one block: no copy (and autograd sees no in-place write)
            weights.append(p.reshape(b, h, -1, end))
        else:
            out[:, :, :, rows] = block_out
        del s, p, pv
    if split is not None:  # the copies' rows as the layer stacked them: its own code rotates each back at its positions
        out = split.reshape(-1, h, q_len, d).transpose(1, 2).contiguous()
        return out, (weights[0] if dense else None)
    out = out.reshape(b, h, q_len, d).transpose(1, 2).contiguous()
    return restack(module, out), (weights[0] if dense else None)


def dense_attention(module, query, key, value, attention_mask, **kwargs):
    return attention_forward(module, query, key, value, attention_mask, dense=True, **kwargs)


def blocked_attention(module, query, key, value, attention_mask, **kwargs):
    return attention_forward(module, query, key, value, attention_mask, dense=False, **kwargs)
