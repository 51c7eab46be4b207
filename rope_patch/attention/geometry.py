"""What an attention-side scheme declares: which copy of the queries meets which set of keys, where.

A re-positioned layer runs its queries and keys at several position maps (`Layout`, attention/copies.py): query copy t
at `maps[t]`, key set s at `maps[key_copies[s]]`. A `Geometry` says which (query, key) pairs read which copies: a
`Region` is a band of distances i − j (in positions), optionally cut to the first tokens' keys, or read per KV head from
the copy the rule picked (Ms-PoE). Keys that no region covers are hidden. A `Bias` of the distance alone (ALiBi, T5's
buckets) adds to every region's scores. The backends' code (attention/declared.py) derives every path from this
declaration: the materialised scores, the fused flash path, flex_attention's block masks and the one-row decoding step.

Self-Extend, for instance, is two regions: distances below W at the true positions, the rest at grouped ones:

    Geometry((Region(hi=W), Region(query=1, keys=1, lo=W)))

and ALiBi one region, every key at the true positions, with a bias: `Geometry((Region(),), bias=AlibiBias(8.0))`.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Region:
    """Where query copy `query` meets key set `keys`.

    Args:
        query: the query copy (index into the layout's position maps).
        keys: the key set (index into the layout's `key_copies`).
        lo: the smallest distance i − j (in positions) of the region.
        hi: the first distance past the region (`math.inf`: no end).
        first: only the keys of the first `first` tokens (attention sinks, LM-Infinite's global branch); None: any key.
        chunk: count chunks instead of positions: lo ≤ n(i) − n(j) < hi with n(p) = ⌊p/chunk⌋ (DCA's intra-,
            successive- and inter-chunk regions); None: distances.
        chosen: each KV head reads the query copy and key set its rule picked for it (`AttentionRule.chosen_sets`:
            Ms-PoE's ratio per head, from the prompt) instead of `query` and `keys`.
    """

    query: int = 0
    keys: int = 0
    lo: int = 0
    hi: float = math.inf
    first: int | None = None
    chunk: int | None = None
    chosen: bool = False

    def __post_init__(self):
        if not 0 <= self.lo < self.hi:
            raise ValueError(f"a region's distances lo ≤ i − j < hi need 0 ≤ lo < hi, got lo={self.lo}, hi={self.hi}")

    @property
    def plain(self) -> bool:
        """Whether the region is attention as the model has it: copy 0 against key set 0, every causal key."""
        return self == Region()


class Bias:
    """An additive bias of the distance alone, b_h(i − j) per query head, on every region's scores.

    `flat_after`: a distance from which the bias no longer changes (T5's last bucket), so the fused path reads the
    keys beyond it through one kernel call without a mask; None: it changes at every distance (ALiBi)."""

    flat_after: int | None = None

    def by_distance(self, call, distance):
        """(H, n) float32: b_h(d) for the distances `distance` (n,), query heads in the call's order. A negative
        distance is a key after the query, which only a mask that opens the future (a prefix-LM's) lets count."""
        raise NotImplementedError

    def probe(self) -> Bias:
        """The bias at its identity setting, zero (the apply-time check's)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A scheme's attention, declared: its regions, which must not overlap (a key two regions cover would be counted
    twice in the softmax).

    Args:
        regions: the `Region`s; a key no region covers is hidden.
        bias: a `Bias` of the distance added to every score; None: none.
    """

    regions: tuple[Region, ...]
    bias: Bias | None = None

    def __post_init__(self):
        if len({r.chunk for r in self.regions}) > 1:
            raise ValueError(f"regions count distances or chunks of one size, not both: {self.regions}")
        bands = sorted((r.lo, r.hi) for r in self.regions)
        if any(a_hi > b_lo for (_, a_hi), (b_lo, _) in zip(bands, bands[1:], strict=False)):
            raise ValueError(f"overlapping regions: {self.regions}")

    @property
    def chunk(self) -> int | None:
        """The chunk size the regions count in (None: they count distances)."""
        return self.regions[0].chunk

    @property
    def hides(self) -> bool:
        """Whether some causal key is hidden whatever its token: a band of distances (or chunks) that no region open
        to every key covers (StreamingLLM's and LM-Infinite's middle, where only the first tokens' keys count)."""
        reach = 0
        for lo, hi in sorted((r.lo, r.hi) for r in self.regions if r.first is None):
            if lo > reach:
                return True
            reach = max(reach, hi)
        return reach < math.inf

    def reach(self, distance: int) -> tuple[Region, ...]:
        """The regions a key at most `distance` back (in the regions' unit: positions or chunks) can fall in."""
        return tuple(r for r in self.regions if r.lo <= distance)

    def boundaries(self) -> list[int]:
        """The finite distances where one region ends or another starts, in order (none for chunk regions)."""
        return sorted({b for r in self.regions for b in (r.lo, r.hi) if 0 < b < math.inf and r.chunk is None})

    def probe(self, length: int) -> Geometry:
        """The same regions with their boundaries spread over a `length`-token input (so every region and its edges
        occur: four chunks for chunk regions), every key a first one and the bias zero: on identical position copies
        this is the model's own attention, which is what the apply-time check (attention/plumbing.py) compares
        against."""
        cuts = self.boundaries()
        spread = {b: max(2, (k + 1) * length // (len(cuts) + 1)) for k, b in enumerate(cuts)}
        return Geometry(tuple(dataclasses.replace(r, lo=spread.get(r.lo, r.lo), hi=spread.get(r.hi, r.hi),
                                                  first=None if r.first is None else length,
                                                  chunk=None if r.chunk is None else max(2, length // 4))
                              for r in self.regions), None if self.bias is None else self.bias.probe())
