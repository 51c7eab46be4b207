"""apply / remove / patched / current: per-instance, reversible patching of one loaded model.

Where the state lives: a patch is a `PatchState` module attached to the model's rotary module (which the causal-LM
wrapper and its decoder share) under the name `rope_patch`. It holds the applied scheme, the unpatched RoPE config
and the undo log. Being a module inside the model, it is copied by `copy.deepcopy`, pickled by `torch.save`, and
moved/cast by `model.to(...)` together with everything it refers to.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Iterator
from typing import Any, TypeVar

from torch import nn

from . import notices
from .discovery import NoRotary, PatchSite, find_target
from .registry import get_scheme_class
from .schemes.base import UNBOUNDED, Scheme
from .schemes.stack import Stack
from .specs import parse_spec
from .undo import UndoLog

M = TypeVar("M", bound=nn.Module)  # apply/remove return the object they were given (a peft wrapper stays one)
SchemeLike = str | Scheme | type[Scheme]  # a name or spec string ("yarn:4"), a Scheme, or a Scheme class

STATE = "rope_patch"  # child module of the rotary module holding the applied patch


class PatchState(UndoLog):
    """The applied scheme (model-derived defaults filled in), the unpatched RoPE fields of the config (for saving a
    reloadable model) and the undo log of everything the patch changed."""

    def __init__(self, scheme: Scheme, original: dict, window: int | None, table=None):
        super().__init__()
        self.scheme = scheme
        self.original = original
        self.window = window  # the context the scheme serves (None: unchanged), see context_window
        # a table rotary's layout as the patch found it (discovery.SinCosTable: its rows may be scaled now), else None
        self.table = table

    def extra_repr(self) -> str:
        return f"{self.scheme}, {super().extra_repr()}"


def _unpatched_rope_fields(target: PatchSite) -> dict:
    cfg = target.config
    # a table rotary's config (GPT-J, CodeGen) has no rope_parameters: its RoPE is the table the model builds at init
    return {"rope_parameters": copy.deepcopy(getattr(cfg, "rope_parameters", None)),
            "max_position_embeddings": getattr(cfg, "max_position_embeddings", None)}  # RecurrentGemma records none


def as_scheme(scheme: SchemeLike | list | tuple, **params: Any) -> Scheme:
    """A `Scheme` from a name or spec string (`"yarn"`, `"yarn:4"`, `"self_extend:group_size=4,window_size=1024"`,
    the grammar of the command line) plus keyword parameters, or a `Scheme` object as it is. A list of those, or a
    spec joined by `+` (`"yarn:4+logn"`), is a stack (schemes/stack.py); a list of one is that scheme.

    Args:
        scheme: a registered name or alias, a spec string, a `Scheme` object, a `Scheme` class, or a list of those
            (a stack).
        **params: the scheme's parameters (transformers' `rope_parameters` keys), for a name, a spec or a class.

    Returns:
        The scheme, validated but not yet resolved against a model (model-derived defaults are still None).

    Raises:
        ValueError: an unknown scheme name (with "Did you mean"), a value out of range, schemes that do not compose.
        TypeError: an unknown parameter, a value of the wrong type, a parameter given twice (in the spec and as a
            keyword), or keywords with a `Scheme` object or a stack.
    """
    if isinstance(scheme, (list, tuple)) or (isinstance(scheme, str) and "+" in scheme
                                             and parse_spec(scheme)[0] == "stack"):
        if params:
            raise TypeError(f"Pass each part's parameters in its own spec or Scheme when applying several schemes "
                            f"(got keywords {sorted(params)} for {scheme!r}).")
        return Stack.of(parse_spec(scheme)[1]["schemes"] if isinstance(scheme, str) else scheme)
    if isinstance(scheme, Scheme):
        if params:
            raise TypeError("Pass parameters either in the Scheme object or as keywords, not both "
                            f"(got {sorted(params)}).")
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


def patch_state(target: PatchSite) -> PatchState | None:
    """The patch on `target`'s rotary module (its scheme, undo log and original config), or None when unpatched."""
    state = target.rotary._modules.get(STATE)
    return state if isinstance(state, PatchState) else None


