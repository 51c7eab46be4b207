"""The numbers the theory page (docs/theory.md) quotes, for one scheme on one RoPE layout (`rope-patch explain`)."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..schemes.logn import Positions, QueryTemperature
from .frequencies import frequencies_at
from .layout import original_window, setup
from .scores import decay_bound, decay_bound_at_zero
from .spec import label_of


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The numbers the theory page (docs/theory.md) quotes, for one scheme on one RoPE layout (`explain`)."""

    scheme: str
    n_pairs: int  # pairs of the rotary dimensions (rotary_dim / 2)
    window: int | None  # L, the pre-training window
    turns_vanilla: int  # pairs that complete a full turn inside L under the unpatched θ_i
    turns: int  # ... under the scheme's θ′_i
    unchanged: int  # pairs with θ′_i = θ_i
    interpolated: int | None  # pairs with θ′_i = θ_i / s (fully interpolated by the factor s), None without s
    longest_wavelength: float  # 2π / min θ′_i over the rotating pairs (tokens)
    attention_scaling: float  # cos/sin scale; logits × its square
    decay_mean: float  # mean of the RoFormer decay bound over Δ ∈ [L/16, L]
    decay_max: float  # its maximum there
    decay_at_zero: float  # (n + 1)/2
    # a stack's modifiers: (label, ((p + 1, t(p)) at p + 1 = L, 2L, 4L, 8L)), the query temperature logn applies
    temperatures: tuple = ()
    n_rotating: int | None = None  # pairs with θ′_i > 0 (p_rope: its fraction p; alibi, nope: 0); None: all of them
    seq_len: int | None = None  # ℓ every number holds at: a length-dependent scheme's s·L; None: load time (ℓ ≤ L)

    def lines(self) -> list[str]:
        n, L = self.n_pairs, self.window
        r = n if self.n_rotating is None else self.n_rotating
        pairs = f"{n} rotating pairs" if r == n else f"{n} pairs, {r or 'none'} rotating"
        at = f", at ℓ = {self.seq_len:,} (its frequencies follow the length)" if self.seq_len else ""
        out = [f"{self.scheme}: {pairs}, pre-training window L = {L}{at}",
               f"  pairs completing a full turn inside L: {self.turns} (unpatched: {self.turns_vanilla})",
               f"  pairs unchanged (θ′ = θ): {self.unchanged} of {n}"]
        if self.interpolated is not None:
            out.append(f"  pairs fully interpolated (θ′ = θ/s): {self.interpolated} of {n}")
        out += [f"  longest wavelength: {self.longest_wavelength:,.0f} tokens",
                f"  cos/sin scale: {self.attention_scaling:.4g} (logits × {self.attention_scaling ** 2:.4g})",
                f"  decay bound over Δ ∈ [L/16, L]: mean {self.decay_mean:.2f}, max {self.decay_max:.2f} "
                f"(Δ = 0: {self.decay_at_zero:g})"]
        for label, points in self.temperatures:
            shown = ", ".join(f"×{t:.4g} at {n // L}L" if L and n % L == 0 else f"×{t:.4g} at {n:,}" for n, t in points)
            out.append(f"  query temperature ({label}): {shown} (logits × the same)")
        return out


def explain(scheme=None, head_dim=None, rope_theta=None, *, max_position_embeddings=None, partial_rotary_factor=None,
            model=None, config=None, layer_type=None, **params) -> Explanation:
    """Pair counts, wavelengths, temperature and decay of `scheme` (what `rope-patch explain` prints)."""
    s = setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config,
               layer_type, None, params)
    # a length-dependent scheme (dynamic, longrope, dynamic_yarn) at its extended window s·L, as the plots draw it:
    # every number below at that one length (at load time it is vanilla RoPE / LongRoPE's short factors)
    fs = s.spec.frequency_scheme
    factor = getattr(fs, "factor", None)
    ell = int(factor * original_window(s)) if fs is not None and fs.length_dependent and factor else None
    f = frequencies_at(s, ell)
    window = f.original_window or s.ctx.max_position_embeddings
    base, new = f.base_inv_freq.double(), f.inv_freq.double()
    two_pi = 2 * math.pi

    def turns(theta):
        return int((window * theta / two_pi >= 1).sum())

    factor = getattr(s.spec.frequency_scheme, "factor", None)
    model_config = config if config is not None else getattr(model, "config", None)  # llama4 logn's scales
    close = functools.partial(torch.isclose, rtol=1e-6, atol=0.0)
    rotating = new[new > 0]
    distances = torch.arange(max(1, window // 16), window + 1)
    bound = decay_bound(scheme, head_dim, distances, rope_theta=rope_theta,
                        max_position_embeddings=max_position_embeddings,
                        partial_rotary_factor=partial_rotary_factor, model=model, config=config, layer_type=layer_type,
                        seq_len=ell, **params)
    return Explanation(
        scheme=s.spec.label or s.spec.name, n_pairs=new.numel(), window=window,
        turns_vanilla=turns(base), turns=turns(new), unchanged=int(close(new, base).sum()),
        interpolated=None if not factor or factor == 1 else int(close(new, base / factor).sum()),
        longest_wavelength=float(two_pi / rotating.min()) if rotating.numel() else math.inf,
        attention_scaling=f.attention_scaling, decay_mean=float(bound.mean()), decay_max=float(bound.max()),
        decay_at_zero=decay_bound_at_zero(new.numel()),
        temperatures=tuple((label_of(m), _temperatures(m, window, model_config)) for m in s.spec.modifiers),
        n_rotating=rotating.numel(), seq_len=ell,
    )


def _temperatures(modifier, window: int, config) -> tuple:
    """logn's t(p) where p + 1 = L, 2L, 4L, 8L (llama4's scales as the model would run them: `LogN.with_defaults`)."""
    m = modifier.with_defaults(config)
    t = QueryTemperature(m.kind, window, m.attn_scale, m.floor_scale, "eager", True, Positions())
    lengths = [k * window for k in (1, 2, 4, 8)]
    factors = t.factor(torch.tensor(lengths) - 1)
    return tuple((n, float(f)) for n, f in zip(lengths, factors, strict=True))
