"""`fix_length(model, N)`: freeze a length-dependent RoPE at the frequencies of a known final length N.

Three schemes change their frequencies with the current sequence length ℓ = max(position_ids) + 1:

    dynamic       dynamic NTK (emozilla 2023): b′ = b·(s·ℓ/L − (s−1))^(d/(d−2)) for ℓ > L, b for ℓ ≤ L
    dynamic_yarn  YaRN with s(ℓ) = min(factor, max(1, ℓ/L)) (YaRN §3.3 dynamic scaling)
    longrope      LongRoPE (Ding et al. 2024): `short_factor` for ℓ ≤ L, `long_factor` for ℓ > L

so a prompt prefilled at ℓ = n and decoded to N runs under up to N − n + 1 different sets of frequencies, and the
KV cache mixes them (transformers #25104). When the final length N is known before the prefill (an evaluation that
generates a fixed number of tokens, a batch of documents of one length), `fix_length(model, N)` installs the
frequencies (and cos/sin scale) that a fresh length-N forward uses and stops them from following ℓ: every forward
then runs with them, so a prefill of n ≤ N tokens gives exactly the first n positions of a length-N forward, and
cached decoding up to N equals full recomputation at length N.

How: the frozen frequencies are computed the way the model's own update would compute them for ℓ = N (transformers'
ROPE_INIT_FUNCTIONS with `seq_len` for dynamic NTK and LongRoPE's long set, the `YarnLengthUpdate` for dynamic YaRN),
then put on every rotary module whose frequencies follow ℓ (a model may have several: Granite-SWA one per base)
through the patch's undo log: the `inv_freq` buffer (fp32, kept fp32 across casts by the patched rotary forward), the
cos/sin scale, `rope_type` = "default" (so transformers' `dynamic_rope_update` leaves the buffers alone) and a copy
of the patched rotary forward without its length update. `fix_length(model, None)` takes exactly those records back
out; `rope_patch.remove(model)` undoes them with the rest of the patch (bit-identical logits); applying another
scheme drops the fix with the old patch.

A fresh length-N forward means one with no history: transformers' dynamic NTK never shrinks its base while
sequences stay at or beyond L, so after a longer input its own frequencies for ℓ = N depend on what ran before; the
frozen ones do not.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from . import validation as check
from .api import current, patch_state
from .discovery import find_target
from .rotary import PatchedRotaryForward
from .schemes.frequency import LengthUpdate

FIX = "_length_fix"  # attribute of the PatchState: (N, index of the fix's first record)


@dataclasses.dataclass(frozen=True)
class LengthFix:
    """What `fix_length` did; true when it froze the frequencies.

    Attributes:
        length: the N the frequencies are frozen at (None: not fixed).
        fixed: whether frequencies were frozen (also the truth value of the object).
        reason: why, in one line (printable).
        previous: the N of the fix this one replaced (None: there was none).
    """

    length: int | None
    fixed: bool
    reason: str
    previous: int | None = None

    def __bool__(self) -> bool:
        return self.fixed


def fixed_length(model) -> int | None:
    """The N the model's frequencies are frozen at by `fix_length`, or None.

    Args:
        model: a model (or a wrapper of one), patched or not.

    Returns:
        The frozen length N, or None when no fix is in place.
    """
    state = patch_state(find_target(model))
    fix = getattr(state, FIX, None) if state is not None else None
    return None if fix is None else fix[0]


def length_dependent(model) -> list[str]:
    """The layer types ("" for a model with one RoPE for all its layers) whose frequencies follow the sequence length
    now, on any of the model's rotary modules."""
    types = []
    for rotary in find_target(model).rotaries:
        update = _length_update(vars(rotary).get("forward"))
        types += [lt or "" for lt, rt in rope_types(rotary).items() if update is not None or _varies(rt)]
    return list(dict.fromkeys(types))


