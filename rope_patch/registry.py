"""Name -> scheme class registry, with aliases and "Did you mean" errors (lm-eval style)."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .schemes.base import Scheme

_SCHEMES: dict[str, type[Scheme]] = {}
_ALIASES: dict[str, str] = {}


def did_you_mean(name: str, options) -> str:
    """' Did you mean 'x'?' when `name` is close to one of `options`, else ''."""
    close = difflib.get_close_matches(str(name), list(options), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def register_scheme(cls: type[Scheme] | None = None, *, name: str | None = None, aliases: tuple[str, ...] = (),
                    override: bool = False):
    """Register a `Scheme` subclass under `name` (default: `cls.name`) and `aliases`.

    Usable as `@register_scheme` or `register_scheme(MyScheme, name="mine")`. Re-registering a taken name raises
    unless `override=True`, so a plugin cannot silently shadow a built-in.
    """

    def add(scheme_cls):
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


def canonical_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"A scheme name must be a str, got {type(name).__name__} {name!r}.")
    key = name.strip().lower().replace("-", "_")
    if key in _SCHEMES:
        return key
    if key in _ALIASES:
        return _ALIASES[key]
    raise ValueError(
        f"Unknown position-encoding scheme {name!r}.{did_you_mean(key, [*list_schemes(), *_ALIASES])} "
        f"Available: {', '.join(list_schemes())} (see rope_patch.list_schemes()); '+' stacks them (yarn:4+logn)."
    )


def get_scheme_class(name: str) -> type[Scheme]:
    return _SCHEMES[canonical_name(name)]


def list_schemes() -> list[str]:
    """Registered scheme names (aliases excluded), sorted. A class with `listed = False` (the `stack` of several
    schemes: a composition, not a scheme of its own) is registered, so that saved stacks resolve, but not listed."""
    return sorted(name for name, cls in _SCHEMES.items() if getattr(cls, "listed", True))


def aliases() -> dict[str, str]:
    """alias -> scheme name."""
    return dict(_ALIASES)
