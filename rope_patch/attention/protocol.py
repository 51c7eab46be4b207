"""The protocol between a scheme and the attention functions: `AttentionRule` (what a scheme changes in attention),
`AttentionCall` (one attention call, laid out for GQA), `Partial` softmaxes and their log-sum-exp `merge`."""

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
    `rows` (a slice) against key slots [start, end), before the mask: scaling, softcapping and any additive bias applied.
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


class Plain(AttentionRule):
    """Attention as the model has it: copy 0's queries against key set 0, no bias. What a re-positioning rule runs on
    a layer that handed over one copy (a layer without positions, or one the scheme leaves as it is)."""

    def logits(self, call, rows, start, end):
        return call.qk(call.query[:, :, :, rows], call.key[:, :, start:end])

    def fused_rows(self, heads):
        return 1024

    def fused(self, call, rows, end):
        from .blocked import flash_causal_partial, flash_partial  # the kernels sit above the protocol

        c, q, k, v = call.first_slot(rows), call.query[:, :, :, rows], call.key, call.value
        parts = [flash_partial(call, q, k[:, :, :c], v[:, :, :c])] if c > 0 else []
        return [*parts, flash_causal_partial(call, q, k[:, :, c:end], v[:, :, c:end])]

    def flex(self, call, block_mask):
        from .flex import flex_call

        return flex_call(call, call.query.flatten(1, 2), call.key, call.value, block_mask)


PLAIN = Plain()


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


def merge(parts: list[Partial]) -> torch.Tensor:
    """softmax over the union of disjoint key sets: Σ_p e^(lse_p − M)·out_p / Σ_p e^(lse_p − M). A row that no part
    covers (a padding query under a flex BlockMask: every lse = −inf) comes out 0, not NaN."""
    if len(parts) == 1:
        return parts[0][0]
    top = torch.stack([lse for _, lse in parts]).amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = [torch.exp(lse - top)[..., None] for _, lse in parts]
    total = sum(weights)
    return sum(w * o for w, (o, _) in zip(weights, parts, strict=True)) / total.clamp_min(torch.finfo(total.dtype).tiny)


def stand_in(backend: str, module):
    """The attention function that one of ours stands in for (`backend`: "eager" — the modeling file's own —, "sdpa",
    "flex_attention", "flash_attention_2"): what a module that carries no rope_patch state runs when the model's
    backend is ours. A patched model can hold attention modules the scheme leaves alone (Blt's cross-attention, which
    takes no positions): they attend as the model does."""
    if backend == "eager":
        import sys

        return sys.modules[type(module).__module__].eager_attention_forward
    import transformers

    return transformers.AttentionInterface._global_mapping[backend]


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


def gapped_ids(position_ids: torch.Tensor | None, q_slot: torch.Tensor, offset: torch.Tensor, k_len: int):
    """The position ids (b, n) when they are not the slots plus the per-row offset for the real tokens (a PoSE gap,
    a packed row that restarts at 0), else None. Slots before a row's first real token (left padding: generate gives
    pads the id 1) are not compared. Only a call whose queries are all its keys (no cache) can be judged."""
    if position_ids is None or position_ids.shape[-1] != k_len:
        return None
    ids = position_ids.long().reshape(-1, k_len)
    expected = torch.arange(k_len, device=ids.device) + offset
    real = expected >= 0
    return ids if bool(((ids != expected) & real).any()) else None


def _offsets(position_ids: torch.Tensor | None, q_slot: torch.Tensor) -> torch.Tensor:
    """Per row: true position − slot index. Read at the row's largest position id (a real token under left padding,
    where generate gives pads position 1, and under right padding)."""
    if position_ids is None:
        return torch.zeros(1, 1, dtype=torch.long, device=q_slot.device)
    pos = position_ids.long().reshape(-1, position_ids.shape[-1])
    r = pos.argmax(-1, keepdim=True)
    return pos.gather(-1, r) - q_slot[r]


