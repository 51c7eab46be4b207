"""apply / remove / patched / current: per-instance, reversible patching of one loaded model."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

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
            _install(target, old.scheme, old.install)
        raise
    vars(target.rotary)[_STATE] = _State(resolved, install, log)
    return model


def _install(target: Target, scheme: Scheme, install: Install) -> None:
    log = UndoLog()
    install(log)
    vars(target.rotary)[_STATE] = _State(scheme, install, log)


def remove(model):
    """Undo the patch exactly (logits bit-identical to before `apply`); a no-op on an unpatched model."""
    target = find_target(model)
    state = _state(target)
    if state is not None:
        state.log.undo()
        del vars(target.rotary)[_STATE]
    return model


def current(model) -> Scheme | None:
    """The applied scheme (with model-derived defaults filled in), or None."""
    state = _state(find_target(model))
    return None if state is None else state.scheme


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
            _install(target, before.scheme, before.install)
