"""`rope-patch compare`: perplexity and passkey retrieval for several schemes on one loaded model.

The model is loaded once; each scheme is applied with `rope_patch.patched`, so the model is back to vanilla
between schemes (and after an error). For every scheme the same text (perplexity) and the same passkey prompts
(same seed) are used, so differences between rows are differences between schemes.

Result JSON (`compare.json`, format "rope_patch.compare/1"; `rope-patch plot results` redraws the plots from it):

    {
      "format": "rope_patch.compare/1",
      "model":    {"spec": "tiny", "name": "tiny", "path": ..., "model_type": "llama", "window": 256,
                   "n_params": ..., "dtype": "float32"},
      "settings": {"lengths": [256, ...], "passkey_lengths": [...], "depths": [0.1, 0.5, 0.9],
                   "passkey_samples": 4, "seed": 0, "ppl_tokens": 8192, "windows_at_longest": 4,
                   "heldout": {"path", "sha256", "bytes", "tokens"}},
      "versions": {"rope_patch", "torch", "transformers", "python", "platform", "threads"},
      "schemes":  [{"spec": "yarn:8", "label": "yarn×8", "name": "yarn", "params": {...}}, ...],
                  # params: the applied scheme with model-derived defaults filled in (rope_patch.current)
      "records":  [{"scheme": "yarn:8", "label", "name", "length", "perplexity", "nll", "n_windows", "n_tokens",
                    "passkey_accuracy" (pooled over depths, null when not run), "passkey_n"}, ...],
      "passkey":  [{"scheme", "label", "length", "depth", "n", "correct", "accuracy", "answers", "outputs"}, ...],
      "buckets":  [{"scheme", "label", "length" (the longest), "start", "end", "n_tokens", "nll", "perplexity"}, ...],
      "elapsed_s": {"total": ..., "<spec>": ...}
    }

`scheme` (the spec as given) is the key that ties records, passkey cells and buckets to `schemes`; `label` is for
display. Perplexities are plain floats (inf when exp overflows, written as the JSON string "inf").
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .common import read_tokens, versions
from .perplexity import evaluate_perplexity, perplexity_work
from .retrieval import DEFAULT_DEPTHS, accuracy_by_length, evaluate_passkey

FORMAT = "rope_patch.compare/1"
DEFAULT_SCHEMES = ("default", "linear:4", "ntk:8", "dynamic:4", "yarn:8", "llama3:8")
DEFAULT_LENGTHS = (256, 512, 1024, 2048)


def _label(spec: str) -> str:
    from ..cli import scheme_label

    return scheme_label(spec)


def parse_schemes(specs: Sequence[str]) -> list[tuple[str, object]]:
    """Validate every spec before anything runs: [(spec, Scheme)]; ValueError/TypeError name the bad spec."""
    from ..cli import parse_scheme_spec

    out, seen = [], set()
    for spec in specs:
        if spec in seen:
            raise ValueError(f"Scheme {spec!r} is listed twice.")
        seen.add(spec)
        try:
            out.append((spec, parse_scheme_spec(spec)))
        except (ValueError, TypeError) as err:
            raise type(err)(f"Bad scheme spec {spec!r}: {err} Specs look like `yarn`, `yarn:8` or `yarn:factor=8,beta_fast=16`.") from None
    return out


def _json_params(params: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


@torch.no_grad()
def run_compare(model, tokenizer, schemes: Sequence[str] = DEFAULT_SCHEMES, lengths: Sequence[int] = DEFAULT_LENGTHS, *,
                passkey_lengths: Sequence[int] | None = None, depths: Sequence[float] = DEFAULT_DEPTHS,
                passkey_samples: int = 4, windows_at_longest: int = 2, ppl_tokens: int | None = None, seed: int = 0,
                heldout: str | Path | None = None, token_ids: Sequence[int] | None = None, model_spec: str = "",
                model_path: str = "", progress: Callable[[int, str], None] | None = None,
                ) -> dict:
    """Run perplexity and passkey for each scheme; returns the result dict described in the module docstring.

    `passkey_lengths` defaults to `lengths` (pass [] to skip passkey). `token_ids` overrides the held-out file.
    `progress(tokens_done, description)` is called as work completes; `work_units(...)` gives the total.
    """
    import rope_patch

    parsed = parse_schemes(schemes)
    lengths = sorted(set(int(x) for x in lengths))
    passkey_lengths = lengths if passkey_lengths is None else sorted(set(int(x) for x in passkey_lengths))
    if token_ids is None:
        token_ids, held = read_tokens(tokenizer, heldout)
    else:
        held = {"path": None, "tokens": len(token_ids)}
    n_tokens = ppl_tokens if ppl_tokens is not None else windows_at_longest * lengths[-1]
    if n_tokens > len(token_ids):
        raise ValueError(f"The held-out text has {len(token_ids)} tokens; {n_tokens} requested for perplexity.")
    window = int(getattr(model.config, "max_position_embeddings", 0)) or None

    result = {
        "format": FORMAT,
        "model": {"spec": model_spec, "name": model_spec or type(model).__name__, "path": model_path,
                  "model_type": getattr(model.config, "model_type", None), "window": window,
                  "n_params": sum(p.numel() for p in model.parameters()),
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", "")},
        "settings": {"lengths": lengths, "passkey_lengths": passkey_lengths, "depths": [float(d) for d in depths],
                     "passkey_samples": passkey_samples, "seed": seed, "ppl_tokens": n_tokens,
                     "windows_at_longest": windows_at_longest, "heldout": held},
        "versions": versions(),
        "schemes": [], "records": [], "passkey": [], "buckets": [], "elapsed_s": {},
    }
    t_all = time.perf_counter()
    for spec, scheme in parsed:
        t0 = time.perf_counter()
        label = _label(spec)

        def tick(n, _label=label):
            if progress is not None:
                progress(n, _label)

        with rope_patch.patched(model, scheme):
            applied = rope_patch.current(model)
            name = applied.name
            ppl = evaluate_perplexity(model, token_ids, lengths, n_tokens=n_tokens, window=window,
                                      progress=tick)
            pk = _passkey(model, tokenizer, token_ids, passkey_lengths, depths, passkey_samples, seed, tick)
        result["schemes"].append({"spec": spec, "label": label, "name": name, "params": _json_params(applied.params())})
        acc = accuracy_by_length(pk)
        n_by_len = {}
        for r in pk:
            n_by_len[r["length"]] = n_by_len.get(r["length"], 0) + r["n"]
        for row in ppl["lengths"]:
            L = row["length"]
            result["records"].append({"scheme": spec, "label": label, "name": name, **row,
                                      "passkey_accuracy": acc.get(L), "passkey_n": n_by_len.get(L, 0)})
        for L in passkey_lengths:  # passkey-only lengths still get a record
            if L not in lengths:
                result["records"].append({"scheme": spec, "label": label, "name": name, "length": L,
                                          "perplexity": None, "nll": None, "n_windows": 0, "n_tokens": 0,
                                          "passkey_accuracy": acc.get(L), "passkey_n": n_by_len.get(L, 0)})
        result["passkey"] += [{"scheme": spec, "label": label, **r} for r in pk]
        result["buckets"] += [{"scheme": spec, "label": label, "length": lengths[-1], **b} for b in ppl["buckets"]]
        result["elapsed_s"][spec] = round(time.perf_counter() - t0, 2)
    result["records"].sort(key=lambda r: ([s for s, _ in parsed].index(r["scheme"]), r["length"]))
    result["elapsed_s"]["total"] = round(time.perf_counter() - t_all, 2)
    return result


def _passkey(model, tokenizer, token_ids, lengths, depths, n_samples, seed, tick):
    """evaluate_passkey per length, reporting progress in prompt tokens."""
    out = []
    for L in lengths:
        out += evaluate_passkey(model, tokenizer, token_ids, [L], depths, n_samples, seed,
                                progress=lambda n, L=L: tick(n * L))
    return out


def work_units(n_schemes: int, token_count: int, lengths: Sequence[int], passkey_lengths: Sequence[int] | None = None,
               depths: Sequence[float] = DEFAULT_DEPTHS, passkey_samples: int = 4, windows_at_longest: int = 2,
               ppl_tokens: int | None = None) -> int:
    """Total of the `progress` increments of `run_compare` (tokens processed)."""
    passkey_lengths = lengths if passkey_lengths is None else passkey_lengths
    ppl = perplexity_work(token_count, lengths, ppl_tokens, windows_at_longest)
    pk = sum(L * len(depths) * passkey_samples for L in set(passkey_lengths))
    return n_schemes * (ppl + pk)


# ---- writing results ---------------------------------------------------------------------------------------------
def _clean(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def load_results(path: str | Path) -> dict:
    """Read a compare.json back (string "inf"/"nan" perplexities become floats)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a rope-patch compare result (format {data.get('format')!r}, expected {FORMAT!r}).")
    for key in ("records", "buckets", "passkey"):
        for row in data.get(key, []):
            for k in ("perplexity", "nll", "accuracy", "passkey_accuracy"):
                if isinstance(row.get(k), str):
                    row[k] = float(row[k])
    return data


