"""The theory of position encodings as numbers: frequencies, wavelengths, the long-term-decay bound, angles,
expected attention scores and effective relative distances, for any scheme and any model.

Pure functions on tensors; no model is needed. Every function takes the scheme in one of these forms

    "yarn:8", "default:500000", "yarn:factor=8,beta_fast=16"   a spec string (as on the command line)
    "yarn", factor=8                                           a name plus parameters
    rope_patch.as_scheme("yarn", factor=8)                     a Scheme object

and the model's RoPE either as numbers (`head_dim`, `rope_theta`, `max_position_embeddings` = the original
training window L, `partial_rotary_factor`), or read from a transformers `config=` or a loaded `model=` (whose
applied scheme, `rope_patch.current(model)`, is used when `scheme` is None).

Frequency schemes are computed with the very code that patches a model (`FrequencyScheme.inv_freq`, i.e.
transformers' own `ROPE_INIT_FUNCTIONS`), so θ′_i and the cos/sin scale are the numbers the patched model uses,
bit for bit (tests/test_analysis.py checks that against `model.model.rotary_emb`). Attention schemes are
described by name + parameters with the small formulas below, so they work before and after their classes are
registered:

    scheme            rotation θ_i          relative distance seen by attention        additive bias
    alibi             none (θ_i = 0)        Δ                                          −m_h·Δ (Press et al. 2022)
    nope              none                  Δ                                          0     (Kazemnejad et al. 2023)
    relative_bias     none                  Δ                                          learned T5 buckets (not modelled)
    sinusoidal        none                  (absolute, added to the embeddings)        0     (Vaswani et al. 2017)
    learned_absolute  none                  (absolute, learned table)                  0
    self_extend       model's θ_i           Δ < W: Δ; else ⌊i/G⌋ − ⌊j/G⌋ + W − ⌊W/G⌋    0     (Jin et al. 2024)
    rerope            model's θ_i           min(Δ, W)                                  0     (Su 2023)
    leaky_rerope      model's θ_i           Δ < W: Δ; else W + (Δ − W)/k (k = factor)  0     (Su 2023)

Notation (FORMULAS.md): head dim d, pair i = 0..d/2−1, base b, θ_i = b^(−2i/d), wavelength λ_i = 2π/θ_i, original
window L, relative distance Δ = m − n.

Sequence-length dependent schemes: dynamic NTK changes θ with the current length ℓ and LongRoPE switches from its
short to its long factors once ℓ > L. `frequencies(..., seq_len=ℓ)` gives the numbers at length ℓ (exactly what
transformers' `dynamic_rope_update` installs at that length); without `seq_len` they are the ones at load time
(ℓ ≤ L). The distance-based functions default to ℓ = max(distances) + 1, the shortest sequence that contains
all the requested distances.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import numpy as np
import torch

from . import validation as check
from .api import as_scheme
from .registry import aliases as _aliases
from .registry import canonical_name, list_schemes
from .schemes.base import Scheme
from .schemes.frequency import FrequencyScheme
from .discovery import RopeContext, PatchSite, find_target

__all__ = [
    "ATTENTION_SCHEMES",
    "AnalysisSpec",
    "ExpectedScore",
    "Frequencies",
    "Wavelengths",
    "alibi_slopes",
    "angles",
    "as_spec",
    "attention_bias",
    "decay_bound",
    "decay_bound_at_zero",
    "effective_distance",
    "expected_score",
    "frequencies",
    "leaky_rerope_distance",
    "rerope_distance",
    "self_extend_distance",
    "wavelengths",
]

# Attention schemes: does the model's rotation stay, and how is the relative distance remapped?
# (name -> (keeps_rotation, {parameter: default used when the scheme object does not set it}))
ATTENTION_SCHEMES: dict[str, tuple[bool, dict]] = {
    "alibi": (False, {"max_bias": 8.0}),
    "nope": (False, {}),
    "relative_bias": (False, {"num_buckets": 32, "max_distance": 128}),
    "sinusoidal": (False, {"rope_theta": 10000.0}),
    "learned_absolute": (False, {"max_position_embeddings": None}),
    "self_extend": (True, {"group_size": None, "window_size": None}),
    "rerope": (True, {"window_size": None}),
    "leaky_rerope": (True, {"window_size": None, "factor": None}),
}
# Other spellings a scheme class may use for the same parameter (first match wins).
_SYNONYMS = {
    "factor": ("factor", "leak_factor", "k"),
    "window_size": ("window_size", "window"),
    "group_size": ("group_size", "group"),
}
_SHORT = {"factor": "s", "rope_theta": "b", "partial_rotary_factor": "p", "group_size": "G", "window_size": "W",
          "original_max_position_embeddings": "L"}
_SHORT_BY_SCHEME = {"leaky_rerope": {"factor": "k"}}


# ------------------------------------------------------------------------------------------------------------------
# Scheme normalisation
@dataclasses.dataclass(frozen=True)
class AnalysisSpec:
    """A scheme as analysis sees it: canonical name, parameters, the Scheme object where one is registered."""

    name: str
    params: dict
    scheme: Scheme | None = None
    label: str = ""

    @property
    def is_frequency(self) -> bool:
        return isinstance(self.scheme, FrequencyScheme)

    @property
    def keeps_rotation(self) -> bool:
        return self.is_frequency or (self.name in ATTENTION_SCHEMES and ATTENTION_SCHEMES[self.name][0])

    def param(self, key: str):
        """An attention-scheme parameter: the scheme's value (under any synonym) or the documented default."""
        for k in _SYNONYMS.get(key, (key,)):
            if self.params.get(k) is not None:
                return self.params[k]
        default = ATTENTION_SCHEMES.get(self.name, (True, {}))[1].get(key)
        if default is None:
            raise TypeError(f"{self.name}: missing required parameter `{key}` for the analysis (e.g. {self.name}:{key}=4).")
        return default


