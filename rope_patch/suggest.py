"""`suggest(model, target_length)`: the parameters each training-free scheme's paper recommends for a target length.

Notation: L = the model's pre-training window (discovery's `pretraining_window` of the model as loaded: a checkpoint
that ships scaling, such as Llama 3.1's llama3 ×8 over 8192, has L = 8192, not its shipped 131,072), N = the target
length. Each rule is its scheme class's `suggestion(n, window)` classmethod, whose docstring states it and where it
comes from (the paper or reference code; where a paper gives a range, the choice is named in the reason):

    linear, ntk, dynamic, yarn, dynamic_yarn, llama3    factor s = N/L (`FrequencyScheme.factor_suggestion`); yarn
                                                        and dynamic_yarn add rope_patch's beta_fast for small L
    self_extend, self_extend_logistic, dca, rerope,     the window / group / chunk sizes their papers give for N > L
    leaky_rerope
    string                                              S = N/3, W = min(128, L/32); beyond L only with a frequency
                                                        scheme (`alone=False`)

On a model whose RoPE is per layer type (Gemma 3), a layer type whose every layer attends within a sliding window of
at most L tokens never meets a distance past L: the frequency schemes are suggested on the other layer types only
(`layer_types=`), as Google's Gemma 3 4B+ ship their scaling. On Gemma 3 270M at 64k this beat the same YaRN on every
layer, inside the window and past it (docs/studies/gemma3.md).

On a model whose every RoPE layer attends within a window of at most L (Beam, Cohere Compass, Ergo: sliding RoPE
layers, global layers without RoPE), no layer that rotates meets a distance past L, so nothing needs rescaling: no
frequency scheme is suggested, and of the attention-side schemes only those that reach the global layers, which have
no positions to move: the ones that hide keys (sink, lm_infinite), keeping the number of keys those layers attend to
near what they were trained with.

A scheme class without a rule (`Scheme.suggestion` returns None) is not suggested: longrope (its per-pair factors
come from the LongRoPE search), and the schemes that need training (alibi, nope, relative_bias, sinusoidal,
learned_absolute, p_rope, a new rope_theta). For N ≤ L only STRING and Ms-PoE are suggested (they help the model
use its window, the middle of a long context): the model serves N as it was trained, and the extension schemes would
only move it away from that.

Each suggestion is one `rope_patch.apply` accepts on this model: a scheme it refuses there (a rope type the config
class rejects, a width the attention does not rotate, an attention the side-by-side check cannot show exact, ...) is
left out (`api.refusal`: applied for a moment and removed, the model left bit for bit as it was). A companion that
needs a frequency scheme (STRING beyond L) is left out where no frequency scheme is.
"""

from __future__ import annotations

from torch import nn

from . import registry, validation
from .api import _materialised as materialised
from .api import original_config, patch_state, refusal
from .attention.windowed import attention_modules
from .discovery import find_target
from .schemes.base import Suggestion
from .schemes.common import AttentionScheme

__all__ = ["Suggestion", "pretraining_window", "specs_for_target", "suggest"]


def pretraining_window(model: nn.Module) -> int:
    """L of the model as loaded (before any patch): the shipped `original_max_position_embeddings` of a checkpoint
    that ships with scaling, else `max_position_embeddings`."""
    target = find_target(model)
    original = original_config(model) if patch_state(target) is not None else None
    # Unpatched, or a config whose window no patch changes: a table rotary's (GPT-J, CodeGen: no rope_parameters, its
    # RoPE is the sin/cos table the model builds) or one without max_position_embeddings (RecurrentGemma: discovery
    # refuses it with the reason)
    if original is None or original["rope_parameters"] is None or original["max_position_embeddings"] is None:
        return target.pretraining_window
    params = original["rope_parameters"]
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3): one of them
        params = next(iter(params.values()))
    window = int(original["max_position_embeddings"])
    shipped = (params.get("original_max_position_embeddings")
               or getattr(target.config, "original_max_position_embeddings", None))
    return int(shipped) if shipped and int(shipped) < window else window


