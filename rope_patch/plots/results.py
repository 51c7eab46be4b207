"""Figures of results (`rope-patch compare` / sweeps), all drawn from `rope_patch.evaluation.results.read_results`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..evaluation.results import read_results
from . import style as S

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def results(source, window=None) -> Figure:
    """Redraw a compare/sweep run: perplexity vs length (log-log), passkey accuracy vs length, and perplexity by
    position inside the longest windows; panels without data are left out. `window` overrides the file's L."""
    res = source if isinstance(source, dict) and source.get("normalised") else read_results(source)
    L = window or res["window"]
    panels = []
    if any(r["perplexity"] is not None for r in res["records"]):
        panels.append("ppl")
    if any(r["passkey_accuracy"] is not None for r in res["records"]):
        panels.append("passkey")
    if res["buckets"]:
        panels.append("buckets")
    if not panels:
        raise ValueError("results: no perplexity, passkey or bucket values to plot.")
    fig, axes = S.figure(len(panels), width=5.4, height=4.2)
    color = {key: S.color(k) for k, (key, _) in enumerate(res["schemes"])}
    style = {key: S.STYLES[(k // 10) % 4] for k, (key, _) in enumerate(res["schemes"])}
    for ax, panel in zip(axes, panels, strict=True):
        for key, label in res["schemes"]:
            if panel == "buckets":
                rows = [b for b in res["buckets"] if b["scheme"] == key]
                longest = max((b["length"] or 0 for b in rows), default=0)
                rows = sorted((b for b in rows if (b["length"] or 0) == longest), key=lambda b: b["start"])
                if rows:
                    xs = [(b["start"] + b["end"]) / 2 for b in rows]
                    ax.plot(xs, [S.finite(b["perplexity"]) for b in rows], marker="o", markersize=3, color=color[key],
                            linestyle=style[key], label=label)
                continue
            rows = sorted((r for r in res["records"] if r["scheme"] == key), key=lambda r: r["length"])
            field = "perplexity" if panel == "ppl" else "passkey_accuracy"
            rows = [r for r in rows if r[field] is not None]
            if rows:
                ys = [S.finite(r[field]) for r in rows] if panel == "ppl" else [100 * r[field] for r in rows]
                ax.plot([r["length"] for r in rows], ys, marker="o", markersize=4, color=color[key],
                        linestyle=style[key], label=label)
                ci = [r for r in rows if r.get("passkey_ci_low") is not None] if panel == "passkey" else []
                if ci:  # Wilson 95% intervals of the pooled accuracy
                    ax.errorbar([r["length"] for r in ci], [100 * r[field] for r in ci],
                                yerr=[[100 * (r[field] - r["passkey_ci_low"]) for r in ci],
                                      [100 * (r["passkey_ci_high"] - r[field]) for r in ci]],
                                fmt="none", ecolor=color[key], elinewidth=0.8, capsize=2, alpha=0.7)
        xmax = max((x for line in ax.get_lines() for x in line.get_xdata()), default=None)
        ends = [b["end"] for b in res["buckets"]] if panel == "buckets" else []
        S.mark_window(ax, L, upto=max([xmax or 0, *ends]) or None)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(S.int_formatter())
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=7)
        if panel == "ppl":
            ax.set_yscale("log")
            S.plain_log_ticks(ax.yaxis)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("perplexity (log scale)")
            ax.set_title("Perplexity vs. context length", fontsize=10)
        elif panel == "passkey":
            ax.set_ylim(-3, 103)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("passkey accuracy (%)")
            ax.set_title("Passkey retrieval", fontsize=10)
        else:
            ax.set_yscale("log")
            S.plain_log_ticks(ax.yaxis)
            ax.set_xscale("linear")
            ax.xaxis.set_major_formatter(S.int_formatter())
            ax.set_xlabel("token position (bucket centre)")
            ax.set_ylabel("perplexity in bucket (log scale)")
            ax.set_title("Perplexity by position", fontsize=10)
    fig.suptitle(f"{res['name']}" + (f"  (original window L = {L:,})" if L else ""), fontsize=10)
    return fig


def _normalised(source) -> dict:
    return source if isinstance(source, dict) and source.get("normalised") else read_results(source)


def perplexity(source) -> Figure:
    """Perplexity vs. length (log-log), one line per scheme; the training window as a dashed line."""
    res = _normalised(source)
    fig, (ax,) = S.figure(1, width=6.4, height=4.2)
    for k, (key, label) in enumerate(res["schemes"]):
        rows = sorted((r for r in res["records"] if r["scheme"] == key and r["perplexity"] is not None),
                      key=lambda r: r["length"])
        ax.plot([r["length"] for r in rows], [S.finite(r["perplexity"]) for r in rows], marker="o", color=S.color(k),
                linestyle=S.STYLES[(k // 10) % len(S.STYLES)], label=label)
    lengths = sorted({r["length"] for r in res["records"]})
    S.mark_window(ax, res["window"], upto=max(lengths, default=None))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths)
    ax.xaxis.set_major_formatter(S.int_formatter())
    S.plain_log_ticks(ax.yaxis)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity (held-out)")
    ax.set_title(f"Perplexity vs. length - {res['name']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def passkey(source) -> Figure:
    """Passkey accuracy heatmaps, one panel per scheme: rows = needle depth, columns = prompt length. Each cell is
    annotated with its accuracy and, where the results have them, "k/n" and the Wilson 95% interval."""
    res = _normalised(source)
    cells = [p for p in res["passkey"] if p["depth"] is not None]
    if not cells:
        raise ValueError("passkey: the results hold no passkey cells (run compare with --passkey-lengths).")
    schemes = [s for s in res["schemes"] if any(p["scheme"] == s[0] for p in cells)]
    lengths = sorted({p["length"] for p in cells})
    depths = sorted({p["depth"] for p in cells})
    cols = min(len(schemes), 3)
    rows = math.ceil(len(schemes) / cols)
    fig = S.figure(1)[0]
    fig.set_size_inches(3.2 * cols + 0.8, 2.6 * rows + 0.6)
    fig.clear()
    axes = fig.subplots(rows, cols, squeeze=False)
    im = None
    for k, (key, label) in enumerate(schemes):
        ax = axes[k // cols][k % cols]
        grid = np.full((len(depths), len(lengths)), np.nan)
        notes: dict[tuple[int, int], str] = {}
        for p in cells:
            if p["scheme"] == key and p["accuracy"] is not None:
                at = (depths.index(p["depth"]), lengths.index(p["length"]))
                grid[at] = p["accuracy"]
                if p.get("n"):
                    notes[at] = f"{p['correct']:.0f}/{p['n']:.0f}"
                    if p.get("ci_low") is not None and p.get("ci_high") is not None:
                        notes[at] += f"\n[{100 * p['ci_low']:.0f}-{100 * p['ci_high']:.0f}]"
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(grid[i, j]):
                    note = notes.get((i, j))
                    ax.text(j, i, f"{100 * grid[i, j]:.0f}%" + (f"\n{note}" if note else ""), ha="center",
                            va="center", fontsize=8 if note is None else 6)
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_title(label, fontsize=9)
        if k % cols == 0:
            ax.set_ylabel("needle depth")
        if k // cols == rows - 1:
            ax.set_xlabel("length (tokens)")
    for k in range(len(schemes), rows * cols):
        axes[k // cols][k % cols].axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="passkey accuracy")
    annotated = any(p.get("n") for p in cells)
    fig.suptitle(f"Passkey retrieval - {res['name']}" + ("\ncells: accuracy, right/n, [Wilson 95% interval, %]"
                                                          if annotated else ""), fontsize=10 if not annotated else 9)
    return fig


FIGURE_FILES = ("perplexity.png", "passkey.png")  # what write_figures may write (checked writable before a run)


def write_figures(result, out_dir) -> dict[str, Path]:
    """perplexity.png (when perplexity ran: a sweep of passkey tasks alone has none) and passkey.png (when passkey
    ran) for a compare result in `out_dir`; returns {kind: path}."""
    res = _normalised(result)
    out = Path(out_dir)
    paths = {}
    if any(r["perplexity"] is not None for r in res["records"]):
        paths["perplexity_plot"] = S.save(perplexity(res), out / FIGURE_FILES[0], dpi=120)
    if any(p["depth"] is not None for p in res["passkey"]):
        paths["passkey_plot"] = S.save(passkey(res), out / FIGURE_FILES[1], dpi=120)
    return paths
