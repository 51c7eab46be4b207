"""The flex_attention stand-in (`rope_patch_flex`): the rule's `flex` under transformers' BlockMask (causal,
padding, sliding window): one flex_attention call with a `score_mod` (the bias), or two calls (near band / far part)
merged by log-sum-exp for the two-rotation schemes (flex.py). A decoding step (≤ settings.DECODE_ROWS query rows)
takes the blocked function's one-row path with the BlockMask's rows as its mask."""

from __future__ import annotations

from torch.nn.attention.flex_attention import BlockMask

from . import settings
from .blocked import blocked_attention
from .calls import begin, make_call, placeholder, restack, stand_in
from .copies import NotProven
from .flex import causal_block_mask, mask_rows
from .protocol import STATE


def flex_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """transformers attention-function signature on top of flex_attention: `attention_mask` is transformers' BlockMask
    (causal, padding, sliding window) from `flex_attention_mask`. Returns (out (b, q, H, d), None)."""
    state = getattr(module, STATE, None)
    if state is None:  # a module the patch leaves alone (no positions): attention as the model has it
        return stand_in("flex_attention", module)(module, query, key, value, attention_mask, dropout=dropout,
                                                  scaling=scaling, softcap=softcap, **kwargs)
    if query.shape[2] <= settings.DECODE_ROWS and not module.training:
        # a decoding step: one row of scores per head (the blocked function's materialised path, the same math) costs
        # less than flex's calls, each with its block masks and its compiled variant's guards
        if attention_mask is not None:
            attention_mask = mask_rows(attention_mask, 0, query.shape[2], key.shape[2])
        return blocked_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 softcap=softcap, **kwargs)
    waiting = placeholder(module, query, key, value)  # a copy that runs before copy 0 (attention/copies.py)
    if waiting is not None:
        return waiting, None
    if dropout and module.training:
        raise ValueError("flex_attention does not support attention dropout (as in transformers): use model.eval() or "
                         "set the config's attention_dropout to 0.")
    if attention_mask is not None and not isinstance(attention_mask, BlockMask):
        raise ValueError(f"the flex_attention backend expects a BlockMask, got {type(attention_mask).__name__}: pass "
                         "a 2-D padding mask and let transformers build it, or use the sdpa backend for custom masks.")
    if kwargs.get("indices") is not None:
        raise NotProven("hands its sparse-attention indexer's chosen keys (`indices`) to attention, which rope_patch's "
                        "flex_attention function does not take (its eager and sdpa ones do)")
    call = make_call(module, query, key, value, scaling, softcap, kwargs.get("position_ids"))
    if call.values:  # copies.SPLIT: the apply-time check refuses the scheme on this backend
        raise NotProven("its values rotate with its keys (K = V), and rope_patch's flex_attention function reads one "
                        "value per key and returns one output per query; its eager and sdpa ones split them by copy")
    if call.gapped:
        raise ValueError("rope_patch: position ids with gaps or restarts (PoSE, packed rows) are not supported on the "
                         "flex_attention backend, whose block masks are built from slots; use the sdpa or eager "
                         "backend (model.set_attn_implementation('sdpa') before rope_patch.apply).")
    call.scratch["attention_mask"] = attention_mask  # a rule that reads the mask itself (ms_poe's head order)
    begin(state, call)  # the rule's, then a prompt's cache store it picks for
    block_mask = attention_mask if attention_mask is not None else causal_block_mask(call)
    out = state.scores.flex(call, block_mask)
    return restack(module, out.to(value.dtype).transpose(1, 2).contiguous()), None
