"""The README's SmolLM2 tables: perplexity by position from ppl16k/compare.json (run_ppl16k.sh) and ppl32k/
(run_ppl32k.sh, the schemes finished so far), the tuned scheme against the baselines on the acceptance text
(tune_self_extend/search_log.json, `rope-patch tune`), RULER's niah_single_1 by `rope-patch sweep` (RULER), and passkey by length x depth from the passkey runs
(run_passkey.sh, run_passkey16k.sh: the folders in PASSKEY, and PASSKEY_NOISE for the passkey in noise; a cell of one scheme, length and template setting found
in several runs is taken from the first folder listed).

    python eval/results/smollm2/table.py            # prints the tables
    python eval/results/smollm2/table.py --readme   # rewrites them in README.md, below their marks (MARKS)
"""

from __future__ import annotations

import sys
from pathlib import Path

from rope_patch import schema
from rope_patch.evaluation.results import load_results
from rope_patch.evaluation.retrieval import wilson_interval
from rope_patch.tuning import load_log

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "eval/results/smollm2/ppl16k/compare.json"
RESULTS_32K = ROOT / "eval/results/smollm2/ppl32k/compare.json"
TUNE = ROOT / "eval/results/smollm2/tune_self_extend/search_log.json"
MARK = "<!-- smollm2-table -->"
MARK_32K = "<!-- smollm2-32k -->"
TUNE_MARK = "<!-- smollm2-tune -->"
RULER = [ROOT / "eval/results/smollm2" / d for d in  # rope-patch sweep runs; a cell in several: the first folder's
         ("ruler4k_n20", "ruler4k_floor_n20", "ruler4k", "ruler8k_n20", "ruler8k",
          "ruler16k_n20", "ruler16k_n10", "ruler16k", "ruler16k_b", "ruler16k_floor", "ruler16k_floor_b")]
RULER_MARK = "<!-- smollm2-ruler -->"
PASSKEY = [ROOT / "eval/results" / d for d in
           ("chat_template_smollm2/per_sample_on", "smollm2/passkey", "smollm2/passkey16k",
            "chat_template_smollm2/per_sample_off", "smollm2/passkey_plain")]
PASSKEY_MARK = "<!-- smollm2-passkey -->"
PASSKEY_NOISE = [ROOT / "eval/results/smollm2" / d for d in  # run_passkey.sh noise [SCHEME ...]
                 ("passkey_noise", "passkey_noise_dca", "passkey_noise_yarn")]
PASSKEY_NOISE_MARK = "<!-- smollm2-passkey-noise -->"


def table(results: dict) -> str:
    buckets = {}
    for b in results["buckets"]:
        buckets.setdefault(b["scheme"], []).append(b)
    spans = [(b["start"], b["end"]) for b in next(iter(buckets.values()))]
    head = f"| scheme | all {results['records'][0]['length'] // 1024}k | " + " | ".join(f"{s // 1024}–{e // 1024}k" for s, e in spans) + " |"
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


# RULER's score per sample is the fraction of its answers found: one answer for the needle tasks (so the cell is
# k/n with a Wilson interval), 5 variables for ruler_vt, 10 words for ruler_cwe and 3 for ruler_fwe (a mean, in %).
RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
ONE_ANSWER = {"niah_single_1", "niah_multikey_2", "niah_multikey_3"}


def ruler_table(folders) -> str:
    """(length, scheme) rows of `rope-patch sweep` runs, one column per RULER task; a (length, scheme, task) cell
    found in several runs is taken from the first folder listed."""
    cells, order, sources = {}, [], {}
    for folder in folders:
        path = folder / "sweep.json"
        if not path.is_file():
            continue
        result = schema.read(path, schema.SWEEP)
        (length,) = result["settings"]["lengths"]  # RULER: one length per call (its docs are sorted by length)
        source = folder.relative_to(ROOT / "eval/results").as_posix() + "/"
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
        rows.append(f"| {length / 1024:g}k | `{scheme}` | " + " | ".join(row) + f" | {', '.join(sources[(length, scheme)])} |")
    return "\n".join(rows)


def passkey_table(folders, haystack: str = "prose") -> str:
    """(template, scheme, length) rows of the runs whose passkey hid in `haystack` (prose: also the runs from before
    the setting existed), one column per depth and one for the row: `k/n (low-high%)`, Wilson 95%."""
    cells, order, depths = {}, [], set()
    for folder in folders:
        result = _read(folder / "compare.json")
        if result is None or result["settings"].get("haystack", "prose") != haystack:
            continue
        template = "on" if result["settings"]["chat_template"]["used"] else "off"
        for c in result["passkey"]:
            key = (template, c["scheme"], c["length"])
            source = folder.relative_to(ROOT / "eval/results").as_posix()
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
            rows.append(f"| {template} | `{scheme}` | {length / 1024:g}k | " + " | ".join(row) + f" | {fmt(k, n)} | {cell['source']}/ |")
    return "\n".join(rows)


def fmt(k: int, n: int) -> str:
    low, high = wilson_interval(k, n)
    return f"{k}/{n} ({100 * low:.0f}–{100 * high:.0f}%)"


def replace_table(lines: list[str], mark: str, text: str) -> list[str]:
    start = lines.index(mark) + 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[:start] + text.split("\n") + lines[end:]


def _read(path: Path) -> dict | None:
    """A compare.json or search_log.json of the runs, checked against its schema (rope_patch/schema.py); None where
    the run has not been made."""
    if not path.is_file():
        return None
    return load_log(path) if path.name == "search_log.json" else load_results(path)


def tables() -> dict[str, str]:
    """Mark -> table, for the results that exist."""
    out = {MARK: table(load_results(RESULTS)), PASSKEY_MARK: passkey_table(PASSKEY)}
    if any((folder / "compare.json").is_file() for folder in PASSKEY_NOISE):
        out[PASSKEY_NOISE_MARK] = passkey_table(PASSKEY_NOISE, haystack="noise")
    if any((folder / "sweep.json").is_file() for folder in RULER):
        out[RULER_MARK] = ruler_table(RULER)
    if (results_32k := _read(RESULTS_32K)) and results_32k["records"]:
        out[MARK_32K] = table(results_32k)
    if (log := _read(TUNE)) and "acceptance" in log:
        out[TUNE_MARK] = tune_table(log)
    return out


def main() -> None:
    if "--readme" not in sys.argv[1:]:
        print("\n\n".join(tables().values()))
        return
    readme = ROOT / "README.md"
    lines = readme.read_text().split("\n")
    for mark, text in tables().items():
        if mark in lines:
            lines = replace_table(lines, mark, text)
    readme.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