def fix_length(model, length: int | None) -> LengthFix:
    """Freeze the frequencies of a length-dependent scheme (`dynamic`, `dynamic_yarn`, `longrope`, also under
    `cache_rotation="consistent"`) at those of a fresh `length`-token forward, before the prefill; returns a
    `LengthFix`. `length=None` releases a fix (the frequencies follow the length again, as before the fix).

    With the fix, a prefill of n ≤ N tokens equals the first n positions of a length-N forward, and cached decoding
    to N equals recomputation at N. Longer inputs also run with the frozen frequencies (they are not rescaled for
    their length). Reversible: `fix_length(model, None)` or `rope_patch.remove(model)` restore the model bit for bit;
    a second `fix_length` replaces the first. For schemes whose frequencies do not depend on the length (every
    other scheme, and an unpatched model with static RoPE) it changes nothing and says so (`fixed` False, `reason`).

    Args:
        model: a model patched by `rope_patch.apply` (or a wrapper of one).
        length: the final sequence length N (prompt + new tokens) the frequencies are frozen for; None releases a fix.

    Returns:
        A `LengthFix`: whether the frequencies were frozen, at which N, the N of a fix it replaced, and why.

    Raises:
        ValueError: N < 1 or beyond the largest position supported, or an unpatched model whose own RoPE depends on
            the length (a checkpoint that ships `dynamic` or `longrope`): the fix is recorded in a patch's undo log,
            so apply that scheme with `rope_patch.apply` first. The model is untouched on error.
        TypeError: a length that is not an integer.
    """
    if length is not None:
        length = check.integer("fix_length", "length", length, ge=1, le=check.POSITIONS_MAX,
                               hint="It is the final sequence length N (prompt + new tokens) the frequencies are "
                                    "frozen for; pass None to release a fix.")
    target = find_target(model)
    state = patch_state(target)
    if state is None:
        varying = [rt for rotary in target.rotaries for rt in rope_types(rotary).values() if _varies(rt)]
        if varying and length is not None:
            rope_type = varying[0]
            raise ValueError(
                f"fix_length: this unpatched model's own RoPE (rope_type {rope_type!r}) depends on the "
                "sequence length, and fix_length records its change in a rope_patch patch's undo log, "
                "which an unpatched model does not carry. Apply the scheme explicitly first "
                "(e.g. rope_patch.apply(model, 'dynamic', factor=...) or rope_patch.apply(model, 'longrope', "
                "short_factor=..., long_factor=...)), then call fix_length."
            )
        return LengthFix(None, False, "the model is not patched and its RoPE does not depend on the sequence length: "
                                      "nothing to fix")
    previous = _release(state)
    applied = current(model)
    name = str(applied) if applied.name == "stack" else applied.name
    if length is None:
        return LengthFix(None, False,
                         f"released the fix at {previous}" if previous is not None else "nothing was fixed",
                         previous)
    # Every rotary module of the model (one per base in Granite-SWA, per block kind in Blt, DeepSeek-V4's memory
    # rotaries): each one a patch put a patched forward on and whose frequencies follow ℓ, by its own length update
    # (dynamic_yarn) or by transformers' rope type (dynamic, longrope), is frozen.
    plans = []  # (rotary, its patched forward, its length update, its rope type per layer type, the varying ones)
    for rotary in target.rotaries:
        forward = vars(rotary).get("forward")
        update = _length_update(forward)
        by_type = rope_types(rotary)
        varying = [lt for lt, rt in by_type.items() if update is not None or _varies(rt)]
        if varying and isinstance(forward, PatchedRotaryForward):
            plans.append((rotary, forward, update, by_type, varying))
    if not plans:
        return LengthFix(None, False, f"{name}'s frequencies do not depend on the sequence length: nothing to fix",
                         previous)

    try:  # nothing touched yet (a fix this one replaces comes back on error)
        frozen = [{lt: _frequencies_at(rotary, update, lt, by_type[lt], length) for lt in varying}
                  for rotary, _, update, by_type, varying in plans]
    except BaseException:
        if previous is not None:
            fix_length(model, previous)
        raise
    start = len(state.records)
    try:
        for (rotary, forward, _, by_type, _), frequencies in zip(plans, frozen, strict=True):
            _freeze(state, rotary, forward, by_type, frequencies)
    except BaseException:
        _undo_from(state, start)
        raise
    setattr(state, FIX, (length, start))
    types = list(dict.fromkeys(lt for *_, varying in plans for lt in varying if lt is not None))
    kinds = f" (layer types {', '.join(types)})" if types else ""
    return LengthFix(length, True, f"{name}: frequencies frozen at those of a {length}-token forward{kinds}", previous)


