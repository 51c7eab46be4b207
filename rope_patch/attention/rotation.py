"""Deferred RoPE: rotate queries and keys inside the attention function, at positions of the scheme's choosing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from ..rotary import unpatched_forward


@dataclasses.dataclass
class Rotation:
    """The model's own RoPE, callable at any (also fractional) positions: its rotary module's own (class) forward
    (inv_freq, attention_scaling, dynamic/longrope updates) and its modeling file's `apply_rotary_pos_emb`
    (rotate_half or interleaved convention, partial rotary). Holds the module, not a bound method of an instance
    override, so a copied or pickled model rotates with its own rotary."""

    rotary: nn.Module
    apply_rotary: Callable
    layer_type: str | None = None  # per-layer-type rotaries (Gemma 3): which frequencies

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (b, heads, n, d) rotated to positions (b|1, n)."""
        extra = () if self.layer_type is None else (self.layer_type,)
        cos, sin = unpatched_forward(self.rotary, x, positions, *extra)
        return self.apply_rotary(x, x[:, :1], cos, sin)[0]  # the function rotates a (q, k) pair: k is a dummy


def floor_div(x: torch.Tensor, g: int) -> torch.Tensor:
    return torch.div(x, g, rounding_mode="floor")
