"""The contract between a scheme and the attention functions: `AttentionRule` (what a scheme changes in attention),
`AttentionCall` (one attention call, laid out for GQA), `Partial` softmaxes and their log-sum-exp `merge`, and the
`AttnState` lookup (`STATE`, `module_state`). The runtime that fills an `AttentionCall` is calls.py; the rule of an
unchanged layer (`Plain`) is rules.py."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from . import settings

STATE = "_rope_patch_attn"  # attribute on each attention module of a patched model: its `AttnState`


class AttentionRule:
    """What a scheme changes in attention: pre-softmax logits for one block of queries.

    Not a flex_attention `score_mod`: one rule serves every backend (blocked/dense through `logits` and `fused`,
    flex through `flex`, flash-attention through `flash_slopes`).

    `begin(call)` runs once per attention call (rotate the keys once, not once per block).
    `logits(call, rows, start, end)` returns float32 scores (b, Hkv, G, len(rows), end − start) of the query rows
    `rows` (a slice) against key slots [start, end), before the mask: scaling, softcapping and any additive bias
    applied.
    `fused(call, rows, end)` (optional) returns the same attention as a list of `Partial`s, the long far-away part
    through a fused kernel; None means "use logits"."""

    def begin(self, call: AttentionCall) -> None:
        pass

    def logits(self, call: AttentionCall, rows: slice, start: int, end: int) -> torch.Tensor:
        raise NotImplementedError

    def fused(self, call: AttentionCall, rows: slice, end: int) -> list[Partial] | None:
        return None

    def fused_rows(self, heads: int) -> int:
        """Query rows per block on the fused path (`heads` = batch × query heads)."""
        return 256

    # flex_attention: `flex(call, block_mask)` → out (b, H, q, d). `flex_lse`: whether it merges partial softmaxes,
    # which needs flex's log-sum-exp (not available from the compiled CPU kernel in torch ≤ 2.13).
    flex_lse: bool = False

    def flex(self, call: AttentionCall, block_mask) -> torch.Tensor:
        raise NotImplementedError

    def flash_slopes(self, device, heads: int = 0) -> torch.Tensor | None:
        """(H,) float32 ALiBi slopes of `heads` query heads for flash_attn's `alibi_slopes`, or None: the scheme has no
        flash-attention form."""
        return None

    def regions(self, call: AttentionCall, rows: slice, start: int, end: int) -> list:
        """[(query copy, key set, where)] for the scores `logits` returns: which copy's query and which key set each
        score used (`where`: bool, broadcastable to the scores; None: all). A layer whose values rotate with its keys
        (copies.SPLIT) reads each pair's value from its key set and hands the layer its output split by query copy."""
        return [(0, 0, None)]

    def chosen_sets(self, layer_idx: int, rows: int) -> torch.Tensor:
        """(rows, Hkv) int64: the key set each KV head of each row reads, for a layout whose heads read one set each
        (`copies.Layout.chosen`), picked by the latest prompt's `begin`; a clear error where none was picked."""
        raise NotImplementedError(f"{type(self).__name__} picks no key sets")

    def probe(self, length: int) -> AttentionRule:
        """This rule at an identity setting that still runs its own code paths on a `length`-token input (a window
        or chunk short enough to split it, a zero bias): the apply-time check (attention/plumbing.py) runs it on
        identical position copies, where it must reproduce the model's own attention."""
        return self


def fit_rows(heads: int, extra: int, cap: int = 1024) -> int:
    """The largest power-of-two block (64 ≤ r ≤ cap) whose materialised band, heads × r × (r + extra) numbers, fits
    in settings.BLOCK_ELEMENTS: big blocks mean few kernel calls, the budget keeps the band small for many heads."""
    r = 64
    while r * 2 <= cap and heads * (r * 2) * (r * 2 + extra) <= settings.BLOCK_ELEMENTS:
        r *= 2
    return r


