"""Every built-in scheme once: its family, a small valid parameter set on the tiny models, and what the suites need to
know about it. The suites that run "every scheme" (test_ownership, schemes/test_attention, test_rotation_math,
test_stateful, test_composition) take their list from here, and tests/test_scheme_table.py checks that the rows are
exactly the registered built-in schemes: a new scheme fails there until it has its row (and is then tested by every
suite), and a scheme that disappears fails there too.

A row's `params` suit every tiny model of helpers.models (head_dim 16: longrope takes head_dim/2 = 8 factors per list)
and sequences of 3·WINDOW = 96 tokens: the window-like sizes are below that, so the far region is exercised.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rope_patch
from helpers.models import WINDOW, logits, tiny_model, token_batch


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    family: str  # the class's `kind`: "frequency", "attention" or "modifier"
    params: dict
    # what rope_patch.suggest gives for a target N > L: "factor" (s = N/L, the frequency schemes' rule), "own" (a
    # rule of the scheme's own: window / group / chunk sizes), None (not suggested: searched, or needs training)
    suggest: str | None = None

    @property
    def spec(self) -> str:
        """The row as a spec string (`yarn:factor=4`; lists `/`-separated)."""
        def text(v):
            return "/".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

        return self.name + (":" + ",".join(f"{k}={text(v)}" for k, v in self.params.items()) if self.params else "")


SCHEMES = [
    Row("default", "frequency", {"rope_theta": 500_000}),
    Row("linear", "frequency", {"factor": 2}, suggest="factor"),
    Row("ntk", "frequency", {"factor": 4}, suggest="factor"),
    Row("dynamic", "frequency", {"factor": 4}, suggest="factor"),
    Row("yarn", "frequency", {"factor": 4}, suggest="factor"),
    Row("dynamic_yarn", "frequency", {"factor": 4}, suggest="factor"),
    Row("llama3", "frequency", {"factor": 4}, suggest="factor"),
    Row("longrope", "frequency", {"factor": 4, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}),
    Row("p_rope", "frequency", {"partial_rotary_factor": 0.5}),
    Row("alibi", "attention", {}),
    Row("nope", "attention", {}),
    Row("relative_bias", "attention", {"init": "alibi", "num_buckets": 16, "max_distance": 64}),
    Row("sinusoidal", "attention", {}),
    Row("learned_absolute", "attention", {"max_position_embeddings": 4 * WINDOW}),
    Row("self_extend", "attention", {"group_size": 4, "window_size": 16}, suggest="own"),
    Row("self_extend_logistic", "attention", {"group_size": 6, "window_size": 16, "growth_rate": 0.5}, suggest="own"),
    Row("rerope", "attention", {"window_size": 16}, suggest="own"),
    Row("leaky_rerope", "attention", {"window_size": 16, "factor": 4.0}, suggest="own"),
    Row("string", "attention", {"shift_size": 16, "window_size": 4}, suggest="own"),
    Row("dca", "attention", {"chunk_size": 24, "local_size": 4}, suggest="own"),
    Row("dpe", "attention", {"group_sizes": [3, 1, 4, 8], "window_size": 16}, suggest="own"),
    Row("ms_poe", "attention", {"min_ratio": 1.2, "max_ratio": 1.8, "skip_layers": 1}),  # 2-layer models: skip one
    Row("sink", "attention", {"window_size": 16, "sink_size": 4}, suggest="own"),
    Row("lm_infinite", "attention", {"local_size": 16, "global_size": 4, "max_distance": 12}, suggest="own"),
    Row("logn", "modifier", {}),
]
BY_NAME = {row.name: row for row in SCHEMES}


def rows(family: str | None = None, *, without: tuple[str, ...] = ()) -> list[Row]:
    """The rows of one family (None: all), less the names in `without` (each must be a row: a suite's exclusion of a
    scheme that no longer exists fails here)."""
    unknown = sorted(set(without) - set(BY_NAME))
    assert not unknown, f"not in tests/helpers/schemes.py: {unknown}"
    return [r for r in SCHEMES if (family is None or r.family == family) and r.name not in without]


def cases(family: str | None = None, *, without: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """(name, params) pairs for `pytest.mark.parametrize("scheme,params", ...)`."""
    return [(r.name, dict(r.params)) for r in rows(family, without=without)]


def names(family: str | None = None, *, without: tuple[str, ...] = ()) -> list[str]:
    return [r.name for r in rows(family, without=without)]


def refused_at_apply(scheme: str, params: dict, error: type, words: str) -> None:
    """apply() refuses `params` with `error` matching `words`, and the model is left exactly as it was."""
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, _ = token_batch(40, 0, 0)
    before = logits(model, ids)
    with pytest.raises(error, match=words):
        rope_patch.apply(model, scheme, **params)
    assert rope_patch.current(model) is None and torch.equal(logits(model, ids), before)
