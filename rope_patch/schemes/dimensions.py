"""DPE: Self-Extend's grouped positions with a group size per group of RoPE dimensions.

DPE (Lu et al. 2025, "Effective Length Extrapolation via Dimension-Wise Positional Embeddings Manipulation",
arXiv:2504.18857, COLM 2025; reference code LuLuLuyi/DPE, `dpe_for_llama.py`, read at 46b85de) cuts the d/2 rotary
frequencies into equal groups, fastest first (the code's `dimension_groups_range` [0, 8, …, 64] over the 64 pairs of
a 128-dim head), and gives each group g a group size s_g from a per-model detection of the distance each group uses
well (its "effective length"). For a query at true position i and a key at j:

    i − j < W      every pair at its true positions (exact RoPE)
    i − j ≥ W      pair k of group g: q at ⌊i/s_g⌋ + W − ⌊W/s_g⌋, k at ⌊j/s_g⌋

So each group is Self-Extend (arXiv:2401.01325) with its own group size; s_g = 1 leaves the group's pairs at their
true positions everywhere.

**Frequency- or attention-side.** Attention-side. Were DPE "position p → p/s_g in group g" everywhere it would be
θ_k → θ_k/s_g, a frequency scheme; it is not: inside the window W (1024 in every setting of the authors) the true
positions are kept, and beyond it the positions are floor-divided and shifted so the two regions join. The authors
run two flash-attention calls (a band `window_size=[W − 1, 0]` at true positions and the keys j ≤ i − W at the
grouped ones) merged by log-sum-exp; here the same two regions are the two-region scores of schemes/positions.py,
and the layer runs at three position copies (attention/copies.py): true positions, the grouped query positions and
the grouped key positions. A grouped copy gives each frequency group the positions of its own group size: the
rotary module is called once per distinct group size and its (cos, sin) spliced per element (`GroupPositions`).
Which element belongs to which frequency is read from the rotary itself (the angle of each element at one
probe position, ranked: fastest first, as the code's index order for RoPE's falling θ_k), so rotate-half,
interleaved and one-tensor (Llama 4) rotaries group alike.

**Group sizes.** The authors detect them per model by a needle-in-a-haystack sweep at the target length N (their
`effective_length_detection/run_niah_detect.sh`): group g at each of 1, 2, 4, …, N/1024 while every other group
is at 2N/L, the best score fixing s_g; 8 groups × log2(N/1024) + 1 generations of a 4-needle NIAH at N (8 × 8 runs
at 128k), neither cheap nor deterministic enough to run inside `apply()`. So `group_sizes` is a parameter, and
`rope_patch.tuning.detect_group_sizes(model, score, target, window_size)` runs the authors' sweep with a score of
the user's choice (e.g. passkey accuracy at N). Their detected values (config/dpe_config.yaml) for Llama-3-8B-Instruct
(L = 8k, N = 128k) are group_sizes=2/8/2/8/32/32/32/4, window_size=1024 (their README's Quick Start has
4/4/2/16/32/32/16/128, the setting of their released RULER predictions, which also select the top 48 of 64 pairs).

Where rope_patch and the authors' code differ:
- The query shift. The code's prefill shifts grouped queries by W − W/s_g (true division) and its decode by
  W − ⌊W/s_g⌋; they agree when s_g divides W (all the authors' settings: W = 1024, s_g powers of two ≤ 128).
  rope_patch uses W − ⌊W/s_g⌋ in both (integer positions, as Self-Extend), so cached decoding equals recomputation.
- Positions. The code's decode places keys at their slots 0 … n − 1 (batch size 1, no padding); rope_patch takes
  the tokens' true positions, as every scheme here (left padding is skipped).
- The code's optional top-k selection (`select_topk_dim`: per layer and head only the k pairs of largest mean
  |q_k|·|k_k| are grouped, the others keep true positions in both regions) is not implemented: it needs positions
  per head, which the position copies do not carry. Its Quick Start runs without it (`select_topk_dim = False`).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import validation as check
from ..registry import register_scheme
from ..rotary import embed
from .base import Suggestion
from .positions import Affine, TwoRegion, _check_window_size, grouped_reach, required

PROBE = 0.5  # the probe position: angles 0.5·θ_k < π for every θ_k ≤ 1 (RoPE's fastest pair turns 1 rad a token)


def frequency_groups(embeddings, count: int) -> torch.Tensor:
    """The frequency group (0 … count − 1, fastest first) of every element of the last axis of the embeddings a
    rotary module makes: the elements' angles at one probe position, ranked (element e has r_e elements with a
    strictly larger angle; its group is ⌊r_e · count / E⌋ of E elements). A pair's two elements carry the same angle,
    so they share a rank and a group; for E/2 frequencies in `count` equal groups that is the authors' index grouping.
    Read once per forward (memoised on the embeddings) with the rotary's undecorated forward, so a probe never moves
    a dynamic rotary's frequencies."""
    key = ("dpe_groups", count)
    if key in embeddings.memo:
        return embeddings.memo[key]
    rotary = embeddings.rotary
    forward = type(rotary).forward
    forward = getattr(forward, "__wrapped__", forward)  # transformers' dynamic_rope_update wraps with functools.wraps
    probe = torch.full_like(embeddings.position_ids[..., :1], PROBE, dtype=torch.float32)
    out = forward(rotary, embeddings.x, probe, *embeddings.args, **embeddings.kwargs)
    angle = torch.atan2(out[1].float(), out[0].float()) if isinstance(out, tuple) else torch.angle(out)
    angle = angle.reshape(-1, angle.shape[-1])[0]  # (E,): one token of one row (M-RoPE: every section alike)
    faster = (angle[None, :] > angle[:, None]).sum(-1)
    groups = torch.div(faster * count, angle.numel(), rounding_mode="floor")
    embeddings.memo[key] = groups
    return groups


