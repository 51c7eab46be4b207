"""Frequency schemes: they change only the rotary angles θ_i (and the cos/sin scale), never the attention code.

Each scheme maps the unpatched model's RoPE (a `RopeContext`) to a transformers `rope_parameters` dict. Where
transformers has the scheme, its own init function (`ROPE_INIT_FUNCTIONS`) computes `inv_freq`, so the patched
model equals a natively configured one bit for bit; `ntk` is expressed through the default init with a new base,
`p_rope` is transformers' `proportional`. Zero run-time cost: the model's own rotary module does the work with new
buffers. `dynamic_yarn`, which transformers has no rope type for, recomputes YaRN for the current length through an
`update` object the patched rotary forward calls (rope_patch/rotary.py).

How a scheme reaches a model's rotary modules (and the checks around that): schemes/rotary_install.py.

Notation: head dim d, pair i, base b, θ_i = b^(−2i/d), factor s, original window L.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import typing
from typing import ClassVar

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

from .. import discovery
from .. import validation as check
from ..discovery import PatchSite, RopeContext
from ..registry import register_scheme
from ..rotary import ForwardLength
from ..undo import UndoLog  # noqa: F401 (tests patch the undo log the install writes through, by this name)
from . import rotary_install
from .base import InstallStep, Scheme, Suggestion, extension_ratio, plain_number
from .cached import cache_rotation as _cache_rotation
from .rotary_install import StandaloneConfig, init_fn, resonance_wavelengths

# Keys of the unpatched rope_parameters that describe the model rather than a scaling scheme: kept under a patch.
# transformers' RopeParameters lists the keys of its own rope types; every other key a checkpoint carries is the
# model's own (PhiMoE's short_mscale / long_mscale, which its rotary multiplies cos/sin by and its config requires
# beside any scaling type; Qwen-VL's mrope_interleaved; Ministral 3's llama_4_scaling_beta). Of transformers' keys,
# the partial rotary fraction describes the model too.
# Before 5.21, RopeParameters did not list yarn's mscale / mscale_all_dim / truncate, which its yarn reads all the
# same: named here so that a patch drops them on every release (DeepSeek's attention scale reads a kept mscale_all_dim
# under any rope type).
_SCHEME_KEYS = frozenset(typing.get_type_hints(RopeParameters)).union(
    {"mscale", "mscale_all_dim", "truncate"}) - {"partial_rotary_factor"}


def _model_keys(rope_parameters: dict) -> dict:
    """The keys of an unpatched `rope_parameters` that a patch keeps: those no transformers rope type defines."""
    return {k: v for k, v in rope_parameters.items() if k not in _SCHEME_KEYS and k != "type"}


@dataclasses.dataclass(frozen=True)
class FrequencyScheme(Scheme):
    kind: ClassVar[str] = "frequency"
    rope_theta: float | None = None  # new base b′ (ABF); None keeps the model's
    # Resonance RoPE (Wang et al. 2024, arXiv:2403.00071): every wavelength the scheme gives rounded to an integer
    resonance: bool | None = None  # None (= False): unrounded
    # The layer types (keys of a per-layer-type rope_parameters: Gemma 3's "full_attention", "sliding_attention") the
    # scheme applies to; the others keep the model's own RoPE (Google's Gemma 3 4B+ scale the global layers only).
    # None: every layer type. A name or a list (spec: `layer_types=full_attention`, several joined by '/').
    layer_types: tuple | None = None

    def __post_init__(self):
        if self.rope_theta is not None:
            self._set("rope_theta", check.rope_theta(self.name, self.rope_theta))
        if self.layer_types is not None:
            self._set("layer_types", check.name_list(
                self.name, "layer_types", self.layer_types,
                hint="It names the layer types (keys of the model's per-layer-type rope_parameters, e.g. "
                     "full_attention) the scheme applies to; leave it unset for every layer."))
            own_update = type(self).rotary_update is not FrequencyScheme.rotary_update
            if own_update or getattr(self, "cache_rotation", None) == "consistent":
                what = ("its own per-forward frequency update (no transformers rope type computes it per layer type)"
                        if own_update else "cache_rotation='consistent' (keys re-rotated inside attention, one "
                                           "rotation for every layer)")
                raise ValueError(
                    f"{self.name}: layer_types cannot be combined with {what}. layer_types works with the schemes "
                    "whose frequencies transformers' own rope types compute per layer type: default, linear, ntk, "
                    "yarn, llama3, p_rope, and dynamic / longrope with the default cache_rotation='native'.")
        if self.resonance is not None and not check.boolean(self.name, "resonance", self.resonance):
            self._set("resonance", None)  # off is the default: yarn(resonance=False) is yarn
        if self.resonance:
            if self.length_dependent:
                raise ValueError(
                    f"{self.name}: resonance=True rounds the wavelengths installed at apply time, and {self.name}'s "
                    "frequencies follow the sequence length at run time, where the rounding would be lost. Use it with "
                    "a static scheme (default, linear, ntk, yarn, llama3, p_rope).")
            # no transformers rope type or engine rounds the wavelengths, nor reduces positions modulo them before the
            # multiply (an engine computes p·θ in its own precision): saved with rope_patch, refused by the export
            self._set("native", False)
            self._set("changes", "its wavelengths, rounded to integers by resonance=True, each position reduced modulo "
                                 "them before the angle is computed")

    # ---- what a scheme defines -------------------------------------------------------------------------------
    def rope_parameters(self, ctx: RopeContext) -> dict:
        """The transformers `rope_parameters` (one layer type) that this scheme amounts to."""
        raise NotImplementedError

    def applies_to(self, layer_type: str | None) -> bool:
        """Whether the scheme changes the RoPE of `layer_type` (None: a model with one RoPE for all its layers, or a
        context without a layer type) or leaves the model's own (`layer_types` names others)."""
        return self.layer_types is None or layer_type is None or layer_type in self.layer_types

    def window(self, ctx: RopeContext) -> int | None:
        """The extended context window this scheme targets (config.max_position_embeddings), None = unchanged."""
        return None

    def public_window(self, ctx: RopeContext) -> int | None:
        """`config.max_position_embeddings` that the patched model announces (generate, lm-eval, a plain
        save_pretrained): the extended window, as a natively configured model of this scheme would have it."""
        return self.window(ctx)

    def served_window(self, target: PatchSite) -> int | None:
        # the window of the first layer type the scheme applies to: the one the install announces (`_prepare_site`)
        return self.window(next(ctx for lt, ctx in target.contexts().items() if self.applies_to(lt)))

    def init_window(self, ctx: RopeContext) -> int:
        """`max_position_embeddings` that transformers' init function must see (dynamic NTK reads L from it)."""
        return self.window(ctx) or ctx.max_position_embeddings

    def adjust(self, inv_freq: torch.Tensor, ctx: RopeContext) -> torch.Tensor:
        """Post-process the inverse frequencies: with `resonance`, λ̃_i = round(2π/θ_i), θ̃_i = 2π/λ̃_i (Resonance
        RoPE, Wang et al. 2024 §3: an integer wavelength repeats its angles exactly every λ̃_i positions, so positions
        past the window meet the feature values seen in training; the authors' `resonance_register`). Pairs that do
        not rotate (θ = 0: p_rope) stay at 0. Otherwise unchanged."""
        if not self.resonance:
            return inv_freq
        return resonance_wavelengths(inv_freq).reciprocal() * (2 * math.pi)  # θ̃ = 2π/λ̃ as the authors compute it

    def rotary_update(self, target: PatchSite, rotary_config) -> LengthUpdate | None:
        """For length-dependent schemes without a transformers rope type: the `update` object the patched rotary
        forward calls before every forward (it also gives the frequencies installed at apply time). None: static."""
        return None

    native: ClassVar[bool] = True  # does `rope_parameters` alone reproduce the scheme in plain transformers?

    def check_export(self, head_dim: int | None, rope_theta: float | None) -> None:
        """Raise ValueError when `rope_parameters` cannot be written from the scheme alone and what
        `to_rope_parameters` was given without a model (`head_dim`, `rope_theta`: None where not given)."""
        if getattr(self, "original_max_position_embeddings", 0) is None:
            raise ValueError(f"{self.name}: pass original_max_position_embeddings (or model=) to export it.")

    @classmethod
    def factor_suggestion(cls, n: int, window: int, extra: str = "", **params) -> Suggestion | None:
        """factor s = N/L, the extension ratio (None for N ≤ L): the rule of the factor-scaled schemes' papers
        (Chen et al. 2023 §2.3 "s = L′/L"; bloc97 2023; emozilla 2023; Peng et al. 2023 §3; Meta 2024). `extra` is
        appended to the reason, `params` to the factor."""
        if n <= window:
            return None
        s = n / window
        return Suggestion.of(cls.name, {"factor": plain_number(s), **params},
                             f"factor = N/L = {n}/{window} = {s:g}{extra}")

    # ---- shared machinery ------------------------------------------------------------------------------------
    def theta(self, ctx: RopeContext) -> float:
        return self.rope_theta if self.rope_theta is not None else ctx.rope_theta

    def _params(self, ctx: RopeContext, rope_type: str, **keys) -> dict:
        kept = _model_keys(ctx.rope_parameters)
        # Ministral 3's attention temperature reads its window from rope_parameters (a model built without it fails):
        # unless the scheme sets its own, that window stays
        if "llama_4_scaling_beta" in kept and "original_max_position_embeddings" in ctx.rope_parameters:
            kept["original_max_position_embeddings"] = ctx.rope_parameters["original_max_position_embeddings"]
        given = {k: v for k, v in keys.items() if v is not None}
        return {"rope_type": rope_type, "rope_theta": self.theta(ctx), **kept, **given}

    def inv_freq(self, ctx: RopeContext, rotary_cls=None, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """θ_i and the cos/sin scale, computed without a model (rope_patch.analysis uses this too).

        With `seq_len`, the numbers transformers' `dynamic_rope_update` installs for a sequence of that length:
        dynamic NTK rescales once ℓ exceeds its window, LongRoPE switches to its long factors for ℓ > L.
        """
        own = not self.applies_to(ctx.layer_type)  # a layer type `layer_types` leaves: the model's own RoPE
        params = dict(ctx.rope_parameters) if own else self.rope_parameters(ctx)
        window = ctx.max_position_embeddings if own else self.init_window(ctx)
        rope_type = params["rope_type"]
        cfg = StandaloneConfig(rope_parameters=params, head_dim=ctx.head_dim, hidden_size=ctx.head_dim,
                                num_attention_heads=1, max_position_embeddings=window)
        kwargs = {}
        if seq_len is not None and "dynamic" in rope_type and seq_len > window:
            kwargs["seq_len"] = torch.tensor(seq_len, dtype=torch.int64)  # as in the forward pass
        elif seq_len is not None and rope_type == "longrope" and seq_len > params["original_max_position_embeddings"]:
            kwargs["seq_len"] = params["original_max_position_embeddings"] + 1
        fn = init_fn(rope_type, rotary_cls)
        if rope_type == "default" and "layer_type" in inspect.signature(fn).parameters:
            # a per-layer-type rotary's own default (Gemma 3's) reads config.rope_parameters[layer_type]
            layer_type = ctx.layer_type or "default"
            cfg.rope_parameters, kwargs["layer_type"] = {layer_type: params}, layer_type
        inv_freq, scaling = fn(cfg, **kwargs)
        return (inv_freq.float() if own else self.adjust(inv_freq.float(), ctx)), float(scaling)

    def prepare(self, target: PatchSite) -> InstallStep:
        """Every rotary module of the model (one in most; one per block kind or base in Blt, Granite-SWA, Moshi,
        DeepSeek-V4) gets the scheme applied to its own RoPE, as a model built with the patched rope_parameters would
        compute it from its config; the model's config announces the patched form (rotary_install.py)."""
        return rotary_install.prepare(self, target)

def _factor(scheme: str, value, *, required: bool = True, key: str = "factor"):
    if value is None:
        if required:
            raise TypeError(f"{scheme}: missing required parameter `factor` (the context extension ratio s = L′/L, "
                            "e.g. factor=4).")
        return None
    low, high = check.FACTOR_RANGE  # 1024: LongRoPE's 2048k-from-4k, the largest published extension, is 512×
    return check.number(
        scheme, key, value, ge=low, le=high,
        hint=f"`{key}` is the context extension ratio s = L′/L (4 turns a 4k window into 16k): 1 changes nothing, a "
             f"factor below 1 would shrink the context window, and {high:g} is the largest supported (LongRoPE's "
             "2048k-from-4k is 512×).",
    )


def _check_original_window(scheme: str, value, *, ge: int = 1, why: str = ""):
    if value is None:
        return None
    return check.integer(
        scheme, "original_max_position_embeddings", value, ge=ge, le=check.POSITIONS_MAX,
        hint=f"It is the window L the model was pretrained with (default: the model's max_position_embeddings); "
             f"fp32 positions count exactly only up to 2^24 = {check.POSITIONS_MAX}.{why}",
    )


def _attention_factor(scheme: str, value):
    if value is None:
        return None
    low, high = check.ATTENTION_FACTOR_RANGE
    return check.number(
        scheme, "attention_factor", value, ge=low, le=high,
        hint="cos/sin are multiplied by it, attention logits by its square; leave it unset for the paper's default "
             "(YaRN: 0.1·ln s + 1, at most ≈ 1.69).",
    )


def _rotations(scheme: str, key: str, value, usual):
    low, high = check.ROTATIONS_RANGE
    return check.number(scheme, key, value, ge=low, le=high,
                        hint=f"It counts rotations/wavelengths within the original window (usual: {usual}).")


# ------------------------------------------------------------------------------------------------------------------
@register_scheme
@dataclasses.dataclass(frozen=True)
class Default(FrequencyScheme):
    """Vanilla RoPE (Su et al. 2021, RoFormer, arXiv:2104.09864): pair i of q_m, k_n rotates by m·θ_i, n·θ_i with
    θ_i = b^(−2i/d), so q_m·k_n depends on m−n only. With `rope_theta` it is a base change ("adjusted base
    frequency", Xiong et al. 2023, arXiv:2309.16039; Code Llama 1e6, Llama 3 5e5)."""

    name = "default"
    aliases = ("rope", "base", "theta", "abf", "vanilla")
    bare_param = "rope_theta"

    def plot_style(self):
        # the model's own RoPE is the reference line of every figure; a new base (ABF) is a scheme like the others
        return {"color": "black", "linestyle": "-"} if self.rope_theta is None else None

    def rope_parameters(self, ctx):
        return self._params(ctx, "default")

    def window(self, ctx):
        # on a checkpoint that ships with scaling, `default` is unscaled RoPE: it serves the pre-training window
        return ctx.pretraining_window if ctx.shipped_scaling else None


@register_scheme
@dataclasses.dataclass(frozen=True)
class Linear(FrequencyScheme):
    """Position Interpolation (Chen et al. 2023, arXiv:2306.15595): m → m/s, i.e. θ_i → θ_i/s, so positions up to
    s·L map into the trained range [0, L)."""

    name = "linear"
    aliases = ("pi", "position_interpolation")
    factor: float | None = None

    def __post_init__(self):
        super().__post_init__()
        self._set("factor", _factor(self.name, self.factor))

    def rope_parameters(self, ctx):
        return self._params(ctx, "linear", factor=self.factor)

    def window(self, ctx):
        return int(self.factor * ctx.pretraining_window)

    @classmethod
    def search_space(cls, window, target):
        s = extension_ratio(window, target)
        return {"factor": [s, 1.25 * s, 1.5 * s, 2 * s]}

    @classmethod
    def suggestion(cls, n, window):
        return cls.factor_suggestion(n, window)


@register_scheme
@dataclasses.dataclass(frozen=True)
class NTK(FrequencyScheme):
    """NTK-aware scaling (bloc97 2023, "NTK-Aware Scaled RoPE", r/LocalLLaMA; YaRN paper §3.2):
    b′ = b·s^(d/(d−2)), so the lowest frequency is interpolated by exactly s and the highest is untouched.
    `alpha` is the name of s in the original post."""

    name = "ntk"
    aliases = ("ntk_aware", "ntk_static")
    factor: float | None = None
    alpha: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.factor is not None and self.alpha is not None:
            raise TypeError("ntk: give `factor` or its synonym `alpha`, not both.")
        self._set("factor", _factor(self.name, self.factor if self.alpha is None else self.alpha,
                                    key="factor" if self.alpha is None else "alpha"))
        self._set("alpha", None)

    def rope_parameters(self, ctx):
        exponent = ntk_exponent(self.name, ctx)  # d/(d−2)
        return self._params(ctx, "default") | {"rope_theta": self.theta(ctx) * self.factor ** exponent}

    def window(self, ctx):
        return int(self.factor * ctx.pretraining_window)

    def check_export(self, head_dim, rope_theta):
        if head_dim is None or rope_theta is None:
            lacking = " and ".join(k for k, v in (("head_dim=", head_dim), ("rope_theta=", rope_theta)) if v is None)
            raise ValueError(f"ntk's native form is a base change b′ = b·s^(d/(d−2)), which needs the model's head_dim "
                             f"and rope_theta: pass {lacking} (or model=).")
        super().check_export(head_dim, rope_theta)

    @classmethod
    def search_space(cls, window, target):
        s = extension_ratio(window, target)
        return {"factor": [s, 1.5 * s, 2 * s, 3 * s]}

    @classmethod
    def suggestion(cls, n, window):
        return cls.factor_suggestion(n, window)


def ntk_exponent(scheme: str, ctx: RopeContext) -> float:
    """d/(d−2), the exponent of the NTK-aware base change b′ = b·s^(d/(d−2)) (d = rotary dim; bloc97 2023), which
    `ntk` uses once and transformers' `dynamic` at every length past L. It makes the lowest frequency b^(−(d−2)/d)
    exactly s times smaller. With one rotated pair (d = 2) the only frequency is θ_0 = b^0 = 1, which no base moves,
    and the exponent divides by zero (transformers' dynamic NTK raises ZeroDivisionError there): refused, pointing to
    linear, which divides θ_0 itself by s (YaRN and llama3 leave a pair of wavelength 2π unscaled once L > 2π·β_fast,
    L > 2π·high_freq_factor)."""
    d = ctx.rotary_dim
    if d > 2:
        return d / (d - 2)
    where = f" for its {ctx.layer_type} layers" if ctx.layer_type else ""
    raise ValueError(
        f"{scheme}: the model's rotary embedding{where} rotates one coordinate pair per head (rotary dim d = {d}), "
        "whose frequency θ_0 = b^0 = 1 does not depend on the base b. NTK-aware scaling changes only the base "
        f"(b′ = b·s^(d/(d−2)), which divides by d − 2 = 0 here), so it cannot scale that pair. Use linear, which "
        "divides θ_0 itself by s.")


class _Windowed(FrequencyScheme):
    """Schemes whose transformers form carries `original_max_position_embeddings` (default: the model's window)."""

    def resolve(self, target):
        """L defaults to the pre-training window the checkpoint records (Llama 3.1: 8192, not its shipped 131072),
        else the model's window; a given L must not exceed the model's window (it is where the model was trained)."""
        original = self.original_max_position_embeddings
        if original is None:
            return self.replace(original_max_position_embeddings=target.pretraining_window)
        window = int(target.config.max_position_embeddings)
        if original > window:
            raise ValueError(
                f"{self.name}: parameter `original_max_position_embeddings` is the window the model was pre-trained "
                f"on and must be <= the model's max_position_embeddings = {window}, got {original}. Leave it unset "
                f"(default {target.pretraining_window}) or pass the pre-training window."
            )
        return self

    def window(self, ctx):
        return int(self.factor * self.original_max_position_embeddings)


@register_scheme
@dataclasses.dataclass(frozen=True)
class Dynamic(_Windowed):
    """Dynamic NTK (emozilla 2023, r/LocalLLaMA; YaRN paper §3.3): for current length ℓ > L,
    b′ = b·(s·ℓ/L − (s−1))^(d/(d−2)); unchanged for ℓ ≤ L. Frequencies follow the longest sequence seen, so keys
    already in a KV cache keep the base they were rotated with (transformers issue #25104); see docs/guides/kv-cache.md.
    `cache_rotation="consistent"` caches keys un-rotated and rotates them with each step's base instead
    (schemes/cached.py)."""

    name = "dynamic"
    aliases = ("dynamic_ntk", "ntk_dynamic")
    length_dependent = True
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    # "native" (None): transformers' behaviour, cached keys keep the rotation of the step that wrote them (#25104);
    # "consistent": keys cached un-rotated, q and every cached key rotated with each step's frequencies (cached.py)
    cache_rotation: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self._set("factor", _factor(self.name, self.factor))
        self._set("original_max_position_embeddings",
                  _check_original_window(self.name, self.original_max_position_embeddings))
        self._set("cache_rotation", _cache_rotation(self.name, self.cache_rotation))

    def rope_parameters(self, ctx):
        ntk_exponent(self.name, ctx)  # transformers' dynamic NTK computes b·(…)^(d/(d−2)): refused at d = 2
        return self._params(ctx, "dynamic", factor=self.factor)

    def init_window(self, ctx):
        return self.original_max_position_embeddings

    def public_window(self, ctx):
        # transformers' dynamic NTK starts scaling at config.max_position_embeddings: the native form announces L
        return self.original_max_position_embeddings

    @classmethod
    def search_space(cls, window, target):
        s = extension_ratio(window, target)
        return {"factor": [max(1.0, s / 2), s, 1.5 * s, 2 * s]}

    @classmethod
    def suggestion(cls, n, window):
        """factor s = N/L (emozilla 2023), as transformers' docs configure it; at ℓ = N dynamic NTK then has the
        effective factor s·N/L − (s − 1) (FORMULAS.md)."""
        s = n / window
        return cls.factor_suggestion(n, window, f" (at ℓ = N dynamic NTK's effective factor is s·N/L − (s − 1) = "
                                                f"{s * s - s + 1:.4g})")


@register_scheme
@dataclasses.dataclass(frozen=True)
class Yarn(_Windowed):
    """YaRN (Peng et al. 2023, arXiv:2309.00071): NTK-by-parts. With r_i = L/λ_i and a ramp γ that is 0 below
    `beta_slow` rotations and 1 above `beta_fast`, θ′_i = (1−γ_i)·θ_i/s + γ_i·θ_i; cos/sin are scaled by
    `attention_factor` (default 0.1·ln s + 1), which scales attention logits by its square. transformers computes
    the ramp in dimension space (find_correction_dim); its function is used here."""

    name = "yarn"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    def __post_init__(self):
        super().__post_init__()
        n = self.name
        self._set("factor", _factor(n, self.factor))
        self._set("original_max_position_embeddings", _check_original_window(n, self.original_max_position_embeddings))
        for key, usual in (("beta_fast", 32), ("beta_slow", 1)):
            if getattr(self, key) is not None:
                self._set(key, _rotations(n, key, getattr(self, key), usual))
        self._set("attention_factor", _attention_factor(n, self.attention_factor))
        for key in ("mscale", "mscale_all_dim"):
            if getattr(self, key) is not None:
                self._set(key, check.number(n, key, getattr(self, key), gt=0.0, le=check.MSCALE_MAX,
                                            hint="It enters as 0.1·mscale·ln s + 1 (DeepSeek-V3: 1)."))
        if self.truncate is not None:
            check.boolean(n, "truncate", self.truncate)
        fast, slow = self.beta_fast or 32.0, self.beta_slow or 1.0
        if fast <= slow:
            raise ValueError(f"yarn: `beta_fast` must be > `beta_slow` (rotations at which interpolation "
                             f"stops/starts), got beta_fast={fast}, beta_slow={slow}.")

    def rope_parameters(self, ctx):
        keys = {k: getattr(self, k) for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                              "attention_factor", "mscale", "mscale_all_dim", "truncate")}
        return self._params(ctx, "yarn", **keys)

    @classmethod
    def search_space(cls, window, target):
        s = extension_ratio(window, target)
        return {"factor": [s, 1.5 * s, 2 * s], "beta_fast": [8, 16, 32], "beta_slow": [0.5, 1, 2]}

    @classmethod
    def suggestion(cls, n, window):
        """factor s = N/L (Peng et al. 2023 §3) and beta_fast = min(32, max(2, L/128)), beta_slow = 1 (rope_patch's
        rule, not the paper's): YaRN's β count turns inside L and were tuned at L ≈ 4096, where β_fast = 32 leaves
        the pairs with wavelength λ < L/32 = 128 tokens unchanged. The rule keeps that 128-token threshold for
        smaller windows (L = 256: β_fast = 2, i.e. λ < 128 unchanged, where 32 would leave only λ < 8 and
        interpolate pairs that turn 2–32 times in the window); β_slow = 1 (pairs that never complete a turn inside L
        are interpolated) has the same meaning at any L. For L ≥ 4096 it is the paper's 32 / 1 and no beta is
        written into the spec. Measured on rope-tiny (L = 256), docs/guides/choosing-a-scheme.md: yarn ×4 at 1024
        tokens perplexity 113.2 → 87.4, passkey 7% → 60% (30 prompts)."""
        fast = yarn_beta_fast(window)
        if fast == 32:
            return cls.factor_suggestion(n, window, "; beta_fast / beta_slow: the paper's 32 / 1")
        return cls.factor_suggestion(n, window, f"; beta_fast = min(32, max(2, L/128)) = {fast:g}: pairs with "
                                                "wavelength < 128 tokens stay unchanged, as with the paper's 32 at "
                                                "L = 4096", beta_fast=plain_number(fast))