def _attach(target: PatchSite, state: PatchState) -> None:
    target.rotary._modules[STATE] = state


def _detach(target: PatchSite) -> None:
    target.rotary._modules.pop(STATE, None)


def apply(model: M, scheme: SchemeLike = "default", *, check: bool = True, **params: Any) -> M:
    """Patch the position encoding of this one model instance; returns `model` (unchanged wrapper).

    `scheme` is a registered name (see `list_schemes()`), a spec string such as `"yarn:4"`, or a `Scheme`; `params`
    use transformers' `rope_parameters` keys. Applying to a patched model replaces its scheme (schemes are defined
    relative to the model as loaded). On any error the model is left exactly as it was.

    Example:
        ```python
        rope_patch.apply(model, "yarn", factor=4.0, original_max_position_embeddings=4096)
        rope_patch.apply(model, "self_extend:group_size=4,window_size=1024")  # replaces the yarn patch
        rope_patch.apply(model, "yarn:4+logn")                                # a stack
        ```

    Args:
        model: a loaded causal LM of the LLaMA family (any model with a rotary embedding module), or a wrapper of one
            (a `PeftModel`): the base model inside is patched and the wrapper returned.
        scheme: a registered name or alias (`"yarn"`, `"pi"`), a spec string as on the command line (`"yarn:4"`,
            `"self_extend:group_size=4,window_size=1024"`), specs joined by `+` or a list of them (a stack: one
            frequency scheme, one attention-side scheme, modifiers), a `Scheme` object or a `Scheme` class.
        check: an attention-side scheme that runs its own attention function is first run side by side with the
            model's own layers at an identity setting (once per architecture and process,
            rope_patch/attention/plumbing.py) and refused if they differ; False skips that.
        **params: the scheme's parameters, transformers' `rope_parameters` keys (`factor`,
            `original_max_position_embeddings`, `beta_fast`, ...) and rope_patch's own (`window_size`,
            `group_size`, ...); model-derived defaults fill in the rest.

    Returns:
        `model` itself, patched (the same object, so `apply` can be chained or ignored).

    Raises:
        ValueError: an unknown scheme (with "Did you mean"), a value out of its range, parameters that contradict
            each other, schemes that do not compose, an architecture or backend the scheme cannot run on, a model
            whose rotary module holds no values yet (meta device). The model is left exactly as it was.
        TypeError: an unknown parameter, a value of the wrong type, or a model without a rotary embedding module.

    Warns:
        UserWarning: a scheme written to extend the context (self_extend, rerope, dca, sink, ...) whose sizes serve no
            input longer than the model's window (a neighbour window ≥ L, say); a scheme that replaces a shipped
            scaling with a shorter window; the learned tables of a replaced patch being discarded.
    """
    return _apply(model, as_scheme(scheme, **params), temporary=False, check=check)


def _apply(model: M, new: Scheme, *, temporary: bool, check: bool = True) -> M:
    """`apply`; `temporary` (patched()): the previous patch comes back afterwards, so its tables are not lost."""
    target = find_target(model)
    target.check = check
    _materialised(target)
    old = patch_state(target)
    trained = patch_modules(model) if old is not None and not temporary else {}
    if old is not None:
        old.undo()
        _detach(target)
        target = find_target(model)  # the config object is the model's own again
        target.check = check
    try:
        resolved = new.resolve(target)
        if target.table is not None:
            resolved = resolved.on_table(target)
        install = resolved.prepare(target)
        state = PatchState(resolved, _unpatched_rope_fields(target), resolved.served_window(target), target.table)
        try:
            target.config = state.private_config(target.model)
            install(state)  # the apply-time check runs here: a refused patch says nothing more
            _warn_unserved(target, resolved)
            _announce_window(target.model, state)
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
    if trained:
        _carry_tables(model, trained, keep=old.scheme == resolved)
    return model


