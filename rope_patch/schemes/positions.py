"""Schemes that attend at other positions beyond a window: Self-Extend, SELF, ReRoPE, leaky ReRoPE, STRING.

Each is two regions of distances i − j (attention/geometry.py): below the window W (STRING: its shift size S) the
true positions, beyond it the query at far_q(i) and the key at far_k(j). The layer computes those copies of its
queries and keys with its own rotary (attention/copies.py); the regions pick which copy each (query, key) pair reads.
A sliding layer whose window is at most W never meets a key W back: the scheme is exact RoPE there, and the layer
runs as it is (Gemma 3's local layers).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from fractions import Fraction

import torch

from .. import attention
from .. import validation as check
from ..registry import register_scheme
from .base import UNBOUNDED, Suggestion, extension_ratio, plain_number
from .common import AttentionScheme, DeviceTables

Positions = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Affine:
    """Far positions p ↦ p/divisor + shift (⌊p/divisor⌋ with `floor`; divisor 0: the constant `shift`). A small
    data class rather than a lambda, so the scores on a patched model pickle and deep-copy."""

    divisor: float
    shift: float
    floor: bool = False

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        if self.divisor == 0:
            return torch.full_like(p, self.shift)
        scaled = attention.floor_div(p, self.divisor) if self.floor else p / self.divisor
        return scaled + self.shift if self.shift else scaled


@dataclasses.dataclass(frozen=True)
class Shift:
    """Far positions p ↦ max(p + offset, 0), integer in, integer out (STRING's query at i − S + W, its keys at j): the
    far rotation then uses exactly the angles vanilla RoPE uses at those positions. A query below S − W has no far
    key (that needs i − j ≥ S), so the floor at 0 changes nothing read; it keeps a sin/cos table rotary (GPT-J,
    CodeGen), which has no rows before position 0, from indexing past its start. The offset W − S is negative (STRING
    checks S > W)."""

    offset: int

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        return (p + self.offset).clamp(min=0)


def required(name: str, key: str, value, what: str, bounds: tuple = check.WINDOW_RANGE, hint: str = "",
              kind=check.integer):
    """A required parameter, checked by `kind` (an integer, or `check.number`) in `bounds`: a TypeError that says
    `what` it is when it is missing (None)."""
    if value is None:
        raise TypeError(f"{name}: missing required parameter `{key}` ({what}).")
    return kind(name, key, value, ge=bounds[0], le=bounds[1], hint=hint or f"It counts tokens: {what}.")


def _check_window_size(name: str, value) -> int:
    return required(name, "window_size", value, "the neighbour window W in tokens, e.g. 512",
                     hint="The neighbour window W counts tokens (e.g. 512); a W longer than the sequence is "
                          "plain RoPE.")


def _check_groups(name: str, window_size: int, group_size: int) -> None:
    if window_size <= group_size:
        raise ValueError(
            f"{name}: parameter `window_size` must be larger than `group_size` (the neighbour window holds whole "
            f"groups), got window_size={window_size}, group_size={group_size}. Raise window_size."
        )


class TwoRegion(AttentionScheme):
    """A scheme of two regions: true positions for i − j < split, q at far_q(i) and k at far_k(j) beyond. A subclass
    says where (`far_positions`, `split`); its layout, geometry and rule follow."""

    def far_positions(self) -> tuple[Positions, Positions]:
        """Where the far region puts its queries and keys.

        Returns:
            (far_q, far_k): maps from true positions (a tensor) to the query's and the key's positions beyond the
                split; `attention.Identity()` for keys that stay at their own positions.
        """
        raise NotImplementedError

    def split(self) -> int:
        """Where the far region starts.

        Returns:
            The distance i − j (in positions) from which pairs use the far positions (default: `window_size`).
        """
        return self.window_size

    def copies(self) -> attention.Layout:
        """Copies (true, far query[, far key]): the far keys' copy is the last key set."""
        far_q, far_k = self.far_positions()
        if isinstance(far_k, attention.Identity):  # STRING: the far keys stay at their own positions
            return attention.Layout((attention.Identity(), far_q), key_copies=(0,))
        # the far-key copy's queries are never read
        return attention.Layout((attention.Identity(), far_q, far_k), key_copies=(0, 2), query_copies=(0, 1))

    def layout(self, module):
        # A sliding layer whose window S ≤ split never sees a key `split` back: the scheme is exact RoPE there, and
        # the layer runs as it is (no copies). A window S > split is taken as asked: the far region applies.
        # A layer with memory (DeepSeek-V4: entries of compressed blocks appended to its window's keys) sees beyond
        # its window: the far region applies there. A scheme that hides keys (sink, LM-Infinite) changes a full layer
        # that carries its model's `sliding_window` without using it (exaone4's global NoPE layers, `is_sliding` False).
        sliding = getattr(module, "sliding_window", None)
        if (isinstance(sliding, int) and sliding <= self.split() and not attention.memory_rotaries(module)
                and not (self.geometry().hides and getattr(module, "is_sliding", None) is False)):
            return None
        return self.copies()

    def geometry(self) -> attention.Geometry:
        """The scheme's attention, declared.

        Returns:
            Two regions: distances below `split` at the true positions (copy 0), the rest with the far query copy
                against the far keys.
        """
        w = self.split()
        far_keys = len(self.copies().key_copies) - 1  # the far keys' set: the last one
        return attention.Geometry((attention.Region(hi=w), attention.Region(query=1, keys=far_keys, lo=w)))


@register_scheme
@dataclasses.dataclass(frozen=True)
class SelfExtend(TwoRegion):
    """Self-Extend (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning",
    arXiv:2401.01325, §3.2 and the reference code datamllab/LongLM): neighbour attention with exact positions for
    i − j < W (`window_size`); beyond it grouped attention with floor-divided positions, the query shifted so the
    two regions join: q at ⌊i/G⌋ + W − ⌊W/G⌋, k at ⌊j/G⌋ (G = `group_size`), i.e. relative position
    ⌊i/G⌋ − ⌊j/G⌋ + W − ⌊W/G⌋. Positions are the tokens' true positions (left padding is skipped). The paper's rule
    of thumb for a target length N and pretraining window L: W + (N − W)/G ≲ (½…⅔)·L."""

    name = "self_extend"
    aliases = ("selfextend", "longlm", "grouped_attention")
    bare_param = "group_size"
    group_size: int | None = None
    window_size: int | None = None

    @classmethod
    def search_space(cls, window, target):
        return {"group_size": [2, 4, 8, 16], "window_size": [window // 8, window // 4, window // 2]}

    @classmethod
    def suggestion(cls, n, window):
        """W = L/4 (the paper's neighbour windows 512–1536 at L = 4096) and the smallest group size G with
        W + (N − W)/G ≤ ⅔·L (Jin et al. 2024 §4: "(½ … ⅔)·L > W + (N − W)/G"); none where that needs G ≥ W."""
        if n <= window:
            return None
        w = max(2, window // 4)
        budget = Fraction(2 * window, 3)
        if w >= budget:
            return None
        g = max(1, math.ceil(Fraction(n - w) / (budget - w)))  # smallest G with W + (N − W)/G ≤ ⅔·L
        if g >= w:  # the paper's neighbour window holds whole groups: G < W
            return None
        reach = w + (n - w) / g
        return Suggestion.of(cls.name, {"group_size": g, "window_size": w},
                             f"W = L/4 = {w}, smallest G with W + (N − W)/G ≤ ⅔·L: {w} + {n - w}/{g} = {reach:.1f} ≤ "
                             f"{float(budget):.1f} (Jin et al. 2024)")

    def __post_init__(self):
        n = self.name
        self._set("group_size", required(n, "group_size", self.group_size,
                                          "positions beyond the window are floor-divided by it, e.g. 4",
                                          check.GROUP_SIZE_RANGE,
                                          hint="group_size=1 is plain RoPE; the paper uses 2 … 64."))
        self._set("window_size", _check_window_size(n, self.window_size))
        _check_groups(n, self.window_size, self.group_size)

    def far_positions(self):
        g, w = self.group_size, self.window_size
        return Affine(g, w - w // g, floor=True), Affine(g, 0, floor=True)

    def served_length(self, window):
        return grouped_reach(self.group_size, self.window_size, window)


@dataclasses.dataclass(frozen=True)
class LogisticGroups(DeviceTables):
    """SELF's far positions (Dang et al. 2025, arXiv:2505.17296): p ↦ shift + f(p − shift), f(t) the group of token t
    when consecutive groups grow along the logistic curve g(x) = C / (1 + (C − 1)·e^(−r·x)) (C = `capacity`, r =
    `rate`): group x holds ⌊g(x)⌋ tokens, 1 at first, approaching C − 1. Keys use shift 0 (k at f(j)), queries shift W
    (q at W + f(i − W)).

    Built as the authors' kernel builds it (alexeipc/SELF-LLM, self_extend_patch/attn_method/logistic.cu, read at
    e8d729e): size class s = 1 … C − 1 holds the groups x with ⌈x_s⌉ ≤ x < ⌈x_{s+1}⌉, x_s = ln(s(C − 1)/(C − s))/r the
    inverse of g (the last class is unbounded), and tokens fill the classes in order, counted from 1 as the kernel
    counts them: f(t) = F(max(t − 1, 0)), F the plain 0-based assignment (so tokens 0 and 1 share group 0).
    A small data class with its tables precomputed (C entries), so the scores pickle and deep-copy."""

    capacity: int
    rate: float
    shift: int = 0
    # per non-empty size class: its first token (0-based F), its first group, its group size
    tokens: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    groups: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    sizes: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        c, r = self.capacity, self.rate
        # ⌈x_s⌉, written as the kernel's (log(s·C − s) − log(C − s))/rate so the class bounds are the same doubles
        first = [math.ceil((math.log(s * c - s) - math.log(c - s)) / r) for s in range(1, c)]
        classes, token = [], 0  # (first token, first group, size) of each non-empty class
        for s in range(1, c):
            end = first[s] if s < c - 1 else None  # the last class (size C − 1) never ends
            if end is not None and end <= first[s - 1]:
                continue  # no integer x has ⌊g(x)⌋ = s: the curve jumps over this size
            classes.append((token, first[s - 1], s))
            if end is not None:
                token += s * (end - first[s - 1])
        for name, column in zip(("tokens", "groups", "sizes"), zip(*classes, strict=True), strict=True):
            object.__setattr__(self, name, column)

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        t = (p.long() - self.shift - 1).clamp(min=0)  # the kernel counts tokens from 1: t − 1, token 0 with token 1
        # (3, classes): first tokens, first groups, sizes; once per device (three host copies per call were most of
        # SELF's decoding-step overhead: four position maps per layer)
        starts, groups, sizes = self.on_device(p.device, lambda d: torch.tensor([self.tokens, self.groups, self.sizes],
                                                                                device=d))
        k = torch.searchsorted(starts, t, right=True) - 1  # the size class of token t
        return (groups[k] + torch.div(t - starts[k], sizes[k], rounding_mode="floor") + self.shift).to(p.dtype)


def grouped_reach(group_size: int, window_size: int, window: int) -> int | None:
    """The longest input Self-Extend's grouping (G = `group_size`, W = `window_size`) serves on a window of L: its
    largest relative position ⌊(N − 1)/G⌋ + W − ⌊W/G⌋ stays ≤ L − 1 up to N = G·(L − W + ⌊W/G⌋), the paper's
    (L − W)·G + W when G divides W. None when W ≥ L (the neighbour window alone reaches L)."""
    if window_size >= window:
        return None
    return group_size * (window - window_size + window_size // group_size)


def _reach(capacity: int, rate: float, n: int, w: int) -> int:
    """The largest relative position SELF uses on n tokens: the last query's far position W + f(n − 1 − W) minus the
    first key's, f(0) = 0 (n − 1 when no pair is W apart)."""
    return int(LogisticGroups(capacity, rate, w)(torch.tensor([n - 1])).item()) if n - 1 >= w else n - 1


@register_scheme
@dataclasses.dataclass(frozen=True)
class SelfExtendLogistic(TwoRegion):
    """SELF, Self-Extend with logistic group sizes (Dang et al. 2025, "SELF: Self-Extend the Context Length With
    Logistic Growth Function", arXiv:2505.17296; reference code alexeipc/SELF-LLM): Self-Extend's two regions, exact
    positions for i − j < W (`window_size`), grouped positions beyond, but the groups are not all G tokens: group x
    holds ⌊g(x)⌋ tokens, g(x) = C / (1 + (C − 1)·e^(−r·x)) the logistic curve from 1 towards the capacity C
    (`group_size`, the authors' name for it; groups reach C − 1 tokens) at growth rate r (`growth_rate`), the curve
    whose inverse the authors' kernel evaluates (`gs_inverse_generating_function`). With f(t) the group of token t
    (`LogisticGroups`; tokens counted from 1 as the kernel counts them, so tokens 0 and 1 share group 0), the far key
    is at f(j) and the far query at W + f(i − W): the pair's relative position is W + f(i − W) − f(j), W at the
    window's edge as in Self-Extend. A schedule that jumps to C − 1 at once (a large r) is Self-Extend with G = C − 1
    on positions moved by G − 2 (group 0 holds two tokens).

    A scheme of its own rather than a `group_schedule` option of `self_extend`: its `group_size` is a capacity that no
    group reaches (Self-Extend's is every group's size), it has a third parameter, and its suggestion rule differs, so
    one class per method keeps each parameter meaning one thing. Both positions are functions of the token's own
    position (f(j) of the key's, W + f(i − W) of the query's), so it runs on the same machinery, exactly: the far keys
    are rotated once, when written, and cached rotated, as Self-Extend's ⌊j/G⌋ are.

    Where rope_patch and the authors' code differ (read at e8d729e):
    - Their kernel skips a size class whose next class is empty (a curve that jumps over a size: large rates, small
      capacities), misplacing the tokens from there on; rope_patch assigns every class in order. At the authors'
      settings (C = 16, r = 0.02) and wherever every size occurs, the positions are theirs (tests/schemes/test_self.py).
    - Their flash decoding path (q_len = 1) places keys with another kernel (logistic_qlen_1.cu, capacity W, the far
      distance growing with the key's position j, the reverse of the prefill's), and their eager path computes the
      groups for the one new query only; rope_patch decodes with the prefill's positions, so cached generation equals
      recomputation.
    - Their `apply(..., increase_rate)` is not passed to the kernel, which always runs at its default rate 0.02 (the
      value their PG19 script sets); here `growth_rate` is used."""

    name = "self_extend_logistic"
    aliases = ("self", "logistic_self_extend")
    bare_param = "group_size"
    label_symbols = {"growth_rate": "r"}
    group_size: int | None = None
    window_size: int | None = None
    growth_rate: float = 0.02

    @classmethod
    def search_space(cls, window, target):
        w, r = max(3, window // 8), 0.02 * 4096 / window  # around the suggestion (below); every point has C < W
        sizes = [c for c in (4, 8, 16, 32) if c < w] or [w - 1]
        return {"group_size": sizes, "window_size": [w, 2 * w], "growth_rate": [r / 2, r, 2 * r]}

    @classmethod
    def suggestion(cls, n, window):
        """The authors' setting (C = 16, W = 512, r = 0.02 on Llama-2's L = 4096) in proportion to the window: W = L/8,
        r = 0.02·4096/L (the curve keeps its shape in units of the window), and the smallest capacity C whose largest
        relative position W + f(N − 1 − W) stays within ⅔·L (Self-Extend's rule of thumb, Jin et al. 2024 §4); none
        where that needs C ≥ W."""
        if n <= window:
            return None
        w = max(2, window // 8)
        rate = plain_number(round(0.02 * 4096 / window, 4))
        budget = 2 * window / 3
        for c in range(3, w):
            reach = _reach(c, rate, n, w)
            if reach <= budget:
                return Suggestion.of(cls.name, {"group_size": c, "window_size": w, "growth_rate": rate},
                                     f"W = L/8 = {w}, r = 0.02·4096/L = {rate:g} (the authors' C = 16, W = 512, "
                                     f"r = 0.02 at L = 4096), smallest C with largest position {reach} ≤ ⅔·L = "
                                     f"{budget:.1f} (Dang et al. 2025)")
        return None

    def __post_init__(self):
        n = self.name
        low, high = check.GROUP_SIZE_RANGE
        self._set("group_size", required(n, "group_size", self.group_size,
                                          "the capacity C of the logistic curve: group sizes grow from 1 towards "
                                          "C − 1, e.g. 16", (max(2, low), high),
                                          hint="It is the logistic curve's capacity C; the authors use 16."))
        self._set("window_size", _check_window_size(n, self.window_size))
        self._set("growth_rate", check.number(n, "growth_rate", self.growth_rate, gt=0, le=100,
                                              hint="The logistic curve's rate r per group; the authors use 0.02."))
        _check_groups(n, self.window_size, self.group_size)

    def far_positions(self):
        c, r, w = self.group_size, self.growth_rate, self.window_size
        return LogisticGroups(c, r, w), LogisticGroups(c, r)

    def served_length(self, window):
        """The largest N whose largest relative position W + f(N − 1 − W) (`_reach`, growing with N) is below L;
        found by bisection, since f is a table. Groups hold at most C − 1 tokens, so N < (C − 1)·L + W + 2."""
        c, r, w = self.group_size, self.growth_rate, self.window_size
        if w >= window:
            return None
        low, high = window, (c - 1) * window + w + 2  # reach(low) ≤ L − 1 < reach(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if _reach(c, r, mid, w) <= window - 1 else (low, mid)
        return low


@register_scheme
@dataclasses.dataclass(frozen=True)
class ReRope(TwoRegion):
    """ReRoPE (Su 2023, "Rectified Rotary Position Embeddings", kexue.fm/archives/9708, github.com/bojone/rerope):
    relative position min(i − j, W): exact RoPE inside the window (`window_size`), a constant W beyond it, realised
    as q at position W against un-rotated keys (position 0)."""

    name = "rerope"
    aliases = ("re_rope", "rectified_rope")
    bare_param = "window_size"
    window_size: int | None = None

    @classmethod
    def search_space(cls, window, target):
        return {"window_size": [window // 8, window // 4, window // 2, 3 * window // 4]}

    @classmethod
    def suggestion(cls, n, window):
        """W = L/2 (Su 2023, kexue.fm/archives/9708: w = 256 on a 512-token model; the bojone/rerope README runs
        w = 1024 at 4k): distances ≥ W collapse to W < L."""
        if n <= window:
            return None
        w = max(1, window // 2)
        return Suggestion.of(cls.name, {"window_size": w},
                             f"W = L/2 = {w}: distances ≥ W collapse to W, inside L = {window} (Su 2023)")

    def __post_init__(self):
        self._set("window_size", _check_window_size(self.name, self.window_size))

    def far_positions(self):
        return Affine(0, self.window_size), Affine(0, 0)

    def served_length(self, window):
        # distances ≥ W all rotate as W: below L whatever the length, once W < L
        return UNBOUNDED if self.window_size < window else None


@register_scheme
@dataclasses.dataclass(frozen=True)
class LeakyReRope(TwoRegion):
    """Leaky ReRoPE (Su 2023, same post and repository as ReRoPE): relative position i − j inside the window and
    W + (i − j − W)/k beyond it (k = `factor` ≥ 1; k = 1 is plain RoPE, k → ∞ is ReRoPE), realised as q at
    i/k + W − W/k and k at j/k (fractional positions)."""

    name = "leaky_rerope"
    aliases = ("leaky_re_rope",)
    bare_param = "window_size"
    label_symbols = {"factor": "k"}
    window_size: int | None = None
    factor: float | None = None

    @classmethod
    def search_space(cls, window, target):
        s = extension_ratio(window, target)
        return {"window_size": [window // 4, window // 2], "factor": [s, 2 * s, 4 * s]}

    @classmethod
    def suggestion(cls, n, window):
        """W = L/4 and the smallest k (two decimals) with W + (N − 1 − W)/k ≤ L − 1, so every relative position
        stays inside the window (Su 2023, kexue.fm/archives/9708)."""
        w = max(1, window // 4)
        if n <= window or window - 1 - w <= 0:
            return None
        k = max(1.0, math.ceil(100 * (n - 1 - w) / (window - 1 - w)) / 100)  # W + (N − 1 − W)/k ≤ L − 1
        reach = w + (n - 1 - w) / k
        return Suggestion.of(cls.name, {"window_size": w, "factor": plain_number(k)},
                             f"W = L/4 = {w}, smallest k (2 decimals) with W + (N − 1 − W)/k ≤ L − 1: {w} + "
                             f"{n - 1 - w}/{k:g} = {reach:.1f} ≤ {window - 1} (Su 2023)")

    def __post_init__(self):
        n = self.name
        self._set("window_size", _check_window_size(n, self.window_size))
        self._set("factor", required(n, "factor", self.factor, "k: distances beyond the window grow 1/k as fast, "
                                      "e.g. 16", check.LEAKY_FACTOR_RANGE, kind=check.number,
                                      hint="factor=1 is plain RoPE, k < 1 would stretch distances, a large k "
                                           "approaches ReRoPE (use rerope for k → ∞); Su's post uses 16."))

    def far_positions(self):
        w, k = self.window_size, self.factor
        return Affine(k, w - w / k), Affine(k, 0)

    def served_length(self, window):
        # the largest distance N − 1 rotates as W + (N − 1 − W)/k ≤ L − 1  ⇔  N ≤ W + k·(L − 1 − W) + 1
        w, k = self.window_size, self.factor
        return math.floor(w + k * (window - 1 - w)) + 1 if w < window else None


@register_scheme
@dataclasses.dataclass(frozen=True)
class String(TwoRegion):
    """STRING, ShifTed Rotary position embeddING (An et al. 2024, "Why Does the Effective Context Length of LLMs Fall
    Short?", arXiv:2410.18745; reference code HKUNLP/STRING `string_for_llama.py`): the relative distance
    d = i − j is kept for d < S (`shift_size`) and replaced by d − S + W for d ≥ S (`window_size` W < S), so the
    largest distances, the least trained ones (the paper's left-skewed position frequency distribution), are never
    used: far tokens reuse the well-trained distances W, W + 1, ... Realised on the two-region scores: near region
    d < S at the true positions, far region with the query at i − S + W and the key at j (integer positions, so the
    far logits are exactly vanilla RoPE's at those positions). The authors use S ≈ N/3 for a test length N (their
    README suggests 0.25–0.4·N) and W = 128 … 512. The distances it uses reach N − 1 − S + W (and S − 1 in the near
    region), at least (N + W)/2 − 1 whatever S: on its own it cannot keep them below the training window L once
    N > 2L − W. It improves the use of the window (N ≤ L); beyond the window combine it with a frequency scheme
    (a stack, `rope_patch.apply(model, ['yarn:...', 'string:...'])`), or use a checkpoint
    whose config ships the scaling (Llama 3.1's `llama3`, a `yarn` config): STRING rotates with the model's own
    frequencies.

    Where rope_patch and the authors' code differ (read at 216cc2f0):
    - The boundary d = S. The code's prefill runs a flash-attention band with `window_size=[S, 0]` (distances
      0 … S at true positions) and a far part over keys j ≤ i − S (distances ≥ S, shifted query), merged by
      log-sum-exp: the key at d = S is counted in both partial softmaxes. Its decode path splits the cache at
      kv_len − S, putting d = S in the far part only. rope_patch follows the paper's formula and the decode path:
      d = S is far, in prefill and decoding alike (so cached decoding equals recomputation).
    - The code multiplies cos/sin by 0.1·ln 2 + 1 (a YaRN-style temperature, logits × ≈ 1.14; its comment: to
      sharpen the attention map that STRING smooths). rope_patch does not scale: the model's own cos/sin (and
      `attention_scaling`) are used unchanged.
    - The code takes S as a ratio of the test length (`shifted_ratio` 0.5 in its NIAH script, int(0.33·L) in its
      README); rope_patch takes S in tokens."""

    name = "string"
    aliases = ("shifted_rope",)
    bare_param = "shift_size"
    shift_size: int | None = None
    window_size: int | None = None

    @classmethod
    def search_space(cls, window, target):
        shifts = [target // 4, target // 3, target // 2]  # W < S in every pair: below the smallest S
        return {"shift_size": shifts, "window_size": sorted({min(w, shifts[0] - 1) for w in (window // 8, window // 4,
                                                                                           window // 2)})}

    @classmethod
    def suggestion(cls, n, window):
        """Local window W = min(128, L/32) (the authors' W = 128 at L ≥ 4096, scaled down with the window) and shift
        S = N/3 (An et al. 2024, arXiv:2410.18745, README "0.25–0.4·N"), S > W. It improves the use of the window for
        N ≤ L; beyond it its distances reach N − 1 − S + W > L, so it is only suggested as a companion of a frequency
        scheme there (`alone=False`; the reason shows the stack, e.g. apply(model, ['yarn:factor=4', 'string:...']))."""
        w = max(1, min(128, window // 32))
        shift = max(w + 1, round(n / 3))
        if shift >= n:  # S ≥ N is plain RoPE: nothing to shift
            return None
        reach = n - 1 - shift + w
        params = {"shift_size": shift, "window_size": w}
        base = f"S = N/3 = {shift}, W = min(128, L/32) = {w} (An et al. 2024)"
        if n <= window:
            return Suggestion.of(cls.name, params, f"{base}: distances d ≥ S become d − S + W, the well-trained short "
                                                   f"ones; N = {n} ≤ L = {window}, so it works on its own")
        spec = Suggestion.of(cls.name, params, "").spec
        return Suggestion.of(cls.name, params, f"{base}; N = {n} > L = {window}: its distances reach N − 1 − S + W = "
                                               f"{reach}, so compose it with a frequency scheme (on its own it is not "
                                               "enough), e.g. rope_patch.apply(model, "
                                               f"['yarn:factor={plain_number(n / window)!r}', '{spec}'])", alone=False)

    def __post_init__(self):
        n = self.name
        self._set("shift_size", required(n, "shift_size", self.shift_size,
                                          "S: distances d ≥ S are replaced by d − S + W; about ⅓ of the test "
                                          "length, an S at least the sequence length is plain RoPE"))
        self._set("window_size", required(n, "window_size", self.window_size,
                                           "W: the smallest distance far tokens are moved to, 128 … 512 in the "
                                           "paper's code"))
        if self.shift_size <= self.window_size:
            raise ValueError(
                f"{n}: parameter `shift_size` must be larger than `window_size` (distances d ≥ S become d − S + W, "
                f"which must be shorter than d), got shift_size={self.shift_size}, window_size={self.window_size}. "
                "Raise shift_size (about ⅓ of the test length) or lower window_size (128 … 512)."
            )

    def split(self):
        return self.shift_size

    def far_positions(self):
        return Shift(self.window_size - self.shift_size), attention.Identity()

    def served_length(self, window):
        # the largest distance N − 1 rotates as N − 1 − S + W ≤ L − 1  ⇔  N ≤ L + S − W; the near region needs S ≤ L
        return window + self.shift_size - self.window_size if self.shift_size <= window else None
