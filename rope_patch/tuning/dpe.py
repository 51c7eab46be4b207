"""DPE's effective-length detection: the group size of each group of RoPE frequencies, measured on the model.

The authors (Lu et al. 2025, arXiv:2504.18857 §3; LuLuLuyi/DPE `effective_length_detection/run_niah_detect.sh`)
detect, for a target length N on a model trained to L, one group at a time: every other group sits at the baseline
2N/L, the detected group takes each size of 1, 2, 4, …, N/W in turn (W = 1024: `length` halves from N down to
1024), and a 4-needle NIAH at N scores each setting; the best score gives that group's size (its "effective
length" N/s). That is groups × (log2(N/W) + 1) long-context evaluations (8 × 8 at 128k), so `apply()` does not run
it: `detect_group_sizes` does, with the score the caller chooses, and its result is the `group_sizes` of
`rope_patch.apply(model, "dpe", group_sizes=..., window_size=W)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn

from ..api import patched
from ..suggest import pretraining_window as trained_window


def candidate_sizes(target: int, window_size: int) -> list[int]:
    """1, 2, 4, … up to N/W (the authors' `detecting_factor`), below W (a group holds fewer tokens than the window)."""
    top = max(1, target // window_size)
    return [2**k for k in range(int(math.log2(top)) + 1) if 2**k < window_size]


def detect_group_sizes(model: nn.Module, score: Callable[[nn.Module], float], target: int, window_size: int, *,
                       groups: int = 8, pretraining_window: int | None = None,
                       baseline: int | None = None) -> list[int]:
    """The authors' detection sweep: for each group g, `score(model)` (higher is better, e.g. passkey or NIAH
    accuracy at `target` tokens) with group g at each of `candidate_sizes(target, window_size)` and the other groups
    at `baseline` (default 2N/L, L = `pretraining_window`, default the window the model was pre-trained on:
    `rope_patch.suggest.pretraining_window`, a shipped `original_max_position_embeddings` where the checkpoint ships
    with scaling, else `max_position_embeddings`, read before any patch). Group g
    keeps its best size; ties go to the smaller size (the positions closer to the model's own). The model is patched
    only inside each evaluation (rope_patch.patched) and left as it was.

    Example (passkey accuracy at 16k on a 4k model, the 20 samples `rope-patch compare` uses):

        from rope_patch.evaluation.retrieval import evaluate_passkey
        sizes = detect_group_sizes(model, lambda m: evaluate_passkey(m, tokenizer, 16384, ...)["accuracy"],
                                   target=16384, window_size=512)
        rope_patch.apply(model, "dpe", group_sizes=sizes, window_size=512)
    """
    if pretraining_window is None:  # the window it was pre-trained on (Llama 3.1: 8192, not its 131072)
        pretraining_window = trained_window(model)
    if baseline is None:
        baseline = max(1, round(2 * target / pretraining_window))
    sizes = candidate_sizes(target, window_size)
    found = []
    for g in range(groups):
        best, best_size = -math.inf, None
        for s in sizes:
            trial = [baseline] * groups
            trial[g] = s
            with patched(model, "dpe", group_sizes=trial, window_size=window_size):
                value = float(score(model))
            if value > best:  # strictly better: a tie keeps the smaller size
                best, best_size = value, s
        found.append(best_size)
    return found
