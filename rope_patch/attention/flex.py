"""flex_attention for the rules and the flex backend (flex_backend.py): `flex_call`, one
`torch.nn.attention.flex_attention` call with a `score_mod` (the bias) under a BlockMask, compiled
(settings.FLEX_COMPILE), as transformers' own flex backend is, in a function of rope_patch's own (`compiled_flex`);
and the BlockMasks the rules cut (`causal_block_mask`, `band_block_mask`: a region's, `mask_rows`)."""

from __future__ import annotations

import functools

import torch
import transformers
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from . import settings
from .protocol import AttentionCall
from .rotation import floor_div


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


def band_block_mask(block_mask, call: AttentionCall, lo: int, hi: float, first: torch.Tensor | None = None,
                    chunk: int | None = None):
    """`block_mask` ∧ lo ≤ i − j < hi [∧ j < first[b], a row's first keys]; i − j in key slots, or with `chunk` the
    difference of the chunks ⌊p/chunk⌋ of the true positions p. The element rule is the mask_mod; the block list keeps
    the original blocks that hold an element of the band (judged from each block's smallest and largest difference),
    all partial: a full block may now be cut by the band."""
    q_len, k_len, b = call.query.shape[3], call.key.shape[2], call.query.shape[0]
    dev = call.key.device
    shift = torch.tensor(k_len - q_len, device=dev)
    low, high = torch.tensor(lo, device=dev), torch.tensor(min(hi, k_len + q_len), device=dev)
    limit = None if first is None else first.reshape(-1).expand(b).contiguous()
    offsets = call.offset.reshape(-1).expand(b).contiguous()
    base = block_mask.mask_mod

    def back(i, j, off):  # i − j, in slots or in chunks of the true positions
        if chunk is None:
            return i - j
        return floor_div((i + off).clamp(min=0), chunk) - floor_div((j + off).clamp(min=0), chunk)

    def mask_mod(bi, h, qi, kv):
        d = back(qi + shift, kv, offsets[bi])
        inside = base(bi, h, qi, kv) & (d >= low) & (d < high)
        return inside if limit is None else inside & (kv < limit[bi])

    qb, kb = block_mask.BLOCK_SIZE
    dense = block_mask.to_dense().bool()  # (B, H, q blocks, kv blocks): partial ∪ full
    off = offsets.view(-1, 1, 1, 1)
    q0 = torch.arange(dense.shape[-2], device=dev).view(1, 1, -1, 1) * qb + (k_len - q_len)
    k0 = torch.arange(dense.shape[-1], device=dev).view(1, 1, 1, -1) * kb
    dense = dense & (back(q0 + qb - 1, k0, off) >= lo) & (back(q0, k0 + kb - 1, off) < high)
    if limit is not None:
        dense = dense & (k0 < limit.max())
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
