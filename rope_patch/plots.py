"""Figures of `rope_patch.analysis` and of compare/sweep results (matplotlib, no pyplot state).

Every function returns a `matplotlib.figure.Figure` built with the object-oriented API (no global pyplot figure,
no backend switch: saving goes through Agg/SVG by the file format), so they are safe in scripts, notebooks and
tests alike. `save(fig, path, fmt)` writes PNG or SVG.

    from rope_patch import plots
    fig = plots.decay(["default", "yarn:8", "linear:8"], head_dim=128, rope_theta=10000, max_position_embeddings=4096)
    plots.save(fig, "decay.png")

The RoPE numbers are given as in `rope_patch.analysis` (`head_dim`, `rope_theta`, `max_position_embeddings` = the
original window L, `partial_rotary_factor`, or `config=` / `model=`); every plot marks L (grey dashed line, gid
"original-window").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import analysis as A
from .registry import did_you_mean

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# matplotlib (~1 s to import) is imported where a figure is built (_figure, _formatter, _color), so that the
# `rope-patch` command line and `figure_memory` start without it.

__all__ = ["KINDS", "MEMORY_LIMIT", "angles", "decay", "distance", "figure_memory", "frequencies", "make",
           "plot_bytes", "read_results", "results", "save", "score", "wavelengths"]

WINDOW_STYLE = dict(color="0.35", linestyle="--", linewidth=1.1, zorder=1)
_ROPE_KEYS = ("head_dim", "rope_theta", "max_position_embeddings", "partial_rotary_factor", "model", "config",
              "layer_type")


def _rope(kw: dict) -> dict:
    unknown = set(kw) - set(_ROPE_KEYS) - {"seq_len"}
    if unknown:
        raise TypeError(f"unknown keyword(s) {sorted(unknown)}; RoPE keywords: {', '.join(_ROPE_KEYS)}, seq_len.")
    return {k: v for k, v in kw.items() if v is not None}


def _specs(schemes) -> list[A.AnalysisSpec]:
    if isinstance(schemes, (str, A.AnalysisSpec)) or not isinstance(schemes, Sequence):
        schemes = [schemes]
    if not schemes:
        raise ValueError("Give at least one scheme to plot (e.g. default yarn:8 linear:8).")
    return [A.as_spec(s) for s in schemes]


def _color(k: int):
    from matplotlib import colormaps  # matplotlib: only when drawing (see the imports)

    cmap = colormaps["tab10"]
    return cmap(k % 10)


_STYLES = ("-", "--", "-.", ":")


def _style(k: int, spec: A.AnalysisSpec | None = None) -> dict:
    if spec is not None and _is_vanilla(spec):
        return {"color": "black", "linestyle": "-"}
    return {"color": _color(k), "linestyle": _STYLES[(k // 10) % len(_STYLES)]}


def _is_vanilla(spec: A.AnalysisSpec) -> bool:
    return spec.name == "default" and spec.params.get("rope_theta") is None


_LENGTH_DEPENDENT = ("dynamic", "dynamic_yarn", "longrope")


def _at_length(spec: A.AnalysisSpec, rope: dict, L) -> dict:
    """Length-dependent schemes are drawn at their extended window s·L unless seq_len is given."""
    if spec.name in _LENGTH_DEPENDENT and rope.get("seq_len") is None:
        w = _scheme_window(spec, L)
        if w:
            return {**rope, "seq_len": w}
    return rope


def _label(spec: A.AnalysisSpec, rope: dict, seq_len=None) -> str:
    ell = seq_len if seq_len is not None else rope.get("seq_len")
    return spec.label + (f" @ ℓ = {ell:,}" if spec.name in _LENGTH_DEPENDENT and ell else "")


def _binned(x: np.ndarray, y: np.ndarray, bins: int = 400):
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


def _mark_window(ax, L, *, axis="x", text=True, upto=None):
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


def _formatter(fn):
    from matplotlib.ticker import FuncFormatter  # matplotlib: only when drawing (see the imports)

    return FuncFormatter(fn)


def _int_formatter():
    return _formatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}")


def _figure(ncols=1, width=6.6, height=4.3):
    from matplotlib.figure import Figure  # matplotlib: only when drawing (see the imports)

    fig = Figure(figsize=(width * ncols if ncols > 1 else width, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _title(fig, text, rope_note):
    fig.suptitle(f"{text}\n{rope_note}", fontsize=10)


def _note(f: A.Frequencies) -> str:
    rot = f" (rotary dim {f.rotary_dim})" if f.rotary_dim != f.head_dim else ""
    window = f", L = {f.original_window:,}" if f.original_window else ""
    return f"head_dim {f.head_dim}{rot}, base b = {f.rope_theta:g}{window}"


def _legend_label(f: A.Frequencies, label: str | None = None) -> str:
    extra = []
    if not f.rotates:
        extra.append("no rotation")
    if abs(f.attention_scaling - 1.0) > 1e-12:
        extra.append(f"cos/sin × {f.attention_scaling:.3g}")
    return (label or f.scheme) + (f" [{'; '.join(extra)}]" if extra else "")


def _scheme_window(spec: A.AnalysisSpec, L: int | None) -> int | None:
    """The extended window a frequency scheme targets, factor × L (its original_max_position_embeddings or L)."""
    factor = spec.params.get("factor")
    if not spec.is_frequency or not factor or spec.name in ("default", "p_rope"):
        return None
    base = spec.params.get("original_max_position_embeddings") or L
    return int(factor * base) if base else None


# ------------------------------------------------------------------------------------------------------------------
def frequencies(schemes, **rope) -> Figure:
    """θ′_i per pair (log y) and the per-pair interpolation factor θ_i/θ′_i; the pair whose wavelength equals L
    (pairs right of it never complete a turn inside the original window) is marked. Dynamic NTK / LongRoPE are
    drawn at their extended window s·L unless `seq_len` is given."""
    rope = _rope(rope)
    specs = _specs(schemes)
    base = A.frequencies("default", **_no_len(rope))
    L = base.original_window
    fig, (ax, ax2) = _figure(2)
    for k, spec in enumerate(specs):
        kw = _at_length(spec, rope, L)
        f = A.frequencies(spec, **kw)
        i = np.arange(f.inv_freq.numel())
        theta = f.inv_freq.double().numpy()
        st = _style(k, spec)
        label = _legend_label(f, _label(spec, kw))
        if f.rotates:
            ax.plot(i, np.where(theta > 0, theta, np.nan), marker=".", markersize=3, label=label, **st)
            ax2.plot(i, np.where(theta > 0, f.interpolation.numpy(), np.nan), marker=".", markersize=3,
                     label=_label(spec, kw), **st)
        else:
            ax.plot([], [], label=label, **st)
    _mark_pair(ax, base)
    _mark_pair(ax2, base, text=False)
    ax.set_yscale("log")
    ax.set_xlabel("pair index i (dimensions 2i, 2i+1 of the head)")
    ax.set_ylabel("angular frequency θ′ᵢ (rad / token)")
    ax.set_title("Frequencies after the scheme", fontsize=10)
    ax.legend(fontsize=7, loc="lower left")
    ax2.set_yscale("log")
    ax2.set_xlabel("pair index i")
    ax2.set_ylabel("interpolation factor θᵢ / θ′ᵢ")
    ax2.set_title("Which pairs are interpolated (1 = kept, s = fully interpolated)", fontsize=10)
    _plain_log_ticks(ax2.yaxis)
    ax2.legend(fontsize=7, loc="upper left")
    for a in (ax, ax2):
        a.grid(True, which="both", alpha=0.25)
    _title(fig, "RoPE frequencies per pair", _note(base))
    return fig


def _no_len(rope: dict) -> dict:
    return {k: v for k, v in rope.items() if k != "seq_len"}


def _plain_log_ticks(axis):
    """Plain numbers on a log axis; minor ticks labelled 2 and 5 (all of them when the axis spans < 1.5 decades)."""

    def minor(v, _):
        lo, hi = sorted(axis.get_view_interval())
        narrow = lo > 0 and hi / lo < 30
        return f"{v:g}" if narrow or f"{v:.1g}"[0] in "25" else ""

    axis.set_major_formatter(_formatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(_formatter(minor))


def _mark_pair(ax, f: A.Frequencies, text=True):
    """Vertical line at the (fractional) pair index where the unpatched wavelength equals L."""
    L = f.original_window
    if L is None:
        return
    # λ_i = 2π b^(2i/d) = L  ⇔  i = d·ln(L/2π) / (2 ln b)   (d = rotary_dim for partial rotary)
    i = f.rotary_dim * math.log(L / (2 * math.pi)) / (2 * math.log(f.rope_theta))
    if 0 <= i <= f.inv_freq.numel() - 1:
        line = ax.axvline(i, label=f"λᵢ = original window L = {L:,}", **WINDOW_STYLE)
        line.set_gid("original-window")
        if text:
            ax.annotate(" λᵢ > L: no full turn\n inside the window", xy=(i, 0.98), xycoords=("data", "axes fraction"),
                        va="top", ha="left", fontsize=7, color="0.3")


def wavelengths(schemes, window=None, **rope) -> Figure:
    """λ′_i = 2π/θ′_i per pair (log y) with L marked, and r_i = L/λ′_i, the turns each pair makes inside L, with
    YaRN's default thresholds β = 32 (kept above) and α = 1 (interpolated below)."""
    rope = _rope(rope)
    specs = _specs(schemes)
    base = A.frequencies("default", **_no_len(rope))
    fig, (ax, ax2) = _figure(2)
    L = window
    for k, spec in enumerate(specs):
        kw = _at_length(spec, rope, base.original_window)
        w = A.wavelengths(spec, window=window, **kw)
        L = w.window
        i = np.arange(w.wavelength.numel())
        lam = w.wavelength.numpy()
        finite = np.isfinite(lam)
        st = _style(k, spec)
        label = _label(spec, kw) if finite.any() else f"{spec.label} [no rotation: λ = ∞]"
        ax.plot(i, np.where(finite, lam, np.nan), marker=".", markersize=3, label=label, **st)
        ax2.plot(i, np.where(finite, w.ratio.numpy(), np.nan), marker=".", markersize=3, label=label, **st)
    _mark_window(ax, L, axis="y")
    ax.set_yscale("log")
    ax.set_xlabel("pair index i")
    ax.set_ylabel("wavelength λ′ᵢ = 2π / θ′ᵢ (tokens)")
    ax.set_title("Wavelength per pair", fontsize=10)
    ax.yaxis.set_major_formatter(_int_formatter())
    ax.legend(fontsize=7, loc="upper left")
    ax2.set_yscale("log")
    for level, text in ((32, "β = 32: YaRN keeps pairs above"), (1, "α = 1: YaRN interpolates pairs below")):
        ax2.axhline(level, color="0.55", linestyle=":", linewidth=1)
        ax2.annotate(text, xy=(0.99, level), xycoords=("axes fraction", "data"), va="bottom", ha="right", fontsize=7,
                     color="0.4")
    ax2.set_xlabel("pair index i")
    ax2.set_ylabel(f"rᵢ = L / λ′ᵢ  (turns inside L = {L:,})")
    ax2.set_title("Full periods inside the original window", fontsize=10)
    _plain_log_ticks(ax2.yaxis)
    ax2.yaxis.set_minor_formatter(_formatter(lambda v, _: ""))
    ax2.legend(fontsize=7, loc="lower left")
    for a in (ax, ax2):
        a.grid(True, which="both", alpha=0.25)
    _title(fig, "RoPE wavelengths", _note(base))
    return fig


