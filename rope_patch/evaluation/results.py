"""The one results schema of `rope-patch compare` / `rope-patch sweep` and its readers and writers.

`load_results(path)` reads a compare.json back as written (the schema is in rope_patch.evaluation.compare's
docstring); `read_results(source)` normalises it — or a bare list of records, {"records": [...]}, JSON Lines — into
the flat view every figure draws from (rope_patch.plots). Writers: JSON (atomic), CSV, a Markdown table, a rich
table for the terminal.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from pathlib import Path

from rich.table import Table

from .. import schema
from ..files import portable, write_text_atomic

FORMAT = schema.COMPARE_FORMAT


# ---- writing ---------------------------------------------------------------------------------------------
def json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def load_results(path: str | Path) -> dict:
    """Read a compare.json back, checked against its schema (`schema.COMPARE`: a damaged or foreign file raises a
    ValueError naming the file, the field and what to do); string "inf"/"nan" perplexities become floats."""
    return _floats(schema.read(path, schema.COMPARE))


def _floats(data: dict) -> dict:
    for key in ("passkey", "buckets"):
        data.setdefault(key, [])  # optional in the schema (results from before they existed)
    for key in ("records", "buckets", "passkey"):
        for row in data[key]:
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


def _fmt_passkey(r: dict) -> str:
    """"92% (11/12, 65-99)": accuracy, k/n and the Wilson 95% interval in percent, where the record has them."""
    acc = r.get("passkey_accuracy")
    if acc is None:
        return "-"
    k, n = r.get("passkey_correct"), r.get("passkey_n")
    lo, hi = r.get("passkey_ci_low"), r.get("passkey_ci_high")
    if k is None or not n:
        return _fmt_acc(acc)
    ci = f", {100 * lo:.0f}-{100 * hi:.0f}" if lo is not None and hi is not None else ""
    return f"{_fmt_acc(acc)} ({k}/{n}{ci})"


def _run_line(s: dict) -> str:
    """Chat template, shared haystack, threads, load and budget of a run, in one line (empty for older files)."""
    parts = []
    chat = s.get("chat_template")
    if chat:
        parts.append(f"chat template {'on' if chat.get('used') else 'off'} ({chat.get('mode')})")
    if s.get("shared_haystack"):
        parts.append("one haystack per passkey cell (shared prefix prefilled once; its samples differ only in the key, "
                     "so they are not independent and the intervals are too narrow)")
    machine = s.get("machine") or {}
    if machine:
        load = machine.get("loadavg_start")
        parts.append(f"{machine.get('threads')} threads on {machine.get('cpu_count')} cores"
                     + (f", load {load[0]:.2f}" if load else ""))
    budget = s.get("budget")
    if budget and budget.get("line"):
        parts.append(budget["line"].rstrip("."))
    return ("; ".join(parts) + ".") if parts else ""


def patch_note(model: dict) -> str:
    """The model line's words for a model loaded with a saved patch (evaluation.loading; "" for none)."""
    patch = model.get("patch")
    if not patch:
        return ""
    source = "its rope_patch.json" if patch.get("file") else "the patch it carried"
    return (f" as saved, with {source}: {patch['label']} (the `as loaded` row; every other scheme replaces it and is "
            "relative to the unpatched model)")


def _lengths(result) -> list[int]:
    return sorted({r["length"] for r in result["records"]})


def _cell(result, spec, length):
    for r in result["records"]:
        if r["scheme"] == spec and r["length"] == length:
            return r
    return None


def _scored_text(result: dict) -> str:
    """The held-out tokens the perplexity cells read, from their records (n_windows x L: the first tokens of the
    text), in words: one count for every length, else one per length."""
    scored = sorted({(r["length"], r["n_windows"] * r["length"]) for r in result["records"] if r.get("n_windows")})
    counts = {n for _, n in scored}
    if len(counts) <= 1:
        return f"the first {counts.pop() if counts else 0} held-out tokens at every length"
    return "the first " + " / ".join(str(n) for _, n in scored) + " held-out tokens at lengths " + \
        " / ".join(str(L) for L, _ in scored)


def markdown_table(result: dict) -> str:
    """Markdown: perplexity / passkey accuracy per scheme x length, then perplexity by position bucket."""
    lengths = _lengths(result)
    m, s = result["model"], result["settings"]
    lines = [
        f"Model `{m['name']}` (window {m['window']}){patch_note(m)}; perplexity on {_scored_text(result)}; "
        f"passkey: {s['passkey_samples']} samples x depths {', '.join(f'{d:g}' for d in s['depths'])} per length, "
        f"seed {s['seed']}." + (" " + _run_line(s) if _run_line(s) else ""),
        "",
        "| scheme | " + " | ".join(f"{L}" for L in lengths) + " |",
        "| --- | " + " | ".join("---:" for _ in lengths) + " |",
    ]
    for sch in result["schemes"]:
        cells = []
        for L in lengths:
            r = _cell(result, sch["spec"], L)
            cells.append("-" if r is None else f"{_fmt_ppl(r['perplexity'])} / {_fmt_passkey(r)}")
        lines.append(f"| {sch['label']} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: perplexity / passkey accuracy (right/prompts, Wilson 95% interval in %)."]
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
    """The result as JSON, paths inside the home directory written `~/...` (files.portable: results name no machine's
    home)."""
    write_text_atomic(path, json.dumps(json_safe(portable(result)), indent=1) + "\n")