def placeholder(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
    """In a re-positioned layer whose copies run one after another (attention/copies.py, SEQUENTIAL), the call of a
    copy other than the last (copy 0): keep what the attention will read of it and return zeros of the output's shape
    (b, q, H, dv), which the layer's own code finishes and `Reentry` drops. None otherwise: attend."""
    state = getattr(module, STATE, None)
    current = state.current if state is not None else None
    if current is None or current.stash is None or current.copy == 0:
        return None
    current.stash.keep(current.copy, current.layout, query, key, value)
    b, h, q_len, _ = query.shape
    return query.new_zeros(b, q_len, h, value.shape[-1])


def unstack(module, query, key, value, position_ids, indices=None):
    """Split what a re-positioned layer passed (attention/copies.py): c query copies stacked on the batch axis, keys
    either stacked likewise (no cache) or as S key sets on the head axis (what `CacheView` stored), values of copy 0;
    or, with the copies run one after another, copy 0's here and the others' from the call's `Stash`.
    Returns (queries, keys, value, true position ids); one copy of each for a layer that is not re-positioned."""
    state = module_state(module)
    current = state.current
    if current is not None and current.stash is not None:
        return _gathered(module, state, current, query, key, value, indices)
    if state.recorder is not None:
        state.recorder.seen(query, key, value, module, indices)
    if current is None:
        return (query,), (key,), value, position_ids
    b, layout = current.rows, current.layout
    queries = tuple(query[t * b:(t + 1) * b] for t in range(layout.copies))
    if key.shape[0] == query.shape[0]:  # no cache, or a ROWS cache: every copy's keys, stacked like the queries
        keys = tuple(key[t * b:(t + 1) * b] for t in layout.key_copies)
        # values of every key set where they rotate with the keys (SPLIT), else copy 0's
        value = tuple(value[t * b:(t + 1) * b] for t in layout.key_copies) if current.split else value[:b]
    else:  # a HEADS cache: its key sets, side by side on the head axis
        keys = _cached_sets(module, current, key, value.shape[1])
    return queries, keys, value, current.positions


def _key_sets(key: torch.Tensor, hkv: int, sets: int) -> tuple:
    return tuple(key[:, s * hkv:(s + 1) * hkv] for s in range(sets))


def _cached_sets(module, current, key: torch.Tensor, hkv: int) -> tuple:
    """The key sets a cache handed back: side by side on the head axis, or one set of the model's heads (the sets each
    head's rule picked, `copies.Layout.chosen`)."""
    from .copies import SharedKeys  # copies.py builds on this module

    layout = current.layout
    if layout.chosen and current.cache and not current.stored and len(layout.key_copies) > 1:
        raise SharedKeys(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) attends to keys that "
                         "another layer stored in the cache (KV sharing), and the cache keeps, per key/value head, only "
                         "the key set the storing layer's prompt picked. The apply-time check (rope_patch.apply's "
                         "default, check=True) finds such layers and keeps every key set in the cache instead.")
    if layout.chosen and key.shape[1] == hkv:
        return (key,)
    return _key_sets(key, hkv, len(layout.key_copies))


def _gathered(module, state, current, query, key, value, indices):
    """`unstack` for copy 0's call of a SEQUENTIAL layer: its own query and key plus the stashed copies. The keys come
    as the cache's key sets on the head axis (S·Hkv heads) when a cache stored them, else one copy's per call."""
    stash, layout = current.stash, current.layout
    stash.keep(0, layout, query, key, value)
    queries = tuple(stash.queries.get(t) for t in range(layout.copies))
    kept = layout.key_copies
    # a layer that reads another layer's cache (KV sharing) stores nothing itself: its key sets are recognised by shape
    from_cache = stash.cached or (len(kept) > 1 and key.shape[1] == len(kept) * value.shape[1])
    if from_cache or (layout.chosen and current.cache):
        keys = _cached_sets(module, current, key, value.shape[1])
    else:
        keys = tuple(stash.keys[t] for t in kept)
    if state.recorder is not None:  # the check reads the copies stacked, as the stacked call hands them over
        every = range(layout.copies)
        state.recorder.seen(torch.cat([stash.queries[t] for t in every]),
                            key if from_cache else torch.cat([stash.keys[t] for t in every]),
                            value if from_cache else torch.cat([stash.values[t] for t in every]), module, indices)
    return queries, keys, value, current.positions


