"""`suggest(model, target_length)`: the parameters each training-free scheme's paper recommends for a target length.

Notation: L = the model's pre-training window (discovery's `pretraining_window` of the model as loaded: a checkpoint
that ships scaling, such as Llama 3.1's llama3 ×8 over 8192, has L = 8192, not its shipped 131,072), N = the target
length. Every rule below is the one its paper or reference code states; where a paper gives a range, the choice is
named in the reason.

    linear, ntk, dynamic,   factor s = N/L: the extension ratio (Chen et al. 2023 §2.3 "s = L′/L"; bloc97 2023;
    yarn, dynamic_yarn,     emozilla 2023; Peng et al. 2023 §3; Meta 2024). dynamic NTK at ℓ = N then has the
    llama3                  effective factor s·N/L − (s − 1) (FORMULAS.md), as transformers' docs configure it.
    yarn, dynamic_yarn      beta_fast = min(32, max(2, L/128)), beta_slow = 1 (rope_patch's rule, not the paper's):
                            YaRN's β count turns inside L and were tuned at L ≈ 4096, where β_fast = 32 leaves the
                            pairs with wavelength λ < L/32 = 128 tokens unchanged. The rule keeps that 128-token
                            threshold for smaller windows (L = 256: β_fast = 2, i.e. λ < 128 unchanged, where 32 would
                            leave only λ < 8 and interpolate pairs that turn 2–32 times in the window); β_slow = 1
                            (pairs that never complete a turn inside L are interpolated) has the same meaning at any
                            L. For L ≥ 4096 it is the paper's 32 / 1 and no beta is written into the spec. Measured on
                            rope-tiny (L = 256), README "Choosing parameters": yarn ×4 at 1024 tokens perplexity
                            113.2 → 87.4, passkey 7% → 60% (30 prompts).
    self_extend             W = L/4 (the paper's neighbour windows 512–1536 at L = 4096) and the smallest group size G
                            with W + (N − W)/G ≤ ⅔·L (Jin et al. 2024 §4: "(½ … ⅔)·L > W + (N − W)/G"); needs G < W.
    string                  local window W = min(128, L/32) (the authors' W = 128 at L ≥ 4096, scaled down with the
                            window) and shift S = N/3 (An et al. 2024, arXiv:2410.18745, README "0.25–0.4·N"), S > W.
                            It improves the use of the window for N ≤ L; beyond it its distances reach N − 1 − S + W > L,
                            so it is only suggested as a companion of a frequency scheme there (`alone=False`; the
                            reason shows the stack, e.g. apply(model, ['yarn:factor=4', 'string:...'])).
    dca                     chunk_size = ¾·L, local_size = L/8 (An et al. 2024, arXiv:2402.17463; ChunkLlama's
                            `replace_with_chunkllama` defaults).
    rerope                  window W = L/2 (Su 2023, kexue.fm/archives/9708: w = 256 on a 512-token model; the
                            bojone/rerope README runs w = 1024 at 4k): distances ≥ W collapse to W < L.
    leaky_rerope            W = L/4 and the smallest k (two decimals) with W + (N − 1 − W)/k ≤ L − 1, so every
                            relative position stays inside the window (Su 2023, same post).

Not suggested: longrope (its per-pair factors come from the LongRoPE search, not from a rule), and the schemes that
need training (alibi, nope, relative_bias, sinusoidal, learned_absolute, p_rope, a new rope_theta). For N ≤ L only
STRING is suggested: the model serves N as it was trained, and the extension schemes would only move it away from
that.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

from torch import nn

from . import validation as check
from .api import original_config, patch_state
from .discovery import find_target

FREQUENCY_SCHEMES = ("linear", "ntk", "dynamic", "yarn", "dynamic_yarn", "llama3")


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One scheme with the parameters its paper recommends for the target: `spec` is what `rope_patch.apply(model,
    spec)` and `rope-patch compare --schemes` take, `reason` says where the numbers come from, `alone` whether the
    scheme serves the target on its own (False: STRING beyond the window, which needs a frequency scheme with it)."""

    scheme: str
    params: dict
    spec: str
    reason: str
    alone: bool = True

    def __str__(self) -> str:
        return f"{self.spec}: {self.reason}"


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
    shipped = params.get("original_max_position_embeddings") or getattr(target.config, "original_max_position_embeddings", None)
    return int(shipped) if shipped and int(shipped) < window else window