def _freeze(state, rotary, forward: PatchedRotaryForward, by_type: dict, frozen: dict) -> None:
    """Install `frozen` ({layer type: (inv_freq, cos/sin scale)}) on `rotary` through the patch's undo log, with a copy
    of its patched `forward` that no longer follows the length."""
    masters = dict(forward.masters)
    for lt, (inv_freq, scaling) in frozen.items():
        prefix = f"{lt}_" if lt else ""
        state.set_buffer(rotary, f"{prefix}inv_freq", inv_freq)
        state.setattr(rotary, f"{prefix}attention_scaling", scaling)
        if f"{prefix}inv_freq" in masters:
            masters[f"{prefix}inv_freq"] = inv_freq
    new_types = {lt: ("default" if lt in frozen else rt) for lt, rt in by_type.items()}
    state.setattr(rotary, "rope_type", new_types if isinstance(rotary.rope_type, dict) else new_types[None])
    fixed = copy.copy(forward)  # every setting of the patched forward kept, without the length update
    fixed.masters, fixed.update = masters, None
    fixed.seen = fixed._buffers_now()
    state.setattr(rotary, "forward", fixed)


def _length_update(forward) -> LengthUpdate | None:
    """The length update a patched rotary forward runs before each call (dynamic_yarn's), or None. A table rotary's
    forward (GPT-J, CodeGen) runs an update too, `rotary.TableGrowth`, which only appends rows of the frequencies it
    holds past the last one: those do not follow the length."""
    update = getattr(forward, "update", None)
    return update if isinstance(update, LengthUpdate) else None


def rope_types(rotary) -> dict:
    """A rotary module's rope type per layer type ({None: type} for one RoPE for all its layers)."""
    # a table rotary (GPT-J, CodeGen) has no rope_type: it holds one fixed set of frequencies, as "default" does
    rope_type = getattr(rotary, "rope_type", "default")
    return dict(rope_type) if isinstance(rope_type, dict) else {None: rope_type}


def _varies(rope_type: str) -> bool:
    """transformers' `dynamic_rope_update` rule: the substring "dynamic", or "longrope"."""
    return "dynamic" in str(rope_type) or rope_type == "longrope"


def _frequencies_at(rotary, update, layer_type, rope_type: str, length: int) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32, cos/sin scale) of a fresh forward over `length` tokens, as the model's own update computes them
    (transformers 5.x `dynamic_rope_update`; rope_patch's `YarnLengthUpdate`)."""
    prefix = f"{layer_type}_" if layer_type else ""
    device = rotary._buffers[f"{prefix}inv_freq"].device
    kw = {"layer_type": layer_type} if layer_type else {}
    scaling = float(getattr(rotary, f"{prefix}attention_scaling"))
    if update is not None:  # dynamic_yarn: s = min(cap, max(1, N/L)), exactly as one forward at ℓ = N sets it
        inv_freq, scaling = update.frequencies(update.scale(torch.tensor([[length - 1]])), layer_type)
    elif "dynamic" in rope_type:
        # growth past the window: the init function with seq_len = max(position_ids) + 1 (a 0-d int64 tensor, as in
        # the forward); at or below it the unscaled start frequencies
        seq = ({"seq_len": torch.tensor(length, dtype=torch.int64, device=device)}
               if length > rotary.original_max_seq_len else {})
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](rotary.config, device, **seq, **kw)
    else:  # longrope: the long set beyond original_max_position_embeddings, else the short one (the start buffer)
        params = rotary.config.rope_parameters[layer_type] if layer_type else rotary.config.rope_parameters
        original = params["original_max_position_embeddings"]
        if length > original:
            inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](rotary.config, device, seq_len=original + 1, **kw)
        else:
            inv_freq = getattr(rotary, f"{prefix}original_inv_freq")
    return inv_freq.float().to(device, copy=True), float(scaling)


def _release(state) -> int | None:
    fix = getattr(state, FIX, None)
    if fix is None:
        return None
    _undo_from(state, fix[1])
    setattr(state, FIX, None)
    return fix[0]


def _undo_from(state, start: int) -> None:
    """Undo and drop the records from `start` on (the fix's), and the tensors they saved in the log."""
    records = state.records[start:]
    for record in reversed(records):
        record.undo(state)
        saved = getattr(record, "saved", None)
        if saved is not None:
            state._buffers.pop(saved, None)
    del state.records[start:]