def _default_max_distance(specs, L):
    windows = [w for w in (_scheme_window(s, L) for s in specs) if w]
    return max([*windows, 4 * L]) if L else 65536


def _dense(ax, x, y, st, label, envelope="max"):
    """Every integer distance on a log axis is a solid block of oscillation: draw the per-bin max (decay bound)
    or mean (score) as the line and the per-bin min–max range as a faint band."""
    if x.size <= 600:
        ax.plot(x, y, linewidth=1.2, label=label, **st)
        return
    xs, lo, mean, hi = _binned(x, y)
    ax.fill_between(xs, lo, hi, color=st["color"], alpha=0.10, linewidth=0)
    ax.plot(xs, hi if envelope == "max" else mean, linewidth=1.4, label=label, **st)


def decay(schemes, distances=None, normalize=False, max_distance=None, log_x=True, **rope) -> Figure:
    """The long-term-decay bound of RoFormer §3.4.3, (1/(d/2)) Σ_j |S_j| vs relative distance Δ, one line per
    scheme. Every integer Δ up to `max_distance` (default max(4L, the schemes' extended windows)) is computed; on
    the log-x axis the line is the mean over log-spaced bins and the band the bin's min–max (the oscillation).
    `log_x=False` draws every Δ on a linear axis, like the RoFormer paper's figure."""
    rope = _rope(rope)
    specs = _specs(schemes)
    f0 = A.frequencies("default", **_no_len(rope))
    L = f0.original_window
    if distances is None:
        top = max_distance or _default_max_distance(specs, L)
        distances = torch.arange(1 if log_x else 0, int(top) + 1)
    d = A._distances(distances)
    if log_x and (d <= 0).any():
        d = d[d > 0]
    fig, (ax,) = _figure(1, width=7.6, height=4.8)
    x = d.numpy()
    for k, spec in enumerate(specs):
        y = A.decay_bound(spec, distances=d, normalize=normalize, **rope).numpy()
        ell = rope.get("seq_len") or int(x.max()) + 1
        _dense(ax, x, y, _style(k, spec), _label(spec, rope, ell), envelope="mean")
    _mark_window(ax, L, upto=x.max())
    if log_x:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_int_formatter())
    zero = A.decay_bound_at_zero(f0.inv_freq.numel())
    ax.set_xlabel("relative distance Δ = m − n (tokens)" + (", log scale" if log_x else ""))
    ax.set_ylabel(r"$\frac{1}{d/2}\sum_{j=1}^{d/2} |S_j|,\ \ S_j = \sum_{i<j} e^{\mathrm{i}\Delta\theta'_i}$"
                  + ("  (÷ value at Δ = 0)" if normalize else ""))
    note = "line: bin mean, band: bin min–max" if x.size > 600 else "every Δ"
    ax.set_title(f"RoFormer §3.4.3 bound; Δ = 0 gives {'1' if normalize else f'{zero:g}'}; {note}", fontsize=9)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper right")
    _title(fig, "Relative-position decay of the attention score bound", _note(f0))
    return fig


