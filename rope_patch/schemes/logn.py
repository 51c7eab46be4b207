"""`logn`: a query temperature that grows with the position (log-n attention scaling, Llama 4 temperature tuning).

Attention entropy grows with the number of keys a query sees; scaling the query by a factor that grows like log n
keeps it near what the model saw in training (Su 2023, "从熵不变性看Attention的Scale操作",
https://kexue.fm/archives/8823; arXiv:2501.19399, "Scalable-Softmax Is Superior for Attention", analyses both
forms below). Two forms, per query at position p:

    kind="logn"    q ← q·max(1, log_L(p + 1))                                   Su 2023; Qwen-1's `use_logn_attn`
                   L = the model's pre-training window: 1 inside it, log(p + 1)/log(L) beyond
    kind="llama4"  q ← q·(1 + attn_scale·log(⌊(p + 1)/floor_scale⌋ + 1))        Llama 4 (`attn_temperature_tuning`,
                   attn_scale 0.1, floor_scale 8192 as in transformers' Llama4TextConfig; transformers computes it as
                   log1p(floor((p + 1)/floor_scale))·attn_scale + 1 and applies it on the NoPE layers only)

`layers`: "all", or "nope" for the layers that do not rotate (Llama 4 / SmolLM3 `no_rope_layers`; every layer when
stacked with the `nope` scheme), where Llama 4 applies it.

Where: right before the attention computation, on the query that goes into it (after q_proj, the q/k norms of
Qwen3/OLMo2 and the rotation; RoPE is linear, so scaling before or after the rotation is the same, but not before a
norm). The model's attention function is wrapped: the patch registers four functions of its own with transformers'
`AttentionInterface` (`rope_patch_logn_eager`, `_sdpa`, `_flex`, `_fa2`, one per mask family, each with that
family's mask function in `AttentionMaskInterface`), and each attention module carries a `QueryTemperature` naming
the function it wraps: the model's backend, or the function of the attention-side scheme it is stacked with.

p is the token's true position: the `position_ids` the decoder receives (what its RoPE uses; `generate` passes
attention_mask.cumsum − 1, so left padding does not shift it), recorded by a forward pre-hook on the decoder for the
architectures that do not hand them to attention (Llama 4), else the cache slot. So cached decoding equals
recomputation. The scale only multiplies q: forward and backward are those of q·t(p).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch
import transformers
from torch import nn
from transformers.masking_utils import (
    AttentionMaskInterface,
    eager_mask,
    flash_attention_mask,
    flex_attention_mask,
    sdpa_mask,
)

from .. import attention
from .. import validation as check
from ..discovery import PatchSite
from ..registry import register_scheme
from ..rotary import BackendChanged, PatchedRotaryForward
from ..undo import UndoLog
from .absolute import NoPE
from .base import InstallStep
from .common import AttentionScheme, _runs_attention, attention_modules, cache_arg, decoder
from .stack import Modifier

STATE = "_rope_patch_logn"  # attribute on each attention module of a patched model
PREFIX = "rope_patch_logn_"
# wrapper name suffix -> the mask function of the backends it wraps (transformers' mask for that family)
FAMILIES = {"eager": eager_mask, "sdpa": sdpa_mask, "flex": flex_attention_mask, "fa2": flash_attention_mask}
NATIVE_KEYS = ("attn_temperature_tuning", "use_logn_attn")  # configs that scale the query already (Llama 4, Qwen-1)
ATTN_SCALE, FLOOR_SCALE = 0.1, 8192  # transformers' Llama4TextConfig defaults


# ---- the temperature ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Positions:
    """What the decoder's pre-hook recorded for the current forward: the positions its RoPE uses, (b|1, n)."""

    last: torch.Tensor | None = None


