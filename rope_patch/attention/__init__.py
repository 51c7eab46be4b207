"""Attention for the attention-side schemes: functions registered with transformers' `AttentionInterface` under
names of rope_patch's own (rope_patch_dense: eager, the whole score matrix; rope_patch_blocked: sdpa, query blocks,
nothing of size L×L per head; rope_patch_flex: flex_attention; rope_patch_fa2: ALiBi on flash_attn; plus their
`AttentionMaskInterface` entries, without which transformers would drop padding). They hold no scheme state: each
patched attention module carries an `AttnState` whose rule (`AttentionRule`) is the scheme, so two models in one
process run different schemes through one registered name.

A re-positioning layer runs its queries and keys at several position maps with its own rotary (copies.py); the rule
says which copy each (query, key) pair reads. Most rules are declared (geometry.py: `Region`s of distances or chunks)
and `Declared` (declared.py) derives every path from the declaration: the materialised scores (training, padding,
decoding), the fused path (CPU inference: flash calls that return their log-sum-exp, merged), and flex_attention (one
BlockMask per region).

Shape letters:
    b       batch rows                      H       query heads           Hkv    key/value heads
    G       query heads per kv head (H/Hkv) q, r    query rows (of a call, of a block)
    k, e    key slots (of a call, of a block's range)                     d, dv  head size of q/k, of v
    c       a block's first query slot, or DCA's chunk   W, S   a window / split, a shift or a sliding window
    slot    a key's index in the call (the cache's order); its position is slot + offset (left padding), or the
            position id where ids have gaps (`AttentionCall.gapped`)

    protocol.py      the contract: AttentionRule, AttentionCall, Partial + merge
    geometry.py      Region, Bias, Geometry: a declaration             declared.py   Declared: the rule derived from it
    rules.py         Plain: attention as the model has it              kernels.py    flash kernels returning lse
    copies.py        the position copies a layer runs                  calls.py      one call's copies → AttentionCall
    blocked.py       rope_patch_blocked / rope_patch_dense             flex.py       flex_call and block masks
    flex_backend.py  rope_patch_flex                                   flash.py      rope_patch_fa2
    windowed.py      sliding layers over their window only             rotation.py   the model's RoPE, re-applied
    registration.py  AttnState, the interface entries                  plumbing.py   installing, the apply-time check
    settings.py      tunables read at call time
"""

from __future__ import annotations

from . import plumbing, settings, windowed
from .blocked import blocked_attention, dense_attention
from .copies import HEADS, ROWS, SEQUENTIAL, SPLIT, CacheView, Identity, Layout, NotProven, Reentry, memory_rotaries
from .declared import Declared
from .flash import flash_module
from .flex import band_block_mask, causal_block_mask, flex_available, flex_call, mask_rows
from .geometry import Bias, Geometry, Region
from .kernels import flash_causal_partial, flash_distance_partial, flash_partial
from .protocol import STATE, AttentionCall, AttentionRule, Partial, fit_rows, merge
from .registration import BACKENDS, BLOCKED, DENSE, FA2, FLEX, AttnState, register
from .rotation import Rotation, floor_div
from .rules import PLAIN, Plain, causal_parts

__all__ = [
    "AttentionCall", "AttentionRule", "AttnState", "BACKENDS", "Bias", "band_block_mask", "BLOCKED",
    "blocked_attention", "CacheView", "causal_block_mask", "causal_parts", "Declared", "DENSE", "dense_attention",
    "FA2", "fit_rows", "flash_causal_partial", "flash_distance_partial", "flash_module", "flash_partial", "FLEX",
    "flex_available", "flex_call", "floor_div", "Geometry", "HEADS", "Identity", "Layout", "mask_rows",
    "memory_rotaries", "merge", "NotProven", "Partial", "Plain", "PLAIN", "plumbing", "Reentry", "Region", "register",
    "Rotation", "ROWS", "SEQUENTIAL", "settings", "SPLIT", "STATE", "windowed",
]