def suggest(model: nn.Module, target_length: int, *, verify: bool = True, check: bool = True) -> list[Suggestion]:
    """The training-free schemes with the parameters their papers recommend for serving `target_length` tokens on
    this model (module docstring: the rules and where they come from), each applicable with
    `rope_patch.apply(model, s.spec)`.

    Args:
        model: a model (or a wrapper of one), patched or not: L is the pre-training window of the model as loaded
            (a checkpoint that ships scaling counts from its `original_max_position_embeddings`).
        target_length: N, the context length in tokens the model should serve.
        verify: True: only the suggestions `apply` accepts on this model, each tried on it (`api.refusal`, the model
            left bit for bit as it was); False: every rule's suggestion, untried (a plan made on a model on the meta
            device, where apply accepts nothing until the weights are loaded).
        check: as for `apply`: the suggestions are the ones `apply(model, spec, check=check)` accepts (False: the
            attention-side schemes' side-by-side check is not run, and not asked of them).

    Returns:
        One `Suggestion` per scheme with a rule that `apply` accepts on this model (its `spec`, `params`, `reason`
            and whether it serves N `alone`): the frequency schemes first, then the attention-side ones, then those
            that need a frequency scheme with them. For N ≤ L only STRING and Ms-PoE.

    Raises:
        ValueError: a target below 2 tokens or beyond 1024 × L; with `verify`, a model whose weights are not loaded
            (the meta device), where apply accepts no scheme.
        TypeError: a target that is not an integer.
    """
    n = validation.integer("suggest", "target_length", target_length, ge=2, le=validation.POSITIONS_MAX,
                           hint="It is the context length N (tokens) the model should serve.")
    window = pretraining_window(model)
    high = validation.FACTOR_RANGE[1]
    if n > high * window:
        raise ValueError(f"suggest: target_length {n} is {n / window:g}× the pre-training window L = {window}; the "
                         f"schemes support factors up to {high:g} (N ≤ {int(high * window)}). Choose a smaller target.")
    made = [(cls, s) for cls in _scheme_classes() if (s := cls.suggestion(n, window)) is not None]
    local, wide = local_layer_types(model, window)
    if local and wide:
        made = [(cls, _on_layer_types(cls, s, wide, local) if cls.kind == "frequency" else s) for cls, s in made]
    elif local and n > window:
        # Every RoPE layer attends within a window inside L: none of them meets a distance past L, so a scheme that
        # changes them (every frequency scheme; an attention-side scheme's moved positions) only costs. The layers that
        # see past L have no RoPE: a scheme that moves positions leaves them as they are (no positions reach them), and
        # only one that hides keys (sink, LM-Infinite) changes what they attend to. Those alone are suggested.
        unrotated = unrotated_wide_layer_types(model, window)
        made = [(cls, _on_unrotated(s, unrotated, local)) for cls, s in made
                if unrotated and cls.kind != "frequency" and _hides_keys(cls, s)]
    if verify:
        try:
            materialised(find_target(model))  # else apply refuses every scheme, for the model's sake
        except ValueError as err:
            raise ValueError(f"suggest: {err} Or call suggest(..., verify=False): the rules' suggestions, untried.") \
                from None
        made = [(cls, s) for cls, s in made if refusal(model, s.spec, check=check) is None]
    if not any(cls.kind == "frequency" for cls, _ in made):  # a companion with no frequency scheme to go with
        made = [(cls, s) for cls, s in made if s.alone]
    # the frequency schemes first, then the attention-side ones, then those that need another scheme with them; each
    # group in the order the schemes were registered
    return [s for cls, s in sorted(made, key=lambda m: (m[0].kind != "frequency", not m[1].alone))]


def local_layer_types(model: nn.Module, window: int) -> tuple[list[str], list[str]]:
    """(the RoPE layer types whose every layer attends within a sliding window of at most `window` tokens, the other
    RoPE layer types) of a model with one rotary module whose RoPE is per layer type; ([], []) for any other model.
    Read from the attention modules (their `sliding_window` and `layer_idx`) and the config's `layer_types`."""
    target = find_target(model)
    types = [t for t in target.layer_types if t is not None]
    per_layer = _per_layer_types(target)
    if not types or not per_layer:
        return [], []
    reach = _reach(target.model)

    def local(t: str) -> bool:
        layers = [i for i, lt in enumerate(per_layer) if lt == t]
        return bool(layers) and all(_within(reach.get(i), window) for i in layers)

    return [t for t in types if local(t)], [t for t in types if not local(t)]


