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
      "elapsed_s": {"total": ..., "<spec>": ...},
      "pending":  ["<spec>", ...]   # schemes not finished yet ([] in a complete result); a file written
                                    # mid-resume still holds the earlier cells of these
    }

`scheme` (the spec as given) is the key that ties records, passkey cells and buckets to `schemes`; `label` is for
display. Perplexities are plain floats (inf when exp overflows, written as the JSON string "inf").

`rope-patch compare` rewrites compare.json (atomically: a temporary file, then `os.replace`) after every finished
scheme, so an interrupted or failed run leaves a valid file of the schemes that finished; `--resume` reads it back
and evaluates only the scheme x length cells that are missing (`run_compare(..., resume=)`).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..api import original_config
from ..files import write_text_atomic
from ..specs import parse_scheme_spec, scheme_label
from ..discovery import find_target
from .common import read_tokens, versions
from .perplexity import evaluate_perplexity, perplexity_work
from .retrieval import DEFAULT_DEPTHS, accuracy_by_length, evaluate_passkey, make_cell

FORMAT = "rope_patch.compare/1"
DEFAULT_SCHEMES = ("default", "linear:4", "ntk:8", "dynamic:4", "yarn:8", "llama3:8")
# The model as loaded, no patch: the baseline row. Added first on a checkpoint that ships with scaling (Llama 3.x
# `llama3`, Qwen/gpt-oss `yarn`, Phi-3 `longrope`), where `default` is unscaled RoPE, not the model people run.
AS_LOADED = "loaded"
DEFAULT_LENGTHS = (256, 512, 1024, 2048)


def _shipped_scaling(model) -> str | None:
    """The rope_type a checkpoint ships with when it is a scaling, else None."""
    return next(iter(find_target(model).contexts().values())).shipped_scaling


def _row_label(spec: str, scheme, shipped: str | None) -> str:
    if scheme is None:
        return f"as loaded ({shipped or 'RoPE'})"
    if shipped and scheme.name == "default":
        return "unscaled RoPE" + (f" θ={scheme.rope_theta:g}" if scheme.rope_theta is not None else "")
    return scheme_label(spec)


def parse_schemes(specs: Sequence[str]) -> list[tuple[str, object]]:
    """Validate every spec before anything runs: [(spec, Scheme or None for `loaded`)]; ValueError/TypeError name
    the bad spec."""
    out, seen = [], set()
    for spec in specs:
        if spec in seen:
            raise ValueError(f"Scheme {spec!r} is listed twice.")
        seen.add(spec)
        if spec == AS_LOADED:
            out.append((spec, None))
            continue
        try:
            out.append((spec, parse_scheme_spec(spec)))
        except (ValueError, TypeError) as err:
            raise type(err)(f"Bad scheme spec {spec!r}: {err} Specs look like `yarn`, `yarn:8` or `yarn:factor=8,beta_fast=16`.") from None
    return out


def check_schemes(model, parsed: Sequence[tuple[str, object]]) -> None:
    """Apply and remove each scheme once, so that a scheme this model refuses (a LongRoPE list of the wrong
    length, a frequency scheme on a model whose config forbids it, ...) fails before the first evaluation instead
    of after the schemes before it ran. The model is unpatched afterwards, also on error."""
    import rope_patch

    kind = getattr(model.config, "model_type", None) or type(model).__name__
    for spec, scheme in parsed:
        if scheme is None:  # the model as loaded
            continue
        try:
            with rope_patch.patched(model, scheme):
                pass
        except (ValueError, TypeError) as err:
            raise type(err)(f"Scheme {spec!r} cannot be applied to this model ({kind}): {err} "
                            "Fix it or drop it from the schemes.") from None


def check_passkey_prompts(tokenizer, token_ids, lengths, depths, seed) -> None:
    """Build one passkey prompt per (length, depth): a length too short for the prompt fails now, not mid-run."""
    for L in lengths:
        for d in depths:
            make_cell(tokenizer, token_ids, L, d, 1, seed)


