"""Figures of the position-encoding theory (`rope_patch.analysis`): frequencies, wavelengths, the decay bound,
angles, effective distances and expected scores."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import analysis as A
from . import style as S

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def frequencies(schemes, **rope) -> Figure:
    """θ′_i per pair (log y) and the per-pair interpolation factor θ_i/θ′_i; the pair whose wavelength equals L
    (pairs right of it never complete a turn inside the original window) is marked. Dynamic NTK / LongRoPE are
    drawn at their extended window s·L unless `seq_len` is given."""
    rope = S.rope(rope)
    specs = S.specs(schemes)
    base = A.frequencies("default", **_no_len(rope))
    L = base.original_window
    fig, (ax, ax2) = S.figure(2)
    for k, spec in enumerate(specs):
        kw = S.at_length(spec, rope, L)
        f = A.frequencies(spec, **kw)
        i = np.arange(f.inv_freq.numel())
        theta = f.inv_freq.double().numpy()
        st = S.style(k, spec)
        label = S.legend_label(f, S.label(spec, kw))
        if f.rotates:
            ax.plot(i, np.where(theta > 0, theta, np.nan), marker=".", markersize=3, label=label, **st)
            ax2.plot(i, np.where(theta > 0, f.interpolation.numpy(), np.nan), marker=".", markersize=3,
                     label=S.label(spec, kw), **st)
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
    S.plain_log_ticks(ax2.yaxis)
    ax2.legend(fontsize=7, loc="upper left")
    for a in (ax, ax2):
        a.grid(True, which="both", alpha=0.25)
    S.title(fig, "RoPE frequencies per pair", S.note(base))
    return fig


def _no_len(rope: dict) -> dict:
    return {k: v for k, v in rope.items() if k != "seq_len"}


def _mark_pair(ax, f: A.Frequencies, text=True):
    """Vertical line at the (fractional) pair index where the unpatched wavelength equals L."""
    L = f.original_window
    if L is None:
        return
    # λ_i = 2π b^(2i/d) = L  ⇔  i = d·ln(L/2π) / (2 ln b)   (d = rotary_dim for partial rotary)
    i = f.rotary_dim * math.log(L / (2 * math.pi)) / (2 * math.log(f.rope_theta))
    if 0 <= i <= f.inv_freq.numel() - 1:
        line = ax.axvline(i, label=f"λᵢ = original window L = {L:,}", **S.WINDOW_STYLE)
        line.set_gid("original-window")
        if text:
            ax.annotate(" λᵢ > L: no full turn\n inside the window", xy=(i, 0.98), xycoords=("data", "axes fraction"),
                        va="top", ha="left", fontsize=7, color="0.3")


def wavelengths(schemes, window=None, **rope) -> Figure:
    """λ′_i = 2π/θ′_i per pair (log y) with L marked, and r_i = L/λ′_i, the turns each pair makes inside L, with
    YaRN's default thresholds β = 32 (kept above) and α = 1 (interpolated below)."""
    rope = S.rope(rope)
    specs = S.specs(schemes)
    base = A.frequencies("default", **_no_len(rope))
    fig, (ax, ax2) = S.figure(2)
    L = window
    for k, spec in enumerate(specs):
        kw = S.at_length(spec, rope, base.original_window)
        w = A.wavelengths(spec, window=window, **kw)
        L = w.window
        i = np.arange(w.wavelength.numel())
        lam = w.wavelength.numpy()
        finite = np.isfinite(lam)
        st = S.style(k, spec)
        label = S.label(spec, kw) if finite.any() else f"{spec.label} [no rotation: λ = ∞]"
        ax.plot(i, np.where(finite, lam, np.nan), marker=".", markersize=3, label=label, **st)
        ax2.plot(i, np.where(finite, w.ratio.numpy(), np.nan), marker=".", markersize=3, label=label, **st)
    S.mark_window(ax, L, axis="y")
    ax.set_yscale("log")
    ax.set_xlabel("pair index i")
    ax.set_ylabel("wavelength λ′ᵢ = 2π / θ′ᵢ (tokens)")
    ax.set_title("Wavelength per pair", fontsize=10)
    ax.yaxis.set_major_formatter(S.int_formatter())
    ax.legend(fontsize=7, loc="upper left")
    ax2.set_yscale("log")
    for level, text in ((32, "β = 32: YaRN keeps pairs above"), (1, "α = 1: YaRN interpolates pairs below")):
        ax2.axhline(level, color="0.55", linestyle=":", linewidth=1)
        ax2.annotate(text, xy=(0.99, level), xycoords=("axes fraction", "data"), va="bottom", ha="right", fontsize=7,
                     color="0.4")
    ax2.set_xlabel("pair index i")
    ax2.set_ylabel(f"rᵢ = L / λ′ᵢ  (turns inside L = {L:,})")
    ax2.set_title("Full periods inside the original window", fontsize=10)
    S.plain_log_ticks(ax2.yaxis)
    ax2.yaxis.set_minor_formatter(S.formatter(lambda v, _: ""))
    ax2.legend(fontsize=7, loc="lower left")
    for a in (ax, ax2):
        a.grid(True, which="both", alpha=0.25)
    S.title(fig, "RoPE wavelengths", S.note(base))
    return fig


