"""θ′_i after a scheme, its cos/sin scale, and the wavelengths λ_i = 2π/θ′_i against the window L."""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import validation as check
from ..api import as_scheme
from ..discovery import RopeContext
from ..schemes.frequency import FrequencyScheme
from .layout import Setup, original_window, setup


@dataclasses.dataclass(frozen=True)
class Frequencies:
    """θ′_i after the scheme, the unpatched θ_i, and the cos/sin scale (logits scale by its square)."""

    scheme: str  # label for legends
    name: str  # canonical scheme name
    inv_freq: torch.Tensor  # θ′_i, float32 [rotary_dim/2]: the model's `rotary_emb.inv_freq` under the scheme
    base_inv_freq: torch.Tensor  # θ_i = b^(−2i/d) of the unpatched model, float32
    attention_scaling: float  # multiplies cos and sin (`rotary_emb.attention_scaling`); logits × its square
    head_dim: int
    rotary_dim: int
    rope_theta: float  # the unpatched base b
    original_window: int | None  # L
    seq_len: int | None  # the length ℓ these numbers hold for (None: at load time, ℓ ≤ L)
    rotates: bool = True  # False for position-free schemes (alibi, nope, ...): θ′ = 0, no rotation

    @property
    def logit_scale(self) -> float:
        """Factor on the attention logits q·k/√d (YaRN's "temperature" 1/t = attention_factor²)."""
        return self.attention_scaling**2

    @property
    def interpolation(self) -> torch.Tensor:
        """Per-pair interpolation factor θ_i/θ′_i (1 = unchanged, s = fully interpolated, inf = rotation removed)."""
        base, new = self.base_inv_freq.double(), self.inv_freq.double()
        return torch.where(new > 0, base / new.clamp_min(1e-300), torch.full_like(base, math.inf))


def frequencies(scheme=None, head_dim=None, rope_theta=None, *, max_position_embeddings=None, seq_len=None,
                partial_rotary_factor=None, model=None, config=None, layer_type=None, **params) -> Frequencies:
    """Per-pair angular frequency θ′_i after `scheme` and the attention scaling it implies.

    For frequency schemes this runs `FrequencyScheme.inv_freq` (transformers' own init functions), so the numbers
    equal `model.model.rotary_emb.inv_freq` / `.attention_scaling` of a patched model. With `seq_len`, dynamic NTK
    and LongRoPE give the values transformers installs when the sequence reaches that length.
    Attention schemes keep θ_i (self_extend, rerope, leaky_rerope, string, dca) or remove the rotation (θ′_i = 0:
    alibi, nope, relative_bias, sinusoidal, learned_absolute; `Scheme.keeps_rotation`); their cos/sin scale is 1.
    """
    s = setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config,
               layer_type, None, params)
    return frequencies_at(s, seq_len)


def frequencies_at(s: Setup, seq_len) -> Frequencies:
    if seq_len is not None:
        seq_len = check.integer("analysis", "seq_len", seq_len, ge=1)
    base, _ = as_scheme("default").inv_freq(_init_ctx(s.ctx), s.rotary_cls)
    spec = s.spec
    if spec.is_frequency:  # a frequency scheme, or a stack's frequency part
        inv_freq, scaling = _inv_freq_at(spec.frequency_scheme, s.ctx, seq_len, s.rotary_cls)
        rotates = True
    elif spec.keeps_rotation:  # attention-side schemes (and modifiers) rotating with the model's own frequencies
        inv_freq, scaling, rotates = base.clone(), 1.0, True
    else:
        inv_freq, scaling, rotates = torch.zeros_like(base), 1.0, False
    return Frequencies(spec.label or spec.name, spec.name, inv_freq, base, float(scaling), s.ctx.head_dim,
                       s.ctx.rotary_dim, s.ctx.rope_theta, original_window(s), seq_len, rotates)


def _inv_freq_at(scheme: FrequencyScheme, ctx: RopeContext, seq_len, rotary_cls):
    """`scheme.inv_freq` at load time (seq_len None) or as transformers installs it for a sequence of `seq_len`."""
    return scheme.inv_freq(_init_ctx(ctx, scheme), rotary_cls, seq_len=seq_len)


def _init_ctx(ctx: RopeContext, scheme=None) -> RopeContext:
    """Without a known window L only schemes that do not read it get here (`_resolve_free` demands L from the
    others); `FrequencyScheme.init_window` still wants a number for the init config, which their θ ignores."""
    if ctx.max_position_embeddings is not None:
        return ctx
    fallback = getattr(scheme, "original_max_position_embeddings", None) or 4096
    return dataclasses.replace(ctx, max_position_embeddings=fallback)


@dataclasses.dataclass(frozen=True)
class Wavelengths:
    """λ_i = 2π/θ′_i per pair and r_i = L/λ_i, the number of full turns pair i makes inside the window L
    (YaRN's and Llama 3.1's criterion: r_i > β or λ_i < L/high_freq_factor → keep; r_i < α → interpolate)."""

    scheme: str
    wavelength: torch.Tensor  # float64 [pairs], inf for pairs that do not rotate
    base_wavelength: torch.Tensor  # of the unpatched model
    window: int  # L
    ratio: torch.Tensor  # r_i = L/λ_i under the scheme
    base_ratio: torch.Tensor  # r_i of the unpatched model

    @property
    def full_period(self) -> torch.Tensor:
        """Pairs that complete at least one full period inside the window (λ_i ≤ L): they have seen every angle."""
        return self.wavelength <= self.window

    @property
    def critical_pair(self) -> int:
        """First pair whose unpatched wavelength exceeds L (Liu et al. 2023's "critical dimension" / 2); pairs from
        here on never saw a full period in training. Equals the number of pairs if all complete one."""
        longer = torch.nonzero(self.base_wavelength > self.window)
        return int(longer[0]) if len(longer) else int(self.base_wavelength.numel())


def wavelengths(scheme=None, head_dim=None, rope_theta=None, *, max_position_embeddings=None, window=None,
                seq_len=None, partial_rotary_factor=None, model=None, config=None, layer_type=None,
                **params) -> Wavelengths:
    """Wavelength λ_i = 2π/θ′_i per pair and the ratio r_i = L/λ_i for the original window L (`window`, default:
    the scheme's `original_max_position_embeddings`, else `max_position_embeddings` / the model's window)."""
    s = setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config,
               layer_type, None, params)
    f = frequencies_at(s, seq_len)
    L = window if window is not None else f.original_window
    if L is None:
        raise TypeError("wavelengths: pass the original window L (window= or max_position_embeddings=, "
                        "or model= / config=).")
    L = check.integer("analysis", "window", L, ge=1)
    lam, lam0 = _wavelength(f.inv_freq), _wavelength(f.base_inv_freq)
    return Wavelengths(f.scheme, lam, lam0, L, L / lam, L / lam0)


def _wavelength(inv_freq: torch.Tensor) -> torch.Tensor:
    theta = inv_freq.double()
    return torch.where(theta > 0, 2 * math.pi / theta.clamp_min(1e-300), torch.full_like(theta, math.inf))