def _fmt(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int) and value >= 100000 and value % 1000 == 0:
        return f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
    if isinstance(value, (list, tuple)):
        return f"[{len(value)}]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _label(name: str, params: dict) -> str:
    short = {**_SHORT, **_SHORT_BY_SCHEME.get(name, {})}
    shown = [f"{short.get(k, k)}={_fmt(v)}" for k, v in params.items() if v is not None and k != "original_max_position_embeddings"]
    return f"{name} ({', '.join(shown)})" if shown else name


def _parse_value(text: str):
    from .specs import _value  # the spec value parser, so specs mean the same everywhere

    return _value(text)


def _positional(name: str) -> str:
    from .specs import _POSITIONAL  # the parameter that `name:VALUE` sets

    return _POSITIONAL.get(name, "factor")


def as_spec(scheme, **params) -> AnalysisSpec:
    """Normalise a spec string, a name + params, a Scheme (object or class) or an AnalysisSpec.

    Unknown names raise ValueError with "Did you mean"; bad parameters raise the same errors as `apply()`.
    Attention schemes listed in ATTENTION_SCHEMES are accepted before their classes are registered.
    """
    if isinstance(scheme, AnalysisSpec):
        if params:
            raise TypeError(f"Pass parameters either in the spec or as keywords, not both (got {sorted(params)}).")
        return scheme
    if isinstance(scheme, Scheme) or (isinstance(scheme, type) and issubclass(scheme, Scheme)):
        obj = as_scheme(scheme, **params)
        return AnalysisSpec(obj.name, obj.params(), obj, _label(obj.name, obj.params()))
    if not isinstance(scheme, str):
        raise TypeError(
            f"A scheme must be a name or spec string ('yarn:8'), a rope_patch.Scheme or an AnalysisSpec; "
            f"got {type(scheme).__name__} {scheme!r}."
        )
    name, sep, rest = scheme.strip().partition(":")
    key = name.strip().lower().replace("-", "_")
    given: dict = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        k, eq, v = item.partition("=")
        given[k.strip() if eq else _positional(_aliases().get(key, key))] = _parse_value(v.strip() if eq else k)
    overlap = set(given) & set(params)
    if overlap:
        raise TypeError(f"{scheme!r}: parameter(s) {sorted(overlap)} given both in the spec and as keywords.")
    given.update(params)
    if key in list_schemes() or key in _aliases():
        obj = as_scheme(canonical_name(key), **given)
        return AnalysisSpec(obj.name, obj.params(), obj, _label(obj.name, given))
    if key in ATTENTION_SCHEMES:  # not registered (yet): validate the parameters the analysis reads
        spec = AnalysisSpec(key, given, None, _label(key, given))
        _validate_attention(spec)
        return spec
    canonical_name(key)  # raises "Unknown position-encoding scheme ... Did you mean"
    raise AssertionError("unreachable")


