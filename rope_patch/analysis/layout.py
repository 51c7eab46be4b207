"""The model's RoPE as the analysis needs it: from numbers (head_dim, rope_theta, L), a transformers config, or a
loaded model (read as it was before any patch)."""

from __future__ import annotations

import copy
import dataclasses

from .. import api
from .. import validation as check
from ..discovery import PatchSite, RopeContext, find_target
from ..registry import did_you_mean
from ..schemes.base import Scheme
from ..schemes.chunked import DualChunk
from .spec import AnalysisSpec, as_spec


def check_head_dim(head_dim) -> int:
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
    ctx = make_context(head_dim, theta, int(cfg.max_position_embeddings), prf, params, lt)
    return ctx, getattr(cfg, "num_attention_heads", None)


def make_context(head_dim, rope_theta, window, partial_rotary_factor=1.0, params=None, layer_type=None) -> RopeContext:
    head_dim = check_head_dim(head_dim)
    theta = check.number("analysis", "rope_theta", 10000.0 if rope_theta is None else rope_theta, gt=1.0)
    prf = check.number("analysis", "partial_rotary_factor",
                       1.0 if partial_rotary_factor is None else partial_rotary_factor, gt=0.0, le=1.0)
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
    applied = api.current(target.model)
    if applied is None:
        return target, None
    original = api.original_config(target.model)
    cfg = copy.copy(target.config)
    cfg.rope_parameters = original["rope_parameters"]
    cfg.max_position_embeddings = original["max_position_embeddings"]
    return PatchSite(model=target.model, rotary=target.rotary, config=cfg), applied


@dataclasses.dataclass(frozen=True)
class Setup:
    spec: AnalysisSpec  # resolved (model-derived defaults filled in)
    ctx: RopeContext
    rotary_cls: type | None
    num_heads: int | None


def setup(scheme, head_dim, rope_theta, max_position_embeddings, partial_rotary_factor, model, config, layer_type,
           num_heads, params) -> Setup:
    if model is not None and config is not None:
        raise TypeError("Pass model= or config=, not both.")
    if model is not None:
        if any(v is not None for v in (head_dim, rope_theta, max_position_embeddings, partial_rotary_factor)):
            raise TypeError("With model= the RoPE numbers come from its config; do not also pass head_dim / rope_theta "
                            "/ max_position_embeddings / partial_rotary_factor.")
        target, applied = _unpatched_view(find_target(model))
        contexts = target.contexts()
        lt = layer_type if layer_type is not None else ("full_attention" if "full_attention" in contexts
                                                        else next(iter(contexts)))
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
        _check_layer_types(spec, [lt for lt in contexts if lt is not None])
        return Setup(resolve_free(spec, ctx), ctx, type(target.rotary), heads)
    if config is not None:
        if any(v is not None for v in (head_dim, rope_theta, max_position_embeddings, partial_rotary_factor)):
            raise TypeError("With config= the RoPE numbers come from it; do not also pass head_dim / rope_theta / "
                            "max_position_embeddings / partial_rotary_factor.")
        ctx, heads = _config_context(config, layer_type)
        num_heads = num_heads if num_heads is not None else heads
    else:
        ctx = make_context(head_dim, rope_theta, max_position_embeddings, partial_rotary_factor)
    spec = as_spec("default" if scheme is None else scheme, **params)
    rope = (getattr(config, "rope_parameters", None) or {}) if config is not None else {}
    _check_layer_types(spec, list(rope) if rope and all(isinstance(v, dict) for v in rope.values()) else [])
    return Setup(resolve_free(spec, ctx), ctx, None, num_heads)


def _check_layer_types(spec: AnalysisSpec, types: list[str]) -> None:
    """A frequency scheme's `layer_types` names layer types of the analysed RoPE (apply() refuses the same)."""
    chosen = getattr(spec.frequency_scheme, "layer_types", None) or ()
    if chosen and not types:
        raise ValueError(f"{spec.name}: layer_types={'/'.join(chosen)} picks layer types of a model with RoPE per "
                         "layer type; this RoPE has one for all layers (pass model= or config= of such a model, or "
                         "leave layer_types unset).")
    for name in chosen:
        if name not in types:
            raise ValueError(f"{spec.name}: layer_types names {name!r}, not one of this model's RoPE layer types "
                             f"({', '.join(types)}).{did_you_mean(name, types)}")


def resolve_free(spec: AnalysisSpec, ctx: RopeContext) -> AnalysisSpec:
    """`Scheme.resolve` without a model: fill `original_max_position_embeddings` (and DCA's sizes) from L, check
    LongRoPE lengths; a stack's parts one by one."""
    return dataclasses.replace(spec, scheme=_resolve_free(spec.scheme, ctx))


def _resolve_free(obj: Scheme, ctx: RopeContext) -> Scheme:
    if obj.kind == "stack":
        return dataclasses.replace(obj, schemes=tuple(_resolve_free(p, ctx) for p in obj.schemes))
    if isinstance(obj, DualChunk) and None in (obj.chunk_size, obj.local_size):
        if ctx.max_position_embeddings is None:
            raise TypeError("dca: needs the original training window L for its default sizes: "
                            "pass max_position_embeddings=L (or chunk_size and local_size, or model= / config=).")
        obj = obj.with_window(ctx.max_position_embeddings)
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
            raise ValueError(f"{obj.name}: `{key}` must have rotary_dim/2 = {ctx.rotary_dim // 2} entries, "
                             f"got {len(factors)}.")
    return obj


def original_window(setup: Setup) -> int | None:
    """The original training window L: the scheme's `original_max_position_embeddings`, else the model's."""
    obj = setup.spec.frequency_scheme or setup.spec.scheme
    return getattr(obj, "original_max_position_embeddings", None) or setup.ctx.max_position_embeddings