def yarn_beta_fast(window: int) -> float:
    """rope_patch's β_fast for a pre-training window L: min(32, max(2, L/128)) (`Yarn.suggestion`)."""
    return float(min(32.0, max(2.0, window / 128)))


class LengthUpdate:
    """The per-forward step of a length-dependent scheme (`PatchedRotaryForward.update`). `start[layer_type]` holds
    the (inv_freq fp32, attention_scaling) installed at apply time. On a model whose attention layers hold memory
    rotaries (`attention.memory_rotaries`), the updates of all its rotary modules share one `rotary.ForwardLength`
    (`shared`): the token rotaries record ℓ, the memory rotaries (`follows`) use it (rotary_install.prepare)."""

    start: dict
    shared: ForwardLength | None = None  # None: ℓ is measured from each call's own position ids
    follows: bool = False  # a memory rotary: ℓ is the forward's, recorded by the token rotaries

    def length(self, position_ids: torch.Tensor) -> int:
        """ℓ of the current forward, for a call at `position_ids`."""
        if self.shared is None:
            return int(position_ids.max()) + 1
        return self.shared.measured(position_ids, self.follows)

    def __call__(self, rotary, x, position_ids, layer_type=None) -> None:
        raise NotImplementedError


class YarnLengthUpdate(LengthUpdate):
    """`dynamic_yarn`'s step, run by the patched rotary forward before the class forward: ℓ = max(position_ids) + 1
    over the batch (as transformers' `dynamic_rope_update` measures it), s = min(cap, max(1, ℓ/L)), and on the rotary
    module (fp32 `inv_freq`, `attention_scaling`) for s = 1 the unscaled frequencies computed at apply time (`start`,
    bit-identical to vanilla RoPE), else what transformers' own ROPE_INIT_FUNCTIONS["yarn"] gives for factor s on a
    private copy of the config. Nothing happens while s and the installed tensor stay the same (ℓ ≤ L, ℓ ≥ cap·L, one
    decode step after another at the cap); the last `CACHE` values of s are kept, so lengths that come back (a short
    prompt after a long one, the same batch again) do not recompute either. A module-level class holding only
    data, so a patched model deep-copies and pickles; the rotary module itself is passed in on each call."""

    CACHE = 8

    def __init__(self, config, window: int, cap: float, start: dict):
        self.config = config  # private copy: rope_parameters (per layer type) hold YaRN's keys; `factor` is set per s
        self.window = window  # L, where scaling starts
        self.cap = cap  # the largest s (the scheme's `factor`)
        self.start = start  # layer type -> (inv_freq fp32 on CPU, attention_scaling) at s = 1
        self.cache: dict = {}  # (s, layer type) -> (inv_freq fp32 on CPU, attention_scaling)
        self.installed: dict = {}  # layer type -> (s, the tensor put on the rotary module)

    def scale(self, position_ids: torch.Tensor, length: int | None = None) -> float:
        """s for a forward over `position_ids` (or of the sequence length `length`, where given)."""
        length = int(position_ids.max()) + 1 if length is None else length
        return min(self.cap, max(1.0, length / self.window))

    def frequencies(self, s: float, layer_type=None) -> tuple[torch.Tensor, float]:
        """(inv_freq fp32, attention_scaling) of YaRN with factor s (s = 1: the unscaled start values)."""
        if s == 1.0:
            return self.start[layer_type]
        key = (s, layer_type)
        if key not in self.cache:
            params = self.config.rope_parameters if layer_type is None else self.config.rope_parameters[layer_type]
            params["factor"] = s
            kwargs = {} if layer_type is None else {"layer_type": layer_type}
            # a heterogeneous config (Gemma 4) answers per-layer sizes through its layer type's view
            inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](discovery.layer_config(self.config, layer_type), **kwargs)
            while len(self.cache) >= self.CACHE:
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = (inv_freq.float(), float(scaling))
        return self.cache[key]

    def __call__(self, rotary, x, position_ids, layer_type=None) -> None:
        s = self.scale(position_ids, self.length(position_ids))
        prefix = "" if layer_type is None else f"{layer_type}_"
        live = rotary._buffers[f"{prefix}inv_freq"]
        done = self.installed.get(layer_type)
        if done is not None and done[0] == s and done[1] is live:
            return  # a cast, move or remove() replaces the tensor: then it is installed again
        inv_freq, scaling = self.frequencies(s, layer_type)
        fresh = inv_freq.to(live.device, copy=True)
        rotary._buffers[f"{prefix}inv_freq"] = fresh
        setattr(rotary, f"{prefix}attention_scaling", scaling)
        self.installed[layer_type] = (s, fresh)


