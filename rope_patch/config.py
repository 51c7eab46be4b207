"""Parameter validation shared by all schemes.

Every check raises at `apply()` time, before the model is touched, with what was expected, what was found and
what to do (peft-style `__post_init__` validation; transformers only warns on most invalid RoPE values).
"""

from __future__ import annotations

import math
import numbers


def _where(scheme: str, key: str) -> str:
    return f"{scheme}: parameter `{key}`"


def number(scheme: str, key: str, value, *, gt=None, ge=None, le=None, hint: str = "") -> float:
    """A finite real number (bools rejected) within the given bounds, returned as float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_where(scheme, key)} must be a number, got {type(value).__name__} {value!r}. {hint}".strip())
    value = float(value)
    bounds = []
    if gt is not None and not value > gt:
        bounds.append(f"> {gt}")
    if ge is not None and not value >= ge:
        bounds.append(f">= {ge}")
    if le is not None and not value <= le:
        bounds.append(f"<= {le}")
    if bounds or not math.isfinite(value):
        raise ValueError(f"{_where(scheme, key)} must be finite and {' and '.join(bounds) or 'real'}, got {value!r}. {hint}".strip())
    return value


def integer(scheme: str, key: str, value, *, ge=None, hint: str = "") -> int:
    """An int (bools and non-integral floats rejected) >= `ge`."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_where(scheme, key)} must be an integer, got {type(value).__name__} {value!r}. {hint}".strip())
    value = int(value)
    if ge is not None and value < ge:
        raise ValueError(f"{_where(scheme, key)} must be >= {ge}, got {value}. {hint}".strip())
    return value


def boolean(scheme: str, key: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{_where(scheme, key)} must be True or False, got {type(value).__name__} {value!r}.")
    return value


def number_list(scheme: str, key: str, value, *, gt=None) -> tuple[float, ...]:
    """A non-empty sequence of numbers, returned as a tuple (hashable, so schemes stay frozen)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{_where(scheme, key)} must be a list of numbers, got {type(value).__name__} {value!r}.")
    items = list(value.tolist() if hasattr(value, "tolist") else value)
    if not items:
        raise ValueError(f"{_where(scheme, key)} must not be empty.")
    return tuple(number(scheme, f"{key}[{i}]", v, gt=gt) for i, v in enumerate(items))


def choice(scheme: str, key: str, value, options) -> str:
    if value not in options:
        from .registry import did_you_mean

        raise ValueError(
            f"{_where(scheme, key)} must be one of {', '.join(map(repr, options))}, got {value!r}."
            f"{did_you_mean(value, options)}"
        )
    return value
