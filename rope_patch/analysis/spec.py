"""A scheme as the analysis sees it: one resolved `Scheme` object plus the label legends show."""

from __future__ import annotations

import dataclasses

from ..api import as_scheme
from ..schemes.base import Scheme
from ..schemes.frequency import FrequencyScheme
from ..specs import parse_spec

_SHORT = {"factor": "s", "rope_theta": "b", "partial_rotary_factor": "p", "group_size": "G", "window_size": "W",
          "shift_size": "S", "original_max_position_embeddings": "L"}
_SHORT_BY_SCHEME = {"leaky_rerope": {"factor": "k"}}


@dataclasses.dataclass(frozen=True)
class AnalysisSpec:
    """A scheme as analysis sees it: canonical name, parameters, the Scheme object and a legend label."""

    name: str
    params: dict
    scheme: Scheme
    label: str = ""

    @property
    def is_frequency(self) -> bool:
        return isinstance(self.scheme, FrequencyScheme)

    @property
    def keeps_rotation(self) -> bool:
        return self.scheme.keeps_rotation

    def param(self, key: str):
        """A parameter the analysis needs: the scheme's value, or a TypeError naming it when it is not set."""
        value = getattr(self.scheme, key, None)
        if value is None:
            raise TypeError(f"{self.name}: missing required parameter `{key}` for the analysis (e.g. {self.name}:{key}=4).")
        return value


def _fmt(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int) and value >= 100000 and value % 1000 == 0:
        return f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
    if isinstance(value, (list, tuple)):
        return f"[{len(value)}]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _label(name: str, params: dict) -> str:
    short = {**_SHORT, **_SHORT_BY_SCHEME.get(name, {})}
    shown = [f"{short.get(k, k)}={_fmt(v)}" for k, v in params.items() if v is not None and k != "original_max_position_embeddings"]
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
        obj = _single(as_scheme(scheme, **params))
        return AnalysisSpec(obj.name, obj.params(), obj, _label(obj.name, obj.params()))
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
    obj = _single(as_scheme(name, **given))
    return AnalysisSpec(obj.name, obj.params(), obj, _label(obj.name, given))


def _single(obj: Scheme) -> Scheme:
    """The analysis describes one scheme's positions and frequencies; a stack (yarn:8+logn) is refused, naming its
    parts to analyse one at a time."""
    parts = getattr(obj, "schemes", None)
    if obj.kind == "stack" and parts:
        raise ValueError(f"The analysis describes one scheme at a time; {' + '.join(p.name for p in parts)} is a stack. "
                         f"Analyse its parts separately ({', '.join(p.name for p in parts)}).")
    return obj