@register_scheme
@dataclasses.dataclass(frozen=True)
class DynamicYarn(Yarn):
    """Dynamic YaRN: YaRN (Peng et al. 2023, arXiv:2309.00071) whose factor follows the sequence length, the paper's
    "dynamic scaling" (§3.3, s = max(1, ℓ/L), introduced with dynamic NTK) applied to YaRN:
    s(ℓ) = min(factor, max(1, ℓ/L)), ℓ = max(position_ids) + 1 over the batch (as transformers' dynamic types
    measure it), L = `original_max_position_embeddings`. The cap `factor` is rope_patch's, not the paper's: beyond
    factor·L it is static YaRN ×factor (and `rope_patch.context_window` reports factor·L). The other parameters are
    YaRN's, validated as for `yarn`. For ℓ ≤ L the model runs unscaled RoPE (at `rope_theta`, default the model's),
    bit for bit, also with an `attention_factor` given (it applies once s > 1); at a fixed ℓ > L it is static YaRN
    with factor s(ℓ), computed by transformers' own `ROPE_INIT_FUNCTIONS["yarn"]` (rope_patch/rotary.py: the
    patched rotary forward runs a `YarnLengthUpdate` before each forward). One s per forward on every rotary module:
    those that rotate memory entries at positions of their own making (DeepSeek-V4's compressor and indexer) take ℓ
    from the rotaries that rotate the tokens (`rotary.ForwardLength`); rotaries of separate transformers inside the
    model (Blt's, whose global one numbers patches) are refused.

    transformers has no such rope type, so there is no native `rope_parameters` form: `to_rope_parameters` refuses,
    a plain save_pretrained keeps the unpatched config (the unpatched model), `rope_patch.save_pretrained` records it.

    KV cache: keys are cached rotated (transformers' layout), with the s of the step that wrote them, as with
    transformers' `dynamic` (issue #25104). While s does not change during a generation (every length ≤ L, or the
    prompt already ≥ factor·L) cached decoding equals recomputation. When the sequence grows across L (or between
    L and factor·L), each decoding step rotates its query with the current s against keys rotated with earlier ones,
    while recomputation re-rotates every key with the current s: logits differ (and greedy tokens can).
    `cache_rotation="consistent"` caches keys un-rotated and rotates them with the current s at every step
    (schemes/cached.py); `rope_patch.fix_length(model, N)` freezes s at s(N) before the prefill."""

    name = "dynamic_yarn"
    aliases = ("yarn_dynamic", "dynamic-yarn")
    native = False
    length_dependent = True
    # "native" (None): transformers' behaviour, cached keys keep the rotation of the step that wrote them (#25104);
    # "consistent": keys cached un-rotated, q and every cached key rotated with each step's frequencies (cached.py)
    cache_rotation: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self._set("cache_rotation", _cache_rotation(self.name, self.cache_rotation))

    def init_window(self, ctx):
        return self.window(ctx)

    def public_window(self, ctx):
        return None  # not native: the public config keeps the unpatched window

    @classmethod
    def search_space(cls, window, target):
        return None  # no default grid (yarn's is for the static factor); give one with --space

    def rotary_update(self, target, rotary_config):
        rotary_cls, layered = type(target.rotary), target.layer_types != [None]
        start = {}
        for lt, ctx in target.contexts().items():  # s = 1: unscaled RoPE through the model's own default init
            cfg = copy.deepcopy(rotary_config)
            if layered:
                cfg.rope_parameters[lt] = self._params(ctx, "default")
            else:
                cfg.rope_parameters = self._params(ctx, "default")
            inv_freq, scaling = init_fn("default", rotary_cls)(discovery.layer_config(cfg, lt),
                                                               **({"layer_type": lt} if layered else {}))
            start[lt] = (inv_freq.float(), float(scaling))
        return YarnLengthUpdate(copy.deepcopy(rotary_config), self.original_max_position_embeddings, self.factor, start)

    def inv_freq(self, ctx, rotary_cls=None, seq_len=None):
        """At length `seq_len` (None: before the first forward, i.e. ℓ ≤ L) what the patched model installs."""
        s = 1.0 if seq_len is None else min(self.factor, max(1.0, seq_len / self.original_max_position_embeddings))
        if s == 1.0:
            return Default(rope_theta=self.rope_theta).inv_freq(ctx, rotary_cls)
        yarn = {k: v for k, v in self.params().items() if k != "cache_rotation"}
        return Yarn(**{**yarn, "factor": s}).inv_freq(ctx, rotary_cls)


