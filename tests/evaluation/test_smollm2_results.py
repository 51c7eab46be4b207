"""The README's SmolLM2 tables are what eval/results/smollm2/table.py computes from the committed result JSONs
(perplexity by position at 16k and 32k, the tuned scheme's acceptance, passkey by length x depth), so a re-run that
changes a number and forgets the README fails here. No model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.scripts import ROOT, load_script

TABLE = load_script("eval/results/smollm2/table.py")
TABLES = TABLE.tables()


@pytest.mark.parametrize("mark", list(TABLES))
def test_the_readme_table_is_the_committed_results(mark):
    lines = (ROOT / "README.md").read_text(encoding="utf-8").split("\n")
    assert mark in lines, f"README.md lost the mark {mark}"
    start = lines.index(mark) + 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    assert "\n".join(lines[start:end]) == TABLES[mark], f"run `python eval/results/smollm2/table.py --readme` ({mark})"


def test_every_result_table_has_a_place_in_the_readme():
    """The 16k and passkey tables always exist; 32k and tune appear once their runs are committed."""
    assert {TABLE.MARK, TABLE.PASSKEY_MARK} <= set(TABLES)


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
def test_the_passkey_table_keeps_one_haystack(tmp_path, monkeypatch, haystack, expected):
    """A run without the setting is a prose run (it predates noise); a noise run never lands in the prose table."""
    monkeypatch.setattr(TABLE, "ROOT", tmp_path)
    runs = tmp_path / "eval/results"
    _passkey_run(runs / "old", None, 2)
    _passkey_run(runs / "prose", "prose", 1)
    _passkey_run(runs / "noise", "noise", 3)
    table = TABLE.passkey_table([runs / "old", runs / "prose", runs / "noise"], haystack=haystack)
    # one row: a (template, scheme, length) cell in two prose runs is the first folder's, as in the README's table
    (row,) = table.split("\n")[2:]
    assert row.split(" | ")[3].startswith(expected + " ")