def _warn_unserved(target: PatchSite, scheme: Scheme) -> None:
    """A scheme written to serve inputs past the window (it defines `served_length`) whose parameters serve none on
    this model (Self-Extend's neighbour window ≥ L, a DCA chunk ≥ L; in a stack, the frequency part's window): accepted,
    since it is exact, but it extends nothing, which the user should hear before a long run says so."""
    stacked = isinstance(scheme, Stack)
    part = scheme.attention if stacked else scheme
    if part is None or type(part).served_length is Scheme.served_length:
        return
    frequency = scheme.frequency if stacked else None
    extended = frequency.served_window(target) if frequency is not None else None
    window = extended or getattr(target.config, "max_position_embeddings", None)
    if not window or part.served_length(int(window)):
        return
    params = ", ".join(f"{k}={v}" for k, v in part.params().items())
    whose = f"{frequency.name}'s" if extended else f"{target.model_type}'s"
    notices.warn(
        f"rope_patch: {part.name} with {params} serves no input longer than {whose} window of {window} tokens: past "
        "it, the relative positions it rotates with reach ones the model was not trained on. Choose sizes below the "
        "window (rope_patch.suggest(model, length) gives some).")


def _carry_tables(model, trained: dict[str, nn.Module], *, keep: bool) -> None:
    """Re-applying the very scheme (e.g. after a backend switch) keeps its trained tables; another scheme or other
    parameters start from fresh ones, and say so, since a trained table is work."""
    fresh = patch_modules(model)
    if keep:
        for path, table in fresh.items():
            table.load_state_dict(trained[path].state_dict())
        return
    notices.warn(
        f"rope_patch: the learned tables of the previous patch ({', '.join(sorted(trained))}) were discarded; the "
        f"new patch starts from {'fresh tables' if fresh else 'none'}. Save them first with "
        "rope_patch.save_pretrained, or re-apply the same scheme and parameters to keep them.")


def _materialised(target: PatchSite) -> None:
    """A model built on the meta device (weights not loaded, `init_empty_weights`) has no frequencies yet: the
    rotary's buffers hold no values, so neither a patch's frequencies nor the undo log's copies of the model's would be
    real (and `to_empty` leaves them uninitialised). Refused; an offloaded model (device_map with offload: parameters
    on meta, brought in by accelerate's hooks) keeps real rotary buffers and is served."""
    meta = [name for r in target.rotaries for name, b in r.named_buffers() if b.device.type == "meta"]
    if meta:
        raise ValueError(
            f"rope_patch.apply: {target.model_type}'s rotary module holds no values yet (its {meta[0]!r} "
            "is on the meta device: the weights are not materialised). Load the model (from_pretrained, also with a "
            "device_map), or materialise it (to_empty + weight init) before applying a patch.")


def remove(model: M) -> M:
    """Undo the patch exactly (logits bit-identical to before `apply`); a no-op on an unpatched model.

    The model's modules get their original config object back, with the changes the user made to `model.config`
    while patched carried over (the fields the patch itself set revert).

    Args:
        model: a model patched by `apply` (or a wrapper of one), or any other model (then nothing happens).

    Returns:
        `model` itself, as it was before the first `apply` (the very tensors and attributes the patch replaced).
    """
    try:
        target = find_target(model)
    except NoRotary:  # no rotary module, so no patch: nothing to undo (GPT-2's learned positions)
        return model
    state = patch_state(target)
    if state is not None:
        state.undo()
        _detach(target)
    return model


def original_config(model: nn.Module) -> dict:
    """`rope_parameters` and `max_position_embeddings` of the model as it was before any patch."""
    target = find_target(model)
    state = patch_state(target)
    return copy.deepcopy(state.original) if state is not None else _unpatched_rope_fields(target)


