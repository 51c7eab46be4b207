"""Re-positioned attention: an attention layer's own code, run at several sets of positions at once.

The schemes that give queries and keys positions other than their own (Self-Extend, ReRoPE, leaky ReRoPE, STRING, DCA)
need q and k exactly as the model computes them at those positions: after its own rotation and whatever the layer does
between the rotation and the scores (q/k norms after RoPE, partial-rotary splits, MLA's rope/nope split, layers
without RoPE). So the layer's own `forward` runs on c copies of its input:

    copy t      hidden states h (the same), position embeddings and position ids at map_t(p)
    module      its own projections, norms, rotation, post-rotation operations, cache update, attention call
    attention   rope_patch's function reads copy t's queries and the key copies a scheme keeps, and combines them
                per (query, key) pair by the scheme's regions (near / far, DCA's intra / successive / inter)

Nothing is assumed beyond "positions reach the layer as position embeddings from a rotary module (or as position
ids)"; a layer that ignores positions gives identical copies. Every rotary module of a patched model returns its
(cos, sin) as `Tagged` (the rotary and its arguments), so a layer's copies are made by the rotary that made its
embeddings.

The cache keeps what the scheme's math fixes once a key is written: the keys of `Layout.key_copies`, side by side on
the head axis (b, S·Hkv, n, d), and the values once (`CacheView`); decoding rotates only the new token. Where each KV
head reads one key set the rule picks from the prompt (`Layout.chosen`, Ms-PoE), the cache keeps that set alone.

How the copies run (the cache mode the apply-time check picks, attention/plumbing.py): one after another where the
layer allows (SEQUENTIAL: copy 0 last; earlier copies leave their queries and keys in a `Stash`; the layer's input
projections run once), else stacked on the batch axis (HEADS, ROWS) for layers whose copies share cache state beside
keys and values (a sparse-attention indexer's, a conv state).

Memory entries and K = V (DeepSeek-V4): entries a layer appends to its keys, rotated by a rotary of its own at w·m,
are made by copy t at map_t(w·m) (`MemoryPositions`) and cached with their positions (`MemoryLayerView`); the
attention function places every key by its position. Where values rotate with their keys and the output is rotated
back at the query's position, values are read per key set and each query copy's part of the output goes through the
layer's own code at that copy's positions, the parts summed (`SPLIT`; stacked).

Cost: the layer's code after its input projections runs c times (c = 2 for STRING, 3 for the others); attention reads
each key once. The cache holds S key copies and one value copy: (S + 1)/2 of vanilla.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..discovery import is_rotary
from ..rotary import embed, recover, source
from . import settings
from .protocol import module_state

PositionMap = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Identity:
    """p ↦ p: the tokens' own positions."""

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        return p


@dataclasses.dataclass(frozen=True)
class Layout:
    """The position copies a layer runs at and which of them the cache keeps keys of.

    `maps[t]` gives copy t's positions from the true ones; `key_copies` lists the copies whose keys the attention
    reads (key set s is copy key_copies[s]); values are read from copy 0 (values do not depend on positions);
    `query_copies` the copies whose queries it reads (None: all; a copy that only supplies keys, Self-Extend's far
    keys, need not be kept while the copies run one after another); `chosen`: each KV head reads one key set, which
    the rule picks from a prompt (`AttentionRule.chosen_sets`: Ms-PoE's ratio per head), so the cache keeps that set
    alone, as many key heads as the model's (`CacheView`)."""

    maps: tuple[PositionMap, ...]
    key_copies: tuple[int, ...] = (0,)
    query_copies: tuple[int, ...] | None = None
    chosen: bool = False

    @property
    def copies(self) -> int:
        return len(self.maps)


def own_copy(layout: Layout) -> int:
    """The copy at the tokens' own positions: copy 0, unless a later copy is and copy 0 is not (DCA's extra copy on a
    layer with memory, schemes/chunked.py); 0 when none is. A layer's mask and a sparse indexer's choice are read
    from it."""
    return next((t for t, m in enumerate(layout.maps) if isinstance(m, Identity)), 0)


def _rows(t: torch.Tensor, b: int) -> torch.Tensor:
    return t.expand(b, *t.shape[1:]) if t.shape[0] != b else t