def _dense(ax, x, y, st, label, envelope="max"):
    """Every integer distance on a log axis is a solid block of oscillation: draw the per-bin max (decay bound)
    or mean (score) as the line and the per-bin min–max range as a faint band."""
    if x.size <= 600:
        ax.plot(x, y, linewidth=1.2, label=label, **st)
        return
    xs, lo, mean, hi = S.binned(x, y)
    ax.fill_between(xs, lo, hi, color=st["color"], alpha=0.10, linewidth=0)
    ax.plot(xs, hi if envelope == "max" else mean, linewidth=1.4, label=label, **st)


def decay(schemes, distances=None, normalize=False, max_distance=None, log_x=True, **rope) -> Figure:
    """The long-term-decay bound of RoFormer §3.4.3, (1/(d/2)) Σ_j |S_j| vs relative distance Δ, one line per
    scheme. Every integer Δ up to `max_distance` (default max(4L, the schemes' extended windows)) is computed; on
    the log-x axis the line is the mean over log-spaced bins and the band the bin's min–max (the oscillation).
    `log_x=False` draws every Δ on a linear axis, like the RoFormer paper's figure."""
    rope = S.rope(rope)
    specs = S.specs(schemes)
    f0 = A.frequencies("default", **_no_len(rope))
    L = f0.original_window
    if distances is None:
        top = max_distance or S.default_max_distance(specs, L)
        distances = torch.arange(1 if log_x else 0, int(top) + 1)
    d = A.distances.distances_tensor(distances)
    if log_x and (d <= 0).any():
        d = d[d > 0]
    fig, (ax,) = S.figure(1, width=7.6, height=4.8)
    x = d.numpy()
    for k, spec in enumerate(specs):
        y = A.decay_bound(spec, distances=d, normalize=normalize, **rope).numpy()
        ell = rope.get("seq_len") or int(x.max()) + 1
        _dense(ax, x, y, S.style(k, spec), S.label(spec, rope, ell), envelope="mean")
    S.mark_window(ax, L, upto=x.max())
    if log_x:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(S.int_formatter())
    zero = A.decay_bound_at_zero(f0.inv_freq.numel())
    ax.set_xlabel("relative distance Δ = m − n (tokens)" + (", log scale" if log_x else ""))
    ax.set_ylabel(r"$\frac{1}{d/2}\sum_{j=1}^{d/2} |S_j|,\ \ S_j = \sum_{i<j} e^{\mathrm{i}\Delta\theta'_i}$"
                  + ("  (÷ value at Δ = 0)" if normalize else ""))
    note = "line: bin mean, band: bin min–max" if x.size > 600 else "every Δ"
    ax.set_title(f"RoFormer §3.4.3 bound; Δ = 0 gives {'1' if normalize else f'{zero:g}'}; {note}", fontsize=9)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper right")
    S.title(fig, "Relative-position decay of the attention score bound", S.note(f0))
    return fig


def angles(schemes, length=None, **rope) -> Figure:
    """Largest rotation angle (N − 1)·θ′_i each pair reaches at length N, against what training covered: a pair has
    seen every angle once (L − 1)·θ_i ≥ 2π; below that, angles above the black curve were never seen (shaded)."""
    rope = S.rope(rope)
    specs = S.specs(schemes)
    f0 = A.frequencies("default", **_no_len(rope))
    L = f0.original_window
    if L is None:
        raise TypeError("angles: needs the original window L (max_position_embeddings= or model= / config=).")
    N = int(length or S.default_max_distance(specs, L))
    fig, (ax,) = S.figure(1, width=7.6, height=4.8)
    i = np.arange(f0.inv_freq.numel())
    trained = (L - 1) * f0.base_inv_freq.double().numpy()
    seen = np.minimum(trained, 2 * math.pi)
    ys = [trained]
    for k, spec in enumerate(specs):
        a = A.angles(spec, distances=[N - 1], **{**rope, "seq_len": rope.get("seq_len") or N})[0].numpy()
        ys.append(a[a > 0])
        label = S.label(spec, rope, N) if (a > 0).any() else f"{spec.label} [no rotation]"
        ax.plot(i, np.where(a > 0, a, np.nan), marker=".", markersize=3, label=label, **S.style(k, spec))
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
    S.title(fig, "RoPE angles: which pairs leave the trained range", S.note(f0))
    return fig


