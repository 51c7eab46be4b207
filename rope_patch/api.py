"""apply / remove / patched / current: per-instance, reversible patching of one loaded model."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

from torch import nn

from .registry import get_scheme_class
from .schemes.base import Install, Scheme
from .target import Target, find_target
from .undo import UndoLog

_STATE = "_rope_patch_state"  # attribute on the model's rotary module (shared by ForCausalLM and its decoder)


@dataclass
class _State:
    scheme: Scheme
    install: Install  # kept so a failed replacement can put this patch back exactly
    log: UndoLog
    original: dict  # the unpatched config's RoPE fields, for saving a reloadable model


def _original(target: Target) -> dict:
    cfg = target.config
    return {"rope_parameters": copy.deepcopy(cfg.rope_parameters), "max_position_embeddings": cfg.max_position_embeddings}


def as_scheme(scheme, **params) -> Scheme:
    """A `Scheme` from a name plus parameters, or a `Scheme` object as it is."""
    if isinstance(scheme, Scheme):
        if params:
            raise TypeError(f"Pass parameters either in the Scheme object or as keywords, not both (got {sorted(params)}).")
        return scheme
    if isinstance(scheme, type) and issubclass(scheme, Scheme):
        return scheme.from_params(**params)
    return get_scheme_class(scheme).from_params(**params)


def _state(target: Target) -> _State | None:
    return vars(target.rotary).get(_STATE)


def apply(model, scheme="default", **params):
    """Patch the position encoding of this one model instance; returns `model` (unchanged wrapper).

    `scheme` is a registered name (see `list_schemes()`) or a `Scheme`; `params` use transformers'
    `rope_parameters` keys. Applying to a patched model replaces its scheme. On any error nothing is changed.
    """
    target = find_target(model)
    new = as_scheme(scheme, **params)
    old = _state(target)
    if old is not None:
        old.log.undo()  # schemes are defined relative to the unpatched model
        del vars(target.rotary)[_STATE]
    original = _original(target)
    try:
        resolved = new.resolve(target)
        install = resolved.prepare(target)
        log = UndoLog()
        try:
            install(log)
        except BaseException:
            log.undo()
            raise
    except BaseException:
        if old is not None:
            _reinstall(target, old)
        raise
    vars(target.rotary)[_STATE] = _State(resolved, install, log, original)
    return model


def _reinstall(target: Target, state: _State) -> None:
    log = UndoLog()
    state.install(log)
    vars(target.rotary)[_STATE] = _State(state.scheme, state.install, log, state.original)


def remove(model):
    """Undo the patch exactly (logits bit-identical to before `apply`); a no-op on an unpatched model."""
    target = find_target(model)
    state = _state(target)
    if state is not None:
        state.log.undo()
        del vars(target.rotary)[_STATE]
    return model


def original_config(model) -> dict:
    """`rope_parameters` and `max_position_embeddings` of the model as it was before any patch."""
    target = find_target(model)
    state = _state(target)
    return copy.deepcopy(state.original) if state is not None else _original(target)


def current(model) -> Scheme | None:
    """The applied scheme (with model-derived defaults filled in), or None."""
    state = _state(find_target(model))
    return None if state is None else state.scheme


def patch_modules(model) -> dict[str, nn.Module]:
    """Modules the applied scheme attached (learned position tables, bias tables), by qualified name in `model`'s
    unwrapped form; empty for frequency schemes."""
    target = find_target(model)
    state = _state(target)
    if state is None:
        return {}
    names = {id(m): n for n, m in target.model.named_modules()}
    return {f"{names[id(parent)]}.{name}".lstrip("."): child for parent, name, child in state.log.added_modules}


@contextlib.contextmanager
def patched(model, scheme="default", **params):
    """`with patched(model, "yarn", factor=4): ...` applies, then restores what was there before (also on error)."""
    target = find_target(model)
    before = _state(target)
    apply(model, scheme, **params)
    try:
        yield model
    finally:
        remove(model)
        if before is not None:
            _reinstall(target, before)