def _id_rows(ids: torch.Tensor, b: int) -> torch.Tensor:
    """Position ids (b|1, n), or (sections, b|1, n) for M-RoPE, with b rows: the batch axis is the second last."""
    return ids.expand(*ids.shape[:-2], b, ids.shape[-1]) if ids.shape[-2] != b else ids


def stack_embeddings(embeddings, maps: Sequence[PositionMap], b: int, key) -> object:
    """The embeddings of every copy, stacked on the batch axis (copy t's rows t·b … (t + 1)·b − 1). Memoised on the
    tagged object per layout (`key`): the decoder hands the same embeddings to every layer."""
    if key in embeddings.memo:
        return embeddings.memo[key]
    parts = [_at(embeddings, m) for m in maps]
    if isinstance(embeddings, tuple):
        out = tuple(torch.cat([_rows(p[i], b) for p in parts]) for i in range(len(embeddings)))
    else:  # Llama 4: one complex tensor
        out = torch.cat([_rows(p, b) for p in parts])
    embeddings.memo[key] = out
    return out


class NotProven(RuntimeError):
    """A layer did something with its cache that the stacked copies are not proven to preserve."""


class SharedKeys(NotProven):
    """A layer attends to keys another layer stored (KV sharing) under a layout whose cache keeps, per KV head, the one
    key set the storing layer's rule picked (`Layout.chosen`): the reading layer's own pick cannot be served. The
    apply-time check (plumbing.verify) then installs the layout keeping every set."""


def _repeated(value, b: int, c: int):
    """A per-row tensor (first axis b) repeated for the c copies; a tuple or a plain dict of such (Zaya's {"causal",
    "conv"} masks) entry by entry; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == b:
        return value.repeat(c, *([1] * (value.dim() - 1)))
    if type(value) is dict:
        return {k: _repeated(v, b, c) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(_repeated(v, b, c) for v in value)
    return value


def _copy_zero(out, b: int, c: int):
    """What the layer returns, as copy 0's: every tensor of c·b rows cut to its first b (the output, and what some
    layers hand the next one, as HunYuan-V4's top-k indices)."""
    if isinstance(out, tuple):
        return tuple(_copy_zero(x, b, c) for x in out)
    if isinstance(out, torch.Tensor) and out.dim() and out.shape[0] == b * c:
        return out[:b]
    return out


def _copy_zero_method(method, b: int, c: int):
    """A cache method called with the copies' rows: called with copy 0's, its tensors handed back for every copy."""

    def call(*args, **kwargs):
        kwargs = {k: _copy_zero(v, b, c) for k, v in kwargs.items()}
        return _repeated(method(*_copy_zero(args, b, c), **kwargs), b, c)

    return call


def _per_copy(sets: Sequence[torch.Tensor], kept: Sequence[int], copies: int) -> torch.Tensor:
    """Set s as copy kept[s]'s rows, the copies stacked on the batch axis; a copy whose keys the scheme never reads
    gets set 0 (they are never read)."""
    return torch.cat([sets[kept.index(t)] if t in kept else sets[0] for t in range(copies)])


def _summed(out, b: int, c: int):
    """The layer's output (its first tensor of c·b rows) as the sum of the copies' rows; the rest as copy 0's."""
    if not isinstance(out, tuple):
        return sum(out.split(b))
    return (sum(out[0].split(b)), *_copy_zero(out[1:], b, c))


HEADS, ROWS = "heads", "rows"  # how a cache hands the stored copies back to the layer
SEQUENTIAL = "sequential"  # the copies run one after another, the cache as HEADS (`Reentry`)


