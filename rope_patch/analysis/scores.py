"""The long-term decay bound (RoFormer §3.4.3), rotation angles and expected attention scores vs distance."""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import validation as check
from .distances import bias as distance_bias
from .distances import distances_tensor, effective
from .frequencies import frequencies_at
from .layout import setup


def decay_bound_at_zero(n_pairs: int) -> float:
    """(1/n) Σ_{j=1}^{n} j = (n + 1)/2: the bound at Δ = 0 for n = d/2 rotating pairs (32.5 for d = 128)."""
    return (n_pairs + 1) / 2


def _seq_len_for(spec, d: torch.Tensor, seq_len):
    return seq_len if seq_len is not None else int(math.floor(d.max().item())) + 1


def _at_distances(name, distances, scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor,
                  model, config, layer_type, num_heads, params, seq_len, query_position):
    """The steps every distance-based function shares: validated distances, the setup, θ′ at the length those
    distances need (dynamic NTK / LongRoPE depend on it), and the effective distance the rotation sees."""
    if distances is None:
        raise TypeError(f"{name}: pass `distances` (relative distances Δ >= 0).")
    d = distances_tensor(distances)
    s = setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config,
               layer_type, num_heads, params)
    f = frequencies_at(s, _seq_len_for(s.spec, d, seq_len))
    return f, effective(s.spec, d, query_position)


def decay_bound(scheme=None, head_dim=None, distances=None, *, rope_theta=None, max_position_embeddings=None,
                seq_len=None, normalize=False, partial_rotary_factor=None, model=None, config=None, layer_type=None,
                query_position=None, **params) -> torch.Tensor:
    """The long-term-decay curve of RoFormer §3.4.3 (Su et al. 2021, arXiv:2104.09864): by Abel summation
    |Σ_i h_i e^{iΔθ_i}| ≤ (max_i |h_{i+1} − h_i|) Σ_j |S_j| with S_j = Σ_{i<j} e^{iΔθ_i}; returned is the mean
    (1/(d/2)) Σ_{j=1}^{d/2} |S_j| for each distance Δ, float64, shape [len(distances)].

    Uses the scheme's θ′_i (the pairs that rotate: rotary_dim/2 of them) at the scheme's effective distance
    (rerope/self_extend remap Δ); position-free schemes have no rotation, so the bound stays at its Δ = 0 value
    (n + 1)/2 = 32.5 for d = 128 — ALiBi's decay is in its bias (`attention_bias`). `normalize=True` divides by
    the Δ = 0 value. The cos/sin scale (YaRN's temperature) is not included: it multiplies scores, see
    `expected_score`.
    """
    f, delta = _at_distances("decay_bound", distances, scheme, head_dim, rope_theta, max_position_embeddings,
                             partial_rotary_factor, model, config, layer_type, None, params, seq_len, query_position)
    out = _decay(f.inv_freq.double(), delta)
    return out / decay_bound_at_zero(f.inv_freq.numel()) if normalize else out