def _validate_attention(spec: AnalysisSpec) -> None:
    n = spec.name
    known = {syn for key in ATTENTION_SCHEMES[n][1] for syn in _SYNONYMS.get(key, (key,))}
    for key, value in spec.params.items():
        if key not in known:
            from .registry import did_you_mean

            raise TypeError(
                f"{n}: unknown parameter {key!r}.{did_you_mean(key, known)} Parameters the analysis reads for "
                f"{n!r}: {', '.join(sorted(ATTENTION_SCHEMES[n][1])) or '(none)'}."
            )
        if value is None:
            continue
        if key in (*_SYNONYMS["window_size"], *_SYNONYMS["group_size"], "num_buckets", "max_distance", "max_position_embeddings"):
            check.integer(n, key, value, ge=1)
        else:
            check.number(n, key, value, gt=0.0)
    if n == "leaky_rerope" and any(spec.params.get(k) is not None for k in _SYNONYMS["factor"]):
        check.number(n, "factor", spec.param("factor"), ge=1.0, hint="k < 1 would grow distances beyond the window faster than 1:1.")


# ------------------------------------------------------------------------------------------------------------------
# The model's RoPE: from numbers, a config or a loaded model
def _check_head_dim(head_dim) -> int:
    if head_dim is None:
        raise TypeError("head_dim is required (or pass model= / config=): the per-head dimension d, e.g. 128.")
    head_dim = check.integer("analysis", "head_dim", head_dim, ge=2)
    if head_dim % 2:
        raise ValueError(f"analysis: `head_dim` must be even (RoPE rotates pairs of coordinates), got {head_dim}.")
    return head_dim


