"""The runtime of an attention call: what a backend does with the arguments transformers hands it before the rule
runs. `make_call` splits a re-positioned layer's stacked copies (attention/copies.py) into an `AttentionCall` (query
copies, key sets, true positions, gapped ids, memory entries); `begin` runs the rule's `begin`; `placeholder`,
`own_rows` and `restack` fit the copies' rows in and out; `stand_in` is the function a module without rope_patch
state runs."""

from __future__ import annotations

import sys

import torch
import transformers

from .copies import SharedKeys, own_copy
from .protocol import AttentionCall, module_state


def stand_in(backend: str, module):
    """The attention function that one of ours stands in for (`backend`: "eager" — the modeling file's own —, "sdpa",
    "flex_attention", "flash_attention_2"): what a module that carries no rope_patch state runs when the model's
    backend is ours. A patched model can hold attention modules the scheme leaves alone (Blt's cross-attention, which
    takes no positions): they attend as the model does."""
    if backend == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return transformers.AttentionInterface._global_mapping[backend]


def gapped_ids(position_ids: torch.Tensor | None, offset: torch.Tensor, k_len: int):
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
    where generate gives pads position 1, and under right padding).

    The ids are those of the call's last n slots, n their length: the queries' own (n = q_len), or more where a layer
    runs on its input's last tokens only but is handed every token's ids (Gemma 4's KV-shared layers, which generate's
    `logits_to_keep` cuts to the last query in a prefill, reading every prompt key from an earlier layer)."""
    if position_ids is None:
        return torch.zeros(1, 1, dtype=torch.long, device=q_slot.device)
    pos = position_ids.long().reshape(-1, position_ids.shape[-1])
    end = q_slot[-1] + 1
    slots = torch.arange(end - pos.shape[-1], end, device=q_slot.device)  # = q_slot when the ids are the queries'
    r = pos.argmax(-1, keepdim=True)
    return pos.gather(-1, r) - slots[r]


def placeholder(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
    """In a re-positioned layer whose copies run one after another (attention/copies.py, SEQUENTIAL), the call of a
    copy other than the last (copy 0): keep what the attention will read of it and return zeros of the output's shape
    (b, q, H, dv), which the layer's own code finishes and `Reentry` drops. None otherwise: attend."""
    current = module_state(module).current
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
    queries = query.split(b)
    if key.shape[0] == query.shape[0]:  # no cache, or a ROWS cache: every copy's keys, stacked like the queries
        keys = tuple(key.split(b)[t] for t in layout.key_copies)
        # values of every key set where they rotate with the keys (SPLIT), else copy 0's
        value = tuple(value.split(b)[t] for t in layout.key_copies) if current.split else value[:b]
    else:  # a HEADS cache: its key sets, side by side on the head axis
        keys = _cached_sets(module, current, key, value.shape[1])
    return queries, keys, value, current.positions


def _cached_sets(module, current, key: torch.Tensor, hkv: int) -> tuple:
    """The key sets a cache handed back: side by side on the head axis, or one set of the model's heads (the sets each
    head's rule picked, `copies.Layout.chosen`)."""
    layout = current.layout
    if layout.chosen and current.cache and not current.stored and len(layout.key_copies) > 1:
        raise SharedKeys(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) attends to keys "
                         "that another layer stored in the cache (KV sharing), and the cache keeps, per key/value "
                         "head, only the key set the storing layer's prompt picked. The apply-time check "
                         "(rope_patch.apply's default, check=True) finds such layers and keeps every key set in the "
                         "cache instead.")
    return key.split(hkv, dim=1)[:len(layout.key_copies)]  # one set where the cache keeps each head's pick


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
    # the ids as the layer passed them to attention: a layer cut to its last queries passes every token's (Gemma 4);
    # a re-positioned layer's true ones come from its position embeddings, cut alike or, where the model rotates every
    # cached key again at each step (Qwen4-Exp's indexer), the whole history's, which says nothing of a prompt
    handed = position_ids
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
    tokens = (current.tokens or q_len) if current is not None and current.memory_layer else k_len
    memory = k_len - tokens
    q_slot = torch.arange(tokens - q_len, tokens, device=query.device)
    prompt = q_len == k_len or (handed is not None and handed.shape[-1] == k_len)  # memory entries are no tokens
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
        ids = gapped_ids(position_ids, offset, k_len) if prompt else None
    return AttentionCall(module, queries[0], keys[0], value, scaling if scaling is not None else d**-0.5,
                         softcap, q_slot, offset, queries=queries, keys=keys, ids=ids, q_ids=q_ids, values=values,
                         memory=memory, prompt=prompt)


class NotPlaced(RuntimeError):
    """Keys beyond the tokens' (memory entries) whose positions the layer did not make through a rotary."""


def own_rows(module, mask):
    """The rows of `mask` that belong to the copy at the tokens' own positions of a re-positioned layer (copy 0 unless
    a later copy is: DCA's extra copy on a layer that builds its memory's causality inside itself); the mask itself
    otherwise. Its tensors reach the layer repeated for every copy (attention/copies.py), or made by the layer per
    copy."""
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