def _decay(theta: torch.Tensor, delta: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    out = []
    for part in delta.split(chunk):
        phase = part[:, None] * theta[None, :]  # [n_dist, pairs]
        partial = torch.polar(torch.ones_like(phase), phase).cumsum(dim=1)  # S_j for j = 1..n: [n_dist, pairs]
        out.append(partial.abs().mean(dim=1))
    return torch.cat(out)


def angles(scheme=None, head_dim=None, distances=None, *, rope_theta=None, max_position_embeddings=None,
           seq_len=None, partial_rotary_factor=None, model=None, config=None, layer_type=None, query_position=None,
           **params) -> torch.Tensor:
    """Rotation angle between a query and a key Δ apart, per pair: Δ_eff·θ′_i in radians (not wrapped),
    float64 [len(distances), pairs]. A pair has seen every angle in training once (L − 1)·θ_i ≥ 2π."""
    f, delta = _at_distances("angles", distances, scheme, head_dim, rope_theta, max_position_embeddings,
                             partial_rotary_factor, model, config, layer_type, None, params, seq_len, query_position)
    return delta[:, None] * f.inv_freq.double()[None, :]


@dataclasses.dataclass(frozen=True)
class ExpectedScore:
    """Attention score vs distance (query at Δ, key at 0; float64 tensors of shape [len(distances)]).

    `ones`: q = k = all-ones (the RoFormer decay picture: a²·Σ_i 2cos(Δθ′_i) + the non-rotated dims).
    `random` / `random_std`: mean and spread over q = k = u, u uniform random unit vectors (`num_samples` of them);
    `random_exact`: its expectation, a²·(2/d)·Σ_i cos(Δθ′_i) + (d − rotary_dim)/d.
    `bias`: the additive per-head bias [num_heads, len] (ALiBi), zeros elsewhere.
    With `logits=True` the curves are what the softmax sees: q·k·a²/√d + the head-mean bias.
    """

    scheme: str
    distances: torch.Tensor
    ones: torch.Tensor
    random: torch.Tensor
    random_std: torch.Tensor
    random_exact: torch.Tensor
    bias: torch.Tensor
    logits: bool


def expected_score(scheme=None, head_dim=None, distances=None, *, rope_theta=None, max_position_embeddings=None,
                   seq_len=None, num_samples=256, seed=0, logits=False, num_heads=None, partial_rotary_factor=None,
                   model=None, config=None, layer_type=None, query_position=None, **params) -> ExpectedScore:
    """The q·k score vs relative distance under the scheme: for q = k = all-ones, and averaged over random unit
    vectors q = k = u (independent random q, k average to 0 at every distance). Includes the scheme's cos/sin
    scale a (logits × a²) and the remapped distances of rerope/self_extend; the rotation follows transformers'
    `rotate_half` layout (the score is the same for interleaved pairs). ALiBi's bias is in `.bias`, and added
    (head mean) when `logits=True`."""
    if distances is None:
        raise TypeError("expected_score: pass `distances`.")
    d = distances_tensor(distances)
    num_samples = check.integer("analysis", "num_samples", num_samples, ge=1)
    s = setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config,
               layer_type, num_heads, params)
    f = frequencies_at(s, _seq_len_for(s.spec, d, seq_len))
    delta = effective(s.spec, d, query_position)
    a2 = f.attention_scaling**2
    theta = f.inv_freq.double()
    head, rot = f.head_dim, f.rotary_dim
    cos = torch.cos(delta[:, None] * theta[None, :])  # [n_dist, pairs]
    ones = a2 * 2 * cos.sum(dim=1) + (head - rot)
    exact = a2 * (2.0 / head) * cos.sum(dim=1) + (head - rot) / head
    # q = k = u: the rotate_half layout pairs coordinate i with i + rot/2; the sin terms cancel for q = k, so
    # u_m·u_n = a²·Σ_i (u_i² + u_{i+rot/2}²) cos(Δθ_i) + |u_pass|².
    gen = torch.Generator().manual_seed(int(seed))
    u = torch.randn(num_samples, head, generator=gen, dtype=torch.float64)
    u = u / u.norm(dim=1, keepdim=True)
    half = rot // 2
    energy = u[:, :half] ** 2 + u[:, half:rot] ** 2  # [samples, pairs]
    passive = (u[:, rot:] ** 2).sum(dim=1)  # [samples]
    per_sample = a2 * cos @ energy.T + passive[None, :]  # [n_dist, samples]
    bias = distance_bias(s.spec, d, s.num_heads)
    rand, std = per_sample.mean(dim=1), per_sample.std(dim=1) if num_samples > 1 else torch.zeros_like(d)
    if logits:
        scale = 1 / math.sqrt(head)
        mean_bias = bias.mean(dim=0)
        ones, rand = ones * scale + mean_bias, rand * scale + mean_bias
        std, exact = std * scale, exact * scale + mean_bias
    return ExpectedScore(f.scheme, d, ones, rand, std, exact, bias, logits)
