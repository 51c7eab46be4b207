"""A scheme as the analysis sees it: one resolved `Scheme` object plus the label legends show.

A stack (`yarn:4+string:...`) is analysed as the model runs it: θ′ from its frequency part (else the model's θ),
distances from its attention part, and its modifiers (logn) reported beside (`modifiers`).
"""

from __future__ import annotations

import dataclasses

from ..api import as_scheme
from ..schemes.base import Scheme
from ..schemes.frequency import FrequencyScheme
from ..schemes.stack import Modifier
from ..specs import parse_spec

# short parameter names in legends; a scheme's own (`Scheme.label_symbols`: leaky_rerope's factor is k) come first
_SHORT = {"factor": "s", "rope_theta": "b", "partial_rotary_factor": "p", "group_size": "G", "window_size": "W",
          "shift_size": "S", "original_max_position_embeddings": "L"}


@dataclasses.dataclass(frozen=True)
class AnalysisSpec:
    """A scheme as analysis sees it: canonical name, parameters, the Scheme object and a legend label."""

    name: str
    params: dict
    scheme: Scheme
    label: str = ""

    @property
    def frequency_scheme(self) -> FrequencyScheme | None:
        """What sets θ′: the scheme itself, a stack's frequency part, or None (the model's own θ)."""
        if isinstance(self.scheme, FrequencyScheme):
            return self.scheme
        return self.scheme.frequency if self.scheme.kind == "stack" else None

    @property
    def is_frequency(self) -> bool:
        return self.frequency_scheme is not None

    @property
    def modifiers(self) -> tuple:
        """The modifiers (logn) in the scheme or stack: they change the query temperature, not θ′ or the distances."""
        if isinstance(self.scheme, Modifier):
            return (self.scheme,)
        return self.scheme.modifiers if self.scheme.kind == "stack" else ()

    @property
    def keeps_rotation(self) -> bool:
        return self.scheme.keeps_rotation

    def param(self, key: str):
        """A parameter the analysis needs: the scheme's value, or a TypeError naming it when it is not set."""
        value = getattr(self.scheme, key, None)
        if value is None:
            raise TypeError(f"{self.name}: missing required parameter `{key}` for the analysis "
                            f"(e.g. {self.name}:{key}=4).")
        return value


def _fmt(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int) and value >= 100000 and value % 1000 == 0:
        return f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
    if isinstance(value, (list, tuple)):
        return f"[{len(value)}]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _label(obj: Scheme, params: dict) -> str:
    name = obj.name
    short = {**_SHORT, **obj.label_symbols}
    shown = [f"{short.get(k, k)}={_fmt(v)}" for k, v in params.items()
             if v is not None and k != "original_max_position_embeddings"]
    return f"{name} ({', '.join(shown)})" if shown else name


def as_spec(scheme, **params) -> AnalysisSpec:
    """Normalise a spec string ("yarn:8"), a name + params, a Scheme (object or class) or an AnalysisSpec.

    Unknown names raise ValueError with "Did you mean"; bad parameters raise the same errors as `apply()` (the
    scheme is built by the same registry and validated by the same `__post_init__`).
    """
    if isinstance(scheme, AnalysisSpec):
        if params:
            raise TypeError(f"Pass parameters either in the spec or as keywords, not both (got {sorted(params)}).")
        return scheme
    if isinstance(scheme, Scheme) or (isinstance(scheme, type) and issubclass(scheme, Scheme)):
        obj = as_scheme(scheme, **params)
        return AnalysisSpec(obj.name, obj.params(), obj, label_of(obj))
    if not isinstance(scheme, str):
        raise TypeError(
            f"A scheme must be a name or spec string ('yarn:8'), a rope_patch.Scheme or an AnalysisSpec; "
            f"got {type(scheme).__name__} {scheme!r}."
        )
    name, given = parse_spec(scheme)
    overlap = set(given) & set(params)
    if overlap:
        raise TypeError(f"{scheme!r}: parameter(s) {sorted(overlap)} given both in the spec and as keywords.")
    given.update(params)
    obj = as_scheme(name, **given)
    return AnalysisSpec(obj.name, obj.params(), obj, label_of(obj) if obj.kind == "stack" else _label(obj, given))


def label_of(obj: Scheme) -> str:
    """The legend label of a scheme object; a stack's parts joined by " + "."""
    if obj.kind == "stack":
        return " + ".join(label_of(p) for p in obj.schemes)
    return _label(obj, obj.params())
