"""Each study's tables (docs/studies/*.md) are what rope_patch.evaluation.tables computes from the committed result
files of the runs its eval/<study>/tables.json lists (SmolLM2: perplexity by position at 16k and 32k, the tuned
scheme's acceptance, passkey by length x depth, RULER; Gemma 3: perplexity by position at 64k), so a re-run that
changes a number and forgets the page fails here. No model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.scripts import ROOT, load_script

from rope_patch import schema
from rope_patch.evaluation import tables

STUDIES = {path.parent.name: tables.load_study(path) for path in sorted((ROOT / "eval").glob("*/tables.json"))}
CASES = [(name, mark, table) for name, study in STUDIES.items() for mark, table in tables.compute(study).items()]


@pytest.mark.parametrize("name, mark, table", CASES, ids=[f"{n}:{m}" for n, m, _ in CASES])
def test_the_study_table_is_the_committed_results(name, mark, table):
    study = STUDIES[name]
    found = tables.tables_in(study["document"].read_text(encoding="utf-8"), [mark])[mark]
    assert found is not None, f"{study['document'].name} lost the mark {mark}"
    assert found == table, f"run `python eval/{name}/table.py --write` ({mark})"


@pytest.mark.parametrize("name", list(STUDIES))
def test_the_study_covers_every_table_of_its_page(name):
    study = STUDIES[name]
    marks = [line for line in study["document"].read_text(encoding="utf-8").split("\n")
             if line.startswith(f"<!-- {name}")]
    assert sorted(marks) == sorted(t["mark"] for t in study["tables"])
    assert study["document"] == ROOT / "docs" / "studies" / f"{name}.md"
    assert study["results"] == ROOT / "eval" / "results"


def test_a_missing_run_names_itself(tmp_path):
    study = json.loads((ROOT / "eval" / "smollm2" / "tables.json").read_text(encoding="utf-8"))
    study["results"] = str(ROOT / "eval" / "results")
    study["document"] = str(ROOT / "docs" / "studies" / "smollm2.md")
    study["tables"][0]["runs"] = ["smollm2/ppl16k"]  # a folder by its old name
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(study))
    with pytest.raises(FileNotFoundError, match="smollm2/ppl16k, which is not a folder"):
        tables.load_study(path)
    path.write_text(json.dumps({**study, "tables": [{**study["tables"][0], "kind": "plot"}]}))
    with pytest.raises(schema.FileFormatError, match="kind"):
        tables.load_study(path)


def _passkey_run(folder: Path, haystack: str | None, correct: int) -> None:
    """A passkey-only compare.json (the keys its schema requires, rope_patch/schema.py)."""
    settings = {"lengths": [], "passkey_lengths": [4096], "depths": [0.5], "passkey_samples": 3, "seed": 0,
                "ppl_tokens": 0, "chat_template": {"used": True}, **({"haystack": haystack} if haystack else {})}
    cells = [{"scheme": "default", "length": 4096, "depth": 0.5, "correct": correct, "n": 3}]
    records = [{"scheme": "default", "length": 4096, "perplexity": None, "passkey_accuracy": correct / 3}]
    folder.mkdir(parents=True)
    (folder / "compare.json").write_text(json.dumps({
        "format": "rope_patch.compare/1", "model": {"name": "smollm2"}, "settings": settings,
        "schemes": [{"spec": "default", "label": "default"}], "records": records, "passkey": cells}))


@pytest.mark.parametrize("haystack, expected", [("prose", "2/3"), ("noise", "3/3")])
def test_the_passkey_table_keeps_one_haystack(tmp_path, haystack, expected):
    """A run without the setting is a prose run (it predates noise); a noise run never lands in the prose table."""
    runs = tmp_path / "eval/results"
    _passkey_run(runs / "old", None, 2)
    _passkey_run(runs / "prose", "prose", 1)
    _passkey_run(runs / "noise", "noise", 3)
    table = tables.passkey_table([runs / "old", runs / "prose", runs / "noise"], runs, haystack=haystack)
    # one row: a (template, scheme, length) cell in two prose runs is the first folder's, as in the study's table
    (row,) = table.split("\n")[2:]
    assert row.split(" | ")[3].startswith(expected + " ")
    assert row.endswith(f" | {'noise' if haystack == 'noise' else 'old'}/ |")


def test_replace_tables_rewrites_only_below_the_marks():
    text = "a\n<!-- m -->\n| x |\n| --- |\n| 1 |\nb\n<!-- n -->\nc"
    out = tables.replace_tables(text, {"<!-- m -->": "| y |\n| --- |\n| 2 |", "<!-- absent -->": "| z |"})
    assert out == "a\n<!-- m -->\n| y |\n| --- |\n| 2 |\nb\n<!-- n -->\nc"
    assert tables.tables_in(out, ["<!-- m -->", "<!-- absent -->"]) == {"<!-- m -->": "| y |\n| --- |\n| 2 |",
                                                                         "<!-- absent -->": None}


def _rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.split("\n")[2:]]


def test_the_readme_headline_is_the_study():
    """README.md's results table is a few cells of the study's: perplexity over the 16k window and in its last bucket
    (the 16k table), RULER's niah_single_1 at 16k (k/n without the interval; '–' where that scheme was not run)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    study = tables.compute(STUDIES["smollm2"])
    mark = next(line for line in readme.split("\n") if line.startswith("<!-- headline:"))
    headline = readme.split(mark + "\n", 1)[1].split("\n\n", 1)[0]
    ppl = {row[0]: row for row in _rows(study["<!-- smollm2-table -->"])}
    ruler = {row[1]: row[2].split(" ")[0] for row in _rows(study["<!-- smollm2-ruler -->"]) if row[0] == "16k"}
    rows = _rows(headline)
    assert len(rows) >= 5
    for scheme, everything, last, needle in rows:
        assert scheme in ppl, f"README's headline row {scheme} is no row of the 16k table"
        assert [everything, last] == [ppl[scheme][1], ppl[scheme][-1]], scheme
        assert needle == ruler.get(scheme, "–"), scheme