def distance(schemes, max_distance=None, num_heads=8, **rope) -> Figure:
    """Effective relative distance vs true distance, read from each scheme's `relative_position` (self_extend,
    rerope, leaky_rerope, string and dca remap it; the others keep it), and, when a scheme adds a bias fixed by its
    parameters (`Scheme.distance_bias`: ALiBi's −m_h·Δ), that bias for a few heads."""
    rope = S.rope(rope)
    specs = S.specs(schemes)
    L = rope.get("max_position_embeddings")
    if L is None and ("model" in rope or "config" in rope):
        L = A.frequencies("default", **{k: v for k, v in rope.items() if k != "seq_len"}).original_window
    top = int(max_distance or (4 * L if L else 16384))
    d = torch.arange(0, top + 1)
    biases = {k: b for k, spec in enumerate(specs) if (b := spec.scheme.distance_bias(d, num_heads)) is not None}
    fig, axes = S.figure(2 if biases else 1)
    ax = axes[0]
    ax.plot(d.numpy(), d.numpy(), color="0.6", linewidth=1, linestyle="-", label="true distance (identity)")
    for k, spec in enumerate(specs):
        e = A.effective_distance(spec, d)
        if not torch.equal(e, d.to(e.dtype)):  # the scheme moves positions within this range
            ax.plot(d.numpy(), e.numpy(), linewidth=1.4, label=spec.label, **S.style(k, spec))
        else:
            why = "no rotation: order only via bias / causal mask" if not spec.keeps_rotation else "true distance"
            ax.plot([], [], label=f"{spec.label} [{why}]", **S.style(k, spec))
    S.mark_window(ax, L)
    if L:
        ax.axhline(L, color="0.75", linestyle=":", linewidth=1)
    ax.set_xlabel("true relative distance Δ = i − j (tokens)")
    ax.set_ylabel("relative distance the rotation sees (tokens)")
    ax.set_title("Position remapping (Self-Extend, ReRoPE, STRING, DCA)", fontsize=10)
    ax.xaxis.set_major_formatter(S.int_formatter())
    ax.yaxis.set_major_formatter(S.int_formatter())
    ax.grid(True, alpha=0.25)
    ax.legend(fontsize=7, loc="upper left")
    if biases:
        ax2 = axes[1]
        heads = sorted({0, num_heads // 4, num_heads // 2, num_heads - 1})
        for k, b in biases.items():
            for n, h in enumerate(heads):
                slope = -b[h, -1].item() / top  # the mean slope: ALiBi's m_h, whose bias is −m_h·Δ
                ax2.plot(d.numpy(), b[h].numpy(), color=S.color(k), alpha=1 - 0.2 * n, linestyle=S.STYLES[n % 4],
                         label=f"{specs[k].label}, head {h + 1}/{num_heads}: m = {slope:.3g}")
        S.mark_window(ax2, L)
        ax2.set_yscale("symlog", linthresh=1)
        ax2.set_ylim(top=0.5)
        ax2.set_xlabel("relative distance Δ = i − j (tokens)")
        ax2.set_ylabel("logit bias, ALiBi: −m·Δ (symlog scale)")
        ax2.set_title("Additive bias per head (ALiBi: Press et al. 2022)", fontsize=10)
        ax2.xaxis.set_major_formatter(S.int_formatter())
        ax2.grid(True, which="both", alpha=0.25)
        ax2.legend(fontsize=7, loc="lower left")
    fig.suptitle("Relative distance under position schemes", fontsize=10)
    return fig


def score(schemes, distances=None, max_distance=None, logits=False, num_heads=8, num_samples=256, **rope) -> Figure:
    """Expected attention score vs distance: q = k = all-ones (left) and q = k = random unit vectors (right, the
    mean over `num_samples`), including the scheme's cos/sin scale a (scores × a²). With `logits=True` the curves
    are what the softmax sees, a²·q·k/√d plus ALiBi's head-mean bias. Dense curves: line = mean per log-spaced bin,
    band = the bin's min–max (the oscillation)."""
    rope = S.rope(rope)
    specs = S.specs(schemes)
    f0 = A.frequencies("default", **_no_len(rope))
    L = f0.original_window
    if distances is None:
        distances = torch.arange(1, int(max_distance or S.default_max_distance(specs, L)) + 1)
    d = A.distances.distances_tensor(distances)
    d = d[d > 0]
    x = d.numpy()
    fig, (ax, ax2) = S.figure(2)
    for k, spec in enumerate(specs):
        e = A.expected_score(spec, distances=d, logits=logits, num_heads=num_heads, num_samples=num_samples, **rope)
        st = S.style(k, spec)
        label = S.label(spec, rope, rope.get("seq_len") or int(x.max()) + 1)
        if not logits and spec.scheme.distance_bias(d[:1], num_heads) is not None:
            label += " [no rotation; its bias is not in q·k: see logits]"
        _dense(ax, x, e.ones.numpy(), st, label, envelope="mean")
        _dense(ax2, x, e.random.numpy(), st, label, envelope="mean")
    what = "logit a²·q·k/√d + bias" if logits else "score a²·q·k"
    for a, t in ((ax, "q = k = all-ones"), (ax2, f"q = k = random unit vector (mean of {num_samples})")):
        S.mark_window(a, L, upto=x.max())
        a.set_xscale("log", base=2)
        a.xaxis.set_major_formatter(S.int_formatter())
        a.set_xlabel("relative distance Δ (tokens), log scale")
        a.set_ylabel(what)
        a.set_title(t, fontsize=10)
        a.grid(True, which="both", alpha=0.25)
        a.legend(fontsize=7, loc="lower left")
    S.title(fig, "Attention score vs. distance (query at Δ, key at 0)", S.note(f0))
    return fig