@dataclasses.dataclass
class AttentionCall:
    """One attention call, laid out for GQA without expanding K/V: queries (b, Hkv, G, q, d).

    A re-positioned layer (attention/copies.py) hands over c copies of its queries and S copies of its keys, each at
    the positions of its copy: `queries[t]` and `keys[s]`; `query` and `key` are copy 0 and key set 0."""

    module: nn.Module
    query: torch.Tensor  # (b, Hkv, G, q, d)
    key: torch.Tensor  # (b, Hkv, k, d)
    value: torch.Tensor  # (b, Hkv, k, dv)
    scaling: float
    softcap: float | None
    q_slot: torch.Tensor  # (q,) key-slot index of each query row: k_len − q_len + r
    offset: torch.Tensor  # (b|1, 1) true position minus slot index, per row (0 without left padding)
    scratch: dict = dataclasses.field(default_factory=dict)  # per-call values a AttentionRule computes in begin()
    queries: tuple = ()  # per position copy: (b, Hkv, G, q, d)
    keys: tuple = ()  # per key set: (b, Hkv, k, d)
    # Position ids that are not the slots' (PoSE's skipped ids, packed rows that restart): (b, k) per key, the
    # queries the last q of them; None when they are the slots plus a per-row offset (`offset`)
    ids: torch.Tensor | None = None
    # With memory entries after the tokens' keys (DeepSeek-V4): the queries' positions (b, q); `ids` then gives every
    # key's, memory entries at the positions the layer rotated them at
    q_ids: torch.Tensor | None = None
    values: tuple = ()  # per key set, where values rotate with their keys (copies.SPLIT); () otherwise
    memory: int = 0  # keys after the tokens' (memory entries)
    # The keys are all this forward's tokens (nothing cached before it): the queries are every key, or its last ones
    # where a layer runs on its input's last tokens but is handed every token's position ids (Gemma 4's KV-shared
    # layers in a prefill under generate's `logits_to_keep`)
    prompt: bool = False

    @property
    def gapped(self) -> bool:
        return self.ids is not None

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q (b, Hkv, G, r, d) · k (b, Hkv, e, d)ᵀ → float32 (b, Hkv, G, r, e), scaled and softcapped. G is folded
        into the row dimension so the kv heads are never repeated (repeat_kv semantics: head h reads kv head h // G)."""
        b, hkv, g, r, d = q.shape
        s = torch.matmul(q.reshape(b, hkv, g * r, d), k.transpose(-1, -2)).view(b, hkv, g, r, -1)
        s = s.float() * self.scaling
        if self.softcap is not None:  # Gemma 2: logits ← c·tanh(logits / c), before bias and mask
            s = torch.tanh(s / self.softcap) * self.softcap
        return s

    def distance(self, rows: slice, start: int, end: int) -> torch.Tensor:
        """i − j for query rows `rows` and key slots [start, end) (negative = future): (r, end − start) int64 in
        slots, or with gapped ids the difference of the position ids, (b, 1, 1, r, end − start) like the scores
        (a distance is the difference of position ids, as the rotary embedding has it)."""
        if self.ids is None:
            return self.q_slot[rows, None] - torch.arange(start, end, device=self.q_slot.device)
        q_ids = (self.ids[:, -self.query.shape[3]:] if self.q_ids is None else self.q_ids)[:, rows]
        return (q_ids[:, :, None] - self.ids[:, None, start:end])[:, None, None]

    def segments(self, rows: slice, start: int, end: int) -> torch.Tensor | None:
        """With gapped ids, (b, 1, 1, r, w) bool: the query and the key are in one segment of the row (a packed row
        restarts its ids: keys of the earlier segment are masked, as packed-sequence attention does); else None."""
        if self.ids is None or self.q_ids is not None:
            return None
        seg = torch.cat([torch.zeros_like(self.ids[:, :1]), (self.ids.diff(dim=-1) <= 0).long()], dim=-1).cumsum(-1)
        q_seg = seg[:, -self.query.shape[3]:][:, rows]
        return (q_seg[:, :, None] == seg[:, None, start:end])[:, None, None]

    def first_slot(self, rows: slice) -> int:
        return self.key.shape[2] - self.memory - self.query.shape[3] + rows.start


Partial = tuple  # (out (b, H, r, d) float32, lse (b, H, r) float32): softmax-weighted values over a subset of keys


def merge(parts: list[Partial], lse: bool = False):
    """softmax over the union of disjoint key sets: Σ_p e^(lse_p − M)·out_p / Σ_p e^(lse_p − M). A row that no part
    covers (a padding query under a flex BlockMask: every lse = −inf) comes out 0, not NaN. With `lse`, the Partial
    of the union: (out, M + ln Σ_p e^(lse_p − M)), −inf for an uncovered row."""
    if len(parts) == 1:
        return parts[0] if lse else parts[0][0]
    top = torch.stack([p_lse for _, p_lse in parts]).amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = [torch.exp(p_lse - top)[..., None] for _, p_lse in parts]
    total = sum(weights)
    out = sum(w * o for w, (o, _) in zip(weights, parts, strict=True)) / total.clamp_min(torch.finfo(total.dtype).tiny)
    return (out, top + torch.log(total[..., 0])) if lse else out


def module_state(module):
    """The `AttnState` a patched attention module carries (registration.py), or a clear error for a module whose
    attention implementation was set by hand."""
    state = getattr(module, STATE, None)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} runs the rope_patch attention function but carries no rope_patch state: the "
            "attention implementation was set by hand. Use rope_patch.apply(model, scheme) / rope_patch.remove(model)."
        )
    return state
