"""The README's SmolLM2 tables are what eval/results/smollm2/table.py computes from the committed result JSONs
(perplexity by position at 16k and 32k, the tuned scheme's acceptance, passkey by length x depth), so a re-run that
changes a number and forgets the README fails here. No model is loaded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _table_module():
    spec = importlib.util.spec_from_file_location("smollm2_table", ROOT / "eval/results/smollm2/table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE = _table_module()
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
