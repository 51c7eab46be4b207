"""Figures of `rope_patch.analysis` and of compare/sweep results (matplotlib, no pyplot state).

Every function returns a `matplotlib.figure.Figure` built with the object-oriented API (no global pyplot figure,
no backend switch: saving goes through Agg/SVG by the file format), so they are safe in scripts, notebooks and
tests alike. `save(fig, path, fmt)` writes PNG or SVG.

    style.py    shared by every figure      theory.py   rope_patch.analysis as figures
    results.py  compare / sweep results     memory.py   size estimates of the dense figures
    tuning.py   a `rope-patch tune` search log       tasks.py    a sweep's lm-eval task scores (RULER, ...)

    from rope_patch import plots
    fig = plots.decay(["default", "yarn:8", "linear:8"], head_dim=128, rope_theta=10000, max_position_embeddings=4096)
    plots.save(fig, "decay.png")

The RoPE numbers are given as in `rope_patch.analysis` (`head_dim`, `rope_theta`, `max_position_embeddings` = the
original window L, `partial_rotary_factor`, or `config=` / `model=`); every plot marks L (grey dashed line, gid
"original-window").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..registry import did_you_mean
from .memory import MEMORY_LIMIT, figure_memory, plot_bytes
from .results import FIGURE_FILES, passkey, perplexity, results, write_figures
from .style import save
from .tasks import tasks, write_tasks_figure
from .theory import angles, decay, distance, frequencies, score, wavelengths
from .tuning import SEARCH_FIGURE, search, write_search_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["FIGURE_FILES", "KINDS", "SEARCH_FIGURE", "MEMORY_LIMIT", "angles", "decay", "distance", "figure_memory",
           "frequencies", "make", "passkey",
           "perplexity", "plot_bytes", "results", "save", "score", "search", "tasks", "wavelengths", "write_figures",
           "write_search_figure", "write_tasks_figure"]

KINDS = {"decay": decay, "wavelengths": wavelengths, "frequencies": frequencies, "angles": angles,
         "distance": distance, "score": score}


def make(kind: str, schemes=None, **kw) -> Figure:
    """`make("decay", ["default", "yarn:8"], head_dim=128, ...)`; `make("results", path)` for result files."""
    if kind == "results":
        return results(schemes, window=kw.get("window"))
    if kind not in KINDS:
        raise ValueError(f"Unknown plot kind {kind!r}.{did_you_mean(kind, [*KINDS, 'results'])} "
                         f"Kinds: {', '.join([*KINDS, 'results'])}.")
    return KINDS[kind](schemes, **kw)