@dataclasses.dataclass
class Stash:
    """What the attention reads of the copies that ran before the last one (copy 0), in a `SEQUENTIAL` call: queries
    and keys per copy as the layer handed them to attention, and the keys it gave its cache (`CacheView`). Everything
    when `everything` (the apply-time check compares every copy)."""

    everything: bool = False
    queries: dict = dataclasses.field(default_factory=dict)
    keys: dict = dataclasses.field(default_factory=dict)
    values: dict = dataclasses.field(default_factory=dict)
    cache_keys: dict = dataclasses.field(default_factory=dict)
    cached: bool = False  # copy 0 stored the key sets in the cache: its attention reads them from there

    def keep(self, t: int, layout: Layout, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.everything or layout.query_copies is None or t in layout.query_copies:
            self.queries[t] = query
        if self.everything or t in layout.key_copies:
            self.keys[t] = key
        if self.everything:
            self.values[t] = value


# ROWS, with values read per key set and the attention output split by query copy, each copy's part run through the
# layer's own code after attention at that copy's positions and the parts summed: for layers whose values rotate with
# their keys and whose output is rotated back at the query's position (DeepSeek-V4's K = V), so that a pair placed at
# (P_q, P_k) contributes its value at P_k rotated back at P_q, as the layer treats a query at P_q and a key at P_k
SPLIT = "split"


def memory_rotaries(module: nn.Module) -> list[nn.Module]:
    """Rotary modules held by a part of an attention layer (DeepSeek-V4's compressor and its indexer): they rotate
    memory entries, keys appended after the tokens', at positions the part makes itself (entry w at w·m, the first
    token of its block), not at the position ids the layer is handed. A rotary the layer holds directly (Moshi,
    RecurrentGemma) rotates its queries and keys at the ids it is handed: not one of these. Recognised by what a
    rotary holds (`discovery.is_rotary`), not by its class name."""
    direct = {id(c) for c in module.children()}
    return [m for m in module.modules() if m is not module and id(m) not in direct and is_rotary(m)]


class MemoryPositions:
    """Forward pre-hooks on a layer's memory rotaries for one call of the layer on its c stacked copies: a call at
    positions of the layer's own making (not `given`, the ids the layer was handed) is recorded (copy 0's rows: the
    entries' own positions) and made, for copy t's rows, at map_t of those positions, so copy t's memory entries are
    keys at map_t(p) like its tokens. Removed when the call ends."""

    def __init__(self, rotaries: Sequence[nn.Module], maps: Sequence[PositionMap], b: int, given, seen: list):
        self.maps, self.b, self.given, self.seen = maps, b, given, seen
        self.hooks = [r.register_forward_pre_hook(self, with_kwargs=True) for r in rotaries]

    def __call__(self, rotary, args, kwargs):
        arguments = dict(forward_signature(type(rotary)).bind(rotary, *args, **kwargs).arguments)
        arguments.pop("self")
        ids = arguments.get("position_ids")
        if ids is None or ids is self.given:
            return None
        own = ids[:self.b] if ids.shape[0] == self.b * len(self.maps) else ids.expand(self.b, *ids.shape[1:])
        self.seen.append(own)
        arguments["position_ids"] = torch.cat([_rows(m(own), self.b) for m in self.maps])
        return (), arguments

    def close(self):
        for hook in self.hooks:
            hook.remove()


class CacheView:
    """The cache as a layer of a re-positioned model sees it.

    `update` stores what the scheme reads: the keys of the key copies, side by side on the head axis (b, S·H, n, d),
    so the cache keeps the model's batch (beam search's reordering, cropping and offloading act on the batch and
    sequence axes as before). Three ways, chosen per model by the apply-time check (attention/plumbing.py):

        SEQUENTIAL  the copies run one after another (`Reentry`): a copy before the last hands its keys over and gets
                    them back as they are (the cache is not touched); the last, copy 0, stores the key sets and its
                    values once and gets what the cache returns, as HEADS. Any other method of the cache, called by
                    a copy before the last, is refused (`NotProven`): the check then takes HEADS.
        HEADS       the values once (copy 0: values do not depend on positions), and the stored tensors handed back as
                    they are: the attention function reads key set s from the head axis. For layers that pass what the
                    cache returns straight to attention (most), at (S + 1)/2 of vanilla's cache memory.
        ROWS        both tensors of every key copy, handed back as c copies stacked on the batch axis again, as the
                    layer's own code computed them: for layers that process what the cache returns (DeepSeek's MLA
                    caches its latent and expands it afterwards). S times vanilla's cache memory, and a copy per step.

    Reads a layer makes pass through. With the copies stacked, any other method (a sparse-attention indexer's
    `update_indexer`, a conv state of Zaya's projections) keeps copy 0's rows and hands its results back repeated for
    every copy: exact for copy 0, which is all the layer reads from such state when it is position-free or only feeds
    copy 0's choices (the indexer's top-k: rope_patch's function reads copy 0's); the apply-time check compares the
    copies' queries and keys with the layer's own at other positions, in the cached steps too, so a state that would
    carry copy 0's positions into another copy is caught there."""

    READS = frozenset({"get_seq_length", "get_mask_sizes", "is_compileable", "is_sliding", "get_max_cache_shape",
                       "max_batch_size", "max_cache_len", "is_initialized"})

    def __init__(self, cache, current: Current, mode: str, rule):
        # `current`: the layer call's (Reentry makes it), what the attention function reads besides q, k, v; `rule`:
        # the layer's, which picks the key sets a `Layout.chosen` cache keeps
        self._cache, self._current, self._mode, self._rule = cache, current, mode, rule

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        current, mode = self._current, self._mode
        kept, b, stash = current.layout.key_copies, current.rows, current.stash
        if mode == SEQUENTIAL and current.copy != 0:  # its keys wait for copy 0's call, which stores them all once
            if current.copy in kept:
                stash.cache_keys[current.copy] = key_states
            return key_states, value_states
        if mode == SEQUENTIAL:
            stash.cached = True
            sets = [key_states if t == 0 else stash.cache_keys.pop(t) for t in kept]
            out = self._store(sets, value_states, layer_idx, args, kwargs)
        elif mode == HEADS:
            out = self._store([key_states.split(b)[t] for t in kept], value_states[:b], layer_idx, args, kwargs)
        else:  # ROWS: every key copy's keys and values, side by side on the head axis
            keys, values = (torch.cat([x.split(b)[t] for t in kept], dim=1) for x in (key_states, value_states))
            out = self._cache.update(keys, values, layer_idx, *args, **kwargs)
            # handed back as the c copies stacked on the batch axis
            out = tuple(_per_copy(x.chunk(len(kept), dim=1), kept, current.layout.copies) for x in out)
        current.tokens = out[0].shape[-2]  # the keys that are tokens: the memory entries a layer appends come after
        self._note_head(layer_idx)
        return out

    def _store(self, sets: list, values: torch.Tensor, layer_idx, args, kwargs):
        """HEADS and SEQUENTIAL: the key sets side by side on the head axis and the values once. With `Layout.chosen`,
        only the key set the rule picked for each KV head (`chosen_keys`): vanilla's cache. A prompt (the layer's cache
        still empty) is stored once its attention has picked them (`Current.pending`, run after the rule's `begin`) and
        handed back as every set, as an empty cache hands back its first update: what it was given (static caches,
        which pad, are refused by schemes/common.CacheGuard)."""
        current = self._current
        current.stored = True
        keys = torch.cat(sets, dim=1) if len(sets) > 1 else sets[0]
        if not current.layout.chosen or len(sets) == 1 or current.memory_layer:
            return self._cache.update(keys, values, layer_idx, *args, **kwargs)

        def store():
            chosen = chosen_keys(sets, self._rule.chosen_sets(layer_idx, current.rows))
            return self._cache.update(chosen, values, layer_idx, *args, **kwargs)

        if self._cache.get_seq_length(layer_idx) == 0:
            current.pending = store
            return keys, values
        return store()

    def _note_head(self, layer_idx) -> None:
        """A cache layer that evicts from the middle (StreamingLLM's sink cache, schemes/sink.py) says how many leading
        slots it handed back at their own positions before a contiguous run that ends at the queries (`kept_head`,
        None while it has evicted nothing): the attention function reads it from `Current`."""
        layers = getattr(self._cache, "layers", None)
        if isinstance(layers, (list, tuple)) and isinstance(layer_idx, int):
            layer = layers[layer_idx] if layer_idx < len(layers) else None
            self._current.kept_head = getattr(layer, "kept_head", None)

    @property
    def layers(self):
        """The cache layers, as a layer that reads them directly sees them: DeepSeek-V4's compressors keep their
        state (buffered tokens, memory entries) on the layer (`MemoryLayerView`)."""
        if not self._current.memory_layer:
            return self._cache.layers
        return [MemoryLayerView(layer, self._current) for layer in self._cache.layers]

    def __getattr__(self, name):
        found = getattr(self._cache, name)
        if name in CacheView.READS or not callable(found):
            return found
        if self._mode != SEQUENTIAL:
            return _copy_zero_method(found, self._current.rows, self._current.layout.copies)
        if self._current.copy != 0:  # state the copy would write before copy 0 does: not proven to be position-free
            raise NotProven(f"calls its cache's `{name}` (state beside the keys and values), which the position "
                            "copies run one after another would write once per copy")
        return found


def chosen_keys(sets: Sequence[torch.Tensor], chosen: torch.Tensor) -> torch.Tensor:
    """(b, Hkv, n, d): KV head g of row r from key set chosen[r, g]; sets (S of (b, Hkv, n, d)), chosen (b, Hkv)."""
    return torch.take_along_dim(torch.stack(list(sets), dim=2), chosen[:, :, None, None, None], dim=2)[:, :, 0]


class MemoryLayerView:
    """A cache layer as a re-positioned layer's memory compressor sees it (DeepSeek-V4's `store_compression_weights`,
    `update_overlap_state`, `update_compressor_states`). What the compressor stores of its input (buffered tokens, an
    overlap window) is the same for every copy: copy 0's rows are stored, handed back repeated. The memory entries it
    appends are rotated at each copy's positions: copy 0's go to the layer's own list, the other key copies' to lists
    of their own in the same `compressed_kv` dict of the layer (so a beam reorder or reset reaches them), with the
    entries' own positions beside them; the running lists come back stacked by copy (a copy whose keys the scheme
    never reads gets key set 0's). A cache layer without that dict fails the apply-time check."""

    def __init__(self, layer, current: Current):
        self._layer, self._current = layer, current

    def update_compressor_states(self, name, compressed):
        current = self._current
        b, layout = current.rows, current.layout
        if compressed.shape[0] != b * layout.copies:
            return self._layer.update_compressor_states(name, compressed)
        # the key copies' entries, and the entries at the tokens' own positions, from which a sparse indexer chooses
        own, rows = own_copy(layout), compressed.split(b)
        kept = layout.key_copies if own in layout.key_copies else (*layout.key_copies, own)
        sets = [self._layer.update_compressor_states(name, rows[kept[0]])]
        sets += [self._append(f"{name}:rope_patch_copy{t}", rows[t]) for t in kept[1:]]
        if current.seen and compressed.shape[1] > 0:
            new = current.seen[-1].expand(b, -1)[:, -compressed.shape[1]:]
        else:
            new = compressed.new_zeros(b, 0, dtype=torch.long)
        current.seen.append(self._append(f"{name}:rope_patch_positions", new))
        return _per_copy(sets, kept, layout.copies)

    def _append(self, key: str, new: torch.Tensor) -> torch.Tensor:
        store = self._layer.compressed_kv
        old = store.get(key)
        store[key] = new if old is None else torch.cat([old, new], dim=1)
        return store[key]

    def __getattr__(self, name):
        found = getattr(self._layer, name)
        if not callable(found):
            return found
        return _copy_zero_method(found, self._current.rows, self._current.layout.copies)


@functools.cache
def forward_signature(cls: type) -> inspect.Signature:
    """The signature of a module class's `forward` (read on every call of a re-positioned or checked layer)."""
    return inspect.signature(cls.forward)


CACHE_ARGS = ("cache", "past_key_values", "layer_past")


@dataclasses.dataclass
class Current:
    """What the attention function needs beyond its arguments during one re-positioned layer call."""

    rows: int  # b: the batch the decoder has; the query batch is copies · b (b when the copies run one by one)
    positions: torch.Tensor | None  # (b|1, n) the true position ids of the queries
    layout: Layout
    copy: int = 0  # SEQUENTIAL: the copy this call of the layer computes
    stash: Stash | None = None  # SEQUENTIAL: what the earlier copies left for the attention of copy 0 (None: stacked)
    # set by `CacheView` when the cache layer evicted keys from the middle: the keys are its first `kept_head` slots
    # (at their own positions) and then a contiguous run ending at the queries (None: contiguous from slot 0)
    kept_head: int | None = None
    split: bool = False  # values per key set, the output split by query copy (SPLIT)
    seen: list = dataclasses.field(default_factory=list)  # positions of memory entries, as the layer made them
    tokens: int | None = None  # keys that are tokens (from the cache; None: as many as the queries)
    memory_layer: bool = False  # the layer holds memory rotaries (`memory_rotaries`)
    cache: bool = False  # the layer was handed a cache
    stored: bool = False  # ... and stored its keys in it (a layer that reads another layer's keys does not: KV sharing)
    pending: Callable[[], object] | None = None  # a prompt's store, left for after the rule's `begin` (`CacheView`)

    def memory(self, count: int) -> torch.Tensor | None:
        """(b|1, count) positions of the `count` memory entries after the tokens' keys: the last positions the layer
        made for that many entries (DeepSeek-V4: its compressor's, then its indexer's, the same w·m); None if none."""
        return next((p for p in reversed(self.seen) if p.shape[-1] == count), None)


class Reentry:
    """The `forward` of a re-positioned attention module (an instance attribute, installed through the undo log):
    runs the module's own class forward on the copies (see the module docstring) and returns copy 0's output.

    Two ways, by the cache mode the apply-time check chose: SEQUENTIAL runs the forward once per copy on the layer's
    own batch, the copies other than 0 first (each leaves its queries and keys in a `Stash`; its attention returns
    zeros), copy 0 last (its attention reads them all); so the layer's activations are held once, plus the stashed
    queries and keys; a decoding step (at most settings.DECODE_ROWS tokens) runs stacked as HEADS, one call instead
    of c, with the same cache layout. HEADS and ROWS run it once on the c copies stacked on the batch axis and cut
    copy 0's rows.

    An object of a module-level class holding only the module, its layout and cache mode, and the module's memory
    rotaries, so a patched model deep-copies and pickles."""

    def __init__(self, module: nn.Module, layout: Layout, cache_mode: str = HEADS):
        self.module, self.layout, self.cache_mode = module, layout, cache_mode
        self.memory = memory_rotaries(module)  # found once (a walk of the layer's modules)

    def __call__(self, *args, **kwargs):
        module = self.module
        call = dict(forward_signature(type(module)).bind(module, *args, **kwargs).arguments)
        call.pop("self", None)
        call.update(call.pop("kwargs", {}))  # the layer's **kwargs: passed on as keywords like its other arguments
        embeddings = call.get("position_embeddings")
        several = type(embeddings) is dict  # DeepSeek-V4: {"main", "compress"}
        tagged = {kind: self._tagged(made) for kind, made in (embeddings if several else {None: embeddings}).items()}
        made = next((m for m in tagged.values() if m is not None), None)
        positions = made.position_ids if made is not None else call.get("position_ids")
        if positions is None:  # no positions reach the layer (a NoPE layer): nothing to move, it runs as it is
            return self._run(call, None, positionless=True)  # a rule that needs positions can refuse
        recorder = module_state(module).recorder
        hidden = call[next(iter(call))]
        if (recorder is not None and made is not None and isinstance(hidden, torch.Tensor) and hidden.dim() > 1
                and positions.shape[-1] > hidden.shape[1]):
            # embeddings for more positions than the layer's tokens (every cached key's, at a decoding step: Qwen4-Exp's
            # indexer rotates them all again): something in the layer reads every key's position, at copy 0's
            recorder.rereads.add(module)
        # SEQUENTIAL: a prefill holds the layer's activations once; a decoding step runs stacked as HEADS (one call
        # costs less than c; the cache is laid out alike), and so does a layer with memory entries (DeepSeek-V4)
        if self.cache_mode == SEQUENTIAL and positions.shape[-1] > settings.DECODE_ROWS and not self.memory:
            return self._sequential(call, positions, tagged, several)
        return self._stacked(call, positions, tagged, several)

    def _tagged(self, made):
        """Position embeddings as a rotary module of the model made them (`Tagged`: a decoder's slice is recovered)."""
        if made is None or source(made) is not None:
            return made
        recovered = recover(made, module_state(self.module).rotaries)
        if recovered is None:
            raise NotProven(f"{type(self.module).__name__} received position embeddings that no rotary module of the "
                            "model made, so they cannot be made at other positions")
        return recovered

    @staticmethod
    def _place(call: dict, tagged: dict, several: bool, embeddings_at, ids_at) -> None:
        """`call`'s position embeddings and position ids moved to a copy's positions (or every copy's, stacked)."""
        if any(v is not None for v in tagged.values()):
            moved = {k: embeddings_at(v) if v is not None else None for k, v in tagged.items()}
            call["position_embeddings"] = moved if several else moved[None]
        if call.get("position_ids") is not None:
            # Copy t sees the ids map_t(p) too: layers that rotate with a rotary of their own (Moshi, RecurrentGemma)
            # or scale by position after RoPE (Ministral 3's Llama 4 temperature) compute copy t at map_t(p) as well.
            call["position_ids"] = ids_at(call["position_ids"])

    def _cached(self, call: dict, current: Current, mode: str) -> None:
        """`call`'s caches seen through a `CacheView` of this layer call."""
        for name in CACHE_ARGS:
            if call.get(name) is not None:
                call[name] = CacheView(call[name], current, mode, module_state(self.module).scores)
                current.cache = True

    def _stacked(self, call: dict, positions: torch.Tensor, tagged: dict, several: bool):
        """The forward once on the c copies stacked on the batch axis; copy 0's rows of what it returns (SPLIT: the
        copies' parts summed). A layer's memory rotaries make each copy's entries at its positions meanwhile."""
        layout, c = self.layout, self.layout.copies
        b = call[next(iter(call))].shape[0]  # the layer input, whatever the architecture calls it
        current = Current(b, _true(positions), layout, split=self.cache_mode == SPLIT, memory_layer=bool(self.memory))
        self._place(call, tagged, several, lambda e: stack_embeddings(e, layout.maps, b, id(layout)),
                    lambda ids: torch.cat([_id_rows(m(ids), b) for m in layout.maps], dim=-2))
        self._cached(call, current, {SEQUENTIAL: HEADS, SPLIT: ROWS}.get(self.cache_mode, self.cache_mode))
        # Whatever else the layer receives per row (its input, a mask, a position-dependent query scale computed by
        # the decoder, as Beam's NoPE layers get) is the same for every copy: only positions differ between copies.
        for name, value in call.items():
            if name not in ("position_embeddings", "position_ids", *CACHE_ARGS):
                call[name] = _repeated(value, b, c)
        memory = MemoryPositions(self.memory, layout.maps, b, call.get("position_ids"), current.seen)
        try:
            out = self._run(call, current)
        finally:
            memory.close()
        if current.split:  # each copy's part of the attention output went through the layer's code: their sum
            return _summed(out, b, c)
        return _copy_zero(out, b, c)

    def _sequential(self, call: dict, positions: torch.Tensor, tagged: dict, several: bool):
        """The forward once per copy, copy 0 last (see the class docstring); what its last call returns."""
        module, layout = self.module, self.layout
        hidden = call[next(iter(call))]
        stash = Stash(everything=module_state(module).recorder is not None)
        with _projections_once(module, hidden):
            for t in reversed(range(layout.copies)):
                at, one = layout.maps[t], dict(call)
                current = Current(hidden.shape[0], _true(positions), layout, t, stash)
                self._place(one, tagged, several, functools.partial(_at, at=at), at)
                self._cached(one, current, SEQUENTIAL)
                out = self._run(one, current)
        return out

    def _run(self, call: dict, current: Current | None, positionless: bool = False):
        state = module_state(self.module)
        previous = state.current, state.positionless
        state.current, state.positionless = current, positionless
        try:
            return type(self.module).forward(self.module, **call)
        finally:
            state.current, state.positionless = previous


@contextlib.contextmanager
def _projections_once(module: nn.Module, hidden: torch.Tensor):
    """While one call's copies run: a linear map of the layer applied to the layer's input itself (the same tensor for
    every copy: q, k, v projections before the rotation) is computed once and handed to every copy. The layer's
    `nn.Linear` modules get an instance `forward` for the duration (what was there before is put back, an
    accelerate hook included); inputs other than the hidden states pass through."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    saved, memo = [(m, vars(m).get("forward")) for m in linears], {}

    def once(m: nn.Module, inner, x, *args, **kwargs):
        if x is not hidden or args or kwargs:
            return inner(x, *args, **kwargs)
        if m not in memo:
            memo[m] = inner(x)
        return memo[m]

    for m in linears:
        m.forward = functools.partial(once, m, m.forward)
    try:
        yield
    finally:
        for m, before in saved:
            if before is None:
                del m.forward
            else:
                m.forward = before


def _true(positions: torch.Tensor) -> torch.Tensor:
    return positions if positions.dim() == 2 else positions[0]  # M-RoPE: text tokens' sections are equal


def _at(embeddings, at: PositionMap):
    """The embeddings at a copy's positions. Made again in every layer rather than memoised for the forward: a few
    milliseconds at 16k positions, where holding every copy's (cos, sin) through the forward would cost more memory
    than a copy's queries. A map with an `embed` method makes its copy's embeddings itself (DPE: each frequency group
    at positions of its own)."""
    if isinstance(at, Identity):
        return embeddings
    if hasattr(at, "embed"):
        return at.embed(embeddings, embeddings.position_ids)
    return embed(embeddings, at(embeddings.position_ids))