def _config_context(cfg, layer_type=None) -> tuple[RopeContext, int | None]:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    params = getattr(cfg, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per-layer-type (Gemma 3)
        lt = layer_type or ("full_attention" if "full_attention" in params else sorted(params)[0])
        if lt not in params:
            raise ValueError(f"layer_type {lt!r} not in this config's rope_parameters; choose one of {sorted(params)}.")
        params = params[lt]
    else:
        lt = None
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    prf = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
    ctx = _make_context(head_dim, theta, int(cfg.max_position_embeddings), prf, params, lt)
    return ctx, getattr(cfg, "num_attention_heads", None)


def _make_context(head_dim, rope_theta, window, partial_rotary_factor=1.0, params=None, layer_type=None) -> RopeContext:
    head_dim = _check_head_dim(head_dim)
    theta = check.number("analysis", "rope_theta", 10000.0 if rope_theta is None else rope_theta, gt=1.0)
    prf = check.number("analysis", "partial_rotary_factor", 1.0 if partial_rotary_factor is None else partial_rotary_factor, gt=0.0, le=1.0)
    dim = int(head_dim * prf)  # transformers: dim = int(head_dim * partial_rotary_factor), pairs = arange(0, dim, 2)
    if window is not None:
        window = check.integer("analysis", "max_position_embeddings", window, ge=1)
    rope_parameters = dict(params or {"rope_type": "default", "rope_theta": theta})
    if prf != 1.0:
        rope_parameters["partial_rotary_factor"] = prf
    return RopeContext(head_dim=head_dim, rotary_dim=2 * len(range(0, dim, 2)), rope_theta=theta,
                       max_position_embeddings=window, rope_parameters=rope_parameters, layer_type=layer_type)


def _unpatched_view(target) -> tuple[PatchSite, Scheme | None]:
    """A read-only view of the model as it was before any patch, and the applied scheme (or None).

    Schemes are defined relative to the unpatched model, and a patch rewrites the very config fields that describe
    it (rope_theta for ntk, max_position_embeddings for the extended window). `rope_patch.api.original_config` keeps
    those fields; the view is a shallow copy of the config carrying them, so the model itself is not touched.
    """
    from . import api

    applied = api.current(target.model)
    if applied is None:
        return target, None
    original = api.original_config(target.model)
    cfg = copy.copy(target.config)
    cfg.rope_parameters = original["rope_parameters"]
    cfg.max_position_embeddings = original["max_position_embeddings"]
    return PatchSite(model=target.model, rotary=target.rotary, config=cfg), applied


@dataclasses.dataclass(frozen=True)
class _Setup:
    spec: AnalysisSpec  # resolved (model-derived defaults filled in)
    ctx: RopeContext
    rotary_cls: type | None
    num_heads: int | None


def _setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config, layer_type,
           num_heads, params) -> _Setup:
    if model is not None and config is not None:
        raise TypeError("Pass model= or config=, not both.")
    if model is not None:
        if any(v is not None for v in (head_dim, rope_theta, max_position_embeddings, partial_rotary_factor)):
            raise TypeError("With model= the RoPE numbers come from its config; do not also pass head_dim / rope_theta / max_position_embeddings / partial_rotary_factor.")
        target, applied = _unpatched_view(find_target(model))
        contexts = target.contexts()
        lt = layer_type if layer_type is not None else ("full_attention" if "full_attention" in contexts else next(iter(contexts)))
        if lt not in contexts:
            raise ValueError(f"layer_type {lt!r}: this model's rotary has {sorted(map(str, contexts))}.")
        ctx = contexts[lt]
        if scheme is None:
            if params:
                raise TypeError("Parameters given without a scheme name.")
            spec = as_spec(applied) if applied is not None else as_spec("default")
        else:
            spec = as_spec(scheme, **params)
            if spec.scheme is not None:
                obj = spec.scheme.resolve(target)
                spec = dataclasses.replace(spec, scheme=obj, params=obj.params())
        heads = num_heads if num_heads is not None else getattr(target.config, "num_attention_heads", None)
        return _Setup(_resolve_free(spec, ctx), ctx, type(target.rotary), heads)
    if config is not None:
        if any(v is not None for v in (head_dim, rope_theta, max_position_embeddings, partial_rotary_factor)):
            raise TypeError("With config= the RoPE numbers come from it; do not also pass head_dim / rope_theta / max_position_embeddings / partial_rotary_factor.")
        ctx, heads = _config_context(config, layer_type)
        num_heads = num_heads if num_heads is not None else heads
    else:
        ctx = _make_context(head_dim, rope_theta, max_position_embeddings, partial_rotary_factor)
    spec = as_spec("default" if scheme is None else scheme, **params)
    return _Setup(_resolve_free(spec, ctx), ctx, None, num_heads)


def _resolve_free(spec: AnalysisSpec, ctx: RopeContext) -> AnalysisSpec:
    """`Scheme.resolve` without a model: fill `original_max_position_embeddings` with L, check LongRoPE lengths."""
    obj = spec.scheme
    if obj is None:
        return spec
    if "original_max_position_embeddings" in obj.param_names() and obj.original_max_position_embeddings is None:
        if ctx.max_position_embeddings is None:
            raise TypeError(
                f"{obj.name}: needs the original training window L: pass max_position_embeddings=L (or "
                f"original_max_position_embeddings in the scheme, or model= / config=)."
            )
        obj = obj.replace(original_max_position_embeddings=ctx.max_position_embeddings)
    for key in ("short_factor", "long_factor"):
        factors = getattr(obj, key, None)
        if factors is not None and len(factors) != ctx.rotary_dim // 2:
            raise ValueError(f"{obj.name}: `{key}` must have rotary_dim/2 = {ctx.rotary_dim // 2} entries, got {len(factors)}.")
    return dataclasses.replace(spec, scheme=obj)


def _window(setup: _Setup) -> int | None:
    """The original training window L: the scheme's `original_max_position_embeddings`, else the model's."""
    obj = setup.spec.scheme
    return getattr(obj, "original_max_position_embeddings", None) or setup.ctx.max_position_embeddings