def suggest(model: nn.Module, target_length: int) -> list[Suggestion]:
    """The training-free schemes with the parameters their papers recommend for serving `target_length` tokens on
    this model (module docstring: the rules and where they come from), each applicable with
    `rope_patch.apply(model, s.spec)`. Raises ValueError for a target below 2 tokens or beyond 1024 × L."""
    n = check.integer("suggest", "target_length", target_length, ge=2, le=check.POSITIONS_MAX,
                      hint="It is the context length N (tokens) the model should serve.")
    window = pretraining_window(model)
    high = check.FACTOR_RANGE[1]
    if n > high * window:
        raise ValueError(f"suggest: target_length {n} is {n / window:g}× the pre-training window L = {window}; the "
                         f"schemes support factors up to {high:g} (N ≤ {int(high * window)}). Choose a smaller target.")
    out = []
    string = _string(n, window)
    if n <= window:
        return [string] if string is not None else []
    s = n / window
    for name in FREQUENCY_SCHEMES:
        params, extra = {"factor": _round(s)}, ""
        if name == "dynamic":
            extra = f" (at ℓ = N dynamic NTK's effective factor is s·N/L − (s − 1) = {s * s - s + 1:.4g})"
        elif name in ("yarn", "dynamic_yarn"):
            fast = yarn_beta_fast(window)
            if fast != 32:
                params["beta_fast"] = _round(fast)
                extra = (f"; beta_fast = min(32, max(2, L/128)) = {fast:g}: pairs with wavelength < 128 tokens stay "
                         "unchanged, as with the paper's 32 at L = 4096")
            else:
                extra = "; beta_fast / beta_slow: the paper's 32 / 1"
        out.append(_make(name, params, f"factor = N/L = {n}/{window} = {s:g}{extra}"))
    for rule in (_self_extend, _dca, _rerope, _leaky_rerope):
        found = rule(n, window)
        if found is not None:
            out.append(found)
    if string is not None:
        out.append(string)
    return out


def yarn_beta_fast(window: int) -> float:
    """rope_patch's β_fast for a pre-training window L: min(32, max(2, L/128)) (module docstring)."""
    return float(min(32.0, max(2.0, window / 128)))


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


# ---- the rules ----------------------------------------------------------------------------------------------------
def _self_extend(n: int, window: int) -> Suggestion | None:
    w = max(2, window // 4)
    budget = Fraction(2 * window, 3)
    if w >= budget:
        return None
    g = max(1, math.ceil(Fraction(n - w) / (budget - w)))  # smallest G with W + (N − W)/G ≤ ⅔·L
    if g >= w:  # the paper's neighbour window holds whole groups: G < W
        return None
    reach = w + (n - w) / g
    return _make("self_extend", {"group_size": g, "window_size": w},
                 f"W = L/4 = {w}, smallest G with W + (N − W)/G ≤ ⅔·L: {w} + {n - w}/{g} = {reach:.1f} ≤ "
                 f"{float(budget):.1f} (Jin et al. 2024)")


def _string(n: int, window: int) -> Suggestion | None:
    w = max(1, min(128, window // 32))
    shift = max(w + 1, round(n / 3))
    if shift >= n:  # S ≥ N is plain RoPE: nothing to shift
        return None
    reach = n - 1 - shift + w
    params = {"shift_size": shift, "window_size": w}
    base = f"S = N/3 = {shift}, W = min(128, L/32) = {w} (An et al. 2024)"
    if n <= window:
        return _make("string", params, f"{base}: distances d ≥ S become d − S + W, the well-trained short ones; "
                                       f"N = {n} ≤ L = {window}, so it works on its own")
    spec = _make("string", params, "").spec
    return _make("string", params, f"{base}; N = {n} > L = {window}: its distances reach N − 1 − S + W = {reach}, so "
                                   "compose it with a frequency scheme (on its own it is not enough), e.g. "
                                   f"rope_patch.apply(model, ['yarn:factor={_round(n / window)!r}', '{spec}'])",
                 alone=False)


def _dca(n: int, window: int) -> Suggestion | None:
    chunk, local = window * 3 // 4, max(1, window // 8)
    if chunk <= local:
        return None
    return _make("dca", {"chunk_size": chunk, "local_size": local},
                 f"chunk_size = ¾·L = {chunk}, local_size = L/8 = {local} (An et al. 2024, ChunkLlama defaults)")


def _rerope(n: int, window: int) -> Suggestion | None:
    w = max(1, window // 2)
    return _make("rerope", {"window_size": w},
                 f"W = L/2 = {w}: distances ≥ W collapse to W, inside L = {window} (Su 2023)")


def _leaky_rerope(n: int, window: int) -> Suggestion | None:
    w = max(1, window // 4)
    if window - 1 - w <= 0:
        return None
    k = max(1.0, math.ceil(100 * (n - 1 - w) / (window - 1 - w)) / 100)  # W + (N − 1 − W)/k ≤ L − 1
    reach = w + (n - 1 - w) / k
    return _make("leaky_rerope", {"window_size": w, "factor": _round(k)},
                 f"W = L/4 = {w}, smallest k (2 decimals) with W + (N − 1 − W)/k ≤ L − 1: {w} + {n - 1 - w}/{k:g} = "
                 f"{reach:.1f} ≤ {window - 1} (Su 2023)")


def _round(x: float):
    return int(x) if float(x).is_integer() else float(x)


def _make(name: str, params: dict, reason: str, alone: bool = True) -> Suggestion:
    spec = f"{name}:" + ",".join(f"{k}={v!r}" for k, v in params.items())
    return Suggestion(name, dict(params), spec, reason, alone)
