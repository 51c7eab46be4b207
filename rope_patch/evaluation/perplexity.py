"""Perplexity vs. context length, and by position inside the longest window.

Protocol (the "non-overlapping windows" evaluation of Press et al. 2021 (ALiBi, arXiv:2108.12409) and Chen et al.
2023 (Position Interpolation, arXiv:2306.15595)): the held-out token stream is cut into consecutive windows of
exactly `length` tokens; each window is scored on its own, from position 0, with no context carried over; the
perplexity at `length` is exp(mean NLL) over every predicted token of every window.

Which tokens (`scored_tokens`): a length L reads the first `windows` x max(L, PPL_SHARED_LENGTH) tokens of the stream
(all of it, if shorter), or the first `n_tokens` when given. So every length up to 2048 reads the same text, a
longer one sees the same text with more context per prediction plus more of it, and a length's figure depends on
its own length only, never on the other lengths of the run. (Before 2026-12-06 every length read `windows` x the
run's longest length: the same scheme at 512 gave another figure in a run whose longest length was 2048 than in
one whose longest was 512.)

Perplexity by position bucket inside the longest window shows *where* a scheme breaks down: a vanilla model is
fine up to its training window and then diverges, a good extension scheme stays flat.

Length-dependent RoPE (dynamic NTK, dynamic YaRN, LongRoPE): each window of `length` tokens is scored with the
frequencies of a `length`-token forward (as the model would use for that whole sequence in one forward, whatever
ran before); see `common.at_length` / `rope_patch.fix_length`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .common import at_length, token_nll, windowed_from
from .defaults import PPL_SHARED_LENGTH, WINDOWS_AT_LONGEST


def default_buckets(longest: int, window: int | None) -> list[tuple[int, int]]:
    """Position buckets for the longest window: [0, W), [W, 2W), [2W, 4W), ... (W = the model's training window);
    four equal buckets when everything fits in the window."""
    if not window or window >= longest:
        edges = [round(i * longest / 4) for i in range(5)]
    else:
        edges = [0, window]
        while edges[-1] < longest:
            edges.append(min(2 * edges[-1], longest))
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def fixed_buckets(longest: int, size: int) -> list[tuple[int, int]]:
    """Buckets of `size` positions for the longest window: [0, size), [size, 2·size), ..., the last one cut at
    `longest`. ValueError when `size` is not between 1 and `longest`."""
    size = int(size)
    if not 1 <= size <= longest:
        raise ValueError(f"bucket size must be between 1 and the longest length ({longest}), got {size}: pass "
                         f"--bucket-size N with N <= {longest}, or leave it out for the default buckets.")
    return [(a, min(a + size, longest)) for a in range(0, longest, size)]


def scored_tokens(length: int, token_count: int, windows_at_longest: int = WINDOWS_AT_LONGEST,
                  n_tokens: int | None = None) -> int:
    """Tokens of the stream read at `length` (whole windows of it): the first `n_tokens`, or by default the first
    `windows_at_longest` x max(length, PPL_SHARED_LENGTH), of a stream of `token_count` tokens. A function of the
    length alone (and the settings), not of the run's other lengths: a cell's figure compares across runs."""
    n = n_tokens if n_tokens is not None else windows_at_longest * max(length, PPL_SHARED_LENGTH)
    return min(n, token_count) // length * length


def check_lengths(token_count: int, lengths: Sequence[int], windows_at_longest: int = WINDOWS_AT_LONGEST,
                  n_tokens: int | None = None) -> None:
    """ValueError, before any forward, when a length gets no whole window of the tokens read (`scored_tokens`): it
    would fail after the shorter lengths had run."""
    short = [L for L in sorted(set(lengths)) if scored_tokens(L, token_count, windows_at_longest, n_tokens) < L]
    if short:
        have = min(token_count, n_tokens) if n_tokens is not None else token_count
        raise ValueError(f"Perplexity at length {', '.join(map(str, short))} needs at least one window of that many "
                         f"tokens, and {have} are read" + (" (n_tokens / ppl_tokens)" if n_tokens is not None else
                                                           " (the held-out text)")
                         + ": pass shorter lengths, more tokens or a longer held-out text.")


def check_buckets(buckets: Sequence[tuple[int, int]], longest: int) -> None:
    """ValueError for a bucket that is empty or reaches outside [0, longest]: its row would be labelled with
    positions the longest window does not have."""
    bad = [(a, b) for a, b in buckets if not 0 <= a < b <= longest]
    if bad:
        raise ValueError(f"Buckets must lie inside the longest length's positions, 0 <= start < end <= {longest}; got "
                         f"{', '.join(f'({a}, {b})' for a, b in bad)}.")


def windows(token_ids: Sequence[int], length: int, n_tokens: int) -> torch.Tensor:
    """[n_windows, length] consecutive non-overlapping windows from the first `n_tokens` tokens."""
    n = min(n_tokens, len(token_ids)) // length
    if n == 0:
        raise ValueError(f"Need at least {length} tokens for one window at length {length}, "
                         f"have {min(n_tokens, len(token_ids))}.")
    return torch.tensor(list(token_ids[: n * length]), dtype=torch.long).view(n, length)


def batch_size_for(length: int, tokens_per_batch: int = 8192) -> int:
    return max(1, tokens_per_batch // length)


@torch.no_grad()
def window_nll(model, token_ids: Sequence[int], length: int, n_tokens: int, *, tokens_per_batch: int = 8192,
               progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """Per-token NLL [n_windows, length-1] over the windows of `length` tokens (see module docstring)."""
    ids = windows(token_ids, length, n_tokens).to(next(model.parameters()).device)
    out = []
    with at_length(model, length), windowed_from(model, length):
        for batch in ids.split(batch_size_for(length, tokens_per_batch)):
            out.append(token_nll(model, batch))
            if progress is not None:
                progress(batch.numel())
    return torch.cat(out)


def _ppl(nll: torch.Tensor) -> float:
    mean = nll.double().mean().item()
    return math.exp(mean) if mean < 700 else float("inf")


@torch.no_grad()
def evaluate_perplexity(model, token_ids: Sequence[int], lengths: Sequence[int], *, n_tokens: int | None = None,
                        windows_at_longest: int = WINDOWS_AT_LONGEST, buckets: Sequence[tuple[int, int]] | None = None,
                        window: int | None = None, tokens_per_batch: int = 8192,
                        progress: Callable[[int], None] | None = None, bucket_size: int | None = None) -> dict:
    """Perplexity at each length over the same text, plus by position bucket inside the longest window.

    Args:
        token_ids: the held-out token stream.
        lengths: window lengths in tokens.
        n_tokens: tokens of the stream to read at every length; by default `windows_at_longest` x max(length,
            PPL_SHARED_LENGTH) at each length (`scored_tokens`).
        buckets: (start, end) position ranges for the bucket table (default `default_buckets(longest, window)`).
        bucket_size: buckets of this many positions instead (`fixed_buckets`). Buckets are slices of the longest
            length's per-token NLL: finer buckets cost no forward pass (one decoder forward per batch of windows).
        window: the model's training window, for the default buckets (default config.max_position_embeddings).
        progress: called with the number of tokens processed after each batch.

    Returns:
        {"lengths": [{"length", "n_windows", "n_tokens", "nll", "perplexity"}, ...],
         "buckets": [{"start", "end", "n_tokens", "nll", "perplexity"}, ...]}  (buckets of the longest length)
    """
    lengths = sorted(set(int(x) for x in lengths))
    longest = lengths[-1]
    if window is None:
        window = getattr(model.config, "max_position_embeddings", None)
    if bucket_size is not None:
        if buckets is not None:
            raise ValueError("Pass either buckets or bucket_size, not both.")
        buckets = fixed_buckets(longest, bucket_size)
    if buckets is not None:
        check_buckets(buckets, longest)
    check_lengths(len(token_ids), lengths, windows_at_longest, n_tokens)
    rows, longest_nll = [], None
    for length in lengths:
        n = n_tokens if n_tokens is not None else scored_tokens(length, len(token_ids), windows_at_longest)
        nll = window_nll(model, token_ids, length, n, tokens_per_batch=tokens_per_batch, progress=progress)
        rows.append({"length": length, "n_windows": nll.shape[0], "n_tokens": nll.numel(),
                     "nll": nll.double().mean().item(), "perplexity": _ppl(nll)})
        if length == longest:
            longest_nll = nll
    bucket_rows = []
    # Position p of the window is predicted by nll[:, p-1]; bucket [a, b) covers predicted positions a..b-1.
    for a, b in buckets or default_buckets(longest, window):
        part = longest_nll[:, max(a, 1) - 1 : b - 1]
        if part.numel():
            bucket_rows.append({"start": a, "end": b, "n_tokens": part.numel(), "nll": part.double().mean().item(),
                                "perplexity": _ppl(part)})
    return {"lengths": rows, "buckets": bucket_rows}


def perplexity_work(token_count: int, lengths: Sequence[int], n_tokens: int | None = None,
                    windows_at_longest: int = WINDOWS_AT_LONGEST) -> int:
    """Tokens `evaluate_perplexity` will process (for progress bars)."""
    return sum(scored_tokens(L, token_count, windows_at_longest, n_tokens) for L in set(lengths))