RESULT_FILES = ("compare.json", "compare.csv", "compare.md")  # write_results; the figures: plots.FIGURE_FILES


def check_fresh(path: Path, resumed: str) -> None:
    """FileExistsError unless `path`, the results file a run writes, is absent: a run without --resume or --overwrite
    does not replace the finished work of an earlier one. `resumed`: what --resume does with it."""
    if path.exists():
        raise FileExistsError(f"{path} holds the results of an earlier run, which this run would replace: rerun with "
                              f"--resume to {resumed}, with --overwrite to replace it, or with another --out. Nothing "
                              "has been evaluated yet.")


def check_writable(out_dir: str | Path, files=()) -> Path:
    """Create `out_dir` and write and remove a probe file there, and check that each of `files` (names inside it)
    can be written: so that an unwritable --out, or one file that cannot be written (a folder, or a read-only file,
    in its place), fails before any evaluation runs instead of after the work it was to hold. Raises OSError with a
    message that names the folder or the file."""
    out = Path(out_dir)
    probe = out / f".rope-patch-write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok\n")
        probe.unlink()
    except OSError as err:
        raise OSError(f"cannot write results to --out {str(out)!r} ({err.strerror or err}); choose another folder "
                      "or fix its permissions. Nothing has been evaluated yet.") from None
    for name in files:
        path = out / name
        if not path.exists() and not path.is_symlink():
            continue  # the folder is writable: a new file can be made
        why = ("a folder is in its place" if path.is_dir() else None if path.is_file() else "it is not a regular file")
        if why is None:
            try:  # append mode: opens for writing without changing the file
                with open(path, "a"):
                    pass
            except OSError as err:
                why = err.strerror or str(err)
        if why:
            raise OSError(f"cannot write {path} ({why}); move it away, or choose another --out. Nothing has been "
                          "evaluated yet.")
    return out


def write_csv(result: dict, path: str | Path) -> None:
    cols = ["scheme", "label", "name", "params", "length", "perplexity", "nll", "n_windows", "n_tokens",
            "passkey_accuracy", "passkey_n", "passkey_correct", "passkey_ci_low", "passkey_ci_high"]
    params = {s["spec"]: json.dumps(s["params"], sort_keys=True) for s in result["schemes"]}
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in result["records"]:
        w.writerow({**{k: r.get(k) for k in cols}, "params": params[r["scheme"]]})
    write_text_atomic(path, buf.getvalue())


