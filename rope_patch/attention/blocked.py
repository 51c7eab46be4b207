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
from .calls import begin, make_call, own_rows, placeholder, restack, stand_in
from .copies import Identity, NotProven
from .kernels import _flash_lse_op
from .protocol import STATE, AttentionCall, merge


def in_window(q_slots: torch.Tensor, lo: int, hi: int, window: int | None = None) -> torch.Tensor:
    """(r, hi − lo) bool, True where query slot i may attend key slot j: 0 ≤ i − j (< `window` when one is given)."""
    d = q_slots[:, None] - torch.arange(lo, hi, device=q_slots.device)
    return d >= 0 if window is None else (d >= 0) & (d < window)


def block_rows(batch: int, heads: int, q_len: int, window: int) -> int:
    """Query rows per block of a sliding-window layer: about one window, fewer when batch × heads × rows ×
    (rows + window) would pass the budget of scores per block (settings.BLOCK_ELEMENTS)."""
    rows = max(16, window)
    while rows > 16 and batch * heads * rows * (rows + window) > settings.BLOCK_ELEMENTS:
        rows //= 2
    return min(q_len, rows)


def _mask_block(attention_mask, call: AttentionCall, rows: slice, lo: int, e: int, window: int | None):
    """(b|1, 1|Hkv, 1|G, r, e − lo) bool 'may attend' or float additive mask for one block over key slots [lo, e), or
    None: nothing to mask. Causal when no mask was built (within `window` slots when one is given), except in a block
    of one row (a decoding step), which sees every key before `e`. A mask per query head (Doge's dynamic mask,
    (b, H, q, k)) is laid out as the scores: kv head, then group. A packed row that restarts its ids (gapped ids) also
    masks the keys of its earlier segments."""
    if attention_mask is not None:
        m = attention_mask[:, :, rows, lo:e]
        m = m.unsqueeze(2) if m.shape[1] == 1 else m.view(m.shape[0], *call.query.shape[1:3], *m.shape[2:])
    elif rows.stop - rows.start > 1 or window is not None:  # causal in slots (gapped ids do not change the order)
        m = in_window(call.q_slot[rows], lo, e, window).view(1, 1, 1, -1, e - lo)
    else:
        m = None
    same = call.segments(rows, lo, e)
    if same is None or m is None:
        return m if same is None else same
    return m & same if m.dtype == torch.bool else m.masked_fill(~same, torch.finfo(m.dtype).min)


def with_indices(attention_mask, indices: torch.Tensor, k_len: int, dtype) -> torch.Tensor:
    """The mask of a sparse-attention layer that hands its indexer's top-k keys (b, q, k) as `indices` to backends
    other than eager/sdpa: the keys not chosen are masked, as the model's own eager/sdpa path does (it merges the same
    `index_mask` into its mask). Without a mask the causal one is the base."""
    b, q_len = indices.shape[:2]
    chosen = torch.zeros(b, q_len, k_len, dtype=torch.bool, device=indices.device).scatter(-1, indices.long(), True)
    chosen = chosen[:, None]  # (b, 1, q, k)
    if attention_mask is None:
        return chosen & in_window(torch.arange(k_len - q_len, k_len, device=indices.device), 0, k_len)
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
        return stand_in("eager" if dense else "sdpa", module)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs)
    waiting = placeholder(module, query, key, value)  # a copy that runs before copy 0 (attention/copies.py)
    if waiting is not None:
        return waiting, None
    attention_mask = own_rows(module, attention_mask)
    if kwargs.get("indices") is not None:  # a sparse-attention indexer's choice of keys (DeepSeek-V3.2 & co.)
        attention_mask = with_indices(attention_mask, own_rows(module, kwargs["indices"]), key.shape[2], query.dtype)
        if state.current is not None and not isinstance(state.current.layout.maps[0], Identity):
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
        block = block_rows(b, h, q_len, window)
    elif fused:  # only a narrow band is materialised per block: the scheme picks the block that balances the two
        block = min(q_len, settings.FUSED_BLOCK or state.scores.fused_rows(b * h))
    else:
        block = max(1, min(q_len, settings.BLOCK_ELEMENTS // max(1, b * h * k_len)))
    out = query.new_empty(b, hkv, h // hkv, q_len, d)
    weights = None  # the dense variant's
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
        m = _mask_block(attention_mask, call, rows, lo, end, window)
        if m is not None and m.dtype == torch.bool:
            # finfo.min rather than -inf: a fully masked row (a left-pad query) stays finite, as in transformers
            s = s.masked_fill(~m, torch.finfo(s.dtype).min)
        elif m is not None:
            # a float64 model's additive mask holds finfo(float64).min, -inf in the float32 scores: a fully masked row
            # (a left-pad query) would be NaN, and through the next layer's values every token of its row. Clamped to
            # float32's own minimum it stays finite, as a float32 model's row does (transformers' eager code casts
            # the same mask to float32 for its softmax and gives NaN there)
            s = s + (m.clamp_min(torch.finfo(torch.float32).min) if m.dtype == torch.float64 else m).float()
        if sinks is not None:  # softmax over [scores, sink], the sink's column dropped (its value is 0)
            s = torch.cat([s, sinks.to(s.dtype).expand(*s.shape[:-1], 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :end - lo].to(value.dtype)
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
            weights = p.reshape(b, h, -1, end)
        else:
            out[:, :, :, rows] = block_out
        del s, p, pv
    if split is not None:  # the copies' rows as the layer stacked them: its own code rotates each back at its positions
        return split.reshape(-1, h, q_len, d).transpose(1, 2).contiguous(), weights
    return restack(module, out.reshape(b, h, q_len, d).transpose(1, 2).contiguous()), weights


def dense_attention(module, query, key, value, attention_mask, **kwargs):
    return attention_forward(module, query, key, value, attention_mask, dense=True, **kwargs)


def blocked_attention(module, query, key, value, attention_mask, **kwargs):
    return attention_forward(module, query, key, value, attention_mask, dense=False, **kwargs)