def angles(schemes, length=None, **rope) -> Figure:
    """Largest rotation angle (N − 1)·θ′_i each pair reaches at length N, against what training covered: a pair has
    seen every angle once (L − 1)·θ_i ≥ 2π; below that, angles above the black curve were never seen (shaded)."""
    rope = _rope(rope)
    specs = _specs(schemes)
    f0 = A.frequencies("default", **_no_len(rope))
    L = f0.original_window
    if L is None:
        raise TypeError("angles: needs the original window L (max_position_embeddings= or model= / config=).")
    N = int(length or _default_max_distance(specs, L))
    fig, (ax,) = _figure(1, width=7.6, height=4.8)
    i = np.arange(f0.inv_freq.numel())
    trained = (L - 1) * f0.base_inv_freq.double().numpy()
    seen = np.minimum(trained, 2 * math.pi)
    ys = [trained]
    for k, spec in enumerate(specs):
        a = A.angles(spec, distances=[N - 1], **{**rope, "seq_len": rope.get("seq_len") or N})[0].numpy()
        ys.append(a[a > 0])
        label = _label(spec, rope, N) if (a > 0).any() else f"{spec.label} [no rotation]"
        ax.plot(i, np.where(a > 0, a, np.nan), marker=".", markersize=3, label=label, **_style(k, spec))
    ax.plot(i, trained, color="0.45", linewidth=3, alpha=0.5, label=f"seen in training: (L − 1)·θᵢ, L = {L:,}")
    ax.fill_between(i, seen, 2 * math.pi, where=seen < 2 * math.pi, color="tab:red", alpha=0.10,
                    label="angles never seen in training")
    line = ax.axhline(2 * math.pi, color="0.5", linestyle=":", linewidth=1, label="2π: one full turn")
    line.set_gid("full-turn")
    _mark_pair(ax, f0, text=False)
    ax.set_yscale("log")
    values = np.concatenate([v for v in ys if v.size])
    ax.set_ylim(values.min() / 2, values.max() * 3)
    ax.set_xlabel("pair index i")
    ax.set_ylabel(f"largest angle (N − 1)·θ′ᵢ at N = {N:,} (rad)")
    ax.set_title(f"Rotation angles at length N = {N:,} vs. the angles seen in training", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower left")
    _title(fig, "RoPE angles: which pairs leave the trained range", _note(f0))
    return fig


def distance(schemes, max_distance=None, num_heads=8, **rope) -> Figure:
    """Effective relative distance vs true distance (rerope, leaky_rerope, self_extend remap it; others keep it),
    and, when ALiBi is among the schemes, its additive bias −m_h·Δ for a few heads."""
    rope = _rope(rope)
    specs = _specs(schemes)
    L = rope.get("max_position_embeddings")
    if L is None and ("model" in rope or "config" in rope):
        L = A.frequencies("default", **{k: v for k, v in rope.items() if k != "seq_len"}).original_window
    top = int(max_distance or (4 * L if L else 16384))
    d = torch.arange(0, top + 1)
    alibi = [s for s in specs if s.name == "alibi"]
    fig, axes = _figure(2 if alibi else 1)
    ax = axes[0]
    ax.plot(d.numpy(), d.numpy(), color="0.6", linewidth=1, linestyle="-", label="true distance (identity)")
    for k, spec in enumerate(specs):
        e = A.effective_distance(spec, d)
        if spec.name in ("rerope", "leaky_rerope", "self_extend"):
            ax.plot(d.numpy(), e.numpy(), linewidth=1.4, label=spec.label, **_style(k, spec))
        else:
            why = "no rotation: order only via bias / causal mask" if not spec.keeps_rotation else "true distance"
            ax.plot([], [], label=f"{spec.label} [{why}]", **_style(k, spec))
    _mark_window(ax, L)
    if L:
        ax.axhline(L, color="0.75", linestyle=":", linewidth=1)
    ax.set_xlabel("true relative distance Δ = i − j (tokens)")
    ax.set_ylabel("relative distance the rotation sees (tokens)")
    ax.set_title("Position remapping (Self-Extend, ReRoPE)", fontsize=10)
    ax.xaxis.set_major_formatter(_int_formatter())
    ax.yaxis.set_major_formatter(_int_formatter())
    ax.grid(True, alpha=0.25)
    ax.legend(fontsize=7, loc="upper left")
    if alibi:
        ax2 = axes[1]
        heads = sorted({0, num_heads // 4, num_heads // 2, num_heads - 1})
        for spec in alibi:
            b = A.attention_bias(spec, d, num_heads=num_heads)
            slopes = A.alibi_slopes(num_heads, spec.param("max_bias"))
            for n, h in enumerate(heads):
                ax2.plot(d.numpy(), b[h].numpy(), color=_color(specs.index(spec)), alpha=1 - 0.2 * n,
                         linestyle=_STYLES[n % 4], label=f"{spec.label}, head {h + 1}/{num_heads}: m = {slopes[h]:.3g}")
        _mark_window(ax2, L)
        ax2.set_yscale("symlog", linthresh=1)
        ax2.set_ylim(top=0.5)
        ax2.set_xlabel("relative distance Δ = i − j (tokens)")
        ax2.set_ylabel("ALiBi logit bias −m·Δ (symlog scale)")
        ax2.set_title("ALiBi bias per head (Press et al. 2022)", fontsize=10)
        ax2.xaxis.set_major_formatter(_int_formatter())
        ax2.grid(True, which="both", alpha=0.25)
        ax2.legend(fontsize=7, loc="lower left")
    fig.suptitle("Relative distance under position schemes", fontsize=10)
    return fig


def score(schemes, distances=None, max_distance=None, logits=False, num_heads=8, num_samples=256, **rope) -> Figure:
    """Expected attention score vs distance: q = k = all-ones (left) and q = k = random unit vectors (right, the
    mean over `num_samples`), including the scheme's cos/sin scale a (scores × a²). With `logits=True` the curves
    are what the softmax sees, a²·q·k/√d plus ALiBi's head-mean bias. Dense curves: line = mean per log-spaced bin,
    band = the bin's min–max (the oscillation)."""
    rope = _rope(rope)
    specs = _specs(schemes)
    f0 = A.frequencies("default", **_no_len(rope))
    L = f0.original_window
    if distances is None:
        distances = torch.arange(1, int(max_distance or _default_max_distance(specs, L)) + 1)
    d = A._distances(distances)
    d = d[d > 0]
    x = d.numpy()
    fig, (ax, ax2) = _figure(2)
    for k, spec in enumerate(specs):
        e = A.expected_score(spec, distances=d, logits=logits, num_heads=num_heads, num_samples=num_samples, **rope)
        st = _style(k, spec)
        label = _label(spec, rope, rope.get("seq_len") or int(x.max()) + 1)
        if spec.name == "alibi" and not logits:
            label += " [no rotation; its bias is not in q·k: see logits]"
        _dense(ax, x, e.ones.numpy(), st, label, envelope="mean")
        _dense(ax2, x, e.random.numpy(), st, label, envelope="mean")
    what = "logit a²·q·k/√d + bias" if logits else "score a²·q·k"
    for a, t in ((ax, "q = k = all-ones"), (ax2, f"q = k = random unit vector (mean of {num_samples})")):
        _mark_window(a, L, upto=x.max())
        a.set_xscale("log", base=2)
        a.xaxis.set_major_formatter(_int_formatter())
        a.set_xlabel("relative distance Δ (tokens), log scale")
        a.set_ylabel(what)
        a.set_title(t, fontsize=10)
        a.grid(True, which="both", alpha=0.25)
        a.legend(fontsize=7, loc="lower left")
    _title(fig, "Attention score vs. distance (query at Δ, key at 0)", _note(f0))
    return fig


# ------------------------------------------------------------------------------------------------------------------
# Results of `rope-patch compare` (and sweeps)
_SCHEME_KEYS = ("scheme", "spec", "name")
_LABEL_KEYS = ("label", "scheme", "spec", "name")
_LENGTH_KEYS = ("length", "seq_len", "context_length", "n_ctx", "tokens")
_PPL_KEYS = ("perplexity", "ppl")
_ACC_KEYS = ("passkey_accuracy", "passkey", "accuracy")
_BUCKET_KEYS = ("buckets", "bucket_perplexity", "perplexity_by_bucket", "perplexity_by_position")


def _num(x):
    if x is None or isinstance(x, bool):
        return None
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return float(x) if isinstance(x, (int, float)) else None


def _first(row: dict, keys, default=None):
    for k in keys:
        if k in row and row[k] is not None:
            return row[k]
    return default


def _span(key) -> tuple[float, float] | None:
    """'0-2048', '0–2k', '2048:4096' → (start, end)."""
    text = str(key).replace("–", "-").replace(":", "-").replace(" ", "").lower()
    parts = text.split("-")
    if len(parts) != 2:
        return None

    def val(t):
        mult = 1000 if t.endswith("k") else 1
        return float(t.rstrip("k")) * mult

    try:
        return val(parts[0]), val(parts[1])
    except ValueError:
        return None


def read_results(source) -> dict:
    """Read the results of `rope-patch compare` (or a sweep) into one normalised dict.

    Accepted input (a path to .json / .jsonl, or the already-loaded object):

    * compare.json, format "rope_patch.compare/1": {"model": {"window": L, "name": ...}, "schemes": [{"spec",
      "label"}, ...], "records": [...], "passkey": [...], "buckets": [...]} (see rope_patch.evaluation.compare);
    * a bare list of records, {"records": [...]} or {"results": [...]}, or JSON Lines with one record per line.

    A record is a dict with a scheme ("scheme" | "spec" | "name"; display "label"), a length ("length" | "seq_len" |
    "context_length" | "n_ctx" | "tokens") and any of "perplexity" | "ppl", "passkey_accuracy" | "passkey" |
    "accuracy", "depth" (a record with a depth is one passkey cell), and per-position perplexities under "buckets" |
    "bucket_perplexity" | "perplexity_by_bucket" as {"0-2048": ppl, ...} or [{"start", "end", "perplexity"}, ...].
    Numbers written as strings ("inf", "nan") are read as floats; unknown keys are ignored; records without a
    scheme or length are skipped. The original window comes from model.window | window | max_position_embeddings.

    Returns {"normalised": True, "name", "window", "schemes": [(scheme, label)], "records": [{"scheme", "label", "length",
    "perplexity", "passkey_accuracy"}], "passkey": [{"scheme", "label", "length", "depth", "accuracy"}],
    "buckets": [{"scheme", "label", "length", "start", "end", "perplexity"}]}.
    """
    data = source
    name = "results"
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"results file {str(path)!r} does not exist (run `rope-patch compare --out DIR` first).")
        text = path.read_text()
        name = path.stem
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            try:
                data = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: neither JSON nor JSON Lines ({err}).") from None
    if isinstance(data, dict):
        meta = data
        rows = _first(data, ("records", "results", "rows"), [])
    elif isinstance(data, list):
        meta, rows = {}, data
    else:
        raise ValueError(f"results must be a JSON object or a list of records, got {type(data).__name__}.")
    if not isinstance(rows, list):
        raise ValueError("results: `records` must be a list of records.")
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    window = _num(_first(model, ("window", "max_position_embeddings")) or _first(meta, ("window", "max_position_embeddings", "original_window")))
    out = {"normalised": True, "name": str(model.get("name") or meta.get("name") or name), "window": int(window) if window else None,
           "schemes": [], "records": [], "passkey": [], "buckets": []}
    labels: dict[str, str] = {}
    for s in meta.get("schemes", []) or []:
        if isinstance(s, dict) and _first(s, _SCHEME_KEYS):
            labels[str(_first(s, _SCHEME_KEYS))] = str(_first(s, _LABEL_KEYS))

    def key_label(row):
        key = _first(row, _SCHEME_KEYS)
        if key is None:
            return None, None
        key = str(key)
        label = labels.setdefault(key, str(row.get("label") or key))
        return key, label

    for row in rows:
        if not isinstance(row, dict):
            continue
        key, label = key_label(row)
        length = _num(_first(row, _LENGTH_KEYS))
        if key is None or length is None:
            continue
        length = int(length)
        acc = _num(_first(row, _ACC_KEYS))
        if row.get("depth") is not None and _num(row.get("depth")) is not None:
            out["passkey"].append({"scheme": key, "label": label, "length": length, "depth": _num(row["depth"]), "accuracy": acc})
            if _first(row, _PPL_KEYS) is None:
                continue
        out["records"].append({"scheme": key, "label": label, "length": length,
                               "perplexity": _num(_first(row, _PPL_KEYS)), "passkey_accuracy": acc})
        buckets = _first(row, _BUCKET_KEYS)
        out["buckets"] += _buckets(buckets, key, label, length)
    for p in meta.get("passkey", []) or []:
        if isinstance(p, dict):
            key, label = key_label(p)
            length = _num(_first(p, _LENGTH_KEYS))
            if key is not None and length is not None:
                out["passkey"].append({"scheme": key, "label": label, "length": int(length), "depth": _num(p.get("depth")),
                                       "accuracy": _num(_first(p, ("accuracy", "passkey_accuracy")))})
    top = meta.get("buckets")
    if isinstance(top, list):
        for b in top:
            if isinstance(b, dict):
                key, label = key_label(b)
                if key is not None:
                    out["buckets"] += _buckets([b], key, label, _num(b.get("length")))
    # passkey cells without a pooled accuracy in the records: pool them per (scheme, length)
    for r in out["records"]:
        if r["passkey_accuracy"] is None:
            cells = [p["accuracy"] for p in out["passkey"] if p["scheme"] == r["scheme"] and p["length"] == r["length"] and p["accuracy"] is not None]
            if cells:
                r["passkey_accuracy"] = sum(cells) / len(cells)
    seen = {r["scheme"] for r in out["records"]} | {p["scheme"] for p in out["passkey"]} | {b["scheme"] for b in out["buckets"]}
    order = [k for k in labels if k in seen] + sorted(seen - set(labels))
    out["schemes"] = [(k, labels.get(k, k)) for k in order]
    if not out["schemes"]:
        raise ValueError("results: found no records with a scheme and a length (see rope_patch.plots.read_results for the format).")
    return out


def _buckets(buckets, key, label, length) -> list[dict]:
    out = []
    if isinstance(buckets, dict):
        for span, value in buckets.items():
            se = _span(span)
            ppl = _num(value.get("perplexity") if isinstance(value, dict) else value)
            if se is not None and ppl is not None:
                out.append({"scheme": key, "label": label, "length": length, "start": se[0], "end": se[1], "perplexity": ppl})
    elif isinstance(buckets, list):
        for b in buckets:
            if isinstance(b, dict) and _num(b.get("start")) is not None and _num(b.get("end")) is not None:
                ppl = _num(_first(b, _PPL_KEYS))
                if ppl is not None:
                    out.append({"scheme": key, "label": label, "length": int(_num(b.get("length")) or length or 0) or None,
                                "start": _num(b["start"]), "end": _num(b["end"]), "perplexity": ppl})
    return out


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
    fig, axes = _figure(len(panels), width=5.4, height=4.2)
    color = {key: _color(k) for k, (key, _) in enumerate(res["schemes"])}
    style = {key: _STYLES[(k // 10) % 4] for k, (key, _) in enumerate(res["schemes"])}
    for ax, panel in zip(axes, panels, strict=True):
        for key, label in res["schemes"]:
            if panel == "buckets":
                rows = [b for b in res["buckets"] if b["scheme"] == key]
                longest = max((b["length"] or 0 for b in rows), default=0)
                rows = sorted((b for b in rows if (b["length"] or 0) == longest), key=lambda b: b["start"])
                if rows:
                    xs = [(b["start"] + b["end"]) / 2 for b in rows]
                    ax.plot(xs, [_finite(b["perplexity"]) for b in rows], marker="o", markersize=3, color=color[key],
                            linestyle=style[key], label=label)
                continue
            rows = sorted((r for r in res["records"] if r["scheme"] == key), key=lambda r: r["length"])
            field = "perplexity" if panel == "ppl" else "passkey_accuracy"
            rows = [r for r in rows if r[field] is not None]
            if rows:
                ys = [_finite(r[field]) for r in rows] if panel == "ppl" else [100 * r[field] for r in rows]
                ax.plot([r["length"] for r in rows], ys, marker="o", markersize=4, color=color[key],
                        linestyle=style[key], label=label)
        xmax = max((x for line in ax.get_lines() for x in line.get_xdata()), default=None)
        ends = [b["end"] for b in res["buckets"]] if panel == "buckets" else []
        _mark_window(ax, L, upto=max([xmax or 0, *ends]) or None)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_int_formatter())
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=7)
        if panel == "ppl":
            ax.set_yscale("log")
            _plain_log_ticks(ax.yaxis)
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
            _plain_log_ticks(ax.yaxis)
            ax.set_xscale("linear")
            ax.xaxis.set_major_formatter(_int_formatter())
            ax.set_xlabel("token position (bucket centre)")
            ax.set_ylabel("perplexity in bucket (log scale)")
            ax.set_title("Perplexity by position", fontsize=10)
    fig.suptitle(f"{res['name']}" + (f"  (original window L = {L:,})" if L else ""), fontsize=10)
    return fig


def _finite(x):
    """Plot inf/overflowing perplexities at the top of a log axis instead of dropping them."""
    return min(x, 1e6) if x is not None and not math.isnan(x) else np.nan


# ------------------------------------------------------------------------------------------------------------------
KINDS = {"decay": decay, "wavelengths": wavelengths, "frequencies": frequencies, "angles": angles,
         "distance": distance, "score": score}


# Memory (bytes per plotted distance) that the dense figures need, measured on this code (peak RSS, 1e6 distances)
# and rounded up: decay ~0.7 KB (d = 128, one scheme) - 1 KB (four); score ~4.6 KB (the [distances, samples]
# matrices); distance ~0.35 KB. `rope-patch plot` refuses an estimate above MEMORY_LIMIT before allocating anything.
MEMORY_LIMIT = 1 << 30


def plot_bytes(kind: str, n_distances: int, pairs: int, n_schemes: int, num_heads: int = 8,
               num_samples: int = 256) -> int:
    """Estimated peak memory of figure `kind` over `n_distances` distances (0 for the small figures)."""
    per_scheme = 64 * n_schemes + 64
    per = {"decay": 16 * pairs + per_scheme,
           "score": 8 * (pairs + 2 * num_samples) + per_scheme,
           "distance": 16 * num_heads + per_scheme}.get(kind)
    return 0 if per is None else n_distances * per


def figure_memory(kind: str, schemes, max_distance: int | None = None, num_heads: int | None = None,
                  **rope) -> tuple[int, int]:
    """(estimated peak bytes, number of distances) of `make(kind, schemes, max_distance=..., **rope)`, computed
    without drawing or allocating: the distance range defaults as in the figure itself. (0, 0) for the figures
    whose size does not grow with a distance range. `rope` as in `make`: head_dim, max_position_embeddings,
    partial_rotary_factor, or config= (its num_attention_heads is the default `num_heads`)."""
    if kind not in ("decay", "score", "distance"):
        return 0, 0
    cfg = rope.get("config")
    if cfg is not None:
        window = getattr(cfg, "max_position_embeddings", None)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        partial = getattr(cfg, "partial_rotary_factor", None) or 1.0
        num_heads = num_heads or getattr(cfg, "num_attention_heads", None)
    else:
        window, head_dim = rope["max_position_embeddings"], rope["head_dim"]
        partial = rope.get("partial_rotary_factor") or 1.0
    n = max_distance
    if n is None:
        n = (4 * window if window else 16384) if kind == "distance" else \
            _default_max_distance(_specs(schemes), window)
    schemes = [schemes] if isinstance(schemes, (str, A.AnalysisSpec)) else list(schemes)
    return plot_bytes(kind, n, int(head_dim * partial) // 2, len(schemes), num_heads=num_heads or 8), n


def make(kind: str, schemes=None, **kw) -> Figure:
    """`make("decay", ["default", "yarn:8"], head_dim=128, ...)`; `make("results", path)` for result files."""
    if kind == "results":
        return results(schemes, window=kw.get("window"))
    if kind not in KINDS:
        raise ValueError(f"Unknown plot kind {kind!r}.{did_you_mean(kind, [*KINDS, 'results'])} Kinds: {', '.join([*KINDS, 'results'])}.")
    return KINDS[kind](schemes, **kw)


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
