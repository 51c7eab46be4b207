"""PoSE: positional skip-wise training — see the target window's distances while training on short rows.

Zhu et al., "PoSE: Efficient Context Window Extension of LLMs via Positional Skip-wise Training" (ICLR 2024,
arXiv:2309.10400; reference implementation github.com/dwzhu-pku/PoSE). A training row of `train_length` tokens is
split into `n_chunks` contiguous chunks; every position id of chunk c is shifted by a skip u_c, with
u_0 = 0 and u_c drawn uniformly from [u_{c-1}, target_length - train_length] (non-decreasing), so the position
ids stay increasing, the largest is at most target_length - 1, and relative distances up to the target window
occur in training, at the cost of the short window.

The mask trap (transformers 5): when a model is called with `position_ids` and *no* `attention_mask` (and no
cache), `masking_utils.find_packed_sequence_indices` reads every step != 1 in the position ids as the start of a
new packed sequence and builds a block-diagonal causal mask — PoSE's chunks would then never attend to each
other, the exact opposite of the method. Passing an explicit all-ones 2-D `attention_mask` switches the packed
detection off; the causal mask is then built from token order (query index >= key index), which is what PoSE
needs: the chunks are one sequence whose positions skip ahead. `pose_inputs` builds such a batch
(tests/recipes/test_pose.py checks on eager and sdpa that the first chunk then reaches the last token).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch


def validate_pose(train_length: int, target_length: int, n_chunks: int) -> None:
    """ValueError naming the field and the value when a PoSE setting cannot work."""
    for name, value in (("train_length", train_length), ("target_length", target_length), ("n_chunks", n_chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pose.{name} must be a positive integer, got {value!r}.")
    if target_length < train_length:
        raise ValueError(
            f"pose.target_length={target_length} is shorter than the training rows (train.seq_len={train_length}): "
            "PoSE trains short rows for a longer target window; set target_length >= seq_len."
        )
    if n_chunks > train_length:
        raise ValueError(f"pose.n_chunks={n_chunks} exceeds the {train_length} tokens of a row: use 2 "
                         "(the paper's default).")


def pose_position_ids(train_length: int, target_length: int, n_chunks: int, rng: random.Random) -> list[int]:
    """One row of PoSE position ids (length `train_length`, increasing, max <= target_length - 1).

    Chunk lengths: the row is cut at `n_chunks - 1` distinct random points (every chunk >= 1 token). Skips: u_0 = 0
    (the first chunk keeps the positions the model knows, as in the reference code) and u_c uniform in
    [u_{c-1}, target_length - train_length].
    """
    validate_pose(train_length, target_length, n_chunks)
    cuts = sorted(rng.sample(range(1, train_length), n_chunks - 1)) if n_chunks > 1 else []
    bounds = [0, *cuts, train_length]
    budget = target_length - train_length
    ids: list[int] = []
    skip = 0
    for c in range(n_chunks):
        if c > 0:
            skip = rng.randint(skip, budget)
        ids.extend(range(bounds[c] + skip, bounds[c + 1] + skip))
    return ids


def pose_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor | Sequence[Sequence[int]]) -> dict:
    """Model kwargs for a PoSE batch: ids, skipped position ids and the all-ones mask that keeps attention causal
    across the skips (see the module docstring: without it transformers builds a block-diagonal mask)."""
    position_ids = torch.as_tensor(position_ids, dtype=torch.long, device=input_ids.device)
    if position_ids.dim() == 1:
        position_ids = position_ids.expand_as(input_ids)
    if position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}.")
    return {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": torch.ones_like(input_ids)}
