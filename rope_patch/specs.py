"""Scheme specs: the one-string form of a scheme that every command line, the evaluation and `apply()` accept.

    yarn                                 name only (aliases allowed: pi, ntk_aware, ...)
    yarn:8                               name:VALUE sets the scheme's `bare_param` (factor for most)
    default:500000                       ... rope_theta for default, group_size for self_extend, ...
    yarn:factor=8,beta_fast=16           name:key=value,... with transformers' rope_parameters keys
    longrope:short_factor=1/1.5/2        a `/`-separated value is a list
    yarn:4+logn                          `+` stacks schemes (one frequency, one attention-side, modifiers)

`parse_spec` gives (canonical name, params) without building anything; `parse_scheme_spec` builds the Scheme
through the registry (the same class and the same validation as `apply()`). This module depends on the registry
only, so that `api` can import it. `parse_spec(spec, names=scheme_names)` reads the names from the generated name
table instead of the scheme classes: the command line checks its arguments with it before importing torch.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol

from . import registry

if TYPE_CHECKING:
    from .schemes.base import Scheme


class SchemeNames(Protocol):
    """Where the spec grammar reads scheme names from: the registry (the classes) or rope_patch.scheme_names (the
    table generated from them, readable without torch)."""

    def canonical_name(self, name: str) -> str: ...

    def param_names(self, name: str) -> list[str]: ...

    def bare_param(self, name: str) -> str | None:
        """The parameter the bare VALUE of `name:VALUE` sets (the class's `bare_param`), None when it takes none."""
        ...


_FORMS = "Specs look like `yarn`, `yarn:8` or `yarn:factor=8,beta_fast=16`."
# `+` between two specs stacks them (yarn:4+logn); a `+` inside a number (default:1e+6) is followed by a digit.
_JOIN = re.compile(r"\+(?=\s*[A-Za-z_])")
# A `+` with nothing after it (yarn:4+, yarn:4++logn); not the sign of an exponent (default:1e+).
_EMPTY_PART = re.compile(r"(?<![0-9][eE])\+\s*(?:$|(?=\+))")
# Where an item holds another parameter: `a=1;b=2`, `a=1 b=2` (the ',' that should separate them).
_SEPARATOR = re.compile(r"\s*;\s*|\s+(?=[A-Za-z_]\w*\s*=)")


def parse_value(text: str):
    """`8` -> 8, `0.5` -> 0.5, `true` -> True, `1/1.5/2` -> [1, 1.5, 2]; anything else stays a string (the scheme's
    own validation then says what it expected). How every value of a spec is read (and lm-eval's model_args)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if "/" in text:  # lists for longrope: short_factor=1/1.5/2
        return [parse_value(t) for t in text.split("/")]
    return text


def parse_spec(spec: str, *, names: SchemeNames | None = None) -> tuple[str, dict]:
    """`yarn:8` -> ("yarn", {"factor": 8}); `pi:factor=4` -> ("linear", {"factor": 4}).

    Checks the form (name, positional value, keys); the values are checked when the Scheme is built. Raises
    ValueError (unknown name, with "Did you mean"; malformed items) or TypeError (not a string; a positional value
    for a scheme that has no positional parameter). `names`: where the names come from (default: the registry).
    """
    names = registry if names is None else names
    if not isinstance(spec, str):
        raise TypeError(f"A scheme spec must be a str such as 'yarn:8', got {type(spec).__name__} {spec!r}.")
    if _EMPTY_PART.search(spec):
        raise ValueError(f"Scheme spec {spec!r} has an empty part after '+': a stack joins whole specs, e.g. "
                         "`yarn:4+logn`; drop the '+' or add the scheme to stack.")
    parts = _JOIN.split(spec)
    if len(parts) > 1:  # yarn:4+logn: a stack; each part is checked as a spec of its own
        for part in parts:
            if not part.strip():
                raise ValueError(f"Scheme spec {spec!r} has an empty part around '+'. Stacks look like `yarn:4+logn`.")
            parse_spec(part, names=names)
        return "stack", {"schemes": [part.strip() for part in parts]}
    name, _, rest = spec.strip().partition(":")
    if not name.strip():
        raise ValueError(f"Scheme spec {spec!r} has no scheme name. {_FORMS}")
    name = names.canonical_name(name)
    if any(c in rest for c in "[]()"):
        # `short_factor=[1,1.5,2]`: the commas inside would split it into items (and read `1.5` as a second
        # positional value, "sets 'factor' twice"): say how a list is written instead.
        raise ValueError(f"Scheme spec {spec!r}: a list is written with '/' between its values and no brackets, e.g. "
                         f"{name + ':' + _slashed(rest)!r} (commas separate parameters). {_FORMS}")
    params: dict = {}
    items = [part.strip() for part in rest.split(",")]
    previous = None  # the key of the item before, when it was `key=value`: a bare value after it may be a list item
    for item in items:
        if not item:
            continue
        key, eq, text = (s.strip() for s in item.partition("="))
        if ";" in item or "=" in text:
            raise ValueError(f"Scheme spec {spec!r}: parameters are separated by ',', e.g. "
                             f"{name + ':' + _SEPARATOR.sub(',', rest).strip(',')!r}. {_FORMS}")
        if eq:
            if not key:
                raise ValueError(f"Scheme spec {spec!r}: {item!r} has no parameter name before '='. {_FORMS}")
            if not text:
                raise ValueError(f"Scheme spec {spec!r}: parameter {key!r} has no value after '='. {_FORMS}")
        elif previous is not None and previous == names.bare_param(name):
            # `dpe:group_sizes=4,4`: the second 4 is the bare value, which sets group_sizes a second time; the user
            # meant a list, which is written with '/'
            raise ValueError(f"Scheme spec {spec!r} sets {previous!r} twice: commas separate parameters, so {item!r} "
                             f"after {previous}=... is read as a value of its own. A list value is joined with '/': "
                             f"{name + ':' + _joined(items)!r}.")
        else:
            key, text = _bare(spec, name, names), key
        if key in params:
            raise ValueError(f"Scheme spec {spec!r} sets {key!r} twice.")
        params[key] = parse_value(text)
        previous = key if eq else None
    return name, params


def _joined(items: list[str]) -> str:
    """`['group_sizes=4', '4', 'window_size=64']` -> `group_sizes=4/4,window_size=64`: bare values after a
    `key=value` item joined to it as list items."""
    out: list[str] = []
    for item in filter(None, items):
        if "=" not in item and out and "=" in out[-1]:
            out[-1] += f"/{item}"
        else:
            out.append(item)
    return ",".join(out)


def _slashed(rest: str) -> str:
    """`short_factor=[1, 1.5],factor=4` -> `short_factor=1/1.5,factor=4`: the bracketed lists of a spec in '/' form."""
    return re.sub(r"[\[(]([^\])]*)[\])]",
                  lambda m: "/".join(v.strip() for v in m.group(1).split(",") if v.strip()), rest)


def _bare(spec: str, name: str, names: SchemeNames) -> str:
    """The parameter a bare value sets, or the TypeError for a scheme that takes none."""
    key = names.bare_param(name)
    if key is None:
        known = names.param_names(name)
        raise TypeError(f"Scheme spec {spec!r}: {name} takes no positional value; "
                        + (f"name the parameter, e.g. {name}:{known[0]}=... (parameters: {', '.join(known)})."
                           if known else f"it has no parameters, write {name!r}."))
    return key


def parse_scheme_spec(spec: str) -> Scheme:
    """`yarn`, `yarn:8` (factor), `yarn:factor=8,beta_fast=16`, `default:500000` (rope_theta) -> a Scheme.

    Raises ValueError/TypeError with the same messages as `apply()` (unknown names and keys with "Did you mean").
    """
    name, params = parse_spec(spec)
    return registry.get_scheme_class(name).from_params(**params)


def stack_parts(spec: str) -> list[str]:
    """The specs a `+` stack joins (`yarn:4+logn` -> [`yarn:4`, `logn`]), or [spec]; names and keys checked."""
    name, params = parse_spec(spec)
    return list(params["schemes"]) if name == "stack" and "+" in spec else [spec.strip()]


def is_bare(spec: str) -> bool:
    """Whether a single scheme's spec is its name alone (`yarn`, `pi`): what `rope-patch compare --target` sizes."""
    return not parse_spec(spec)[1]


def scheme_label(spec: str) -> str:
    """Display form: `yarn:8` -> `yarn×8`; other specs as given."""
    return spec.replace(":", "×", 1) if spec.count(":") == 1 and "=" not in spec else spec
