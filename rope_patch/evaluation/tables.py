"""Markdown tables of committed runs, kept in a document below marks: a study's tables as data, recomputed from the
result files through their schema (rope_patch.schema), so a re-run that changes a number and a document that was
not updated disagree in a test.

A study file (`tables.json`, schema.TABLES, format "rope_patch.tables/1") names the document and, per table, its
mark, its kind and the run folders it reads (relative to the study's `results` folder):

    {"format": "rope_patch.tables/1", "document": "../../docs/studies/smollm2.md", "results": "../results",
     "tables": [{"mark": "<!-- smollm2-table -->", "kind": "perplexity", "runs": ["smollm2/ppl-16k-n1"]}, ...]}

| kind | reads | table |
| --- | --- | --- |
| `perplexity` | the run's compare.json | one row per scheme: the whole window and each position bucket |
| `tune` | the run's search_log.json | the searched spec and the baselines on the acceptance text, one column per length |
| `passkey` | compare.json of each run (`haystack`: prose, the default, or noise) | one row per (template, scheme, length), one column per depth |
| `ruler` | sweep.json of each run | one row per (length, scheme), one column per RULER task |

A cell found in several runs is taken from the first run listed. Every run listed must exist.

    study = load_study("eval/smollm2/tables.json")
    compute(study)                 # {mark: table}
    write_document(study)          # rewrites each table below its mark
"""  # noqa: E501 (markdown table rows cannot wrap)

from __future__ import annotations

from pathlib import Path

from .. import schema
from ..tuning import load_log
from .results import load_results
from .retrieval import wilson_interval

TABLES_FORMAT = schema.TABLES_FORMAT
# RULER's score per sample is the fraction of its answers found: one answer for the needle tasks (so the cell is
# k/n with a Wilson interval), 5 variables for ruler_vt, 10 words for ruler_cwe and 3 for ruler_fwe (a mean, in %).
RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
ONE_ANSWER = {"niah_single_1", "niah_multikey_2", "niah_multikey_3"}


def fmt(k: int, n: int) -> str:
    """`k/n (low–high%)`, the Wilson 95% interval."""
    low, high = wilson_interval(k, n)
    return f"{k}/{n} ({100 * low:.0f}–{100 * high:.0f}%)"