@dataclasses.dataclass(frozen=True)
class GroupPositions:
    """A position map per frequency group (`maps[g]` for group g, fastest first): the copy's embeddings are the rotary
    module's at maps[g](p) for the elements of group g (`embed`, which the position copies call). A data class, so a
    patched model pickles and deep-copies.

    Called on position ids, it gives group 0's positions: what a layer that rotates from position ids itself (not
    from the embeddings it is handed) would see; DPE cannot place such a layer per group."""

    maps: tuple[Affine, ...]

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        return self.maps[0](p)

    def embed(self, embeddings, p: torch.Tensor):
        groups = frequency_groups(embeddings, len(self.maps))
        first, *others = dict.fromkeys(self.maps)  # one rotary call per distinct group size
        out = embed(embeddings, first(p))
        for m in others:
            part = embed(embeddings, m(p))
            chosen = torch.tensor([g == m for g in self.maps], device=groups.device)[groups]  # (E,)
            if isinstance(part, tuple):
                out = tuple(torch.where(chosen, a, b) for a, b in zip(part, out, strict=True))
            else:  # Llama 4: one complex tensor
                out = torch.where(chosen, part, out)
        return out


@register_scheme
@dataclasses.dataclass(frozen=True)
class Dpe(TwoRegion):
    """DPE (Lu et al. 2025, arXiv:2504.18857; reference code LuLuLuyi/DPE): Self-Extend with a group size per group
    of RoPE frequencies. The frequencies, fastest first, are cut into len(`group_sizes`) equal groups; for
    i − j < W (`window_size`) every pair is at its true positions, beyond it group g's pairs put the query at
    ⌊i/s_g⌋ + W − ⌊W/s_g⌋ and the key at ⌊j/s_g⌋ (s_g = `group_sizes[g]`). The group sizes come from the authors'
    per-model detection (`rope_patch.tuning.detect_group_sizes`); the module docstring says why this is an
    attention-side scheme, and where it and the authors' code differ.

    `relative_position` (the figures' effective distance) is group 0's; group g sees ⌊i/s_g⌋ − ⌊j/s_g⌋ + W − ⌊W/s_g⌋
    beyond W."""

    name = "dpe"
    aliases = ("dimension_wise",)
    bare_param = "group_sizes"
    group_sizes: tuple | None = None
    window_size: int | None = None

    @classmethod
    def search_space(cls, window, target):
        # `rope-patch tune`'s grid: the window around the detection baseline; per-group sizes are what
        # rope_patch.tuning.detect_group_sizes measures (a grid over 8 sizes would be too large to search)
        s = max(1, round(2 * target / window))
        return {"group_sizes": [[s] * 8], "window_size": [window // 8, window // 4]}

    @classmethod
    def suggestion(cls, n, window):
        """W = min(1024, L/8) (the authors' W = 1024 for every model, L = 8k … 128k) and 8 groups at the baseline of
        the authors' detection, s = 2N/L for every group (run_niah_detect.sh: the groups not being detected sit at
        TEST_MAX_LENGTH / PRETRAIN_LENGTH · 2); the per-group sizes then come from
        rope_patch.tuning.detect_group_sizes. None where that needs s ≥ W."""
        w = min(1024, max(2, window // 8))
        s = max(1, round(2 * n / window))
        if n <= window or s >= w:
            return None
        return Suggestion.of(cls.name, {"group_sizes": [s] * 8, "window_size": w},
                             f"W = min(1024, L/8) = {w}, every group at the detection baseline s = 2N/L "
                             f"= {s} (Lu et al. 2025); detect per-group sizes with "
                             "rope_patch.tuning.detect_group_sizes")

    def __post_init__(self):
        n = self.name
        low, high = check.GROUP_SIZE_RANGE
        sizes = required(n, "group_sizes", self.group_sizes, "one group size per group of RoPE frequencies, fastest "
                          "first, e.g. 2/8/2/8/32/32/32/4; see rope_patch.tuning.detect_group_sizes", (low, high),
                          "Each is a group size s ≥ 1 (1 keeps that group's pairs at their true positions).",
                          check.number_list)
        self._set("group_sizes", tuple(check.integer(n, f"group_sizes[{i}]", s, ge=low, le=high,
                                                     hint="Group sizes are whole numbers of tokens.")
                                       for i, s in enumerate(sizes)))
        self._set("window_size", _check_window_size(n, self.window_size))
        if self.window_size <= max(self.group_sizes):
            raise ValueError(
                f"{n}: parameter `window_size` must be larger than every group size (the neighbour window holds whole "
                f"groups), got window_size={self.window_size}, group_sizes={'/'.join(map(str, self.group_sizes))}. "
                "Raise window_size (the authors use 1024) or lower the largest group size.")

    def far_positions(self):
        w = self.window_size
        return (GroupPositions(tuple(Affine(s, w - w // s, floor=True) for s in self.group_sizes)),
                GroupPositions(tuple(Affine(s, 0, floor=True) for s in self.group_sizes)))

    def served_length(self, window):
        # Self-Extend's bound per group; the group that reaches L first (the smallest size) decides
        reach = [grouped_reach(s, self.window_size, window) for s in self.group_sizes]
        return None if None in reach else min(reach)

    def resolve(self, target):
        # Read from the rotary modules' frequency buffers (`inv_freq`, `<layer_type>_inv_freq`), not from
        # target.contexts(): that needs a pretraining window, which DPE does not (RecurrentGemma records none).
        for rotary in target.rotaries:
            for name, freqs in rotary.named_buffers(recurse=False):
                n = freqs.numel()
                if name.endswith("inv_freq") and n < len(self.group_sizes):
                    raise ValueError(
                        f"{self.name}: {len(self.group_sizes)} group sizes for the {n} RoPE frequencies of "
                        f"{target.model_type} ({type(rotary).__name__}.{name}): every group needs at least "
                        f"one frequency. Give at most {n} group size{'s' if n > 1 else ''} (the authors use 8 "
                        "groups of a 128-dim head's 64).")
        return super().resolve(target)