def begin(state, call: AttentionCall) -> None:
    """The rule's `begin`, then the cache store a prompt's `CacheView` left for after it (`copies.Current.pending`:
    the keys kept as the rule picks them in `begin`)."""
    state.scores.begin(call)
    current = state.current
    if current is not None and current.pending is not None:
        store, current.pending = current.pending, None
        store()


def make_call(module, query, key, value, scaling, softcap, position_ids, indices=None) -> AttentionCall:
    queries, keys, value, position_ids = unstack(module, query, key, value, position_ids, indices)
    values = value if isinstance(value, tuple) else ()
    value = values[0] if values else value
    b, h, q_len, d = queries[0].shape
    hkv, k_len = keys[0].shape[1], keys[0].shape[2]
    if h % hkv:
        raise ValueError(f"{h} query heads cannot share {hkv} key/value heads")
    current = module_state(module).current
    # keys that are tokens: all of them, but in a layer with memory (copies.memory_rotaries), whose entries follow the
    # tokens' keys (as many as the cache returned, else as the queries)
    memory_layer = current is not None and current.memory_layer
    tokens = (current.tokens or q_len) if memory_layer else k_len
    memory = k_len - tokens
    q_slot = torch.arange(tokens - q_len, tokens, device=query.device)
    queries = tuple(q.view(b, hkv, h // hkv, q_len, d) if q is not None else None for q in queries)
    offset = _offsets(position_ids, q_slot)
    q_ids = None
    if memory > 0:  # memory entries after the tokens' keys (DeepSeek-V4): every key's position explicit
        placed = current.memory(memory)
        if placed is None:
            raise NotPlaced(f"{type(module).__name__} attends to {memory} keys beyond its {tokens} tokens, and no "
                            "rotation inside the layer made them at positions, so no scheme can place them")
        token_ids = torch.arange(tokens, device=query.device) + offset
        ids = torch.cat([token_ids.expand(b, -1), placed.to(token_ids).expand(b, -1)], dim=-1)
        q_ids = token_ids.expand(b, -1)[:, -q_len:]
        if recorder := module_state(module).recorder:
            recorder.placed = True
    else:
        # gapped ids come without a cache or into an empty one (a cache holding keys is refused before the forward,
        # schemes/common.py CacheGuard): the queries' ids are every key's
        ids = gapped_ids(position_ids, q_slot, offset, k_len) if k_len == q_len else None
    return AttentionCall(module, queries[0], keys[0], value, scaling if scaling is not None else d**-0.5,
                         softcap, q_slot, offset, queries=queries, keys=keys, ids=ids, q_ids=q_ids, values=values,
                         memory=memory)


class NotPlaced(RuntimeError):
    """Keys beyond the tokens' (memory entries) whose positions the layer did not make through a rotary."""


def own_rows(module, mask):
    """The rows of `mask` that belong to the copy at the tokens' own positions of a re-positioned layer (copy 0 unless
    a later copy is: DCA's extra copy on a layer that builds its memory's causality inside itself); the mask itself
    otherwise. Its tensors reach the layer repeated for every copy (attention/copies.py), or made by the layer per copy."""
    from .copies import own_copy  # copies.py builds on this module

    current = module_state(module).current
    if current is None or not isinstance(mask, torch.Tensor) or mask.shape[0] != current.rows * current.layout.copies:
        return mask
    own, b = own_copy(current.layout), current.rows
    return mask[own * b:(own + 1) * b]


def restack(module, out: torch.Tensor) -> torch.Tensor:
    """The output (b, q, H, dv) of a re-positioned layer's attention, padded with zeros to the c·b rows the layer's
    own code expects (it reshapes by its stacked batch; only copy 0's rows are kept, by `copies.Reentry`)."""
    current = module_state(module).current
    if current is None or current.layout.copies == 1 or current.stash is not None:  # one copy's rows: copy 0's
        return out
    return torch.cat([out, out.new_zeros(((current.layout.copies - 1) * out.shape[0], *out.shape[1:]))])
