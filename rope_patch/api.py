"""apply / remove / patched / current: per-instance, reversible patching of one loaded model.

Where the state lives: a patch is a `PatchState` module attached to the model's rotary module (which the causal-LM
wrapper and its decoder share) under the name `rope_patch`. It holds the applied scheme, the unpatched RoPE config
and the undo log. Being a module inside the model, it is copied by `copy.deepcopy`, pickled by `torch.save`, and
moved/cast by `model.to(...)` together with everything it refers to.
"""

from __future__ import annotations

import contextlib
import copy

from torch import nn

from .registry import get_scheme_class
from .schemes.base import Scheme
from .specs import parse_spec
from .target import Target, find_target
from .undo import UndoLog

STATE = "rope_patch"  # child module of the rotary module holding the applied patch


class PatchState(UndoLog):
    """The applied scheme (model-derived defaults filled in), the unpatched RoPE fields of the config (for saving a
    reloadable model) and the undo log of everything the patch changed."""

    def __init__(self, scheme: Scheme, original: dict, window: int | None):
        super().__init__()
        self.scheme = scheme
        self.original = original
        self.window = window  # the context the scheme serves (None: unchanged), see context_window

    def extra_repr(self) -> str:
        return f"{self.scheme}, {super().extra_repr()}"


def _original(target: Target) -> dict:
    cfg = target.config
    return {"rope_parameters": copy.deepcopy(cfg.rope_parameters), "max_position_embeddings": cfg.max_position_embeddings}


def as_scheme(scheme, **params) -> Scheme:
    """A `Scheme` from a name or spec string (`"yarn"`, `"yarn:4"`, `"self_extend:group_size=4,window_size=1024"`,
    the grammar of the command line) plus keyword parameters, or a `Scheme` object as it is."""
    if isinstance(scheme, Scheme):
        if params:
            raise TypeError(f"Pass parameters either in the Scheme object or as keywords, not both (got {sorted(params)}).")
        return scheme
    if isinstance(scheme, type) and issubclass(scheme, Scheme):
        return scheme.from_params(**params)
    if isinstance(scheme, str) and ":" in scheme:
        name, given = parse_spec(scheme)
        clash = sorted(set(given) & set(params))
        if clash:
            raise TypeError(f"{scheme!r} sets {', '.join(clash)} already; pass each parameter once.")
        return get_scheme_class(name).from_params(**given, **params)
    return get_scheme_class(scheme).from_params(**params)


def _state(target: Target) -> PatchState | None:
    state = target.rotary._modules.get(STATE)
    return state if isinstance(state, PatchState) else None


def _attach(target: Target, state: PatchState) -> None:
    target.rotary._modules[STATE] = state


def _detach(target: Target) -> None:
    target.rotary._modules.pop(STATE, None)


def apply(model, scheme="default", **params):
    """Patch the position encoding of this one model instance; returns `model` (unchanged wrapper).

    `scheme` is a registered name (see `list_schemes()`), a spec string such as `"yarn:4"`, or a `Scheme`; `params`
    use transformers' `rope_parameters` keys. Applying to a patched model replaces its scheme (schemes are defined
    relative to the model as loaded). On any error the model is left exactly as it was.
    """
    target = find_target(model)
    new = as_scheme(scheme, **params)
    old = _state(target)
    if old is not None:
        old.undo()
        _detach(target)
        target = find_target(model)  # the config object is the model's own again
    try:
        resolved = new.resolve(target)
        install = resolved.prepare(target)
        state = PatchState(resolved, _original(target), resolved.served_window(target))
        try:
            target.config = state.private_config(target.model)
            install(state)
            state.seal()
        except BaseException:
            state.undo()
            raise
    except BaseException:
        if old is not None:
            old.redo()
            _attach(target, old)
        raise
    _attach(target, state)
    return model


def remove(model):
    """Undo the patch exactly (logits bit-identical to before `apply`); a no-op on an unpatched model.

    The model's modules get their original config object back, with the changes the user made to `model.config`
    while patched carried over (the fields the patch itself set revert)."""
    target = find_target(model)
    state = _state(target)
    if state is not None:
        state.undo()
        _detach(target)
    return model


def original_config(model) -> dict:
    """`rope_parameters` and `max_position_embeddings` of the model as it was before any patch."""
    target = find_target(model)
    state = _state(target)
    return copy.deepcopy(state.original) if state is not None else _original(target)


def context_window(model) -> int:
    """The number of positions the (patched) model is meant to serve: the scheme's extended window (factor × the
    pre-training window), else `config.max_position_embeddings`. Equal to `model.config.max_position_embeddings`
    except for `dynamic`, whose config keeps transformers' native form (scaling starts at max_position_embeddings)."""
    target = find_target(model)
    state = _state(target)
    if state is not None and state.window is not None:
        return state.window
    return int(target.config.max_position_embeddings)


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
    return {f"{names[id(parent)]}.{name}".lstrip("."): child for parent, name, child in state.added_modules}


@contextlib.contextmanager
def patched(model, scheme="default", **params):
    """`with patched(model, "yarn", factor=4): ...` applies, then restores what was there before (also on error)."""
    before = _state(find_target(model))
    apply(model, scheme, **params)
    try:
        yield model
    finally:
        remove(model)
        if before is not None:
            before.redo()
            _attach(find_target(model), before)
