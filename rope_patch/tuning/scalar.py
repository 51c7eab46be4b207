"""Grid and random search over a scheme's scalar parameters (Self-Extend group_size/window_size, STRING
shift_size/window_size, ReRoPE window_size, YaRN factor/beta_fast/beta_slow, dynamic factor, or any scheme's
parameters given explicitly).

A space maps a parameter to a list of values (grid: every combination, in the order given; random: a uniform
choice) or, for random search only, to a range (lo, hi): uniform integers when both ends are integers, else uniform
reals (rounded to 4 significant digits so that specs stay readable). Combinations a scheme refuses (STRING's S ≤ W,
YaRN's beta_fast ≤ beta_slow, ...) are logged with the scheme's message and rank last. A value that the scheme refuses
in every combination (a negative factor, a range ending at one) is no candidate but a mistake: `check_space` refuses
the space before the first evaluation, naming it and the scheme's reason.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from ..registry import canonical_name, did_you_mean, get_scheme_class, list_schemes
from .log import SearchLog, StopSearch

Space = dict[str, list | tuple]


def default_space(scheme: str, window: int, target: int) -> Space:
    """A small grid around each paper's recommendation for target N on a model of window L (s = N/L): the scheme
    class's `search_space(window, target)`, floats rounded to 4 decimals."""
    name = canonical_name(scheme)
    space = get_scheme_class(name).search_space(window, target)
    if space is None:
        having = sorted(n for n in list_schemes() if get_scheme_class(n).search_space(window, target) is not None)
        raise ValueError(f"no default search space for {name!r}; give one with --space KEY=V1,V2,... "
                         f"(defaults exist for {', '.join(having)}; longrope uses the evolutionary search).")
    return {k: [round(v, 4) if isinstance(v, float) else v for v in vs] for k, vs in space.items()}


def check_space(scheme: str, space: Space, method: str) -> None:
    known = get_scheme_class(scheme).param_names()
    for key, values in space.items():
        if key not in known:
            raise ValueError(f"{scheme} has no parameter {key!r} to search.{did_you_mean(key, known)} Parameters of "
                             f"{scheme!r}: {', '.join(known)}.")
        if isinstance(values, tuple):
            if method == "grid":
                raise ValueError(f"grid search needs a list of values for {key} (KEY=V1,V2,...), got the range "
                                 f"{values[0]}..{values[1]}; use --method random for ranges.")
            if not values[0] < values[1]:
                raise ValueError(f"the range of {key} must have lo < hi, got {values[0]}..{values[1]}.")
        elif not values:
            raise ValueError(f"no values given for {key}.")


def check_candidates(scheme: str, space: Space) -> None:
    """A space the user gave (`--space`), before the first evaluation: every candidate built with the scheme's own
    checks (its parameters alone, no model; a range by its two ends, between which the draws fall). A space with no
    accepted candidate, or a value refused in every combination, raises ValueError naming it and the scheme's
    reason. (The default spaces, grids around a paper's setting, may hold combinations a small window refuses: those
    are logged and rank last.)"""
    cls = get_scheme_class(scheme)
    ends = {k: list(v) if isinstance(v, tuple) else v for k, v in space.items()}
    points = grid_points(ends)
    refused: dict[int, str] = {}
    for i, point in enumerate(points):
        try:
            cls.from_params(**point)
        except (TypeError, ValueError) as err:
            refused[i] = str(err)
    if not refused:
        return
    if len(refused) == len(points):
        raise ValueError(f"--space: {scheme} refuses every candidate, e.g. {_spec(points[0])} "
                         f"({refused[0]}). Nothing was evaluated.")
    for key, values in ends.items():
        for value in values:
            with_it = [i for i, p in enumerate(points) if p[key] == value]
            if all(i in refused for i in with_it):
                what = "the range end" if isinstance(space[key], tuple) else "the candidate"
                raise ValueError(f"--space {key}={value!r}: {scheme} refuses {what} {key}={value!r} in every "
                                 f"combination ({refused[with_it[0]]}). Fix or drop that value; nothing was evaluated.")


def _spec(point: dict) -> str:
    return ",".join(f"{k}={v!r}" for k, v in point.items())


def grid_points(space: Space) -> list[dict]:
    keys = list(space)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(space[k] for k in keys))]


def random_points(space: Space, n: int, rng: random.Random) -> list[dict]:
    """`n` distinct points (fewer when the space has fewer)."""
    total = 1
    for values in space.values():
        total = total * len(values) if isinstance(values, list) else float("inf")
    out, seen = [], set()
    for _ in range(50 * n):
        if len(out) >= min(n, total):
            break
        point = {}
        for key, values in space.items():
            if isinstance(values, tuple):
                lo, hi = values
                point[key] = (rng.randint(lo, hi) if isinstance(lo, int) and isinstance(hi, int)
                              else float(f"{rng.uniform(lo, hi):.4g}"))
            else:
                point[key] = rng.choice(values)
        frozen = tuple(sorted(point.items()))
        if frozen not in seen:
            seen.add(frozen)
            out.append(point)
    return out


def scalar_search(log: SearchLog, objective: Callable[[dict], dict], points: list[dict],
                  spec: Callable[[dict], str]) -> str | None:
    """Evaluate every point through `log`; None when all ran, else the reason the budget stopped the search."""
    try:
        for point in points:
            log.evaluate(point, spec(point), lambda p=point: objective(p), generation=0, origin="point")
    except StopSearch as stop:
        return stop.reason
    return None
