"""Registration with transformers: our functions under names of our own (no existing key is touched) in
`AttentionInterface`, plus the same names in `AttentionMaskInterface` (transformers' own mask function of the backend
each one stands in for: `eager_mask`, `sdpa_mask`, `flex_attention_mask`, `flash_attention_mask`), without which
`create_causal_mask` returns None and padding would be silently dropped; and `AttnState`, what a patched attention
module carries."""

from __future__ import annotations

import dataclasses

import transformers
from transformers.masking_utils import (
    AttentionMaskInterface,
    eager_mask,
    flash_attention_mask,
    flex_attention_mask,
    sdpa_mask,
)

from .blocked import blocked_attention, dense_attention
from .flash import fa2_forward
from .flex_backend import flex_forward
from .protocol import AttentionRule

DENSE = "rope_patch_dense"
BLOCKED = "rope_patch_blocked"
FLEX = "rope_patch_flex"
FA2 = "rope_patch_fa2"


@dataclasses.dataclass
class AttnState:
    scores: AttentionRule
    current: object = None  # during a re-positioned layer's call: its `copies.Current` (rows, true positions, layout)
    positionless: bool = False  # during a call of a layer that no positions reach (`copies.Reentry` runs it as it is)
    recorder: object = None  # during the apply-time check (plumbing.py): what the attention function received
    rotaries: tuple = ()  # the model's rotary modules (copies.Reentry recovers embeddings a decoder sliced)

    def __setstate__(self, state):
        # A patched model unpickled in a fresh process (torch.load) finds its attention functions registered.
        self.__dict__.update(state)
        register()


# backend the model had -> our function's name
BACKENDS = {"eager": DENSE, "sdpa": BLOCKED, "flex_attention": FLEX, "flash_attention_2": FA2}
# each with the mask function of the backend it stands in for: a model's own code may extend the mask it is handed
# (DeepSeek-V4 concatenates a float block bias to an eager mask), so the format must be that backend's
_FUNCTIONS = {DENSE: (dense_attention, eager_mask), BLOCKED: (blocked_attention, sdpa_mask),
              FLEX: (flex_forward, flex_attention_mask), FA2: (fa2_forward, flash_attention_mask)}


def register() -> None:
    """Register our functions and their mask functions (idempotent)."""
    for name, (fn, mask) in _FUNCTIONS.items():
        transformers.AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, mask)
