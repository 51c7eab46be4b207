"""LM-Infinite: a Λ-shaped attention with a distance limit, declared as two regions (attention/geometry.py).

Han, Wang, Peng, Ji & Wang 2024, "LM-Infinite: Zero-Shot Extreme Length Generalization for Large Language Models"
(NAACL 2024, arXiv:2308.16137); reference code Glaciohound/LM-Infinite, read at a0ce64c (`models/llama.py`'s
`use_lambda_mask` path, `models/lambda_attention.py`). The authors' `top_k_attention` variant (the last query row of
some layers also reads its top-k middle keys) is a data-dependent choice per step, not a geometry: not provided.
"""

from __future__ import annotations

import dataclasses

from .. import attention
from .. import validation as check
from ..registry import register_scheme
from .base import UNBOUNDED, Suggestion
from .positions import Affine, TwoRegion, required


@register_scheme
@dataclasses.dataclass(frozen=True)
class LmInfinite(TwoRegion):
    """LM-Infinite (Han et al. 2024, arXiv:2308.16137): each query reads its last `local_size` tokens at their true
    distances (the local branch) and the first `global_size` tokens at distance `max_distance` (the global branch:
    the query rotated at D, the key not rotated); every other key is hidden. D defaults to `local_size`, the
    authors' setting (local branch = distance limit = the pretraining window)."""

    name = "lm_infinite"
    aliases = ("lminfinite", "lambda_attention", "lm_inf")
    bare_param = "local_size"
    label_symbols = {"global_size": "G", "local_size": "W", "max_distance": "D"}
    local_size: int | None = None
    global_size: int = 100
    max_distance: int | None = None

    @classmethod
    def search_space(cls, window, target):
        return {"local_size": [window // 2, window], "global_size": [10, 100]}

    @classmethod
    def suggestion(cls, n, window):
        """The authors' setting: local branch = the pretraining window L, 10 global tokens (their setting past 32k);
        the limit D = L − 1, one below theirs (L), so every distance is one the model was trained on."""
        params = {"local_size": window, "global_size": 10, "max_distance": window - 1}
        return None if n <= window or window < 2 else Suggestion.of(
            cls.name, params, f"W = L = {window}, 10 global tokens, D = L − 1 = {window - 1} (Han et al. 2024)")

    def __post_init__(self):
        n, high = self.name, check.WINDOW_RANGE[1]
        self._set("local_size", required(n, "local_size", self.local_size, "the local branch in tokens, e.g. 4096",
                                          (2, high), "The local branch counts tokens (the pretraining window)."))
        self._set("global_size", check.integer(n, "global_size", self.global_size, ge=0, le=high,
                                               hint="The number of first tokens every query reads (10–100)."))
        limit = self.local_size if self.max_distance is None else self.max_distance
        self._set("max_distance", check.integer(n, "max_distance", limit, ge=1, le=self.local_size,
                                                hint="The global branch's distance D ≤ local_size (the authors' "
                                                     "code rotates a larger D per call, not per query)."))

    def split(self):
        return self.local_size

    def far_positions(self):
        return Affine(0, self.max_distance), Affine(0, 0)

    def geometry(self):
        near, far = super().geometry().regions
        return attention.Geometry((near, dataclasses.replace(far, first=self.global_size)))

    def served_length(self, window):
        # the largest relative position is max(W − 1, D) whatever the length
        return UNBOUNDED if max(self.local_size - 1, self.max_distance) <= window - 1 else None
