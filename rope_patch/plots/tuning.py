"""The figure of a `rope-patch tune` search, drawn from its log JSON (rope_patch.tuning.log): the objective of every
evaluation by generation (evolutionary search) or by evaluation (grid / random search), with the best so far."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..tuning.log import load_log, rank
from . import style as S

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def search(source) -> Figure:
    """`source`: a search log dict or the path of one."""
    log = source if isinstance(source, dict) else load_log(source)
    records = [r for r in log.get("evaluations", []) if rank(r) < math.inf]
    if not records:
        raise ValueError("search plot: the log holds no evaluation with a finite objective.")
    settings = log.get("settings", {})
    by_generation = settings.get("method") == "evolution"
    fig, (ax,) = S.figure(1, width=6.4, height=4.2)
    xs = [r["generation"] if by_generation else r["index"] for r in records]
    ax.scatter(xs, [S.finite(r["objective"]) for r in records], s=10, alpha=0.45, color=S.color(0), label="evaluation")
    best, line = math.inf, []
    if by_generation:
        for g in sorted(set(xs)):
            best = min(best, *(r["objective"] for r in records if r["generation"] == g))
            line.append((g, best))
    else:
        for x, r in zip(xs, records, strict=True):
            best = min(best, r["objective"])
            line.append((x, best))
    ax.plot([p[0] for p in line], [p[1] for p in line], color=S.color(1), marker="o" if by_generation else None,
            markersize=4, label="best so far")
    ax.set_yscale("log")
    S.plain_log_ticks(ax.yaxis)
    ax.set_xlabel("generation" if by_generation else "evaluation")
    weight = settings.get("passkey_weight") or 0
    ax.set_ylabel("perplexity" + (f" × exp(−{weight:g}·passkey accuracy)" if weight else "")
                  + f" at {settings.get('target')} (tuning text)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8)
    fig.suptitle(f"{'evolutionary' if by_generation else settings.get('method', 'a')} search "
                 f"of {settings.get('scheme')} for {settings.get('target')} tokens "
                 f"(window {settings.get('window')}): {len(records)} evaluations",
                 fontsize=10)
    return fig


SEARCH_FIGURE = "search.png"


def write_search_figure(source, out_dir) -> Path:
    return S.save(search(source), Path(out_dir) / SEARCH_FIGURE)
