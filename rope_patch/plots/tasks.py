"""The figure of a sweep's lm-eval tasks (RULER, ...): each task's main score per scheme, grouped by task and length,
drawn from a `rope-patch sweep` result (rope_patch/integrations/lm_eval/sweep.py: its `rows`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .. import schema
from ..specs import scheme_label
from . import style as S

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SWEEP_FORMAT = schema.SWEEP_FORMAT


def task_rows(sweep: dict) -> list[dict]:
    """The rows of lm-eval's own tasks (the rope_* ones are drawn by `results`), with a value."""
    return [r for r in sweep.get("rows", []) if not r.get("family") and isinstance(r.get("value"), (int, float))]


def tasks(source) -> Figure:
    """`source`: a sweep result dict or the path of a sweep.json. Scores in [0, 1] are drawn in %; each bar is
    labelled with its value and the group with its sample count."""
    sweep = source if isinstance(source, dict) else schema.read(source, schema.SWEEP)
    rows = task_rows(sweep)
    if not rows:
        raise ValueError("tasks plot: the sweep has no lm-eval task scores (its rope_* cells are drawn by "
                         "`rope-patch plot results` from compare.json).")
    schemes = [s["spec"] for s in sweep.get("schemes", [])]
    schemes += [r["scheme"] for r in rows if r["scheme"] not in schemes]
    groups = list(dict.fromkeys((r["task"], r.get("length")) for r in rows))
    cell = {(r["task"], r.get("length"), r["scheme"]): r for r in rows}
    percent = all(0 <= r["value"] <= 1 for r in rows)
    fig, (ax,) = S.figure(1, width=max(6.4, 3.5 + 1.3 * len(groups) * max(1, len(schemes)) ** 0.5), height=4.2)
    width = 0.8 / max(1, len(schemes))
    for k, spec in enumerate(schemes):
        xs, ys = [], []
        for g, (task, length) in enumerate(groups):
            r = cell.get((task, length, spec))
            if r is not None:
                xs.append(g - 0.4 + width * (k + 0.5))
                ys.append(100 * r["value"] if percent else r["value"])
        if not xs:
            continue
        bars = ax.bar(xs, ys, width=width, color="black" if spec == "default" else S.color(k),
                      label=scheme_label(spec), edgecolor="white", linewidth=0.5)
        ax.bar_label(bars, labels=[f"{y:.0f}" if percent else f"{y:.3g}" for y in ys], fontsize=7, padding=1)
    names = []
    for task, length in groups:
        ns = sorted({r["n_samples"] for (t, L, _), r in cell.items() if (t, L) == (task, length)
                     and r.get("n_samples")})
        at = f"\n{length / 1024:g}k" if length else ""
        names.append(f"{task}{at}" + (f"\nn = {'/'.join(map(str, ns))}" if ns else ""))
    ax.set_xticks(range(len(groups)), names, fontsize=8)
    ax.set_ylabel("score (%)" if percent else "score")
    if percent:
        ax.set_ylim(0, 109)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    model = (sweep.get("settings") or {}).get("name") or (sweep.get("settings") or {}).get("model") or ""
    ax.set_title(f"lm-eval tasks by scheme{f' ({model})' if model else ''}", fontsize=10)
    return fig


def write_tasks_figure(sweep: dict, out_dir) -> Path | None:
    """OUT/tasks.png when the sweep has lm-eval task scores, else nothing."""
    return S.save(tasks(sweep), Path(out_dir) / "tasks.png") if task_rows(sweep) else None