# ------------------------------------------------------------------------------------------------------------------
# Frequencies and wavelengths
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
    Attention schemes keep θ_i (self_extend, rerope, leaky_rerope) or remove the rotation (θ′_i = 0: alibi, nope,
    relative_bias, sinusoidal, learned_absolute); their cos/sin scale is 1.
    """
    s = _setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config,
               layer_type, None, params)
    return _frequencies(s, seq_len)


def _frequencies(s: _Setup, seq_len) -> Frequencies:
    if seq_len is not None:
        seq_len = check.integer("analysis", "seq_len", seq_len, ge=1)
    base, _ = as_scheme("default").inv_freq(_init_ctx(s.ctx), s.rotary_cls)
    spec = s.spec
    if spec.is_frequency:
        inv_freq, scaling = _inv_freq_at(spec.scheme, s.ctx, seq_len, s.rotary_cls)
        rotates = True
    elif spec.name in ATTENTION_SCHEMES and spec.keeps_rotation:
        inv_freq, scaling, rotates = base.clone(), 1.0, True
    elif spec.name in ATTENTION_SCHEMES:
        inv_freq, scaling, rotates = torch.zeros_like(base), 1.0, False
    else:
        raise ValueError(
            f"analysis: scheme {spec.name!r} is neither a FrequencyScheme nor one of the attention schemes it knows "
            f"({', '.join(ATTENTION_SCHEMES)}); it cannot tell what {spec.name!r} does to positions."
        )
    return Frequencies(spec.label or spec.name, spec.name, inv_freq, base, float(scaling), s.ctx.head_dim,
                       s.ctx.rotary_dim, s.ctx.rope_theta, _window(s), seq_len, rotates)


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
    s = _setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config,
               layer_type, None, params)
    f = _frequencies(s, seq_len)
    L = window if window is not None else f.original_window
    if L is None:
        raise TypeError("wavelengths: pass the original window L (window= or max_position_embeddings=, or model= / config=).")
    L = check.integer("analysis", "window", L, ge=1)
    lam, lam0 = _wavelength(f.inv_freq), _wavelength(f.base_inv_freq)
    return Wavelengths(f.scheme, lam, lam0, L, L / lam, L / lam0)


def _wavelength(inv_freq: torch.Tensor) -> torch.Tensor:
    theta = inv_freq.double()
    return torch.where(theta > 0, 2 * math.pi / theta.clamp_min(1e-300), torch.full_like(theta, math.inf))


# ------------------------------------------------------------------------------------------------------------------
# Distances: validation and the position remappings of the attention schemes
def _distances(distances, name="distances") -> torch.Tensor:
    """A 1-D float64 tensor of finite, non-negative distances (a number, list, range, numpy array or tensor)."""
    if isinstance(distances, (str, bytes, bool)) or distances is None:
        raise TypeError(f"`{name}` must be a number or a 1-D sequence of numbers, got {type(distances).__name__} {distances!r}.")
    try:
        t = distances.detach().cpu() if isinstance(distances, torch.Tensor) else torch.as_tensor(np.asarray(distances, dtype=np.float64))
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
    d = _distances(distances)
    return torch.clamp(d, max=float(check.integer("rerope", "window_size", window_size, ge=1)))


def leaky_rerope_distance(distances, window_size: int, factor: float) -> torch.Tensor:
    """Leaky ReRoPE (Su 2023, same post): Δ for Δ < W, else W + (Δ − W)/k, k = `factor` ≥ 1."""
    d = _distances(distances)
    w = float(check.integer("leaky_rerope", "window_size", window_size, ge=1))
    k = check.number("leaky_rerope", "factor", factor, ge=1.0)
    return torch.where(d < w, d, w + (d - w) / k)


def self_extend_distance(distances, group_size: int, window_size: int, query_position=None) -> torch.Tensor:
    """Self-Extend (Jin et al. 2024, "LLM Maybe LongLM", arXiv:2401.01325, their reference code): neighbour tokens
    (Δ < W) keep the true distance; beyond, the query sits at ⌊i/G⌋ + W − ⌊W/G⌋ and the key at ⌊j/G⌋, so the
    distance is ⌊i/G⌋ − ⌊j/G⌋ + W − ⌊W/G⌋ (continuous at Δ = W when G divides i).

    The grouped distance depends on i and j, not only on Δ = i − j: by default the query is at i = Δ and the key at
    j = 0 (⌊Δ/G⌋ + W − ⌊W/G⌋); pass `query_position` = i to get the exact values for that query (j = i − Δ ≥ 0).
    """
    d = _distances(distances)
    g = check.integer("self_extend", "group_size", group_size, ge=1)
    w = check.integer("self_extend", "window_size", window_size, ge=1)
    if query_position is None:
        i = d
    else:
        i = torch.full_like(d, float(check.integer("self_extend", "query_position", query_position, ge=0)))
        if (d > i).any():
            raise ValueError(f"self_extend: distances must be <= query_position={int(i[0])} (key position j = i − Δ >= 0).")
    j = i - d
    grouped = torch.floor(i / g) - torch.floor(j / g) + (w - w // g)
    return torch.where(d < w, d, grouped)


def effective_distance(scheme=None, distances=None, *, query_position=None, **params) -> torch.Tensor:
    """The relative distance the attention's rotation sees, as a function of the true distance Δ.

    Identity for frequency schemes (their change is in θ′, see `frequencies`) and position-free schemes;
    min(Δ, W) for rerope, the leaky and grouped maps for leaky_rerope and self_extend (see their functions).
    """
    if distances is None:
        raise TypeError("effective_distance: pass `distances` (true relative distances Δ >= 0).")
    spec = as_spec("default" if scheme is None else scheme, **params)
    return _effective(spec, _distances(distances), query_position)


def _effective(spec: AnalysisSpec, d: torch.Tensor, query_position=None) -> torch.Tensor:
    if spec.name == "rerope":
        return rerope_distance(d, spec.param("window_size"))
    if spec.name == "leaky_rerope":
        return leaky_rerope_distance(d, spec.param("window_size"), spec.param("factor"))
    if spec.name == "self_extend":
        return self_extend_distance(d, spec.param("group_size"), spec.param("window_size"), query_position)
    return d.clone()


# ------------------------------------------------------------------------------------------------------------------
# ALiBi
def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022, "Train Short, Test Long", arXiv:2108.12409, §3 and their reference
    `get_slopes`): m_h = 2^(−max_bias·h/n), h = 1..n, for n a power of two (max_bias = 8 in the paper); otherwise the
    slopes of the nearest lower power of two c, then every other slope of 2c (odd h), up to n heads.
    The max_bias generalisation is BLOOM's / llama.cpp's; max_bias = 8 gives exactly the paper's slopes."""
    from .schemes.bias import alibi_slopes as scheme_slopes  # the very slopes the alibi scheme installs

    n = check.integer("alibi", "num_heads", num_heads, ge=1)
    max_bias = check.number("alibi", "max_bias", max_bias, gt=0.0)
    return torch.tensor(scheme_slopes(n, max_bias), dtype=torch.float64)