def context_window(model: nn.Module) -> int:
    """The number of positions the (patched) model is meant to serve: the scheme's extended window (factor × the
    pre-training window; for an attention-side scheme the length its positions stay inside the window for, the
    scheme's `served_length`), else `config.max_position_embeddings`. Equal to `model.config.max_position_embeddings`
    for the schemes with a native form except `dynamic`, whose config keeps transformers' native form (scaling starts
    at max_position_embeddings); the config of the others keeps the unpatched window, so that a plain save reloads
    the unpatched model, and `generate` is told the served window instead (no "exceeded the model's predefined
    maximum length" reminder below it; its default length is capped there, not at the config's window).

    Args:
        model: a model (or a wrapper of one), patched or not.

    Returns:
        The context window in tokens (`dynamic_yarn`: factor × L; `self_extend`: (L − W)·G + W; `rerope`, `alibi`,
            `dca`, `sink`, ...: `rope_patch.schemes.base.UNBOUNDED`, transformers' integer for "no limit").

    Raises:
        TypeError: the model has no rotary embedding module to read a window from.
    """
    target = find_target(model)
    state = patch_state(target)
    if state is not None and state.window is not None:
        return state.window
    return int(target.config.max_position_embeddings)


class GenerateWindow:
    """`model._get_stopping_criteria` of a model whose patch serves more than its config announces (an
    attention-side scheme, `dynamic`, `dynamic_yarn`, a stack): transformers' own criteria (the class's method, called
    unchanged), with the window of the max-length criterion, the one its "exceeded the model's predefined maximum
    length" reminder compares with (config.max_position_embeddings), set to the served window, or None (no limit)
    for an unbounded scheme. The config itself keeps the unpatched window: a plain save must reload the unpatched
    model. Set on the instance through the undo log (remove() gives the class's method back); an object of a
    module-level class holding the model, so copies and pickles carry it."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        criteria = type(self.model)._get_stopping_criteria(self.model, *args, **kwargs)
        window = context_window(self.model)
        for criterion in criteria:
            if getattr(criterion, "max_position_embeddings", None) is not None:  # MaxLengthCriteria
                criterion.max_position_embeddings = (None if window >= UNBOUNDED
                                                     else max(window, criterion.max_position_embeddings))
        return criteria


class GenerateLength:
    """`model._prepare_generated_length` of such a model (see `GenerateWindow`): transformers' own (the class's
    method, called unchanged), then, where no length was asked for (generate's default of 20 new tokens), the cap it
    put on that default, config.max_position_embeddings, becomes the served window (none for an unbounded scheme).
    Without it an input longer than the config's window is refused ("Input length of input_ids is N, but
    `max_length` is set to L") where a natively extended model (yarn) continues it."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        method = type(self.model)._prepare_generated_length
        call = inspect.signature(method).bind(self.model, *args, **kwargs).arguments
        config, length = call.get("generation_config"), call.get("input_ids_length")
        default = getattr(config, "max_length", None)
        out = method(self.model, *args, **kwargs)
        # transformers caps only this case: has_default_max_length and no max_new_tokens (names read as 5.19 to 5.25
        # have them: a release that renames them gets its own behaviour, not an error)
        if (call.get("has_default_max_length") and getattr(out, "max_new_tokens", 0) is None
                and isinstance(default, int) and isinstance(length, int)):
            wanted = default + length
            window = context_window(self.model)
            out.max_length = wanted if window >= UNBOUNDED else min(wanted, max(window, out.max_length))
        return out


def _announce_window(model: nn.Module, state: PatchState) -> None:
    """Tell `generate` the served window where it exceeds what the model's config announces (`GenerateWindow`,
    `GenerateLength`)."""
    announced = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if state.window is None or announced is None or state.window <= announced:
        return
    for name, cover in (("_get_stopping_criteria", GenerateWindow), ("_prepare_generated_length", GenerateLength)):
        if callable(getattr(type(model), name, None)):
            state.setattr(model, name, cover(model))


def current(model: nn.Module) -> Scheme | None:
    """The applied scheme (with model-derived defaults filled in), or None.

    Args:
        model: a model (or a wrapper of one), patched or not.

    Returns:
        The `Scheme` applied now, with the defaults it took from the model filled in
            (`original_max_position_embeddings`, ...); a `Stack` for several schemes; None for an unpatched model.
            `apply(model, current(model))` re-applies it (after a backend switch, say).
    """
    state = patch_state(find_target(model))
    return None if state is None else state.scheme


def patch_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules the applied scheme attached (learned position tables, bias tables), by qualified name in `model`'s
    unwrapped form; empty for frequency schemes."""
    target = find_target(model)
    state = patch_state(target)
    if state is None:
        return {}
    names = {id(m): n for n, m in target.model.named_modules()}
    out = {}
    for parent, name, child in state.added_modules:
        path = f"{names[id(parent)]}.{name}".lstrip(".") if id(parent) in names else name
        out[path] = _in_effect(target.model, path, child)
    return out


def _in_effect(root: nn.Module, path: str, recorded: nn.Module) -> nn.Module:
    """The table the model uses now. peft's `modules_to_save` wraps a table and trains a copy (`merge_and_unload`
    then puts the copy in its place): that copy, not the original the undo log recorded, holds the trained values."""
    try:
        live = root.get_submodule(path)
    except AttributeError:
        return recorded
    if hasattr(live, "modules_to_save") and hasattr(live, "original_module"):  # peft ModulesToSaveWrapper
        # the module its forward runs: the first active adapter's copy, else (adapters disabled, or an active adapter
        # without a copy here) the original. Not `unload_and_optionally_merge_module(merge=False)`, which returned
        # the copy up to peft 0.21 and returns the original from 0.22 on.
        active = list(getattr(live, "active_adapters", None) or [])
        copies = live.modules_to_save
        if getattr(live, "disable_adapters", False) or not active or any(a not in copies for a in active):
            live = live.original_module
        else:
            live = copies[active[0]]
    return live if set(live.state_dict()) == set(recorded.state_dict()) else recorded


@contextlib.contextmanager
def patched(model: M, scheme: SchemeLike = "default", **params: Any) -> Iterator[M]:
    """`with patched(model, "yarn", factor=4): ...` applies, then restores what was there before (also on error).

    Args:
        model: as for `apply`.
        scheme: as for `apply`.
        **params: as for `apply`.

    Yields:
        `model`, patched for the duration of the block. On exit (also on an error) the patch is removed and the one
            the model carried before, if any, comes back with its learned tables.

    Raises:
        ValueError, TypeError: as `apply`, before the block runs.
    """
    before = patch_state(find_target(model))
    _apply(model, as_scheme(scheme, **params), temporary=True)
    try:
        yield model
    finally:
        _restore(model, before)


def _restore(model: nn.Module, before: PatchState | None) -> None:
    """Take a temporary patch off (`_apply(temporary=True)`) and put back the patch the model carried before it."""
    remove(model)
    if before is not None:
        # found while the model is unpatched: a table rotary (GPT-J) whose rows the old patch rescaled is known as a
        # rotary only by the patch state attached to it (discovery._table_rotaries), which is not there yet
        target = find_target(model)
        before.redo()
        _attach(target, before)


def refusal(model: nn.Module, scheme: SchemeLike, *, check: bool = True) -> ValueError | TypeError | None:
    """What `apply(model, scheme, check=check)` says of `scheme` on this model, without keeping the patch: the error it
    raises, or None where it accepts the scheme.

    The scheme is applied for a moment and taken off again: every apply-time check runs as in `apply`, the
    attention-side schemes' side-by-side check included (its verdict on a scheme that holds is kept for the process,
    so a later `apply` of the scheme does not run it again). Many refusals come before the model is touched (the
    scheme's `prepare`); the ones apply can only find on the installed patch (the patched rotary's first call, the
    side-by-side check) need the moment on the model. The model is left bit for bit as it was (`remove`'s guarantee),
    a patch it carried back in place with its learned tables. Warnings of the moment are not shown (`apply` shows them).

    Args:
        model: as for `apply`.
        scheme: as for `apply` (a name, a spec string, a `Scheme`, a list of them).
        check: as for `apply`: False skips the side-by-side check.

    Returns:
        The ValueError or TypeError `apply` would raise, or None.
    """
    before = patch_state(find_target(model))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _apply(model, as_scheme(scheme), temporary=True, check=check)
    except (ValueError, TypeError) as err:  # apply's refusals: the model is as it was (apply's guarantee)
        return err
    _restore(model, before)
    return None
