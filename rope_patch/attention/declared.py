"""`Declared`: the attention rule every backend derives from a scheme's `Geometry` (attention/geometry.py).

Per query block (rows at key slots c … c + r − 1, keys before c + r) a region lo ≤ i − j < hi covers, in slots:

    [c − hi, c − hi + r)    its far edge: key j' of the edge is inside for row i' iff j' > i'
    [c − hi + r, c − lo)    every row: one fused kernel call without a mask
    [c − lo, c − lo + r)    its near edge: inside iff j' ≤ i', the fused kernel's own causal mask

cut to the keys that exist (and to the first tokens' keys for `Region.first`). A band narrower than the block has no
middle: its keys go through one masked call. Regions that count chunks (DCA) split the block's rows at chunk
boundaries instead: a group of rows in one chunk meets each region's keys as one contiguous range. The materialised
path writes each region's scores over the keys it can reach into one block of hidden logits; flex_attention runs one
call per region, its BlockMask cut to the band. The partial softmaxes merge by log-sum-exp (`merge`).

A bias of the distance (`Geometry.bias`) adds to the materialised scores per block, and to flex's scores through a
score_mod reading one (H, keys) vector; on the fused path it is the kernel's additive mask, a strided view of one
(H, q + k) vector (`flash_distance_partial`), for a geometry of one region over every key (else the scores are
materialised).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .copies import NotProven
from .flex import band_block_mask, flex_call
from .geometry import Geometry, Region
from .kernels import flash_causal_partial, flash_distance_partial, flash_partial
from .protocol import AttentionCall, AttentionRule, fit_rows, merge, module_state
from .rotation import floor_div

EVERY = (Region(),)  # one region over every key, at copy 0 and key set 0
HIDDEN = torch.finfo(torch.float32).min  # a hidden key's logit: finite, so a row with every key hidden stays finite


class Declared(AttentionRule):
    """The attention of `geometry`, on every backend.

    Args:
        geometry: the scheme's regions, and the bias of the distance it adds.
    """

    def __init__(self, geometry: Geometry):
        self.geometry = geometry

    @property
    def flex_lse(self) -> bool:
        return len(self.geometry.regions) > 1  # regions merge by log-sum-exp

    def probe(self, length):
        return type(self)(self.geometry.probe(length))

    @property
    def check_key(self) -> tuple:
        """What the apply-time check's verdict depends on (attention/plumbing.py caches it per architecture): the
        rule's class and which copies its regions read, and whether they hide keys (which a layer without positions
        refuses), not the regions' sizes."""
        bias = self.geometry.bias
        return (type(self).__qualname__, tuple((r.query, r.keys, r.first is not None, r.chosen)
                                               for r in self.geometry.regions),
                None if bias is None else type(bias).__qualname__, self.geometry.hides)

    def fused_rows(self, heads):
        if self.geometry.chunk is not None:  # rows split at chunk boundaries: long blocks keep whole chunks together
            return 2048
        # a block no wider than the narrowest band keeps every band's middle a kernel call without a mask
        cuts = self.geometry.boundaries()
        return fit_rows(1, 0, cap=max(64, min(1024, *cuts)) if cuts else 1024)

    # ---- per call --------------------------------------------------------------------------------------------------
    def begin(self, call):
        if module_state(call.module).positionless and any(r.first is not None for r in self.geometry.regions):
            # a layer without positions (exaone4's, kolibri1's global NoPE layers) still hides its middle keys, and
            # which keys are the first tokens' needs the positions, which do not reach it
            raise NotProven("runs without positions (a layer with no position encoding), and this scheme hides keys "
                            "by their positions")
        if self.geometry.chunk is not None:  # chunk boundaries in slots differ per row: the offsets, read once
            call.scratch["offsets"] = call.offset.reshape(-1).tolist()
        call.scratch["regions"] = regions = self._active(call)
        call.scratch["first"] = {r.first: self.first_slots(call, r.first) for r in regions if r.first is not None}
        # their smallest and largest over the batch, read once per call (not once per block: a device sync each)
        call.scratch["first_range"] = {f: (int(t.min()), int(t.max())) for f, t in call.scratch["first"].items()}

    def _active(self, call) -> tuple[Region, ...]:
        """The regions this call can reach: a layer handed one copy (one the scheme leaves as it is) runs plain, and
        without gaps no key is more than k − 1 slots back."""
        if len(call.queries) == 1:
            return EVERY
        reach = math.inf if call.gapped else call.key.shape[2] - 1
        if self.geometry.chunk is not None and not call.gapped:  # in chunks: the last key's chunk
            reach = max(reach + max(call.scratch["offsets"]), 0) // self.geometry.chunk
        # a band that ends past every key ends nowhere (and one from 0 covers every key, in chunks or not): one region
        # left at copy 0 is then the model's attention
        return tuple(dataclasses.replace(r, hi=math.inf, chunk=None if r.lo == 0 else r.chunk) if r.hi > reach else r
                     for r in self.geometry.reach(reach))

    def first_slots(self, call: AttentionCall, first: int) -> torch.Tensor:
        """(b|1, 1): the slots before which keys are among the first `first` tokens (slot j holds position
        j + offset)."""
        return (first - call.offset).clamp(min=0)

    def _pair(self, call, region) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries (b, Hkv, G, q, d) and keys (b, Hkv, k, d) `region` reads: its query copy and key set, or with
        `Region.chosen` each KV head's own (gathered once per call; a cache that kept each head's chosen keys alone
        hands over one key set)."""
        if not region.chosen:
            return call.queries[region.query], call.keys[region.keys]
        if "chosen" not in call.scratch:
            b, hkv = call.key.shape[:2]
            picks = self.chosen_copies(call)
            sets = self.chosen_sets(call.module.layer_idx, b) - picks.start  # (b, Hkv), into the picks
            rows, heads = torch.arange(b, device=sets.device)[:, None], torch.arange(hkv, device=sets.device)
            key = call.key if len(call.keys) == 1 else torch.stack(call.keys[picks.start:picks.stop])[sets, rows, heads]
            call.scratch["chosen"] = torch.stack(call.queries[picks.start:picks.stop])[sets, rows, heads], key
        return call.scratch["chosen"]

    def chosen_copies(self, call) -> range:
        """The copies (query copy t with key set t) `chosen_sets` picks among, stacked once per call to gather each
        head's: by default every one."""
        return range(len(call.queries))

    def _whole(self, call) -> Region | None:
        """The one region over every key (every distance ≥ 0), if that is the call's geometry: a bias's, a chosen
        pair's, or a one-copy layer's."""
        regions = call.scratch["regions"]
        if len(regions) == 1 and (regions[0].lo, regions[0].hi, regions[0].first) == (0, math.inf, None):
            return regions[0]
        return None

    # ---- materialised ----------------------------------------------------------------------------------------------
    def _where(self, call, region, rows, start, end):
        """bool, broadcastable to the scores: the (row, key) pairs of slots [start, end) inside `region`."""
        if region.chunk is None:
            d = call.distance(rows, start, end)
        else:
            d = self._chunks_back(call, region, rows, start, end)
        inside = (d >= region.lo) & (d < region.hi)
        if region.first is not None:
            if call.gapped:
                first = call.ids[:, None, None, None, start:end] < region.first
            else:
                slots = torch.arange(start, end, device=d.device)
                first = (slots < call.scratch["first"][region.first])[:, None, None, None, :]
            inside = inside & first
        return inside

    def _chunks_back(self, call, region, rows, start, end) -> torch.Tensor:
        """n(i) − n(j) for query rows `rows` and key slots [start, end), n(p) = ⌊p/chunk⌋ of the true position (pads,
        at negative positions, in chunk 0): (b|1, 1, 1, r, w)."""
        if call.gapped:
            q_pos = (call.ids[:, -call.query.shape[3]:] if call.q_ids is None else call.q_ids)[:, rows]
            k_pos = call.ids[:, start:end]
        else:
            q_pos = call.q_slot[rows] + call.offset
            k_pos = torch.arange(start, end, device=call.q_slot.device) + call.offset
        q_n, k_n = floor_div(q_pos.clamp(min=0), region.chunk), floor_div(k_pos.clamp(min=0), region.chunk)
        return (q_n[:, :, None] - k_n[:, None, :])[:, None, None]

    def _chunk_slot(self, region, n: int, offset: int) -> int:
        """The first key slot of chunk n in a row whose positions are slot + offset."""
        return 0 if n <= 0 else max(0, n * region.chunk - offset)

    def _chunk_span(self, call, region, rows, every: bool) -> tuple[int, int]:
        """The key slots whose chunk is lo … hi − 1 back from the block's rows' chunks: for some row of some batch
        row (`every` False), or for every row of every batch row (True)."""
        c = region.chunk
        spans = []
        for off in call.scratch["offsets"]:
            n0 = max(call.first_slot(rows) + off, 0) // c
            n1 = max(call.first_slot(rows) + rows.stop - rows.start - 1 + off, 0) // c
            low, high = (n1, n0) if every else (n0, n1)
            a = 0 if region.hi == math.inf else self._chunk_slot(region, low - int(region.hi) + 1, off)
            spans.append((a, self._chunk_slot(region, high - region.lo + 1, off)))
        pick_a, pick_z = (max, min) if every else (min, max)  # the range common to every row, or met by some row
        return pick_a(a for a, _ in spans), pick_z(z for _, z in spans)

    def _keys(self, call, region, rows, start, end, every: bool = False) -> tuple[int, int]:
        """The key slots of [start, end) inside `region` for some row of the block (or, with `every`, for every row),
        as one range, empty at `start` when there is none. With gaps: every key for some row, none for all."""
        if call.gapped:
            return (start, start) if every else (start, end)
        if region.chunk is not None:
            a, z = self._chunk_span(call, region, rows, every)
        else:  # the block's first row c and last row decide the two ends
            c, last = call.first_slot(rows), call.first_slot(rows) + rows.stop - rows.start - 1
            near, far = (c, last) if every else (last, c)
            a = 0 if region.hi == math.inf else far - int(region.hi) + 1
            z = near - region.lo + 1
            if region.first is not None:
                low, high = call.scratch["first_range"][region.first]
                z = min(z, low if every else high)
        a, z = max(a, start), min(z, end)
        return (a, z) if a < z else (start, start)

    def logits(self, call, rows, start, end):
        whole = self._whole(call)
        if whole is not None:  # every key at one pair of copies: the future left to the mask, as the model's own
            q, k = self._pair(call, whole)
            s = call.qk(q[:, :, :, rows], k[:, :, start:end])
        else:
            s = self._region_logits(call, rows, start, end)
        return s if self.geometry.bias is None else s + self._bias(call, rows, start, end)

    def _region_logits(self, call, rows, start, end):
        """Each region's scores over the keys it reaches, HIDDEN where no region covers a key."""
        s = None
        for region in call.scratch["regions"]:
            a, z = self._keys(call, region, rows, start, end)
            if a == z:
                continue
            q, k = self._pair(call, region)
            part = call.qk(q[:, :, :, rows], k[:, :, a:z])
            ia, iz = self._keys(call, region, rows, a, z, every=True)  # every row inside: no mask to build
            if s is None:
                s = part.new_full((*part.shape[:-1], end - start), HIDDEN)
            s[..., ia - start:iz - start] = part[..., ia - a:iz - a]
            for lo, hi in ((a, ia), (iz, z)):
                if lo < hi:
                    s[..., lo - start:hi - start] = torch.where(self._where(call, region, rows, lo, hi),
                                                                part[..., lo - a:hi - a], s[..., lo - start:hi - start])
        if s is None:  # no key within reach of any region
            b, hkv, g = call.query.shape[:3]
            s = torch.full((b, hkv, g, rows.stop - rows.start, end - start), HIDDEN, device=call.query.device)
        return s

    def _bias(self, call, rows, start, end) -> torch.Tensor:
        """(1|b, Hkv, G, r, end − start) float32: the bias of every score's distance (one lookup per score; a decoding
        step's row is one (H, keys) lookup). With gapped ids, one per batch row (distances of position ids)."""
        dist = call.distance(rows, start, end)  # (r, w), or (b, 1, 1, r, w) with gapped ids
        heads = call.query.shape[1:3]
        bias = self.geometry.bias.by_distance(call, dist.reshape(-1))  # (H, n)
        if not call.gapped:
            return bias.view(1, *heads, *dist.shape)
        b, r, w = dist.shape[0], dist.shape[-2], dist.shape[-1]
        return bias.view(-1, b, r, w).transpose(0, 1).reshape(b, *heads, r, w)

    def regions(self, call, rows, start, end):
        return [(r.query, r.keys, None if r.plain else self._where(call, r, rows, start, end))
                for r in call.scratch["regions"]]

    # ---- fused -----------------------------------------------------------------------------------------------------
    def fused(self, call, rows, end):
        if any(low != high for low, high in call.scratch["first_range"].values()):  # rows' first keys differ
            return None
        if self.geometry.bias is not None:
            return self._bias_parts(call, rows, end)
        if any(r.chunk is not None for r in call.scratch["regions"]):  # (not a call within one chunk: plain)
            return self._chunk_parts(call, rows, end)
        parts = []
        for region in call.scratch["regions"]:
            parts += self._region_parts(call, region, rows, end)
        return parts or None

    def _bias_parts(self, call, rows, end):
        """One region over every key with a bias: the kernel's mask a view of the bias-by-distance vector; keys past
        the bias's `flat_after` from every row (one constant per head) through a kernel call without a mask, the
        constant added to its log-sum-exp."""
        region, bias = self._whole(call), self.geometry.bias
        if region is None or region.chosen or (region.query, region.keys) != (0, 0):
            return None
        every = self._by_distance(call)
        if "masked_bias" not in call.scratch:  # once per call: the kernel's vector, the future at −inf
            q_len = call.query.shape[3]
            by = every.clone()
            by[:, :q_len - 1] = float("-inf")
            # float32 for half-precision queries (the kernel adds a float32 mask exactly); float64 queries want theirs
            call.scratch["masked_bias"] = by.to(torch.promote_types(call.query.dtype, torch.float32)).contiguous()
        start = 0 if bias.flat_after is None else max(0, call.first_slot(rows) - bias.flat_after + 1)
        near = flash_distance_partial(call, rows, end, call.scratch["masked_bias"], start)
        if start == 0:
            return [near]
        out, lse = flash_partial(call, call.query[:, :, :, rows], call.key[:, :, :start], call.value[:, :, :start])
        flat = every[:, call.query.shape[3] - 1 + bias.flat_after]  # (H,): start > 0, so that distance is in reach
        return [(out, lse + flat.view(1, -1, 1)), near]

    def _by_distance(self, call) -> torch.Tensor:
        """(H, q + k − 1) float32, once per call: the bias at every distance the call meets, 1 − q … k − 1 (column
        q − 1 + d holds distance d; the future's too, where a mask opens it), for the fused and flex paths."""
        if "by_distance" not in call.scratch:
            distance = torch.arange(1 - call.query.shape[3], call.key.shape[2], device=call.query.device)
            call.scratch["by_distance"] = self.geometry.bias.by_distance(call, distance)
        return call.scratch["by_distance"]

    def _region_parts(self, call, region, rows, end):
        """The block's keys in `region` (module docstring): its far edge, its middle through one kernel call without a
        mask, its near edge; a band narrower than the block through one masked call."""
        c, r = call.first_slot(rows), rows.stop - rows.start
        limit = end if region.first is None else min(end, call.scratch["first_range"][region.first][0])
        (q, k), v = self._pair(call, region), call.value
        q = q[:, :, :, rows]

        def span(a, z, mask=None, dead=None):  # one kernel call over key slots [a, z)
            return flash_partial(call, q, k[:, :, a:z], v[:, :, a:z], mask=mask, dead=dead)

        def edge(kind, lo0):  # the keys of an edge, [lo0, lo0 + r), that exist
            a, z = max(lo0, 0), min(lo0 + r, limit)
            if a >= z:
                return []
            if kind == "near" and (a, z) == (lo0, lo0 + r):
                return [flash_causal_partial(call, q, k[:, :, a:z], v[:, :, a:z])]
            return [span(a, z, *self._triangle(call, r, a - lo0, z - lo0, kind))]

        if region.hi - region.lo < r:  # a narrow band: one masked call over every key it reaches
            a, z = max(0, c - int(region.hi) + 1), min(limit, c + r - region.lo)
            if a >= z:
                return []
            where = self._where(call, region, rows, a, z).reshape(-1, r, z - a)[0]  # one row's first keys: all's
            return [span(a, z, *_kernel_mask(where, q.dtype))]
        # without an end, the far edge lies before slot 0 (empty) and the middle starts at slot 0
        near, far = c - region.lo, (-r if region.hi == math.inf else c - int(region.hi))
        a, z = max(0, far + r), min(limit, near)
        return edge("far", far) + ([span(a, z)] if a < z else []) + edge("near", near)

    def _chunk_parts(self, call, rows, end):
        """Regions by chunk: the rows split at chunk boundaries; a group of rows in one chunk meets each region's keys
        as one contiguous range, every key inside for every row, through one kernel call without a mask (the group's
        own keys through the causal kernel). One Partial per block: the groups' merged softmaxes, stacked."""
        offsets = call.scratch["offsets"]
        if len(set(offsets)) != 1 or offsets[0] < 0:  # rows with chunks at different slots: materialise
            return None
        off, first, stop = offsets[0], call.first_slot(rows), call.first_slot(rows) + rows.stop - rows.start
        outs, lses, a = [], [], first
        while a < stop:
            z = min(stop, ((a + off) // self.geometry.chunk + 1) * self.geometry.chunk - off)  # the group: [a, z)
            group = slice(rows.start + a - first, rows.start + z - first)
            parts = []
            for region in call.scratch["regions"]:
                (q, k), v = self._pair(call, region), call.value
                q = q[:, :, :, group]
                lo, hi = self._keys(call, region, group, 0, z)
                if hi > a:  # the group's own keys: causal
                    parts.append(flash_causal_partial(call, q, k[:, :, a:z], v[:, :, a:z]))
                    hi = a
                if lo < hi:
                    parts.append(flash_partial(call, q, k[:, :, lo:hi], v[:, :, lo:hi]))
            out, lse = merge(parts, lse=True)
            outs.append(out)
            lses.append(lse)
            a = z
        return [(torch.cat(outs, dim=2), torch.cat(lses, dim=2))]

    def _triangle(self, call, r: int, a: int, z: int, kind: str):
        """The additive (1, 1, 1, r, z − a) mask of an edge's keys j' ∈ [a, z) (near: j' ≤ i'; far: j' > i') and its
        rows that see no key; built once per call (the heads share it)."""
        key = ("declared_edge", r, a, z, kind)
        if key not in call.scratch:
            i, j = torch.arange(r, device=call.query.device)[:, None], torch.arange(a, z, device=call.query.device)
            call.scratch[key] = _kernel_mask((j <= i) if kind == "near" else (j > i), call.query.dtype)
        return call.scratch[key]

    # ---- flex_attention ---------------------------------------------------------------------------------------------
    def flex(self, call, block_mask):
        score_mod = None if self.geometry.bias is None else self._flex_bias(call)
        lse = len(call.scratch["regions"]) > 1  # regions merge by log-sum-exp
        parts = []
        for region in call.scratch["regions"]:
            first = call.scratch["first"].get(region.first)
            if (region.lo, region.hi, first, region.chunk) != (0, math.inf, None, None):
                mask = band_block_mask(block_mask, call, region.lo, region.hi, first, region.chunk)
            else:
                mask = block_mask
            q, k = self._pair(call, region)
            parts.append(flex_call(call, q.flatten(1, 2), k, call.value, mask, score_mod, lse=lse))
        return merge(parts) if lse else parts[0]

    def _flex_bias(self, call):
        """The bias as a score_mod reading the per-call (H, q + k − 1) bias-by-distance vector, every distance a call
        meets (the future's too, where a mask opens it): the lookup costs O(L), not O(L²). Distances in slots."""
        by_distance, k_len = self._by_distance(call), call.key.shape[2]
        shift = torch.tensor(k_len - 1, device=call.query.device)  # i − j + q − 1 = qi + (k − 1) − kv

        def bias(score, b, h, qi, kv):
            return score + by_distance[h, qi + shift - kv]

        return bias


def _kernel_mask(inside: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's additive mask (1, 1, 1, r, n) of `inside` (r, n) bool, −inf outside; and its rows that see no
    key."""
    mask = torch.zeros(inside.shape, dtype=dtype, device=inside.device).masked_fill(~inside, float("-inf"))
    return mask.view(1, 1, 1, *inside.shape), ~inside.any(-1)