def _json_params(params: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


# What must be equal for a cell of an earlier run to stand in a new one (the lengths and schemes may differ).
_SAME_MODEL = ("path", "model_type", "window", "n_params", "dtype")
_SAME_SETTINGS = ("depths", "passkey_samples", "seed", "ppl_tokens")


def resume_mismatch(previous: dict, result: dict) -> str | None:
    """Why the cells of `previous` (a compare result) cannot be reused in `result` (same shape), or None."""
    if previous.get("format") != FORMAT:
        return f"it is not a {FORMAT} result"
    diffs = [f"model {k} {previous['model'].get(k)!r} -> {result['model'].get(k)!r}" for k in _SAME_MODEL
             if previous.get("model", {}).get(k) != result["model"].get(k)]
    diffs += [f"{k} {previous['settings'].get(k)!r} -> {result['settings'].get(k)!r}" for k in _SAME_SETTINGS
              if previous.get("settings", {}).get(k) != result["settings"].get(k)]
    old_text = {k: v for k, v in (previous.get("settings", {}).get("heldout") or {}).items() if k != "path"}
    new_text = {k: v for k, v in result["settings"]["heldout"].items() if k != "path"}
    if old_text != new_text:
        diffs.append("held-out text")
    return "; ".join(diffs) or None


def _reusable(previous: dict | None, spec: str, params: dict) -> dict:
    """The finished cells of `spec` in `previous`: {"ppl": {L: record}, "passkey": {L: [rows]}, "buckets": {L: rows},
    "elapsed": s}; empty when the spec was not run or resolved to other parameters."""
    cells = {"ppl": {}, "passkey": {}, "buckets": {}, "elapsed": 0.0}
    if not previous:
        return cells
    old = next((s for s in previous.get("schemes", []) if s["spec"] == spec), None)
    if old is None or old.get("params") != json.loads(json.dumps(_clean(params))):
        return cells
    for r in previous.get("records", []):
        if r["scheme"] == spec and r.get("n_windows"):
            cells["ppl"][r["length"]] = r
    for r in previous.get("passkey", []):
        if r["scheme"] == spec:
            cells["passkey"].setdefault(r["length"], []).append(r)
    for b in previous.get("buckets", []):
        if b["scheme"] == spec:
            cells["buckets"].setdefault(b["length"], []).append(b)
    cells["elapsed"] = float(previous.get("elapsed_s", {}).get(spec, 0.0))
    return cells


@torch.no_grad()
def run_compare(model, tokenizer, schemes: Sequence[str] = DEFAULT_SCHEMES, lengths: Sequence[int] = DEFAULT_LENGTHS, *,
                passkey_lengths: Sequence[int] | None = None, depths: Sequence[float] = DEFAULT_DEPTHS,
                passkey_samples: int = 4, windows_at_longest: int = 2, ppl_tokens: int | None = None, seed: int = 0,
                heldout: str | Path | None = None, token_ids: Sequence[int] | None = None, model_spec: str = "",
                model_path: str = "", progress: Callable[[int, str], None] | None = None,
                resume: dict | None = None, on_scheme: Callable[[dict], None] | None = None,
                ) -> dict:
    """Run perplexity and passkey for each scheme; returns the result dict described in the module docstring.

    `passkey_lengths` defaults to `lengths` (pass [] to skip passkey). `token_ids` overrides the held-out file.
    `progress(tokens_done, description)` is called as work completes; `work_units(...)` gives the total.

    Everything that can be checked is checked before the first evaluation: the specs, each scheme applied to this
    model, the held-out size and one passkey prompt per length. `on_scheme(result)` is called after each finished
    scheme with the result so far (a complete, valid result of the schemes done; `pending` lists the rest): the
    command line writes it to disk, so an interruption or a late error keeps what finished. `resume`: an earlier
    result of the same model and settings (`resume_mismatch` says otherwise: ValueError); its scheme x length cells
    are reused and only the missing ones are evaluated (`resumed_units` is the work they save).
    """
    import rope_patch

    parsed = parse_schemes(schemes)
    shipped = _shipped_scaling(model)
    if shipped and AS_LOADED not in [spec for spec, _ in parsed]:
        parsed.insert(0, (AS_LOADED, None))
    lengths = sorted(set(int(x) for x in lengths))
    passkey_lengths = lengths if passkey_lengths is None else sorted(set(int(x) for x in passkey_lengths))
    if token_ids is None:
        token_ids, held = read_tokens(tokenizer, heldout)
    else:
        held = {"path": None, "tokens": len(token_ids)}
    n_tokens = ppl_tokens if ppl_tokens is not None else windows_at_longest * lengths[-1]
    if n_tokens > len(token_ids):
        raise ValueError(f"The held-out text has {len(token_ids)} tokens; {n_tokens} requested for perplexity.")
    # the window the model was trained on (a shipped-scaling checkpoint's pre-training window): buckets, stars
    window = find_target(model).pretraining_window
    check_schemes(model, parsed)
    check_passkey_prompts(tokenizer, token_ids, passkey_lengths, depths, seed)

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
        "pending": [spec for spec, _ in parsed],
    }
    if resume is not None:
        why = resume_mismatch(resume, result)
        if why:
            raise ValueError(f"The earlier results differ from this run ({why}), so their cells cannot be reused. "
                             "Rerun with the same model and settings, or without --resume to start over.")
    order = [s for s, _ in parsed]
    depth_order = {float(d): i for i, d in enumerate(depths)}
    t_all = time.perf_counter()
    for spec, scheme in parsed:
        t0 = time.perf_counter()
        label = _row_label(spec, scheme, shipped)

        def tick(n, _label=label):
            if progress is not None:
                progress(n, _label)

        with rope_patch.patched(model, scheme) if scheme is not None else contextlib.nullcontext():
            applied = rope_patch.current(model)
            if applied is None:
                name, params = AS_LOADED, _json_params(original_config(model)["rope_parameters"])
            else:
                name, params = applied.name, _json_params(applied.params())
            done = _reusable(resume, spec, params)
            todo_ppl = [L for L in lengths if L not in done["ppl"]]
            if lengths[-1] not in todo_ppl and lengths[-1] not in done["buckets"]:
                todo_ppl.append(lengths[-1])  # the position buckets of the longest length were not kept
            todo_pk = [L for L in passkey_lengths if L not in done["passkey"]]
            ppl = evaluate_scheme_perplexity(model, token_ids, todo_ppl, n_tokens, window, tick)
            pk = _passkey(model, tokenizer, token_ids, todo_pk, depths, passkey_samples, seed, tick)
        ppl_rows = {**{L: r for L, r in done["ppl"].items() if L in lengths}, **{r["length"]: r for r in ppl["lengths"]}}
        pk += [r for L in passkey_lengths if L not in todo_pk for r in done["passkey"][L]]
        buckets = ppl["buckets"] if lengths[-1] in todo_ppl else done["buckets"][lengths[-1]]
        result["schemes"].append({"spec": spec, "label": label, "name": name, "params": params})
        acc = accuracy_by_length(pk)
        n_by_len = {}
        for r in pk:
            n_by_len[r["length"]] = n_by_len.get(r["length"], 0) + r["n"]
        keys = ("length", "n_windows", "n_tokens", "nll", "perplexity")
        for L in lengths:
            row = {k: ppl_rows[L][k] for k in keys}
            result["records"].append({"scheme": spec, "label": label, "name": name, **row,
                                      "passkey_accuracy": acc.get(L), "passkey_n": n_by_len.get(L, 0)})
        for L in passkey_lengths:  # passkey-only lengths still get a record
            if L not in lengths:
                result["records"].append({"scheme": spec, "label": label, "name": name, "length": L,
                                          "perplexity": None, "nll": None, "n_windows": 0, "n_tokens": 0,
                                          "passkey_accuracy": acc.get(L), "passkey_n": n_by_len.get(L, 0)})
        pk.sort(key=lambda r: (r["length"], depth_order.get(r["depth"], 0)))
        result["passkey"] += [{"scheme": spec, "label": label, **{k: v for k, v in r.items() if k not in
                                                                  ("scheme", "label")}} for r in pk]
        result["buckets"] += [{"scheme": spec, "label": label, "length": lengths[-1],
                               **{k: v for k, v in b.items() if k not in ("scheme", "label", "length")}}
                              for b in buckets]
        result["elapsed_s"][spec] = round(done["elapsed"] + time.perf_counter() - t0, 2)
        result["records"].sort(key=lambda r: (order.index(r["scheme"]), r["length"]))
        result["pending"].remove(spec)
        result["elapsed_s"]["total"] = round(time.perf_counter() - t_all, 2)
        if on_scheme is not None:
            on_scheme(_with_earlier(result, resume, order))
    result["elapsed_s"]["total"] = round(time.perf_counter() - t_all, 2)
    return result