def perplexity_table(results: dict) -> str:
    """A compare.json with position buckets: one row per scheme, the whole window then each bucket."""
    buckets = {}
    for b in results["buckets"]:
        buckets.setdefault(b["scheme"], []).append(b)
    spans = [(b["start"], b["end"]) for b in next(iter(buckets.values()))]
    head = (f"| scheme | all {results['records'][0]['length'] // 1024}k | "
            + " | ".join(f"{s // 1024}–{e // 1024}k" for s, e in spans) + " |")
    rows = [head, "| --- | ---: | " + " | ".join("---:" for _ in spans) + " |"]
    for r in results["records"]:
        cells = [f"{b['perplexity']:.1f}" for b in sorted(buckets[r["scheme"]], key=lambda b: b["start"])]
        rows.append(f"| `{r['scheme']}` | {r['perplexity']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def tune_table(log: dict) -> str:
    """The search's best spec and the baselines on the acceptance text, one column per length."""
    acceptance = log["acceptance"]
    lengths = acceptance["lengths"]
    rows = ["| spec | " + " | ".join(f"{L / 1024:g}k" for L in lengths) + " |",
            "| --- | " + " | ".join("---:" for _ in lengths) + " |"]
    for r in acceptance["rows"]:
        label = f"`{r['spec']}`" + (" (searched)" if r["spec"] == log["best"]["spec"] else "")
        rows.append(f"| {label} | " + " | ".join(f"{r['perplexity'][str(L)]:.2f}" for L in lengths) + " |")
    return "\n".join(rows)


def _source(folder: Path, root: Path) -> str:
    return folder.relative_to(root).as_posix() + "/"


def ruler_table(folders: list[Path], root: Path) -> str:
    """(length, scheme) rows of `rope-patch sweep` runs, one column per RULER task; a (length, scheme, task) cell
    found in several runs is taken from the first folder listed; the `run` column names the folders relative to
    `root`."""
    cells, order, sources = {}, [], {}
    for folder in folders:
        result = schema.read(folder / "sweep.json", schema.SWEEP)
        (length,) = result["settings"]["lengths"]  # RULER: one length per call (its docs are sorted by length)
        source = _source(folder, root)
        for r in result["rows"]:
            key = (length, r["scheme"])
            if key not in sources:
                sources[key] = []
                order.append(key)
            if r["task"] in cells.setdefault(key, {}):
                continue  # taken from an earlier folder
            cells[key][r["task"]] = (r["metrics"][str(length)], r["n_samples"])
            if source not in sources[key]:
                sources[key].append(source)
    tasks = [t for t in RULER_TASKS if any(t in c for c in cells.values())]
    tasks += sorted({t for c in cells.values() for t in c} - set(tasks))
    rows = ["| length | scheme | " + " | ".join(tasks) + " | run |",
            "| ---: | --- | " + " | ".join("---:" for _ in tasks) + " | --- |"]
    for length, scheme in sorted(order, key=lambda k: (k[0], k[1] != "default", order.index(k))):  # vanilla first
        row = []
        for t in tasks:
            if t not in cells[(length, scheme)]:
                row.append("–")
                continue
            value, n = cells[(length, scheme)][t]
            row.append(fmt(round(value * n), n) if t in ONE_ANSWER else f"{100 * value:.0f}% of {n}")
        rows.append(f"| {length / 1024:g}k | `{scheme}` | " + " | ".join(row)
                    + f" | {', '.join(sources[(length, scheme)])} |")
    return "\n".join(rows)


def passkey_table(folders: list[Path], root: Path, haystack: str = "prose") -> str:
    """(template, scheme, length) rows of the runs whose passkey hid in `haystack` (prose: also the runs from before
    the setting existed), one column per depth and one for the row: `k/n (low-high%)`, Wilson 95%; a cell found in
    several runs is the first folder's; the `run` column names the folder relative to `root`."""
    cells, order, depths = {}, [], set()
    for folder in folders:
        result = load_results(folder / "compare.json")
        if result["settings"].get("haystack", "prose") != haystack:
            continue
        template = "on" if result["settings"]["chat_template"]["used"] else "off"
        source = _source(folder, root)
        for c in result["passkey"]:
            key = (template, c["scheme"], c["length"])
            if key in cells and cells[key]["source"] != source:
                continue
            if key not in cells:
                cells[key] = {"source": source, "depths": {}}
                order.append(key)
            cells[key]["depths"][c["depth"]] = c
            depths.add(c["depth"])
    depths = sorted(depths)
    rows = ["| template | scheme | length | " + " | ".join(f"depth {d:g}" for d in depths) + " | all | run |",
            "| --- | --- | ---: | " + " | ".join("---:" for _ in depths) + " | ---: | --- |"]
    for template, scheme in dict.fromkeys((t, s) for t, s, _ in order):
        for length in sorted(L for t, s, L in order if (t, s) == (template, scheme)):
            cell = cells[(template, scheme, length)]
            row = [fmt(cell["depths"][d]["correct"], cell["depths"][d]["n"]) if d in cell["depths"] else "-"
                   for d in depths]
            k = sum(c["correct"] for c in cell["depths"].values())
            n = sum(c["n"] for c in cell["depths"].values())
            rows.append(f"| {template} | `{scheme}` | {length / 1024:g}k | " + " | ".join(row)
                        + f" | {fmt(k, n)} | {cell['source']} |")
    return "\n".join(rows)


# ---- a study: its document, its tables and their runs --------------------------------------------------------
def load_study(path: str | Path) -> dict:
    """A study file (schema.TABLES), with `path`, `document` and `results` resolved against its folder and each
    table's runs as folders; a run that does not exist is an error naming it."""
    path = Path(path)
    study = schema.read(path, schema.TABLES)
    base = path.resolve().parent
    study["path"], study["document"] = path, (base / study["document"]).resolve()
    study["results"] = (base / study["results"]).resolve()
    for t in study["tables"]:
        t["folders"] = [study["results"] / run for run in t["runs"]]
        missing = [run for run, folder in zip(t["runs"], t["folders"], strict=True) if not folder.is_dir()]
        if missing:
            raise FileNotFoundError(f"{path}: table {t['mark']!r} reads {', '.join(missing)}, which is not a folder "
                                    f"in {study['results']}. Fix the run's name in {path.name}.")
    return study


def table(spec: dict, root: Path) -> str:
    """The markdown of one of a study's tables (`spec`: an entry of its `tables`, with `folders`)."""
    kind, folders = spec["kind"], spec["folders"]
    if kind == "perplexity":
        (folder,) = folders
        return perplexity_table(load_results(folder / "compare.json"))
    if kind == "tune":
        (folder,) = folders
        return tune_table(load_log(folder / "search_log.json"))
    if kind == "passkey":
        return passkey_table(folders, root, haystack=spec.get("haystack", "prose"))
    return ruler_table(folders, root)


def compute(study: dict) -> dict[str, str]:
    """Mark -> table, in the study's order."""
    return {t["mark"]: table(t, study["results"]) for t in study["tables"]}


def _span(lines: list[str], mark: str) -> tuple[int, int]:
    """The lines of the table below `mark`: [start, end)."""
    start = lines.index(mark) + 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def tables_in(text: str, marks) -> dict[str, str | None]:
    """Mark -> the table below it in `text` (None: the mark is not there)."""
    lines = text.split("\n")
    out = {}
    for mark in marks:
        if mark not in lines:
            out[mark] = None
            continue
        start, end = _span(lines, mark)
        out[mark] = "\n".join(lines[start:end])
    return out


def replace_tables(text: str, tables: dict[str, str]) -> str:
    """`text` with each table below its mark replaced (marks that are not in it are left out)."""
    lines = text.split("\n")
    for mark, markdown in tables.items():
        if mark in lines:
            start, end = _span(lines, mark)
            lines = lines[:start] + markdown.split("\n") + lines[end:]
    return "\n".join(lines)


def write_document(study: dict) -> Path:
    """Rewrite the study's tables in its document, below their marks."""
    document = study["document"]
    document.write_text(replace_tables(document.read_text(encoding="utf-8"), compute(study)), encoding="utf-8")
    return document


def main(study_path: str | Path, argv: list[str]) -> None:
    """A study's `table.py`: print its tables, or (`--write`) rewrite them in its document."""
    study = load_study(study_path)
    if "--write" in argv or "--readme" in argv:  # --readme: the flag's old name
        print(f"rewrote the tables in {write_document(study)}")
    else:
        print("\n\n".join(compute(study).values()))
