"""The flex_attention stand-in: one `torch.nn.attention.flex_attention` call with a `score_mod` (the bias) under
transformers' BlockMask (causal, padding, sliding window), or two calls (near band / far part) merged by log-sum-exp
for the two-rotation schemes. Compiled (settings.FLEX_COMPILE), as transformers' own flex backend is, in a function
of rope_patch's own (`compiled_flex`). A decoding step (≤ settings.DECODE_ROWS query rows) takes the blocked
function's one-row path with the BlockMask's rows as its mask."""

from __future__ import annotations

import functools

import torch
import transformers
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from . import settings
from .blocked import blocked_attention
from .copies import NotProven
from .protocol import STATE, AttentionCall, begin, make_call, placeholder, restack, stand_in


def flex_available() -> bool:
    return transformers.utils.is_torch_flex_attn_available()


def _flex_attention(q, k, v, **kwargs):
    return flex_attention(q, k, v, **kwargs)


@functools.cache
def compiled_flex():
    """rope_patch's compiled flex_attention. Its own function, not transformers' compiled singleton: torch.compile
    keeps at most `recompile_limit` (8) compiled variants per function, one per score_mod, mask_mod, return_lse and
    memory layout, and past that runs the function eagerly, without a word: an unfused flex that materialises every
    score (Self-Extend at 32k on an H200: 133× the time and 165× the memory of vanilla sdpa; compiled, 4.2× and
    1.45×). The GPU check's schemes in one process passed 8 on the shared singleton; here the variants count against
    rope_patch's own function, under settings.FLEX_RECOMPILES, and a call past it raises."""
    return torch.compile(_flex_attention)


def compiled_variants() -> int | None:
    """How many compiled variants `compiled_flex` holds in this process (None where torch does not say)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    return len(_debug_get_cache_entry_list(_flex_attention.__code__))


def _run_compiled(q, k, v, **kwargs):
    import torch._dynamo

    # one memory layout for every call (the projections come transposed, a cache's key sets as slices): each layout
    # would be a variant of its own
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    limits = {"recompile_limit": settings.FLEX_RECOMPILES, "fail_on_recompile_limit_hit": True}
    try:
        with torch._dynamo.config.patch(**{n: x for n, x in limits.items() if hasattr(torch._dynamo.config, n)}):
            return compiled_flex()(q, k, v, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit as e:
        raise RuntimeError(
            f"rope_patch: the compiled flex_attention has {settings.FLEX_RECOMPILES} variants in this process (one per "
            "scheme's score and mask functions, lse and shape kind), the limit (rope_patch.attention.settings."
            "FLEX_RECOMPILES); past it torch would run flex uncompiled, materialising every score. Raise the limit, "
            "run fewer schemes per process, or use the sdpa backend.") from e


def flex_call(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, score_mod=None,
              lse: bool = False):
    """flex_attention of q (b, H, q, d) over k, v (b, Hkv, k, d) (GQA inside the kernel) with the call's scale and
    softcap (before `score_mod`, as in `AttentionCall.qk`). Compiled (`compiled_flex`) unless settings.FLEX_COMPILE
    is off, or inside a torch.compile of the model (which compiles it with the rest). Returns out (b, H, q, d), or the
    Partial (out float32, lse float32) when `lse`; a row the mask excludes entirely comes back with out 0, lse −inf."""
    # Imported here, not at module level: transformers' flex integration imports torch._dynamo (~1.5 s), which
    # `import rope_patch` and every path that never runs flex should not pay.
    from transformers.integrations.flex_attention import get_flex_attention_lse_kwargs

    softcap = call.softcap

    def mod(score, b, h, qi, kv):
        if softcap is not None:  # Gemma 2: c·tanh(s / c) before any bias, as the eager path
            score = torch.tanh(score / softcap) * softcap
        return score if score_mod is None else score_mod(score, b, h, qi, kv)

    kwargs = dict(score_mod=mod, block_mask=block_mask, scale=call.scaling, enable_gqa=q.shape[1] != k.shape[1],
                  **get_flex_attention_lse_kwargs(lse))
    if settings.FLEX_COMPILE and not torch.compiler.is_compiling():
        result = _run_compiled(q, k, v, **kwargs)
    else:
        result = flex_attention(q, k, v, **kwargs)
    if not lse:
        return result
    out, aux = result
    aux_lse = getattr(aux, "lse", aux)  # torch ≥ 2.9: AuxOutput(lse=...); before: the tensor itself
    return out.float(), aux_lse.float()


def causal_block_mask(call: AttentionCall):
    """The BlockMask transformers would build for plain causal attention (queries are the last q slots)."""
    q_len, k_len = call.query.shape[3], call.key.shape[2]
    first = torch.tensor(k_len - q_len, device=call.key.device)

    def causal(b, h, qi, kv):
        return qi + first >= kv

    return create_block_mask(causal, None, None, q_len, k_len, device=call.key.device)


def restrict_block_mask(block_mask, call: AttentionCall, window: int, near: bool, keep=None):
    """`block_mask` ∧ (i − j < W if near else i − j ≥ W) [∧ keep(b, h, q, kv), a mask_mod of the scheme's own], i − j
    in key slots. The element rule is the mask_mod;
    the block list is the original one minus the blocks that hold no element of the region (judged from each
    block's smallest / largest distance), so the near call only visits the diagonal band and the far call the
    rest. All kept blocks are partial (mask_mod evaluated): a block that was full may now be cut by the band."""
    q_len, k_len = call.query.shape[3], call.key.shape[2]
    dev = call.key.device
    first, w = torch.tensor(k_len - q_len, device=dev), torch.tensor(window, device=dev)
    base = block_mask.mask_mod

    def mask_mod(b, h, qi, kv):
        dist = qi + first - kv
        inside = base(b, h, qi, kv) & ((dist < w) if near else (dist >= w))
        return inside if keep is None else inside & keep(b, h, qi, kv)

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


def mask_rows(block_mask: BlockMask, first: int, count: int, k_len: int) -> torch.Tensor:
    """(B, 1, count, k) bool: a BlockMask's element rule (its mask_mod, from which transformers built its blocks) for
    the query rows first … first + count − 1 over k_len keys, as the sdpa-style functions take a mask."""
    dev = block_mask.kv_num_blocks.device
    b = torch.arange(block_mask.shape[0], device=dev)[:, None, None, None]
    q = torch.arange(first, first + count, device=dev)[None, None, :, None]
    seen = block_mask.mask_mod(b, torch.zeros_like(q), q, torch.arange(k_len, device=dev)[None, None, None, :])
    return seen.bool().expand(block_mask.shape[0], 1, count, k_len)  # (a rule that reads no index: one value)


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
                         "flex_attention backend, whose block masks are built from slots; use the sdpa or eager backend "
                         "(model.set_attn_implementation('sdpa') before rope_patch.apply).")
    call.scratch["attention_mask"] = attention_mask  # a rule that reads the mask itself (ms_poe's head order)
    begin(state, call)  # the rule's, then a prompt's cache store it picks for
    block_mask = attention_mask if attention_mask is not None else causal_block_mask(call)
    out = state.scores.flex(call, block_mask)
    return restack(module, out.to(value.dtype).transpose(1, 2).contiguous()), None