def _fmt_ppl(x) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "inf"
    return f"{x:.1f}" if x < 1000 else f"{x:.3g}"


def _fmt_acc(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _lengths(result) -> list[int]:
    return sorted({r["length"] for r in result["records"]})


def _cell(result, spec, length):
    for r in result["records"]:
        if r["scheme"] == spec and r["length"] == length:
            return r
    return None


def markdown_table(result: dict) -> str:
    """Markdown: perplexity / passkey accuracy per scheme x length, then perplexity by position bucket."""
    lengths = _lengths(result)
    m, s = result["model"], result["settings"]
    lines = [
        f"Model `{m['name']}` (window {m['window']}); perplexity on {s['ppl_tokens']} held-out tokens per length; "
        f"passkey: {s['passkey_samples']} samples x depths {', '.join(f'{d:g}' for d in s['depths'])} per length, "
        f"seed {s['seed']}.",
        "",
        "| scheme | " + " | ".join(f"{L}" for L in lengths) + " |",
        "| --- | " + " | ".join("---:" for _ in lengths) + " |",
    ]
    for sch in result["schemes"]:
        cells = []
        for L in lengths:
            r = _cell(result, sch["spec"], L)
            cells.append("-" if r is None else f"{_fmt_ppl(r['perplexity'])} / {_fmt_acc(r['passkey_accuracy'])}")
        lines.append(f"| {sch['label']} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: perplexity / passkey accuracy."]
    if result["buckets"]:
        spans = []
        for b in result["buckets"]:
            if (b["start"], b["end"]) not in spans:
                spans.append((b["start"], b["end"]))
        longest = result["buckets"][0]["length"]
        lines += ["", f"Perplexity by position inside the {longest}-token windows:", "",
                  "| scheme | " + " | ".join(f"{a}-{b}" for a, b in spans) + " |",
                  "| --- | " + " | ".join("---:" for _ in spans) + " |"]
        for sch in result["schemes"]:
            by = {(b["start"], b["end"]): b for b in result["buckets"] if b["scheme"] == sch["spec"]}
            lines.append(f"| {sch['label']} | " + " | ".join(_fmt_ppl(by[sp]["perplexity"]) if sp in by else "-"
                                                           for sp in spans) + " |")
    return "\n".join(lines) + "\n"


def write_csv(result: dict, path: str | Path) -> None:
    cols = ["scheme", "label", "name", "params", "length", "perplexity", "nll", "n_windows", "n_tokens",
            "passkey_accuracy", "passkey_n"]
    params = {s["spec"]: json.dumps(s["params"], sort_keys=True) for s in result["schemes"]}
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in result["records"]:
            w.writerow({**{k: r.get(k) for k in cols}, "params": params[r["scheme"]]})


def plot_perplexity(result: dict, path: str | Path) -> None:
    """Perplexity vs. length (log-log), one line per scheme; the training window as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for sch in result["schemes"]:
        rows = [r for r in result["records"] if r["scheme"] == sch["spec"] and r["perplexity"] is not None]
        xs = [r["length"] for r in rows]
        ys = [min(r["perplexity"], 1e6) for r in rows]
        ax.plot(xs, ys, marker="o", label=sch["label"])
    window = result["model"].get("window")
    if window:
        ax.axvline(window, color="grey", linestyle="--", linewidth=1)
        ax.text(window, ax.get_ylim()[1], " training window", color="grey", va="top", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(_lengths(result))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    lo, hi = ax.get_ylim()
    if hi / lo < 10:  # under a decade a log axis shows one labelled tick or none: use evenly spaced ones
        ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=8))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity (held-out)")
    ax.set_title(f"Perplexity vs. length - {result['model']['name']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_passkey(result: dict, path: str | Path) -> None:
    """Passkey accuracy heatmaps, one panel per scheme: rows = needle depth, columns = prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    schemes = result["schemes"]
    lengths = sorted({p["length"] for p in result["passkey"]})
    depths = sorted({p["depth"] for p in result["passkey"]})
    n = len(schemes)
    cols = min(n, 3)
    rows = math.ceil(n / cols) if n else 1
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 0.8, 2.6 * rows + 0.6), squeeze=False,
                             constrained_layout=True)
    im = None
    for k, sch in enumerate(schemes):
        ax = axes[k // cols][k % cols]
        grid = np.full((len(depths), len(lengths)), np.nan)
        for p in result["passkey"]:
            if p["scheme"] == sch["spec"]:
                grid[depths.index(p["depth"]), lengths.index(p["length"])] = p["accuracy"]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{100 * grid[i, j]:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_title(sch["label"], fontsize=9)
        if k % cols == 0:
            ax.set_ylabel("needle depth")
        if k // cols == rows - 1:
            ax.set_xlabel("length (tokens)")
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="passkey accuracy")
    fig.suptitle(f"Passkey retrieval - {result['model']['name']}", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_results(result: dict, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """compare.json, compare.csv, compare.md, perplexity.png, passkey.png in `out_dir`; returns {kind: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "compare.json", "csv": out / "compare.csv", "markdown": out / "compare.md"}
    paths["json"].write_text(json.dumps(_clean(result), indent=1) + "\n")
    write_csv(result, paths["csv"])
    paths["markdown"].write_text(markdown_table(result))
    if plots:
        paths["perplexity_plot"] = out / "perplexity.png"
        plot_perplexity(result, paths["perplexity_plot"])
        if result["passkey"]:
            paths["passkey_plot"] = out / "passkey.png"
            plot_passkey(result, paths["passkey_plot"])
    return paths


def rich_table(result: dict):
    """A rich Table: one row per scheme, one column per length, cells "perplexity  accuracy"."""
    from rich.table import Table

    lengths = _lengths(result)
    window = result["model"].get("window")
    table = Table(title=f"rope-patch compare - {result['model']['name']} (window {window}): perplexity / passkey")
    table.add_column("scheme")
    for L in lengths:
        table.add_column(f"{L}" + (" *" if window and L > window else ""), justify="right")
    base = {r["length"]: r["perplexity"] for r in result["records"] if r["name"] == "default"
            and r["scheme"] == result["schemes"][0]["spec"]}
    ref = min((v for v in base.values() if v), default=None)
    for sch in result["schemes"]:
        cells = []
        for L in lengths:
            r = _cell(result, sch["spec"], L)
            if r is None:
                cells.append("-")
                continue
            p, a = r["perplexity"], r["passkey_accuracy"]
            style = ""
            if ref and p is not None:
                style = "green" if p <= 1.2 * ref else ("yellow" if p <= 2 * ref else "red")
            ptxt = f"[{style}]{_fmt_ppl(p)}[/]" if style else _fmt_ppl(p)
            cells.append(f"{ptxt}  {_fmt_acc(a)}")
        table.add_row(sch["label"], *cells)
    table.caption = "* beyond the training window; colour: perplexity relative to the first scheme's best"
    return table