def _with_earlier(result: dict, resume: dict | None, order: list[str]) -> dict:
    """`result` plus the earlier run's rows of the schemes still pending, so that a file written mid-resume loses
    none of the cells it was resumed from."""
    carried = [s for s in (resume or {}).get("schemes", []) if s["spec"] in result["pending"]]
    if not carried:
        return result
    keep = {s["spec"] for s in carried}
    out = dict(result)
    rank = {s: i for i, s in enumerate(order)}
    out["schemes"] = sorted([*result["schemes"], *carried], key=lambda s: rank[s["spec"]])
    for key in ("records", "passkey", "buckets"):
        rows = [*result[key], *(r for r in resume.get(key, []) if r["scheme"] in keep)]
        out[key] = sorted(rows, key=lambda r: rank[r["scheme"]]) if key != "records" else \
            sorted(rows, key=lambda r: (rank[r["scheme"]], r["length"]))
    return out


def evaluate_scheme_perplexity(model, token_ids, lengths, n_tokens, window, tick) -> dict:
    """Perplexity of the applied scheme at `lengths` (none: nothing to do); buckets of the longest of them."""
    if not lengths:
        return {"lengths": [], "buckets": []}
    return evaluate_perplexity(model, token_ids, lengths, n_tokens=n_tokens, window=window, progress=tick)


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