def attention_bias(scheme=None, distances=None, *, num_heads=None, model=None, config=None, **params) -> torch.Tensor:
    """Additive logit bias vs distance, [num_heads, len(distances)]: −m_h·Δ for alibi, zeros for every other
    scheme (relative_bias is learned; its values depend on the trained weights and are not modelled here)."""
    if distances is None:
        raise TypeError("attention_bias: pass `distances`.")
    d = _distances(distances)
    if model is not None or config is not None:
        s = _setup(scheme, None, None, None, None, model, config, None, num_heads, params)
        spec, num_heads = s.spec, s.num_heads
    else:
        spec = as_spec("default" if scheme is None else scheme, **params)
    return _bias(spec, d, num_heads)


def _bias(spec: AnalysisSpec, d: torch.Tensor, num_heads) -> torch.Tensor:
    if spec.name != "alibi":
        return torch.zeros(num_heads or 1, d.numel(), dtype=torch.float64)
    if num_heads is None:
        raise TypeError("alibi: the bias needs num_heads (the slopes depend on the head count); pass num_heads= or model= / config=.")
    return -alibi_slopes(num_heads, spec.param("max_bias"))[:, None] * d[None, :]


# ------------------------------------------------------------------------------------------------------------------
# Long-term decay (RoFormer §3.4.3), angles, expected scores
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
    d = _distances(distances)
    s = _setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config,
               layer_type, num_heads, params)
    f = _frequencies(s, _seq_len_for(s.spec, d, seq_len))
    return f, _effective(s.spec, d, query_position)


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
    d = _distances(distances)
    num_samples = check.integer("analysis", "num_samples", num_samples, ge=1)
    s = _setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config,
               layer_type, num_heads, params)
    f = _frequencies(s, _seq_len_for(s.spec, d, seq_len))
    delta = _effective(s.spec, d, query_position)
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
    bias = _bias(s.spec, d, s.num_heads if s.spec.name == "alibi" else (s.num_heads or 1))
    rand, std = per_sample.mean(dim=1), per_sample.std(dim=1) if num_samples > 1 else torch.zeros_like(d)
    if logits:
        scale = 1 / math.sqrt(head)
        mean_bias = bias.mean(dim=0)
        ones, rand, std, exact = ones * scale + mean_bias, rand * scale + mean_bias, std * scale, exact * scale + mean_bias
    return ExpectedScore(f.scheme, d, ones, rand, std, exact, bias, logits)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The numbers the README's scheme guide quotes, for one scheme on one RoPE layout (`explain`)."""

    scheme: str
    n_pairs: int  # rotating pairs (rotary_dim / 2)
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

    def lines(self) -> list[str]:
        n, L = self.n_pairs, self.window
        out = [f"{self.scheme}: {n} rotating pairs, pre-training window L = {L}",
               f"  pairs completing a full turn inside L: {self.turns} (unpatched: {self.turns_vanilla})",
               f"  pairs unchanged (θ′ = θ): {self.unchanged} of {n}"]
        if self.interpolated is not None:
            out.append(f"  pairs fully interpolated (θ′ = θ/s): {self.interpolated} of {n}")
        out += [f"  longest wavelength: {self.longest_wavelength:,.0f} tokens",
                f"  cos/sin scale: {self.attention_scaling:.4g} (logits × {self.attention_scaling ** 2:.4g})",
                f"  decay bound over Δ ∈ [L/16, L]: mean {self.decay_mean:.2f}, max {self.decay_max:.2f} "
                f"(Δ = 0: {self.decay_at_zero:g})"]
        return out


