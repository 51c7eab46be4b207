"""Composition: one frequency scheme, one attention-side scheme and modifiers applied to one model together.

    rope_patch.apply(model, ["yarn:4", "self_extend:group_size=4,window_size=16"])
    rope_patch.apply(model, "yarn:4+logn")                # the same grammar on the command line
    rope_patch.current(model)                             # Stack(yarn(...) + logn(...)); a single scheme stays itself

What composes, and why:
- A frequency scheme sets the θ_i (and the cos/sin scale) of the model's rotary module. The attention-side schemes
  that re-position q and k (self_extend, rerope, leaky_rerope, string, dca, ...: the layer's position copies, made
  by its own rotary) rotate with whatever frequencies it holds, shipped scaling or a frequency scheme, so
  `yarn + self_extend` is Self-Extend on a model natively configured with YaRN.
- The attention-side schemes that remove the rotation (alibi, nope, relative_bias, sinusoidal, learned_absolute)
  leave no frequencies for a frequency scheme to change: refused.
- Two frequency schemes (each defines every θ_i) or two attention-side schemes (each owns the attention function)
  are refused.
- `dynamic` and `longrope` rescale their frequencies from the largest position each call of the rotary sees; inside
  attention the rotating schemes call it at positions other than the tokens' own (grouped, shifted, chunked), so one
  forward would mix two sets of frequencies: refused with those schemes (`dynamic_yarn` follows the true length and
  composes).
- Modifiers (`logn`, schemes/logn.py) change something else (the query temperature) and compose with all of the
  above, at most one of each.

The parts install in a fixed order (frequency, attention, modifiers) through one undo log, so `remove()` undoes the
whole stack bit-exactly; each later part builds on what the earlier left on the model (the attention scheme keeps the
frequency scheme's fp32 masters and length update, the modifier wraps the attention function that is in place).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import ClassVar

from ..discovery import PatchSite
from ..registry import get_scheme_class, register_scheme
from ..rotary import PatchedRotaryForward
from ..specs import parse_spec
from .base import InstallStep, Scheme, without_native_form
from .common import AttentionScheme
from .frequency import Dynamic, FrequencyScheme, LongRope

# The config fields a save writes for the position encoding (what a plain transformers reload reads back).
PUBLIC_FIELDS = ("rope_parameters", "max_position_embeddings")
ALLOWED = ("A stack holds at most one frequency scheme, one attention-side scheme and modifiers (logn); frequency "
           "schemes compose with the attention-side schemes that rotate with the model's RoPE (self_extend, rerope, "
           "leaky_rerope, string, dca), logn with everything.")


class Modifier(Scheme):
    """A part that composes with any frequency and attention-side scheme (kind "modifier"). `prepare` is told which
    attention-side scheme it is applied together with (None: none), since that decides where it hooks in."""

    kind: ClassVar[str] = "modifier"
    changes: ClassVar[str] = "the attention temperature"

    def prepare(self, target: PatchSite, under: AttentionScheme | None = None) -> InstallStep:
        raise NotImplementedError


def _part(item) -> Scheme:
    """A stack part from a Scheme, a Scheme class, a spec string ("yarn:4") or a saved {"scheme", "params"} entry."""
    if isinstance(item, Scheme):
        return item
    if isinstance(item, type) and issubclass(item, Scheme):
        return item.from_params()
    if isinstance(item, str):
        name, params = parse_spec(item)
        return get_scheme_class(name).from_params(**params)
    if isinstance(item, dict) and set(item) <= {"scheme", "params"} and isinstance(item.get("scheme"), str):
        return get_scheme_class(item["scheme"]).from_params(**(item.get("params") or {}))
    raise TypeError(f"A stack part must be a Scheme, a spec string such as 'yarn:4' or a {{'scheme': ..., 'params': "
                    f"...}} entry, got {type(item).__name__} {item!r}.")


def _flatten(items) -> list[Scheme]:
    out: list[Scheme] = []
    for item in items:
        part = _part(item)
        out.extend(part.schemes if isinstance(part, Stack) else (part,))
    return out


def _rank(part: Scheme) -> int:
    return 0 if isinstance(part, FrequencyScheme) else 1 if isinstance(part, AttentionScheme) else 2


def _rotates_with_model(scheme: AttentionScheme) -> bool:
    """Does the scheme keep the model's own rotation (re-positioning: its layers run at copies of other positions with
    the model's rotary, attention/copies.py)? A scheme class of one's own says so by returning True from
    `repositions()`."""
    return scheme.repositions()


def _check(parts: list[Scheme]) -> None:
    for p in parts:
        if not isinstance(p, (FrequencyScheme, AttentionScheme, Modifier)):
            raise TypeError(f"{p.name}: a {type(p).__name__} is neither a frequency scheme, an attention-side scheme "
                            f"nor a modifier, so it cannot be stacked. {ALLOWED}")
    names = " + ".join(p.name for p in parts)
    freq = [p for p in parts if isinstance(p, FrequencyScheme)]
    attn = [p for p in parts if isinstance(p, AttentionScheme)]
    if len(freq) > 1 and all(p.layer_types for p in freq):
        raise ValueError(f"Cannot stack {names}: {' and '.join(p.name for p in freq)} are both frequency schemes; a "
                         "stack holds one frequency scheme, so giving each layer type its own (layer_types) is not "
                         f"supported: apply one of them. {ALLOWED}")
    if len(freq) > 1:
        raise ValueError(f"Cannot stack {names}: {' and '.join(p.name for p in freq)} are both frequency schemes, and "
                         "each defines every θ_i (combine a base change with scaling through the scheme's "
                         f"own rope_theta, e.g. 'yarn:factor=4,rope_theta=500000'). {ALLOWED}")
    if len(attn) > 1:
        raise ValueError(f"Cannot stack {names}: {' and '.join(p.name for p in attn)} are both attention-side schemes, "
                         f"and each owns the attention computation. {ALLOWED}")
    seen: dict[type, Scheme] = {}
    for p in parts:
        if isinstance(p, Modifier):
            if type(p) in seen:
                raise ValueError(f"Cannot stack {names}: {p.name} is given twice; pass it once with the parameters you "
                                 "want.")
            seen[type(p)] = p
    if freq and attn:
        f, a = freq[0], attn[0]
        if not _rotates_with_model(a):
            raise ValueError(f"Cannot stack {names}: {a.name} removes the rotation (its model runs without RoPE), so "
                             f"there are no frequencies for {f.name} to change. {ALLOWED}")
        if getattr(f, "cache_rotation", None) == "consistent":
            raise ValueError(
                f"Cannot stack {names}: {f.name} with cache_rotation='consistent' runs its own attention function, and "
                f"so does {a.name}. {a.name} already rotates the cached keys inside attention with each step's "
                f"frequencies: drop cache_rotation (use {f.name} with its default).")
        if isinstance(f, (Dynamic, LongRope)):
            raise ValueError(
                f"Cannot stack {names}: {f.name} rescales its frequencies from the largest position each rotary call "
                f"sees, and {a.name} rotates q and k inside attention at positions other than the tokens' own, so one "
                "forward would mix two sets of frequencies. Use a static frequency scheme (yarn, linear, ntk, llama3, "
                f"default) or dynamic_yarn (which follows the true sequence length) with {a.name}.")


def _keep_frequency_forward(log, rotary, below) -> None:
    """The attention-side scheme installed its identity rotary forward over the frequency scheme's: keep the frequency
    scheme's fp32 masters (restored after a cast) and its per-length update (dynamic_yarn) in the one that runs."""
    above = vars(rotary).get("forward")
    if above is below or not isinstance(above, PatchedRotaryForward) or not isinstance(below, PatchedRotaryForward):
        return
    log.setattr(above, "masters", {**below.masters, **above.masters})
    log.setattr(above, "update", below.update)
    log.setattr(above, "seen", above._buffers_now())