def unrotated_wide_layer_types(model: nn.Module, window: int) -> list[str]:
    """The layer types (config `layer_types`) of the attention layers that see past `window` tokens and hold no RoPE,
    on a model with one rotary module whose RoPE is per layer type (Beam's, Cohere Compass's, Ergo's global layers: a
    type the rotary has no entry for); [] for any other model."""
    target = find_target(model)
    rotated = {t for t in target.layer_types if t is not None}
    per_layer = _per_layer_types(target)
    if not rotated or not per_layer:
        return []
    wide = [per_layer[i] for i, w in sorted(_reach(target.model).items())
            if i < len(per_layer) and per_layer[i] not in rotated and not _within(w, window)]
    return list(dict.fromkeys(wide))


def _per_layer_types(target) -> list:
    """The config's `layer_types` of a model whose one rotary module keeps a RoPE per layer type, else []."""
    if len(target.rotaries) > 1:
        return []
    return list(getattr(target.config, "layer_types", None) or [])


def _reach(model: nn.Module) -> dict[int, int | None]:
    """Layer index -> how far back its attention reaches: its sliding window, or None (every key), read from the
    attention modules windowed evaluation switches (attention/windowed.py). A layer that carries the model's
    `sliding_window` but is not sliding (`is_sliding` False: Exaone 4's global layers) reaches every key."""
    return {m.layer_idx: None if getattr(m, "is_sliding", None) is False else m.sliding_window
            for m in attention_modules(model) if isinstance(getattr(m, "layer_idx", None), int)}


def _within(reach: int | None, window: int) -> bool:
    return isinstance(reach, int) and reach <= window


def _hides_keys(cls, s: Suggestion) -> bool:
    """Whether the suggested attention-side scheme hides keys: its declared regions (attention/geometry.py) leave
    some distance uncovered, or keep one only for the first tokens' keys (sink, LM-Infinite). A scheme without a
    declared geometry is not known to."""
    if not issubclass(cls, AttentionScheme):
        return False
    try:
        geometry = cls(**s.params).geometry()
    except (TypeError, ValueError):  # a size the model fills in at apply: not declared without the model
        return False
    return geometry is not None and geometry.hides


def _on_unrotated(s: Suggestion, unrotated: list[str], local: list[str]) -> Suggestion:
    """The suggestion, its reason saying where it acts on a model whose RoPE layers are all local."""
    why = (f"; it changes the {'/'.join(unrotated)} layers, which have no RoPE and see every token (it hides keys "
           f"there); the {'/'.join(local)} layers, the RoPE ones, attend within a window inside L and need nothing")
    return Suggestion.of(s.scheme, s.params, s.reason + why, s.alone)


def _on_layer_types(cls, s: Suggestion, wide: list[str], local: list[str]) -> Suggestion:
    """A frequency scheme's suggestion restricted to the layer types that see past L, where the scheme takes
    `layer_types` (dynamic_yarn, with its own per-forward update, does not: it stays on every layer)."""
    params = {**s.params, "layer_types": wide[0] if len(wide) == 1 else list(wide)}
    try:
        cls(**params)
    except (TypeError, ValueError):
        return s
    why = (f"; on {'/'.join(wide)} only: the {'/'.join(local)} layers attend within a window inside L and never meet "
           "a distance past it")
    return Suggestion.of(s.scheme, params, s.reason + why, s.alone)


def _scheme_classes() -> list:
    """Every listed scheme class once, in registration order (a class registered under two names counts once)."""
    registered = registry.registered()  # (loads the built-in schemes)
    listed = set(registry.list_schemes())
    return list(dict.fromkeys(cls for name, cls in registered.items() if name in listed))


def specs_for_target(model: nn.Module, target_length: int, specs: list[str] | None = None) -> list[str]:
    """The scheme list of `rope-patch compare --target N`: without `specs`, `default` (the baseline) and every
    suggestion that serves N on its own; with `specs`, each bare scheme name that `suggest` has numbers for, alone
    or as a part of a stack (`yarn+logn` -> `yarn:factor=4,beta_fast=2+logn` on L = 256, N = 1024), is replaced by
    its suggested spec, and everything else (specs with parameters, other names) is kept as given."""
    from .specs import parse_spec, stack_parts

    suggested = suggest(model, target_length)  # once: each suggestion is tried on the model
    found = {s.scheme: s.spec for s in suggested}
    if specs is None:
        return ["default", *(s.spec for s in suggested if s.alone)]

    def sized(part: str) -> str:
        name, params = parse_spec(part)
        return found[name] if not params and name in found else part

    return [spec if spec == "loaded" else "+".join(map(sized, stack_parts(spec))) for spec in specs]