def resumed_units(resume: dict | None, specs: Sequence[str], token_count: int, lengths: Sequence[int],
                  passkey_lengths: Sequence[int] | None = None, depths: Sequence[float] = DEFAULT_DEPTHS,
                  passkey_samples: int = 4, windows_at_longest: int = 2, ppl_tokens: int | None = None) -> int:
    """The part of `work_units` that `run_compare(..., resume=resume)` skips (cells already in `resume`)."""
    if not resume:
        return 0
    passkey_lengths = lengths if passkey_lengths is None else passkey_lengths
    n = ppl_tokens if ppl_tokens is not None else windows_at_longest * max(lengths)
    ppl = {(r["scheme"], r["length"]) for r in resume.get("records", []) if r.get("n_windows")}
    pk = {(r["scheme"], r["length"]) for r in resume.get("passkey", [])}
    total = 0
    for spec in specs:
        total += sum((min(n, token_count) // L) * L for L in set(lengths) if (spec, L) in ppl)
        total += sum(L * len(depths) * passkey_samples for L in set(passkey_lengths) if (spec, L) in pk)
    return total


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


def write_json(result: dict, path: str | Path) -> None:
    write_text_atomic(path, json.dumps(_clean(result), indent=1) + "\n")


def check_writable(out_dir: str | Path) -> Path:
    """Create `out_dir` and write and remove a probe file there, so that an unwritable --out fails before any
    evaluation runs. Raises OSError with a message that names the folder."""
    out = Path(out_dir)
    probe = out / f".rope-patch-write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok\n")
        probe.unlink()
    except OSError as err:
        raise OSError(f"cannot write results to --out {str(out)!r} ({err.strerror or err}); choose another folder "
                      "or fix its permissions. Nothing has been evaluated yet.") from None
    return out


def write_csv(result: dict, path: str | Path) -> None:
    cols = ["scheme", "label", "name", "params", "length", "perplexity", "nll", "n_windows", "n_tokens",
            "passkey_accuracy", "passkey_n"]
    params = {s["spec"]: json.dumps(s["params"], sort_keys=True) for s in result["schemes"]}
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in result["records"]:
        w.writerow({**{k: r.get(k) for k in cols}, "params": params[r["scheme"]]})
    write_text_atomic(path, buf.getvalue())


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
    write_json(result, paths["json"])
    write_csv(result, paths["csv"])
    write_text_atomic(paths["markdown"], markdown_table(result))
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
    base = {r["length"]: r["perplexity"] for r in result["records"] if r["scheme"] == result["schemes"][0]["spec"]}
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