def test_the_readme_gemma3_headline_is_the_study():
    """README.md's hybrid-model table is the Gemma 3 study's 64k perplexity table, every row: over the window and in
    its last bucket."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    mark = next(line for line in readme.split("\n") if line.startswith("<!-- headline-gemma3:"))
    headline = _rows(readme.split(mark + "\n", 1)[1].split("\n\n", 1)[0])
    table = _rows(tables.compute(STUDIES["gemma3"])["<!-- gemma3-ppl64k -->"])
    assert headline == [[row[0], row[1], row[-1]] for row in table]


def test_the_gemma3_ruler_schemes_are_vanilla_and_the_best_extensions():
    """eval/gemma3/best.py: 'default' and the 3 lowest whole-window perplexities, windows (sink) left out; an
    unfinished table is refused unless asked for; the run script lists the study's schemes."""
    best = load_script("eval/gemma3/best.py")
    records = [{"scheme": s, "name": s.split(":")[0], "perplexity": p}
               for s, p in [("default", 57.8), ("yarn:factor=2", 50.1), ("sink:window_size=8", 40.0),
                            ("dca:chunk_size=8", 46.0), ("self_extend:group_size=5", 45.0), ("rerope:w=2", 47.0)]]
    assert best.best({"records": records}) == ["default", "self_extend:group_size=5", "dca:chunk_size=8",
                                               "rerope:w=2"]
    with pytest.raises(SystemExit, match="not finished .1 schemes pending: x."):
        best.main([], {"records": records, "pending": ["x"]})
    best.main(["--partial"], {"records": records, "pending": ["x"]})
    best.main(["--partial"])  # the committed table reads
    assert load_script("eval/gemma3/layers.py").schemes()[:2] == ["default", "yarn:factor=2"]
