"""What every figure shares: the scheme list, colours and line styles, the window marker, axis formatters.

What is particular to a scheme is read from its class: a fixed style (`Scheme.plot_style`: vanilla RoPE is black),
length dependence (`Scheme.length_dependent`: drawn at the extended window, the length named in the legend).

matplotlib (~1 s to import) is imported where a figure is built (`figure`, `formatter`, `color`), so that the
`rope-patch` command line, which imports this package to build its parser, starts without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import analysis as A

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WINDOW_STYLE = dict(color="0.35", linestyle="--", linewidth=1.1, zorder=1)
ROPE_KEYS = ("head_dim", "rope_theta", "max_position_embeddings", "partial_rotary_factor", "model", "config",
              "layer_type")


def rope(kw: dict) -> dict:
    unknown = set(kw) - set(ROPE_KEYS) - {"seq_len"}
    if unknown:
        raise TypeError(f"unknown keyword(s) {sorted(unknown)}; RoPE keywords: {', '.join(ROPE_KEYS)}, seq_len.")
    return {k: v for k, v in kw.items() if v is not None}


def specs(schemes) -> list[A.AnalysisSpec]:
    if isinstance(schemes, (str, A.AnalysisSpec)) or not isinstance(schemes, Sequence):
        schemes = [schemes]
    if not schemes:
        raise ValueError("Give at least one scheme to plot (e.g. default yarn:8 linear:8).")
    return [A.as_spec(s) for s in schemes]


def color(k: int):
    from matplotlib import colormaps  # matplotlib: only when drawing (see the module docstring)

    cmap = colormaps["tab10"]
    return cmap(k % 10)


STYLES = ("-", "--", "-.", ":")


def style(k: int, spec: A.AnalysisSpec | None = None) -> dict:
    """The k-th scheme's colour and line style, or the scheme's own (`Scheme.plot_style`)."""
    own = spec.scheme.plot_style() if spec is not None else None
    return dict(own) if own is not None else {"color": color(k), "linestyle": STYLES[(k // 10) % len(STYLES)]}


def at_length(spec: A.AnalysisSpec, rope: dict, L) -> dict:
    """Length-dependent schemes are drawn at their extended window s·L unless seq_len is given."""
    if spec.scheme.length_dependent and rope.get("seq_len") is None:
        w = scheme_window(spec, L)
        if w:
            return {**rope, "seq_len": w}
    return rope


def label(spec: A.AnalysisSpec, rope: dict, seq_len=None) -> str:
    ell = seq_len if seq_len is not None else rope.get("seq_len")
    return spec.label + (f" @ ℓ = {ell:,}" if spec.scheme.length_dependent and ell else "")


def binned(x: np.ndarray, y: np.ndarray, bins: int = 400):
    """Dense curves on a log-x axis: per log-spaced bin the x (geometric centre), min, mean and max of y.
    Distances that fall alone in a bin keep their exact value."""
    edges = np.unique(np.geomspace(max(x.min(), 1.0), x.max() + 1, bins + 1).astype(np.int64))
    idx = np.searchsorted(edges, x, side="right") - 1
    xs, lo, mean, hi = [], [], [], []
    for b in np.unique(idx):
        sel = idx == b
        xs.append(float(np.exp(np.log(np.maximum(x[sel], 1e-9)).mean())))
        lo.append(y[sel].min())
        mean.append(y[sel].mean())
        hi.append(y[sel].max())
    return np.array(xs), np.array(lo), np.array(mean), np.array(hi)


def mark_window(ax, L, *, axis="x", text=True, upto=None):
    """The original training window L as a dashed line with a label (gid 'original-window' for tests). When L lies
    beyond the plotted data (`upto`), it is named in the legend instead of stretching the axis."""
    if L is None:
        return
    if upto is not None and L > upto * 1.05:
        ax.plot([], [], label=f"original window L = {L:,} (beyond this range)", **WINDOW_STYLE)
        return
    line = (ax.axvline if axis == "x" else ax.axhline)(L, label=f"original window L = {L:,}", **WINDOW_STYLE)
    line.set_gid("original-window")
    if text:
        if axis == "x":
            ax.annotate(f" L = {L:,}", xy=(L, 0.01), xycoords=("data", "axes fraction"), va="bottom", ha="left",
                        fontsize=8, color="0.3")
        else:
            ax.annotate(f"L = {L:,} ", xy=(1.0, L), xycoords=("axes fraction", "data"), va="bottom", ha="right",
                        fontsize=8, color="0.3")


def formatter(fn):
    from matplotlib.ticker import FuncFormatter  # matplotlib: only when drawing (see the module docstring)

    return FuncFormatter(fn)


def int_formatter():
    return formatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}")


def figure(ncols=1, width=6.6, height=4.3):
    from matplotlib.figure import Figure  # matplotlib: only when drawing (see the module docstring)

    fig = Figure(figsize=(width * ncols if ncols > 1 else width, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def title(fig, text, rope_note):
    fig.suptitle(f"{text}\n{rope_note}", fontsize=10)


def note(f: A.Frequencies) -> str:
    rot = f" (rotary dim {f.rotary_dim})" if f.rotary_dim != f.head_dim else ""
    window = f", L = {f.original_window:,}" if f.original_window else ""
    return f"head_dim {f.head_dim}{rot}, base b = {f.rope_theta:g}{window}"


def legend_label(f: A.Frequencies, label: str | None = None) -> str:
    extra = []
    if not f.rotates:
        extra.append("no rotation")
    if abs(f.attention_scaling - 1.0) > 1e-12:
        extra.append(f"cos/sin × {f.attention_scaling:.3g}")
    return (label or f.scheme) + (f" [{'; '.join(extra)}]" if extra else "")


def scheme_window(spec: A.AnalysisSpec, L: int | None) -> int | None:
    """The extended window a frequency scheme with a `factor` targets, factor × L (its original_max_position_embeddings
    or L); None for the others."""
    factor = spec.params.get("factor")
    if not spec.is_frequency or not factor:
        return None
    base = spec.params.get("original_max_position_embeddings") or L
    return int(factor * base) if base else None


def plain_log_ticks(axis):
    """Plain numbers on a log axis; minor ticks labelled 2 and 5 (all of them when the axis spans < 1.5 decades)."""

    def minor(v, _):
        lo, hi = sorted(axis.get_view_interval())
        narrow = lo > 0 and hi / lo < 30
        return f"{v:g}" if narrow or f"{v:.1g}"[0] in "25" else ""

    axis.set_major_formatter(formatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(formatter(minor))


def default_max_distance(specs, L):
    windows = [w for w in (scheme_window(s, L) for s in specs) if w]
    return max([*windows, 4 * L]) if L else 65536


def finite(x):
    """Plot inf/overflowing perplexities at the top of a log axis instead of dropping them."""
    return min(x, 1e6) if x is not None and not math.isnan(x) else np.nan


def save(fig: Figure, path, fmt: str | None = None, dpi: int = 150) -> Path:
    """Write `fig` as PNG or SVG (`fmt`, else the file extension, else PNG; a missing extension is added)."""
    path = Path(path)
    ext = path.suffix.lower().lstrip(".")
    fmt = (fmt or ext or "png").lower()
    if fmt not in ("png", "svg"):
        raise ValueError(f"Unsupported figure format {fmt!r}: use png or svg.")
    if ext != fmt:
        path = path.with_name(path.name + f".{fmt}") if not ext else path.with_suffix(f".{fmt}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=fmt, dpi=dpi, metadata={"Software": None} if fmt == "png" else {"Date": None})
    return path