@register_scheme
@dataclasses.dataclass(frozen=True)
class Llama3(_Windowed):
    """Llama 3.1 scaling (Meta 2024, "The Llama 3 Herd of Models", arXiv:2407.21783): wavelengths λ_i shorter than
    L/high_freq_factor keep θ_i, longer than L/low_freq_factor get θ_i/s, and in between a smooth blend with
    t = (L/λ_i − low)/(high − low): θ′ = (1−t)·θ/s + t·θ."""

    name = "llama3"
    aliases = ("llama3.1", "llama_3")
    factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        super().__post_init__()
        n = self.name
        self._set("factor", _factor(n, self.factor))
        self._set("original_max_position_embeddings", _check_original_window(n, self.original_max_position_embeddings))
        self._set("low_freq_factor", _rotations(n, "low_freq_factor", self.low_freq_factor, 1))
        self._set("high_freq_factor", _rotations(n, "high_freq_factor", self.high_freq_factor, 4))
        if self.low_freq_factor >= self.high_freq_factor:
            raise ValueError(f"llama3: `low_freq_factor` must be < `high_freq_factor`, got {self.low_freq_factor} >= "
                             f"{self.high_freq_factor}.")

    def rope_parameters(self, ctx):
        keys = {k: getattr(self, k)
                for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
        return self._params(ctx, "llama3", **keys)

    @classmethod
    def search_space(cls, window, target):
        s = extension_ratio(window, target)
        return {"factor": [s, 2 * s], "low_freq_factor": [1, 2], "high_freq_factor": [4, 8]}

    @classmethod
    def suggestion(cls, n, window):
        return cls.factor_suggestion(n, window)


@register_scheme
@dataclasses.dataclass(frozen=True)
class LongRope(_Windowed):
    """LongRoPE (Ding et al. 2024, arXiv:2402.13753): θ′_i = θ_i / λ̂_i with searched per-pair factors,
    `short_factor` while the sequence fits in L and `long_factor` beyond; cos/sin scaled by
    √(1 + ln s / ln L) unless `attention_factor` is given."""

    name = "longrope"
    aliases = ("long_rope", "su")
    length_dependent = True  # short factors within L, long ones beyond
    short_factor: tuple | None = None
    long_factor: tuple | None = None
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    # "native" (None): transformers' behaviour, cached keys keep the rotation of the step that wrote them (#25104);
    # "consistent": keys cached un-rotated, q and every cached key rotated with each step's frequencies (cached.py)
    cache_rotation: str | None = None

    def __post_init__(self):
        super().__post_init__()
        n = self.name
        for key in ("short_factor", "long_factor"):
            if getattr(self, key) is None:
                raise TypeError(f"longrope: missing required parameter `{key}` (one rescale factor per rotary pair, "
                                "head_dim/2 numbers).")
            low, high = check.LONGROPE_FACTOR_RANGE
            self._set(key, check.number_list(n, key, getattr(self, key), ge=low, le=high,
                                             hint="Each is the rescale factor λ_i of one pair (θ′_i = θ_i / λ_i)."))
        self._set("factor", _factor(n, self.factor))
        self._set("original_max_position_embeddings", _check_original_window(
            n, self.original_max_position_embeddings, ge=2, why=" LongRoPE's attention factor divides by ln L."))
        self._set("attention_factor", _attention_factor(n, self.attention_factor))
        self._set("cache_rotation", _cache_rotation(n, self.cache_rotation))

    def resolve(self, target):
        resolved = super().resolve(target)
        for ctx in target.contexts().values():
            for key in ("short_factor", "long_factor"):
                if len(getattr(self, key)) != ctx.rotary_dim // 2:
                    raise ValueError(
                        f"longrope: `{key}` must have rotary_dim/2 = {ctx.rotary_dim // 2} entries for this model "
                        f"(head_dim {ctx.head_dim}), got {len(getattr(self, key))}."
                    )
        return resolved

    def rope_parameters(self, ctx):
        keys = {k: getattr(self, k) for k in ("factor", "original_max_position_embeddings", "attention_factor")}
        lists = {"short_factor": list(self.short_factor), "long_factor": list(self.long_factor)}
        return self._params(ctx, "longrope", **keys, **lists)


@register_scheme
@dataclasses.dataclass(frozen=True)
class PRope(FrequencyScheme):
    """p-RoPE (Barbero et al. 2024, "Round and Round We Go! What makes Rotary Positional Encodings useful?",
    arXiv:2410.06205): rotate only the highest-frequency fraction p = `partial_rotary_factor` of the pairs and set
    θ_i = 0 for the rest, which become position-free "semantic" channels; the kept pairs keep exactly the model's
    θ_i = b^(−2i/d) (d the full head dimension).

    This is transformers 5.x's native `proportional` rope type (Gemma 4; `ROPE_INIT_FUNCTIONS["proportional"]`), and
    rope_patch computes it with that function: the patched model equals a natively configured `proportional` model,
    `to_rope_parameters` exports {"rope_type": "proportional", "rope_theta", "partial_rotary_factor": p}, and a plain
    save_pretrained reloads it without rope_patch. Pair count: k = ⌊p·d/2⌋ (transformers' `int(p * head_dim // 2)`),
    rounded down; rope_patch used to round to nearest, which kept one more pair wherever round(p·d/2) > ⌊p·d/2⌋
    (p = 0.7, d = 16: 5 pairs, formerly 6). A p > 0 that keeps no pair is refused.

    Not the `partial_rotary_factor` that phi, stablelm, gpt-neox and glm carry in their config: there the key slices
    the head (rotate the first p·d coordinates, with a spectrum re-spread over them, and pass the rest through),
    fixed when the model is built. Both meanings cannot live in one `rope_parameters`, so p_rope is refused on such
    models (rotary dim < head dim)."""

    name = "p_rope"
    aliases = ("prope", "partial_rope", "partial", "proportional")
    bare_param = "partial_rotary_factor"
    partial_rotary_factor: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.partial_rotary_factor is None:
            raise TypeError("p_rope: missing required parameter `partial_rotary_factor` (fraction of pairs that keep "
                            "rotating, e.g. 0.75).")
        self._set("partial_rotary_factor", check.number(
            self.name, "partial_rotary_factor", self.partial_rotary_factor, ge=0.0, le=1.0,
            hint="It is the fraction p of rotary pairs that keep rotating: 1 is plain RoPE, 0 the paper's 0-RoPE."))

    def resolve(self, target):
        for ctx in target.contexts().values():
            if ctx.rotary_dim != ctx.head_dim:
                factor = ctx.rope_parameters.get("partial_rotary_factor")
                raise ValueError(
                    f"p_rope: {target.model_type} rotates only part of each head (its config's partial_rotary_factor="
                    f"{factor!r}: the first {ctx.rotary_dim} of {ctx.head_dim} coordinates, with frequencies spread "
                    "over them), while p_rope / transformers' `proportional` rotate the whole head and zero the "
                    "lowest-frequency pairs; both are written `partial_rotary_factor` in rope_parameters, so they "
                    "cannot be combined. Use p_rope on a model that rotates the full head (llama, qwen2, gemma, ...)."
                )
            kept_pairs(self.partial_rotary_factor, ctx.head_dim)
        return self

    def rope_parameters(self, ctx):
        return self._params(ctx, "proportional", partial_rotary_factor=self.partial_rotary_factor)


def kept_pairs(fraction: float, head_dim: int) -> int:
    """k = ⌊p·d/2⌋, the pairs transformers' `proportional` keeps (its `int(p * head_dim // 2)`), refusing a p > 0
    that keeps none (that would silently be p = 0; p = 0 itself is the paper's 0-RoPE)."""
    n_pairs = head_dim // 2
    kept = int(fraction * head_dim // 2)
    if fraction > 0 and kept == 0:
        smallest = 1 / n_pairs
        while int(smallest * head_dim // 2) == 0:  # 1/n in floating point may floor to 0 pairs: the next float up
            smallest = math.nextafter(smallest, 2.0)
        raise ValueError(
            f"p_rope: parameter `partial_rotary_factor` must be 0 or keep at least one of this model's {n_pairs} "
            f"rotary pairs, i.e. 0 or in [{smallest:g}, 1] (⌊p × {head_dim} / 2⌋ >= 1, as transformers' proportional "
            f"counts them), got {fraction!r}: ⌊{fraction!r} × {head_dim} / 2⌋ = 0 pairs keep rotating. Pass "
            f"partial_rotary_factor={smallest!r} to keep one pair, or partial_rotary_factor=0 for no rotation at all "
            "(0-RoPE)."
        )
    return kept
