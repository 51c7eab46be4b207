"""The relative position the rotation sees, as a function of the true distance Δ (read from each scheme's
`relative_position`, the positions its attention function rotates with), and ALiBi's additive bias."""

from __future__ import annotations

import numpy as np
import torch

from .. import validation as check
from ..schemes.bias import alibi_slopes as scheme_slopes
from .layout import setup
from .spec import AnalysisSpec, as_spec


def distances_tensor(distances, name="distances") -> torch.Tensor:
    """A 1-D float64 tensor of finite, non-negative distances (a number, list, range, numpy array or tensor)."""
    if isinstance(distances, (str, bytes, bool)) or distances is None:
        raise TypeError(f"`{name}` must be a number or a 1-D sequence of numbers, "
                        f"got {type(distances).__name__} {distances!r}.")
    try:
        t = (distances.detach().cpu() if isinstance(distances, torch.Tensor)
             else torch.as_tensor(np.asarray(distances, dtype=np.float64)))
    except (TypeError, ValueError) as err:
        raise TypeError(f"`{name}` must be numbers: {err}") from None
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"`{name}` must be real numbers, got dtype {t.dtype}.")
    if t.dim() > 1:
        raise ValueError(f"`{name}` must be 1-D (one relative distance per entry), got shape {tuple(t.shape)}.")
    t = t.double().reshape(-1)
    if t.numel() == 0:
        raise ValueError(f"`{name}` is empty.")
    if not torch.isfinite(t).all():
        raise ValueError(f"`{name}` must be finite.")
    if (t < 0).any():
        bad = t[t < 0][0].item()
        raise ValueError(f"`{name}` must be >= 0 (relative distance Δ = m − n ≥ 0 of a causal model), got {bad:g}.")
    return t


def rerope_distance(distances, window_size: int) -> torch.Tensor:
    """ReRoPE (Su 2023, "Rectified Rotary Position Embeddings", kexue.fm/archives/9708): min(Δ, W)."""
    return effective_distance("rerope", distances, window_size=window_size)


def leaky_rerope_distance(distances, window_size: int, factor: float) -> torch.Tensor:
    """Leaky ReRoPE (Su 2023, same post): Δ for Δ < W, else W + (Δ − W)/k, k = `factor` ≥ 1."""
    return effective_distance("leaky_rerope", distances, window_size=window_size, factor=factor)


def self_extend_distance(distances, group_size: int, window_size: int, query_position=None) -> torch.Tensor:
    """Self-Extend (Jin et al. 2024, "LLM Maybe LongLM", arXiv:2401.01325, their reference code): neighbour tokens
    (Δ < W) keep the true distance; beyond, the query sits at ⌊i/G⌋ + W − ⌊W/G⌋ and the key at ⌊j/G⌋, so the
    distance is ⌊i/G⌋ − ⌊j/G⌋ + W − ⌊W/G⌋ (continuous at Δ = W when G divides i).

    The grouped distance depends on i and j, not only on Δ = i − j: by default the query is at i = Δ and the key at
    j = 0 (⌊Δ/G⌋ + W − ⌊W/G⌋); pass `query_position` = i to get the exact values for that query (j = i − Δ ≥ 0).
    """
    return effective_distance("self_extend", distances, query_position=query_position, group_size=group_size,
                              window_size=window_size)


def string_distance(distances, shift_size: int, window_size: int) -> torch.Tensor:
    """STRING (An et al. 2024, arXiv:2410.18745): Δ for Δ < S, else Δ − S + W."""
    return effective_distance("string", distances, shift_size=shift_size, window_size=window_size)


def dca_distance(distances, chunk_size: int, local_size: int, query_position=None) -> torch.Tensor:
    """Dual Chunk Attention (An et al. 2024, arXiv:2402.17463): with c = chunk_size − local_size, the key at j mod c
    and the query at i mod c (same chunk), min(i mod c + c, chunk_size) (previous chunk) or min(2c − 1, chunk_size)
    (earlier chunks). Depends on i and j: by default i = Δ, j = 0 (pass `query_position` for another query)."""
    return effective_distance("dca", distances, query_position=query_position, chunk_size=chunk_size,
                              local_size=local_size)


def effective_distance(scheme=None, distances=None, *, query_position=None, **params) -> torch.Tensor:
    """The relative distance the attention's rotation sees, as a function of the true distance Δ.

    Identity for frequency schemes (their change is in θ′, see `frequencies`) and position-free schemes; the
    remapped positions of self_extend, rerope, leaky_rerope, string and dca (`Scheme.relative_position`). Schemes
    whose map depends on the absolute positions (self_extend, dca) put the query at i = Δ and the key at 0 unless
    `query_position` = i is given.
    """
    if distances is None:
        raise TypeError("effective_distance: pass `distances` (true relative distances Δ >= 0).")
    spec = as_spec("default" if scheme is None else scheme, **params)
    return effective(spec, distances_tensor(distances), query_position)


def effective(spec: AnalysisSpec, d: torch.Tensor, query_position=None) -> torch.Tensor:
    if query_position is None:
        i = d
    else:
        i = torch.full_like(d, float(check.integer(spec.name, "query_position", query_position, ge=0)))
        if (d > i).any():
            raise ValueError(f"{spec.name}: distances must be <= query_position={int(i[0])} "
                             "(key position j = i − Δ >= 0).")
    return spec.scheme.relative_position(i, i - d).to(torch.float64)


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022, "Train Short, Test Long", arXiv:2108.12409, §3 and their reference
    `get_slopes`): m_h = 2^(−max_bias·h/n), h = 1..n, for n a power of two (max_bias = 8 in the paper); otherwise the
    slopes of the nearest lower power of two c, then every other slope of 2c (odd h), up to n heads.
    The max_bias generalisation is BLOOM's / llama.cpp's; max_bias = 8 gives exactly the paper's slopes."""
    n = check.integer("alibi", "num_heads", num_heads, ge=1)
    max_bias = check.number("alibi", "max_bias", max_bias, gt=0.0)
    return torch.tensor(scheme_slopes(n, max_bias), dtype=torch.float64)


def attention_bias(scheme=None, distances=None, *, num_heads=None, model=None, config=None, **params) -> torch.Tensor:
    """Additive logit bias vs distance, [num_heads, len(distances)]: −m_h·Δ for alibi, zeros for every other
    scheme (relative_bias is learned; its values depend on the trained weights and are not modelled here)."""
    if distances is None:
        raise TypeError("attention_bias: pass `distances`.")
    d = distances_tensor(distances)
    if model is not None or config is not None:
        s = setup(scheme, None, None, None, None, model, config, None, num_heads, params)
        spec, num_heads = s.spec, s.num_heads
    else:
        spec = as_spec("default" if scheme is None else scheme, **params)
    return bias(spec, d, num_heads)


def bias(spec: AnalysisSpec, d: torch.Tensor, num_heads) -> torch.Tensor:
    """The scheme's fixed bias (`Scheme.distance_bias`), else zeros (relative_bias is learned: not modelled)."""
    fixed = spec.scheme.distance_bias(d, num_heads)
    return fixed if fixed is not None else torch.zeros(num_heads or 1, d.numel(), dtype=torch.float64)
