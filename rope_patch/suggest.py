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

A scheme class without a rule (`Scheme.suggestion` returns None) is not suggested: longrope (its per-pair factors
come from the LongRoPE search), and the schemes that need training (alibi, nope, relative_bias, sinusoidal,
learned_absolute, p_rope, a new rope_theta). For N ≤ L only STRING is suggested: the model serves N as it was
trained, and the extension schemes would only move it away from that.
"""

from __future__ import annotations

from torch import nn

from . import registry
from . import validation as check
from .api import original_config, patch_state
from .discovery import find_target
from .schemes.base import Suggestion

__all__ = ["Suggestion", "pretraining_window", "specs_for_target", "suggest"]


def pretraining_window(model: nn.Module) -> int:
    """L of the model as loaded (before any patch): the shipped `original_max_position_embeddings` of a checkpoint
    that ships with scaling, else `max_position_embeddings`."""
    target = find_target(model)
    if patch_state(target) is None:
        return target.pretraining_window
    original = original_config(model)
    params = original["rope_parameters"]
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3): one of them
        params = next(iter(params.values()))
    window = int(original["max_position_embeddings"])
    shipped = (params.get("original_max_position_embeddings")
               or getattr(target.config, "original_max_position_embeddings", None))
    return int(shipped) if shipped and int(shipped) < window else window


def suggest(model: nn.Module, target_length: int) -> list[Suggestion]:
    """The training-free schemes with the parameters their papers recommend for serving `target_length` tokens on
    this model (module docstring: the rules and where they come from), each applicable with
    `rope_patch.apply(model, s.spec)`.

    Args:
        model: a model (or a wrapper of one), patched or not: L is the pre-training window of the model as loaded
            (a checkpoint that ships scaling counts from its `original_max_position_embeddings`).
        target_length: N, the context length in tokens the model should serve.

    Returns:
        One `Suggestion` per scheme with a rule (its `spec`, `params`, `reason` and whether it serves N `alone`):
            the frequency schemes first, then the attention-side ones, then those that need a frequency scheme with
            them. For N ≤ L only STRING.

    Raises:
        ValueError: a target below 2 tokens or beyond 1024 × L.
        TypeError: a target that is not an integer.
    """
    n = check.integer("suggest", "target_length", target_length, ge=2, le=check.POSITIONS_MAX,
                      hint="It is the context length N (tokens) the model should serve.")
    window = pretraining_window(model)
    high = check.FACTOR_RANGE[1]
    if n > high * window:
        raise ValueError(f"suggest: target_length {n} is {n / window:g}× the pre-training window L = {window}; the "
                         f"schemes support factors up to {high:g} (N ≤ {int(high * window)}). Choose a smaller target.")
    made = [(cls, s) for cls in _scheme_classes() if (s := cls.suggestion(n, window)) is not None]
    local, wide = local_layer_types(model, window)
    if local and wide:
        made = [(cls, _on_layer_types(cls, s, wide, local) if cls.kind == "frequency" else s) for cls, s in made]
    # the frequency schemes first, then the attention-side ones, then those that need another scheme with them; each
    # group in the order the schemes were registered
    return [s for cls, s in sorted(made, key=lambda m: (m[0].kind != "frequency", not m[1].alone))]


def local_layer_types(model: nn.Module, window: int) -> tuple[list[str], list[str]]:
    """(the RoPE layer types whose every layer attends within a sliding window of at most `window` tokens, the other
    RoPE layer types) of a model with one rotary module whose RoPE is per layer type; ([], []) for any other model.
    Read from the attention modules (their `sliding_window` and `layer_idx`) and the config's `layer_types`."""
    target = find_target(model)
    types = [t for t in target.layer_types if t is not None]
    per_layer = list(getattr(target.config, "layer_types", None) or [])
    if not types or len(target.rotaries) > 1 or not per_layer:
        return [], []
    reach = {}  # layer index -> its sliding window (None: attends to everything)
    for module in target.model.modules():
        if hasattr(module, "sliding_window") and isinstance(getattr(module, "layer_idx", None), int):
            reach[module.layer_idx] = module.sliding_window

    def local(t: str) -> bool:
        layers = [i for i, lt in enumerate(per_layer) if lt == t]
        return bool(layers) and all(isinstance(reach.get(i), int) and reach[i] <= window for i in layers)

    return [t for t in types if local(t)], [t for t in types if not local(t)]


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
    suggestion that serves N on its own; with `specs`, each bare scheme name that `suggest` has numbers for is
    replaced by its suggested spec, and everything else (specs with parameters, other names) is kept as given."""
    from .specs import parse_spec

    found = {s.scheme: s.spec for s in suggest(model, target_length)}
    if specs is None:
        return ["default", *(s.spec for s in suggest(model, target_length) if s.alone)]
    out = []
    for spec in specs:
        name, params = parse_spec(spec) if spec != "loaded" else (spec, {})
        out.append(found[name] if not params and name in found else spec)
    return out