@dataclasses.dataclass
class QueryTemperature:
    """Per attention module: t(p) and the attention function it wraps (`inner`: a name in transformers'
    AttentionInterface, or "eager" for the modeling file's own eager function). `active` False: the layer is left
    as it was (layers="nope" on a rotating layer; an attention without positions, Blt's cross-attention); only the
    wrapping stays."""

    kind: str
    window: int  # L (kind="logn")
    attn_scale: float
    floor_scale: float
    inner: str
    active: bool
    positions: Positions

    def factor(self, p: torch.Tensor) -> torch.Tensor:
        """t(p) in float32 for integer positions p."""
        p = p.float()
        if self.kind == "llama4":  # exactly transformers' Llama4TextAttention
            return torch.log1p(torch.floor((p + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (torch.log(p + 1.0) / math.log(self.window)).clamp(min=1.0)

    def scale(self, query: torch.Tensor, key: torch.Tensor, position_ids, current=None) -> torch.Tensor:
        """query (b, H, q, d) · t(p) per query row. A re-positioned layer (attention/copies.py, `current`) passes c
        stacked copies of its queries, whose ids are the copies' positions: t is the token's, at its true position,
        in every copy (the temperature follows how many keys a query sees, not where its rotation puts it)."""
        q_len = query.shape[2]
        copies = 1
        if current is not None:  # the copies stacked on the batch axis, or one at a time (attention/copies.py)
            position_ids, copies = current.positions, query.shape[0] // current.rows
        pos = position_ids if position_ids is not None else self.positions.last
        if pos is None or pos.dim() != 2 or pos.shape[-1] != q_len:
            start = key.shape[2] - q_len  # the cache slots: true positions without padding
            pos = torch.arange(start, start + q_len, device=query.device)[None]
        t = self.factor(pos.to(query.device))  # (b|1, q)
        if copies > 1:
            t = t.expand(query.shape[0] // copies, q_len).repeat(copies, 1)
        return (query * t[:, None, :, None]).to(query.dtype)

    def function(self, module: nn.Module):
        if self.inner == "eager":
            return sys.modules[type(module).__module__].eager_attention_forward
        return transformers.AttentionInterface._global_mapping[self.inner]

    def __setstate__(self, state):
        # A patched model unpickled in a fresh process (torch.load) finds the wrappers registered.
        self.__dict__.update(state)
        register()


def _forward(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' attention-function signature: q ← q·t(p), then the wrapped function."""
    state: QueryTemperature | None = getattr(module, STATE, None)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} runs rope_patch's logn attention function but carries "
                           "no logn state: the attention implementation was set by hand. Use rope_patch.apply / "
                           "rope_patch.remove.")
    if state.active:
        attn = getattr(module, attention.STATE, None)
        query = state.scale(query, key, kwargs.get("position_ids"), attn.current if attn is not None else None)
    return state.function(module)(module, query, key, value, attention_mask, *args, **kwargs)


def logn_eager(module, query, key, value, attention_mask, *args, **kwargs):
    return _forward(module, query, key, value, attention_mask, *args, **kwargs)


def logn_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    return _forward(module, query, key, value, attention_mask, *args, **kwargs)


def logn_flex(module, query, key, value, attention_mask, *args, **kwargs):
    return _forward(module, query, key, value, attention_mask, *args, **kwargs)


def logn_fa2(module, query, key, value, attention_mask, *args, **kwargs):
    return _forward(module, query, key, value, attention_mask, *args, **kwargs)


_FUNCTIONS = {"eager": logn_eager, "sdpa": logn_sdpa, "flex": logn_flex, "fa2": logn_fa2}


def register() -> None:
    """Register the wrappers and their mask functions (idempotent; new keys only)."""
    for tag, fn in _FUNCTIONS.items():
        name = PREFIX + tag
        if transformers.AttentionInterface._global_mapping.get(name) is not fn:
            transformers.AttentionInterface.register(name, fn)
        if AttentionMaskInterface._global_mapping.get(name) is not FAMILIES[tag]:
            AttentionMaskInterface.register(name, FAMILIES[tag])


def wrapper_for(inner: str) -> str | None:
    """The wrapper name whose mask function is the one `inner` uses (None: not a backend the wrapper knows)."""
    if inner == "eager":
        return PREFIX + "eager"
    if inner not in transformers.AttentionInterface._global_mapping:
        return None
    mask = AttentionMaskInterface._global_mapping.get(inner)
    return next((PREFIX + tag for tag, fn in FAMILIES.items() if fn is mask), None)


class PositionHook:
    """Forward pre-hook on the decoder: records the positions its RoPE uses (`position_ids`, else the cache length
    onwards, as the decoder counts), for the architectures whose layers do not pass them to attention; and refuses to
    run once the model's attention implementation is no longer the wrapper (a set_attn_implementation after apply
    would silently drop the temperature)."""

    def __init__(self, positions: Positions, config, wrapper: str):
        self.positions, self.config, self.wrapper = positions, config, wrapper

    def __call__(self, module, args, kwargs):
        found = self.config._attn_implementation
        if found != self.wrapper:
            raise BackendChanged(
                f"rope_patch: this model is patched with 'logn', which runs through its own attention function "
                f"{self.wrapper!r}, but the model's attention implementation is now {found!r} "
                "(model.set_attn_implementation was called after rope_patch.apply); it would run without the query "
                "temperature. Re-apply with rope_patch.apply(model, rope_patch.current(model)), or call "
                "rope_patch.remove(model).")
        pos = kwargs.get("position_ids")
        if pos is None:
            ids = args[0] if args else kwargs.get("input_ids")
            embeds = kwargs.get("inputs_embeds")
            n = ids.shape[-1] if ids is not None else embeds.shape[1] if embeds is not None else None
            if n is not None:
                cache = cache_arg(kwargs)
                past = cache.get_seq_length() if cache is not None else 0
                device = (ids if ids is not None else embeds).device
                pos = torch.arange(past, past + n, device=device)[None]
        self.positions.last = pos


def _is_nope_layer(module: nn.Module, config) -> bool:
    if getattr(module, "use_rope", True) in (0, False):  # Llama 4, SmolLM3
        return True
    layers = getattr(config, "no_rope_layers", None)
    return bool(layers is not None and module.layer_idx < len(layers) and not layers[module.layer_idx])


@register_scheme
@dataclasses.dataclass(frozen=True)
class LogN(Modifier):
    """Query temperature that grows with the position (module docstring: formulas, papers, where it applies):
    kind="logn" q ← q·max(1, log_L(p + 1)) (Su 2023, kexue.fm/archives/8823; Qwen-1 `use_logn_attn`), L the
    pre-training window; kind="llama4" q ← q·(1 + attn_scale·log(⌊(p + 1)/floor_scale⌋ + 1)) (Llama 4
    `attn_temperature_tuning`; attn_scale 0.1, floor_scale 8192, or the model config's `attn_scale`/`floor_scale`);
    layers "all" or "nope" (Llama 4 applies it on its NoPE layers). Composes with every frequency and attention-side
    scheme (`rope_patch.apply(model, "yarn:4+logn")`)."""

    name = "logn"
    aliases = ("log_n", "logn_attn", "logn_scaling", "attn_temperature_tuning", "temperature_tuning")
    bare_param = "kind"  # logn:llama4
    kind: str = "logn"  # the formula (the class attribute `kind` of other schemes is their family)
    attn_scale: float | None = None
    floor_scale: float | None = None
    layers: str = "all"

    def __post_init__(self):
        n = self.name
        object.__setattr__(self, "kind", check.choice(n, "kind", self.kind, ("logn", "llama4")))
        object.__setattr__(self, "layers", check.choice(n, "layers", self.layers, ("all", "nope")))
        if self.kind == "logn":
            given = [k for k in ("attn_scale", "floor_scale") if getattr(self, k) is not None]
            if given:
                raise TypeError(f"{n}: parameter(s) {', '.join(given)} belong to kind='llama4' "
                                "(1 + attn_scale·log(⌊(p + 1)/floor_scale⌋ + 1)); kind='logn' (max(1, log_L(p + 1))) "
                                "takes none. Pass kind='llama4' or drop them.")
            return
        if self.attn_scale is not None:
            object.__setattr__(self, "attn_scale", check.number(
                n, "attn_scale", self.attn_scale, ge=0.0, le=10.0,
                hint="It multiplies log(⌊(p + 1)/floor_scale⌋ + 1) (Llama 4: 0.1); 0 is no scaling."))
        if self.floor_scale is not None:
            object.__setattr__(self, "floor_scale", check.number(
                n, "floor_scale", self.floor_scale, ge=1.0, le=float(check.POSITIONS_MAX),
                hint="Positions are counted in steps of floor_scale tokens (Llama 4: 8192)."))

    def resolve(self, target: PatchSite) -> LogN:
        return self.with_defaults(target.config)

    def with_defaults(self, config=None) -> LogN:
        """llama4's attn_scale / floor_scale where the scheme leaves them open: the config's (Llama 4 sets both),
        else transformers' defaults (ATTN_SCALE, FLOOR_SCALE). Other kinds have no such parameters."""
        if self.kind != "llama4":
            return self
        scale = self.attn_scale if self.attn_scale is not None else getattr(config, "attn_scale", None) or ATTN_SCALE
        floor = (self.floor_scale if self.floor_scale is not None
                 else getattr(config, "floor_scale", None) or FLOOR_SCALE)
        return dataclasses.replace(self, attn_scale=float(scale), floor_scale=float(floor))

    def prepare(self, target: PatchSite, under: AttentionScheme | None = None) -> InstallStep:
        n, cfg, model = self.name, target.config, target.model
        for key in NATIVE_KEYS:
            if getattr(cfg, key, False):
                raise ValueError(
                    f"{n}: this model's config has `{key}` on ({type(cfg).__name__}), so it scales its queries by "
                    "position already; logn on top would apply the temperature twice. Set "
                    f"config.{key} = False before loading the model (or leave logn out).")
        modules = attention_modules(model)
        if not modules:
            raise ValueError(f"{n}: found no attention modules in {type(model).__name__}.")
        backend = cfg._attn_implementation
        if wrapper_for(backend) is None:
            raise ValueError(f"{n}: attention backend {backend!r} is not supported; supported: eager, sdpa, "
                             "flex_attention, flash_attention_2. Call model.set_attn_implementation('sdpa') first.")
        if backend == "eager" and any(
                getattr(sys.modules[type(m).__module__], "eager_attention_forward", None) is None for m in modules):
            raise ValueError(f"{n}: {target.model_type}'s modeling file has no module-level `eager_attention_forward` "
                             "to wrap. Call model.set_attn_implementation('sdpa') first.")
        all_nope = isinstance(under, NoPE)
        chosen = [all_nope or self.layers == "all" or _is_nope_layer(m, cfg) for m in modules]
        # The other modules that look their attention function up by the model's backend (Blt's cross-attention, which
        # takes no positions and no scheme patches) call the wrapper too once it is the backend: they carry a state
        # that leaves them as they are (inactive), or every forward would stop at the "set by hand" error.
        known = {id(m) for m in modules}
        alone = [m for m in model.modules() if id(m) not in known and hasattr(m, "config") and _runs_attention(type(m))
                 and not isinstance(m, transformers.PreTrainedModel)]
        if not any(chosen):
            raise ValueError(
                f"{n}: layers='nope' but {target.model_type} has no NoPE layers (no `no_rope_layers` entry of 0 in its "
                "config, as Llama 4 and SmolLM3 have): nothing would change. Use layers='all', or stack logn with the "
                "nope scheme ('nope+logn:layers=nope').")
        window = target.pretraining_window
        if self.kind == "logn" and window < 2:
            raise ValueError(f"{n}: kind='logn' divides by log L, and this model's pre-training window "
                             f"is L = {window}.")
        rotaries = target.rotaries

        def install(log: UndoLog) -> None:
            register()
            config = target.config  # the model's private config (api.apply), as the parts before this one left it
            inner = config._attn_implementation
            wrapper = wrapper_for(inner)
            if wrapper is None:  # pragma: no cover - the attention-side schemes only install known backends
                raise ValueError(f"{n}: cannot wrap the attention function {inner!r}.")
            positions = Positions()
            for m, active in [*zip(modules, chosen, strict=True), *((m, False) for m in alone)]:
                log.setattr(m, STATE, QueryTemperature(self.kind, window, self.attn_scale or 0.0,
                                                       self.floor_scale or 1.0, inner, active, positions))
            log.add_hook(decoder(model), PositionHook(positions, config, wrapper), with_kwargs=True)
            for rotary in rotaries:  # every one the attention-side scheme patched (Granite-SWA: one per base)
                below = vars(rotary).get("forward")
                if isinstance(below, PatchedRotaryForward) and below.attn_implementation is not None:
                    # the attention-side scheme checks its backend on every forward: it now runs inside the wrapper
                    log.setattr(below, "attn_implementation", wrapper)
                    log.setattr(below, "allowed", ())
            model.set_attn_implementation(wrapper)  # writes the model's private config only (api.apply)

        return install


# The parameter `kind` (the formula) shadows the family that `Scheme.kind` names on every other scheme class: the
# instances hold the formula, the class says "modifier" (`rope-patch list`, code that asks a class for its family).
LogN.kind = "modifier"