def explain(scheme=None, head_dim=None, rope_theta=None, *, max_position_embeddings=None, partial_rotary_factor=None,
            model=None, config=None, layer_type=None, **params) -> Explanation:
    """Pair counts, wavelengths, temperature and decay of `scheme` (what `rope-patch explain` prints)."""
    s = _setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config,
               layer_type, None, params)
    f = _frequencies(s, None)
    window = f.original_window or s.ctx.max_position_embeddings
    base, new = f.base_inv_freq.double(), f.inv_freq.double()
    two_pi = 2 * math.pi

    def turns(theta):
        return int((window * theta / two_pi >= 1).sum())

    factor = getattr(s.spec.scheme, "factor", None) if s.spec.is_frequency else None
    close = functools.partial(torch.isclose, rtol=1e-6, atol=0.0)
    rotating = new[new > 0]
    distances = torch.arange(max(1, window // 16), window + 1)
    bound = decay_bound(scheme, head_dim, distances, rope_theta=rope_theta, max_position_embeddings=max_position_embeddings,
                        partial_rotary_factor=partial_rotary_factor, model=model, config=config, layer_type=layer_type,
                        **params)
    return Explanation(
        scheme=s.spec.label or s.spec.name, n_pairs=new.numel(), window=window,
        turns_vanilla=turns(base), turns=turns(new), unchanged=int(close(new, base).sum()),
        interpolated=None if not factor or factor == 1 else int(close(new, base / factor).sum()),
        longest_wavelength=float(two_pi / rotating.min()) if rotating.numel() else math.inf,
        attention_scaling=f.attention_scaling, decay_mean=float(bound.mean()), decay_max=float(bound.max()),
        decay_at_zero=decay_bound_at_zero(new.numel()),
    )
