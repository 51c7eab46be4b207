"""Resonance RoPE as the authors' code computes it, written again (not copied) from sheryc/resonance_rope at 4a7f5a7,
independent of rope_patch.

`llama_finetuning/scaled_rope/LlamaYaRNScaledResonanceRotaryEmbedding.py` (the rotary that `--resonance-yarn`
patches into every Llama layer) and `modeling_llama_yarn.py`'s `LlamaResonanceRotaryEmbedding` (Resonance RoPE
without scaling) do, all in float32:
- `yarn`: θ_i = b^(−2i/d), blended between θ_i/s and θ_i by YaRN's ramp over the pairs (β_fast 32, β_slow 1, the
  ramp's ends floored / ceiled), cos/sin scale 0.1·ln s + 1;
- `resonance_register`: λ̃_i = round(2π / θ_i), θ̃_i = 2π / λ̃_i, for every pair;
- `compute_freqs`: pair i's angle at position t is t·θ̃_i for t < λ̃_i, and the table of its first λ̃_i angles repeated
  past that, i.e. (t mod λ̃_i)·θ̃_i: float32 products of numbers below λ̃_i, so the angles repeat bit for bit.
`AuthorsRotary` serves those tables to a transformers Llama as its rotary module (GPT-NeoX half split: the table's
angles twice, as their modified Llama uses them), so a whole forward runs on the authors' angles.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def yarn_inv_freq(dim: int, base: float, scale: float, original_window: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0) -> tuple[torch.Tensor, float]:
    """The authors' `yarn(device)`: the blended frequencies (float32) and the cos/sin scale."""

    def ramp_end(rotations: float) -> float:  # the pair index where `rotations` turns fit in the original window
        return dim * math.log(original_window / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(ramp_end(beta_fast)), 0)
    high = min(math.ceil(ramp_end(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the pair keeps its frequency (extrapolates), 0: it is divided by the scale (interpolates)
    powers = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (scale * powers)) * (1 - keep) + (1.0 / powers) * keep
    scaling = 0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0
    return inv_freq, scaling


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    """`LlamaRotaryEmbedding.__init__`'s θ_i = 1 / b^(2i/d), float32."""
    return 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))


def register(inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`resonance_register`: (θ̃, λ̃), float32 tensors, as the authors' float32 arithmetic gives them."""
    wavelengths = torch.round(2 * math.pi / inv_freq)
    return 2 * math.pi / wavelengths, wavelengths


def angles(r_inv_freq: torch.Tensor, wavelengths: torch.Tensor, length: int) -> torch.Tensor:
    """`compute_freqs(length)`: (length, pairs) float32, one pair at a time as the authors build it."""
    columns = []
    for theta, lam in zip(r_inv_freq.tolist(), wavelengths.tolist(), strict=True):
        theta = torch.tensor(theta, dtype=torch.float32)
        if length >= lam:  # the first λ̃ angles, tiled
            period = torch.arange(int(lam), dtype=torch.float32) * theta
            columns.append(period.repeat(math.ceil(length / lam))[:length])
        else:
            columns.append(torch.arange(length, dtype=torch.float32) * theta)
    return torch.stack(columns, dim=1)


class AuthorsRotary(nn.Module):
    """A Llama rotary module serving the authors' tables: forward(x, position_ids) -> (cos, sin) rows at the ids."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, length: int):
        super().__init__()
        table = angles(*register(inv_freq), length)
        emb = torch.cat((table, table), dim=-1)
        self.register_buffer("cos_table", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_table", emb.sin() * scaling, persistent=False)

    def forward(self, x, position_ids):
        return self.cos_table[position_ids].to(x.dtype), self.sin_table[position_ids].to(x.dtype)