def write_results(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """compare.json, compare.csv, compare.md in `out_dir` (the figures: `rope_patch.plots.write_figures`); returns
    {kind: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "compare.json", "csv": out / "compare.csv", "markdown": out / "compare.md"}
    write_json(result, paths["json"])
    write_csv(result, paths["csv"])
    write_text_atomic(paths["markdown"], markdown_table(result))
    return paths


def spec_cell(label: str) -> str:
    """A scheme label or spec for a rich table cell: a space after each separator (':', ',', '+'), where rich may
    then wrap it, so that a line ends only between the spec's parts, never inside one such as `window_size=32` (a spec
    has no spaces: rich folded or cut it anywhere, `self_extend_logistic:gr…`). The spec grammar reads the spaced form
    as the same scheme, so a cell still copies into `--schemes` or `rope_patch.apply`."""
    return re.sub(r"\s*([:,])\s*", r"\1 ", re.sub(r"\s*\+\s*", " + ", label)).strip()


def rich_table(result: dict):
    """A rich Table: one row per scheme, one column per length, cells "perplexity  accuracy"."""
    lengths = _lengths(result)
    window = result["model"].get("window")
    table = Table(title=f"rope-patch compare - {result['model']['name']} "
                        f"(window {window}){patch_note(result['model'])}: "
                  "perplexity / passkey")
    labels = [spec_cell(sch["label"]) for sch in result["schemes"]]
    # wrapped between a spec's parts; a part wider than what a narrow terminal leaves is folded, never cut off with "…"
    table.add_column("scheme", overflow="fold")
    for L in lengths:
        table.add_column(f"{L}" + (" *" if window and L > window else ""), justify="right")
    base = {r["length"]: r["perplexity"] for r in result["records"] if r["scheme"] == result["schemes"][0]["spec"]}
    ref = min((v for v in base.values() if v), default=None)
    for sch, label in zip(result["schemes"], labels, strict=True):
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
        table.add_row(label, *cells)
    table.caption = "* beyond the training window; colour: perplexity relative to the first scheme's best"
    return table


# ---- the normalised view (figures) --------------------------------------------------------------------------------
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

    Returns {"normalised": True, "name", "window", "schemes": [(scheme, label)], "records": [{"scheme", "label",
    "length", "perplexity", "passkey_accuracy", "passkey_ci_low", "passkey_ci_high"}], "passkey": [{"scheme", "label",
    "length", "depth", "accuracy", "n", "correct", "ci_low", "ci_high"}] (None where the file does not have them),
    "buckets": [{"scheme", "label", "length", "start", "end", "perplexity"}]}.
    """
    data = source
    name, where = "results", "results"
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"results file {str(path)!r} does not exist "
                                    "(run `rope-patch compare --out DIR` first).")
        name, where = path.stem, str(path)
        try:
            data = schema.parse_text(path, schema.COMPARE)
        except schema.FileFormatError as err:
            text = path.read_text(encoding="utf-8", errors="replace")
            if err.expected != "JSON" or "\n" not in text.strip():  # empty, binary, or one broken JSON document
                raise
            try:
                data = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as line_err:
                raise ValueError(f"{path}: neither JSON nor JSON Lines ({line_err}). {schema.COMPARE.fix}") from None
    family = schema.COMPARE_FORMAT.rsplit("/", 1)[0] + "/"
    if isinstance(data, dict) and str(data.get("format", "")).startswith(family):
        data = _floats(schema.check(data, schema.COMPARE, where))  # this project's own file: its schema, no guesses
    if isinstance(data, dict):
        meta = data
        rows = _first(data, ("records", "results", "rows"), [])
    elif isinstance(data, list):
        meta, rows = {}, data
    else:
        raise ValueError(f"{where}: expected a JSON object or a list of records, found {schema.describe(data)}.")
    if not isinstance(rows, list):
        raise ValueError(f"{where}: 'records' must be a list of records, found {schema.describe(rows)}.")
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    window = _num(_first(model, ("window", "max_position_embeddings"))
                  or _first(meta, ("window", "max_position_embeddings", "original_window")))
    out = {"normalised": True, "name": str(model.get("name") or meta.get("name") or name),
           "window": int(window) if window else None,
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
            out["passkey"].append({"scheme": key, "label": label, "length": length, "depth": _num(row["depth"]),
                                   "accuracy": acc,
                                   **{k: _num(row.get(k)) for k in ("n", "correct", "ci_low", "ci_high")}})
            if _first(row, _PPL_KEYS) is None:
                continue
        out["records"].append({"scheme": key, "label": label, "length": length,
                               "perplexity": _num(_first(row, _PPL_KEYS)), "passkey_accuracy": acc,
                               "passkey_ci_low": _num(row.get("passkey_ci_low")),
                               "passkey_ci_high": _num(row.get("passkey_ci_high"))})
        buckets = _first(row, _BUCKET_KEYS)
        out["buckets"] += _buckets(buckets, key, label, length)
    for p in meta.get("passkey", []) or []:
        if isinstance(p, dict):
            key, label = key_label(p)
            length = _num(_first(p, _LENGTH_KEYS))
            if key is not None and length is not None:
                out["passkey"].append({"scheme": key, "label": label, "length": int(length),
                                       "depth": _num(p.get("depth")),
                                       "accuracy": _num(_first(p, ("accuracy", "passkey_accuracy"))),
                                       **{k: _num(p.get(k)) for k in ("n", "correct", "ci_low", "ci_high")}})
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
            cells = [p["accuracy"] for p in out["passkey"] if p["scheme"] == r["scheme"] and p["length"] == r["length"]
                     and p["accuracy"] is not None]
            if cells:
                r["passkey_accuracy"] = sum(cells) / len(cells)
    seen = ({r["scheme"] for r in out["records"]} | {p["scheme"] for p in out["passkey"]}
            | {b["scheme"] for b in out["buckets"]})
    order = [k for k in labels if k in seen] + sorted(seen - set(labels))
    out["schemes"] = [(k, labels.get(k, k)) for k in order]
    if not out["schemes"]:
        raise ValueError(f"{where}: found no records with a scheme and a length (see "
                         "rope_patch.evaluation.results.read_results for the format).")
    return out


def _buckets(buckets, key, label, length) -> list[dict]:
    out = []
    if isinstance(buckets, dict):
        for span, value in buckets.items():
            se = _span(span)
            ppl = _num(value.get("perplexity") if isinstance(value, dict) else value)
            if se is not None and ppl is not None:
                out.append({"scheme": key, "label": label, "length": length, "start": se[0], "end": se[1],
                            "perplexity": ppl})
    elif isinstance(buckets, list):
        for b in buckets:
            if isinstance(b, dict) and _num(b.get("start")) is not None and _num(b.get("end")) is not None:
                ppl = _num(_first(b, _PPL_KEYS))
                if ppl is not None:
                    out.append({"scheme": key, "label": label,
                                "length": int(_num(b.get("length")) or length or 0) or None,
                                "start": _num(b["start"]), "end": _num(b["end"]), "perplexity": ppl})
    return out