@register_scheme
@dataclasses.dataclass(frozen=True)
class Stack(Scheme):
    """Several schemes applied to one model together (see the module docstring for what composes). Build one with
    `Stack.of(...)` (which gives back the scheme itself for a single part), `rope_patch.as_scheme([...])` or a spec
    "yarn:4+logn"; `rope_patch.current(model)` returns one for a model patched with several schemes.

    Attributes:
        schemes: the parts, in install order: the frequency scheme, the attention-side scheme, the modifiers.
    """

    name = "stack"
    kind: ClassVar[str] = "stack"
    listed: ClassVar[bool] = False  # several schemes, not one: `rope-patch list` names the parts
    schemes: tuple = ()

    def __post_init__(self):
        if isinstance(self.schemes, (str, Scheme, dict)) or not isinstance(self.schemes, Iterable):
            raise TypeError(f"stack: `schemes` must be a list of schemes or specs, got {type(self.schemes).__name__} "
                            f"{self.schemes!r}.")
        parts = _flatten(self.schemes)
        if len(parts) < 2:
            raise ValueError(f"stack: a stack holds at least two schemes, got {len(parts)}"
                             + (f" ({parts[0].name}): apply it on its own." if parts else "."))
        _check(parts)
        object.__setattr__(self, "schemes", tuple(sorted(parts, key=_rank)))

    @classmethod
    def of(cls, items) -> Scheme:
        """The scheme that `items` (Schemes, specs, saved entries) amount to: the one scheme itself, else a Stack.

        Args:
            items: a list of `Scheme` objects, spec strings (`"yarn:4"`) or saved `{"scheme", "params"}` entries;
                nested stacks are flattened.

        Returns:
            The single scheme for one part, else a `Stack` of the parts in install order.

        Raises:
            ValueError: parts that do not compose (two frequency schemes, a frequency scheme with one that removes
                the rotation, ...), with what is allowed.
        """
        if isinstance(items, (str, Scheme, dict)):
            items = [items]
        parts = _flatten(list(items))
        if len(parts) == 1:
            return parts[0]
        return cls(tuple(parts))

    @classmethod
    def from_params(cls, **params) -> Scheme:
        if set(params) - {"schemes"}:
            raise TypeError(f"stack: unknown parameter(s) {sorted(set(params) - {'schemes'})}; a stack takes "
                            "`schemes` only (give each part's parameters in its own spec).")
        if "schemes" not in params:
            raise TypeError("stack: missing required parameter `schemes` (e.g. ['yarn:4', 'logn']).")
        return cls.of(params["schemes"])

    # ---- the parts ---------------------------------------------------------------------------------------------
    @property
    def frequency(self) -> FrequencyScheme | None:
        """The frequency part, or None."""
        return next((p for p in self.schemes if isinstance(p, FrequencyScheme)), None)

    @property
    def attention(self) -> AttentionScheme | None:
        """The attention-side part, or None."""
        return next((p for p in self.schemes if isinstance(p, AttentionScheme)), None)

    @property
    def modifiers(self) -> tuple[Modifier, ...]:
        """The modifiers (`logn`), possibly none."""
        return tuple(p for p in self.schemes if isinstance(p, Modifier))

    def params(self) -> dict:
        """{"schemes": [{"scheme": name, "params": {...}}, ...]}: JSON-ready, and what `from_params` reads back."""
        return {"schemes": [{"scheme": p.name, "params": {k: list(v) if isinstance(v, tuple) else v
                                                            for k, v in p.params().items()}} for p in self.schemes]}

    def __str__(self) -> str:
        return " + ".join(str(p) for p in self.schemes)

    # ---- the life of a scheme -----------------------------------------------------------------------------------
    def resolve(self, target: PatchSite) -> Stack:
        return dataclasses.replace(self, schemes=tuple(p.resolve(target) for p in self.schemes))

    def on_table(self, target: PatchSite) -> Stack:
        """Each part as applied to a table rotary (GPT-J, CodeGen: Scheme.on_table): the frequency part has no native
        form there either, which the saves and the export read part by part (base.without_native_form)."""
        return dataclasses.replace(self, schemes=tuple(p.on_table(target) for p in self.schemes))

    def prepare(self, target: PatchSite) -> InstallStep:
        attn = self.attention
        installs = [p.prepare(target, under=attn) if isinstance(p, Modifier) else p.prepare(target)
                    for p in self.schemes]  # everything is computed (and checked) before the model is touched

        rotaries = target.rotaries
        keep_public = bool(without_native_form(self))

        def install(log) -> None:
            cfg = target.config  # the model's private config (api.apply): what any save writes to config.json
            # (a table rotary's config, GPT-J's, has no rope_parameters, and the parts write none there)
            public = {key: copy.deepcopy(getattr(cfg, key)) for key in PUBLIC_FIELDS if hasattr(cfg, key)}
            below = None
            for part, step in zip(self.schemes, installs, strict=True):
                step(log)
                if isinstance(part, FrequencyScheme):
                    below = {id(r): vars(r).get("forward") for r in rotaries}
                elif isinstance(part, AttentionScheme) and below is not None:
                    for r in rotaries:
                        _keep_frequency_forward(log, r, below[id(r)])
            if keep_public:
                # The frequency part wrote its native form there, but the stack as a whole has none: a plain
                # save_pretrained would reload yarn without the Self-Extend it runs with, a third model. The rotary
                # runs from its own config copy (frequency.py), so the public one can go back to the unpatched RoPE,
                # as a single scheme without a native form leaves it (base.without_native_form).
                for key, value in public.items():
                    setattr(cfg, key, value)

        return install

    @property
    def keeps_rotation(self) -> bool:  # type: ignore[override]  # a ClassVar on single schemes
        """False when a part removes the rotation (alibi / nope / ... + logn)."""
        return all(p.keeps_rotation for p in self.schemes)

    def relative_position(self, i, j):
        """The attention part's remapped positions (a frequency scheme and the modifiers move none)."""
        attn = self.attention
        return i - j if attn is None else attn.relative_position(i, j)

    def longest_input(self) -> int | None:
        limits = [n for p in self.schemes if (n := p.longest_input()) is not None]
        return min(limits, default=None)

    def served_window(self, target: PatchSite) -> int | None:
        """The frequency part's window, then the attention part's `served_length` on it (yarn ×4 + Self-Extend groups
        positions within yarn's 4·L)."""
        freq, attn = self.frequency, self.attention
        window = None if freq is None else freq.served_window(target)
        if attn is None:
            return window
        base = window or getattr(target.config, "max_position_embeddings", None)
        served = attn.served_length(int(base)) if base else None
        return window if served is None or served == base else served
