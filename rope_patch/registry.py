"""Name -> scheme class registry, with aliases and "Did you mean" errors (lm-eval style).

The built-in schemes register themselves when rope_patch.schemes is imported; every lookup here imports it first,
so the registry is complete however the package was entered (`import rope_patch` itself imports nothing heavy).
"""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .schemes.base import Scheme

_SCHEMES: dict[str, type[Scheme]] = {}
_ALIASES: dict[str, str] = {}
_BUILTINS = {"loaded": False}


def _load_builtins() -> None:
    """Import rope_patch.schemes (torch) once, which registers the built-in schemes. Imported on first use, not at
    module level: the registry sits below the schemes, and the command line parses its arguments without torch."""
    if _BUILTINS["loaded"]:
        return
    _BUILTINS["loaded"] = True  # first: the scheme modules call register_scheme while they are being imported
    try:
        importlib.import_module("rope_patch.schemes")
    except BaseException:
        _BUILTINS["loaded"] = False
        raise


def did_you_mean(name: str, options) -> str:
    """' Did you mean 'x'?' when `name` is close to one of `options`, else ''."""
    close = difflib.get_close_matches(str(name), list(options), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def register_scheme(cls: type[Scheme] | None = None, *, name: str | None = None, aliases: tuple[str, ...] = (),
                    override: bool = False):
    """Register a `Scheme` subclass under `name` (default: `cls.name`) and `aliases`.

    Usable as `@register_scheme` or `register_scheme(MyScheme, name="mine")`. Re-registering a taken name raises
    unless `override=True`, so a plugin cannot silently shadow a built-in. `registry.unregister_scheme(name)` undoes
    it (a test or a notebook that registered a scheme of its own).

    Args:
        cls: the `Scheme` subclass (a frozen dataclass of its parameters); omitted when used as `@register_scheme(...)`
            with keywords.
        name: the name to register it under (default: the class's `name`, which is then set to it).
        aliases: more names that resolve to it (beside the class's own `aliases` when `name` is not given).
        override: take a name that is registered already (the built-in's class is replaced for this process).

    Returns:
        The class itself (so it works as a decorator), or the decorator when `cls` is omitted.

    Raises:
        TypeError: `cls` is not a `Scheme` subclass.
        ValueError: the class has no name, or a name or alias is taken and `override` is False.
    """

    def add(scheme_cls):
        _load_builtins()  # a user's scheme is checked against the built-in names before it takes one
        # The Scheme protocol checked by its methods: the registry sits below schemes/ (which register into it).
        if not (isinstance(scheme_cls, type) and all(callable(getattr(scheme_cls, m, None))
                                                      for m in ("from_params", "resolve", "prepare", "param_names"))):
            raise TypeError(f"register_scheme expects a subclass of rope_patch.Scheme, got {scheme_cls!r}.")
        key = name or scheme_cls.name
        if not key:
            raise ValueError(f"{scheme_cls.__name__} has no `name`; pass register_scheme(..., name='my_scheme').")
        names = [key, *aliases, *(scheme_cls.aliases if name is None else ())]
        for n in names:
            taken = _SCHEMES.get(n) or _SCHEMES.get(_ALIASES.get(n, ""))
            if taken is not None and taken is not scheme_cls and not override:
                raise ValueError(
                    f"Scheme name {n!r} is already registered to {taken.__name__}; "
                    "choose another name or pass override=True."
                )
        scheme_cls.name = key
        _SCHEMES[key] = scheme_cls
        for alias in names[1:]:
            _ALIASES[alias] = key
        return scheme_cls

    return add if cls is None else add(cls)


def unregister_scheme(name: str) -> None:
    """Remove the scheme registered under `name` (or an alias of it), with its aliases: what a test or a notebook
    that registered a scheme of its own does afterwards. A no-op for a name that is not registered."""
    key = _ALIASES.get(normalise_name(name), normalise_name(name))
    if _SCHEMES.pop(key, None) is not None:
        for alias in [a for a, target in _ALIASES.items() if target == key]:
            del _ALIASES[alias]


def normalise_name(name: str) -> str:
    """How a given scheme name is looked up: `Self-Extend ` -> `self_extend`."""
    if not isinstance(name, str):
        raise TypeError(f"A scheme name must be a str, got {type(name).__name__} {name!r}.")
    return name.strip().lower().replace("-", "_")


def unknown_scheme(name: str, listed: list[str], aliases: Iterable[str], see: str = "rope_patch.list_schemes()"
                   ) -> ValueError:
    """The error for a name that is no registered scheme (the registry's; the command line's name table's, which
    points to `rope-patch list`)."""
    return ValueError(
        f"Unknown position-encoding scheme {name!r}.{did_you_mean(normalise_name(name), [*listed, *aliases])} "
        f"Available: {', '.join(listed)} (see {see}); '+' stacks them (yarn:4+logn)."
    )


def canonical_name(name: str) -> str:
    key = normalise_name(name)
    _load_builtins()
    if key in _SCHEMES:
        return key
    if key in _ALIASES:
        return _ALIASES[key]
    raise unknown_scheme(name, list_schemes(), _ALIASES)


def get_scheme_class(name: str) -> type[Scheme]:
    return _SCHEMES[canonical_name(name)]


def param_names(name: str) -> list[str]:
    """The parameter names of scheme `name` (or alias), in the class's order."""
    return get_scheme_class(name).param_names()


def bare_param(name: str) -> str | None:
    """The parameter the bare VALUE of the spec `name:VALUE` sets (the class's `bare_param`), None when the scheme
    has no such parameter (then it takes no bare value)."""
    cls = get_scheme_class(name)
    return cls.bare_param if cls.bare_param in cls.param_names() else None


def list_schemes() -> list[str]:
    """Registered scheme names (aliases excluded), sorted. A class with `listed = False` (the `stack` of several
    schemes: a composition, not a scheme of its own) is registered, so that saved stacks resolve, but not listed.

    Returns:
        The names `apply` takes, sorted (`rope_patch.registry.aliases()` maps the aliases to them).
    """
    _load_builtins()
    return sorted(name for name, cls in _SCHEMES.items() if getattr(cls, "listed", True))


def registered() -> dict[str, type[Scheme]]:
    """Every registered name -> class, the unlisted (`stack`) included."""
    _load_builtins()
    return dict(_SCHEMES)


def aliases() -> dict[str, str]:
    """alias -> scheme name."""
    _load_builtins()
    return dict(_ALIASES)
