"""Rules every scheme can build on: `Plain`, the attention of a layer the scheme leaves as it is."""

from __future__ import annotations

from .flex import flex_call
from .kernels import flash_causal_partial, flash_partial
from .protocol import AttentionRule


class Plain(AttentionRule):
    """Attention as the model has it: copy 0's queries against key set 0, no bias. What a re-positioning rule runs on
    a layer that handed over one copy (a layer without positions, or one the scheme leaves as it is)."""

    def logits(self, call, rows, start, end):
        return call.qk(call.query[:, :, :, rows], call.key[:, :, start:end])

    def fused_rows(self, heads):
        return 1024

    def fused(self, call, rows, end):
        return causal_parts(call, call.query[:, :, :, rows], call.key, rows, end)

    def flex(self, call, block_mask):
        return flex_call(call, call.query.flatten(1, 2), call.key, call.value, block_mask)


PLAIN = Plain()


def causal_parts(call, q, k, rows, end):
    """Block `rows`' queries q against keys k[:end]: the keys before the block through one fused kernel call, the
    diagonal block through the causal one."""
    c, v = call.first_slot(rows), call.value
    parts = [flash_partial(call, q, k[:, :, :c], v[:, :, :c])] if c > 0 else []
    return [*parts, flash_causal_partial(call, q, k[:, :, c:end], v[:, :, c:end])]
