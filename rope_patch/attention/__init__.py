"""Attention functions for the attention-side schemes, registered with transformers' `AttentionInterface`.

Two functions are registered once, under names of our own (no existing key is touched):

    rope_patch_dense    eager-style: one block holding the whole score matrix; returns the attention weights
    rope_patch_blocked  sdpa-style: nothing of size L×L per head is ever held. Two paths:
                        fused (inference on CPU, no padding mask / softcap / dropout): per query block, the keys are
                        split into ranges that each need one fused flash-attention call (torch's CPU kernel, which
                        also returns the log-sum-exp) plus a narrow materialised band where the scheme varies per
                        element; the partial softmaxes are merged by log-sum-exp.
                        materialised (training, padding, softcap, other devices): query blocks of ~BLOCK_ELEMENTS
                        scores that see all their keys at once, so they need no merging and autograd works.

    rope_patch_flex     flex_attention: one `torch.nn.attention.flex_attention` call with a `score_mod` (the bias) under
                        transformers' BlockMask (causal, padding, sliding window), or two calls (near band / far part)
                        merged by log-sum-exp for the two-rotation schemes; compiled in a function of its own.
    rope_patch_fa2      flash-attention-2 with `alibi_slopes` (ALiBi only; `flash_attn` on CUDA). The name avoids the
                        substring "flash": transformers rewrites such names to its kernel fallbacks.

plus the same names in `AttentionMaskInterface` (transformers' own mask function of the backend each one stands in
for: `sdpa_mask`, `flex_attention_mask`, `flash_attention_mask`), without which `create_causal_mask` returns None and
padding would be silently dropped.

The functions hold no scheme state. A patched model carries an `AttnState` on each of its attention modules (set
through the undo log), so two models in one process run different schemes through the same registered name, and a
model that is not patched never reaches these functions. The state's `scores` object (an `AttentionRule`) is the scheme:
it turns one query block into pre-softmax logits (two rotations for ReRoPE/Self-Extend, a bias for ALiBi/T5).

Positions. The KV cache of a patched model holds what the attention layers wrote: keys with the identity rotation.
With a dynamic cache (full or sliding-window layers) the keys are contiguous in position and end with the current
queries, so the relative distance of query row r to key slot j is `k_len − q_len + r − j`, with or without left
padding. Absolute positions (needed by Self-Extend's floor) add a per-row offset read from `position_ids`. Static
caches break the contiguity (keys are padded to the maximum length); the schemes refuse them
(schemes/common.py).

    protocol.py      AttentionRule (a scheme's side), AttentionCall, Partial + merge, per-module state lookup
    blocked.py       rope_patch_blocked / rope_patch_dense (sdpa / eager)      flex.py    rope_patch_flex
    flash.py         rope_patch_fa2 (ALiBi on flash_attn)                      rotation.py  deferred RoPE (Rotation)
    registration.py  AttnState and the AttentionInterface / AttentionMaskInterface entries
    settings.py      tunables read at call time (block budget, flex compilation, flash devices)
    windowed.py      rope_patch_windowed(_blocked): sliding-window layers over their window only, per query block (no
                     L×L mask or scores), patched or not, switched on per instance by `windowed(model)`
"""

from __future__ import annotations

from . import plumbing, settings, windowed
from .blocked import blocked_attention, dense_attention
from .copies import HEADS, ROWS, SEQUENTIAL, SPLIT, CacheView, Identity, Layout, NotProven, Reentry, memory_rotaries
from .declared import Declared, band_block_mask
from .flash import flash_module
from .flex import causal_block_mask, flex_available, flex_call, mask_rows, restrict_block_mask
from .geometry import Geometry, Region
from .kernels import band_partial, flash_causal_partial, flash_distance_partial, flash_partial
from .protocol import STATE, AttentionCall, AttentionRule, Partial, fit_rows, merge
from .registration import BACKENDS, BLOCKED, DENSE, FA2, FLEX, AttnState, register
from .rotation import Rotation, floor_div
from .rules import PLAIN, Plain

__all__ = [
    "Declared", "Geometry", "Region", "band_block_mask",
    "BACKENDS", "PLAIN", "Plain", "HEADS", "ROWS", "SEQUENTIAL", "SPLIT", "memory_rotaries", "CacheView", "Identity", "Layout", "NotProven", "Reentry", "BLOCKED", "DENSE", "FA2", "FLEX", "STATE", "AttentionCall", "AttentionRule", "AttnState", "Partial",
    "Rotation", "band_partial", "blocked_attention", "causal_block_mask", "dense_attention", "fit_rows",
    "flash_causal_partial", "flash_distance_partial", "flash_module", "flash_partial", "flex_available", "flex_call", "floor_div", "mask_rows", "merge",
    "plumbing", "register", "restrict_block_mask", "settings", "windowed",
]
