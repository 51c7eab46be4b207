"""The one table of schemes the suites test (tests/helpers/schemes.py) is the registry's built-in schemes: a scheme
added without its row fails here, and so does a row whose scheme is gone (the suites would stop testing it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.schemes import BY_NAME, SCHEMES

import rope_patch
from rope_patch import registry
from rope_patch.specs import parse_scheme_spec


def builtin_schemes() -> dict:
    """name -> class of the listed built-in schemes (a scheme a test registers in this process is not one)."""
    return {name: registry.get_scheme_class(name) for name in registry.list_schemes()
            if registry.get_scheme_class(name).__module__.startswith("rope_patch.schemes.")}


def test_every_registered_scheme_has_a_row_and_every_row_is_registered():
    rows, builtin = [r.name for r in SCHEMES], builtin_schemes()
    assert len(rows) == len(set(rows)), "a scheme has two rows in tests/helpers/schemes.py"
    missing = sorted(set(builtin) - set(rows))
    assert not missing, f"registered schemes without a row in tests/helpers/schemes.py: {missing} (add one each)"
    gone = sorted(set(rows) - set(builtin))
    assert not gone, f"rows of tests/helpers/schemes.py that are no registered scheme: {gone}"


@pytest.mark.parametrize("name", list(BY_NAME))
def test_a_row_is_a_valid_scheme_of_its_family(name):
    row = BY_NAME[name]
    scheme = rope_patch.as_scheme(name, **row.params)
    assert type(scheme).kind == row.family
    assert parse_scheme_spec(row.spec) == scheme  # the row's spec string is the same scheme


# ---- the README's account of the schemes ---------------------------------------------------------------------------
README = Path(__file__).resolve().parents[1] / "README.md"
_UNITS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
         "seventeen eighteen nineteen".split()
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}


def _number(words: str) -> int:
    """'Twenty-four' -> 24, 'nineteen' -> 19, '24' -> 24."""
    if words.isdigit():
        return int(words)
    total = 0
    for part in words.lower().split("-"):
        total += _TENS[part] if part in _TENS else _UNITS.index(part)
    return total


@pytest.mark.parametrize("page", [README, README.parent / "docs" / "index.md"], ids=["README", "docs-index"])
def test_the_front_pages_count_the_listed_schemes(page):
    """The front door's "Twenty schemes" drifted from `rope-patch list` (24) as schemes were added (README.md and the
    documentation's front page, which repeats its introduction)."""
    intro = page.read_text(encoding="utf-8").split("\n## ", 1)[0]
    said = re.search(r"\b([A-Za-z]+(?:-[a-z]+)?|\d+) schemes\b", intro)
    assert said, f"{page.name}'s introduction no longer says how many schemes there are"
    listed = rope_patch.list_schemes()
    assert _number(said.group(1)) == len(listed), (
        f"{page.name} says {said.group(0)!r}; rope-patch list shows {len(listed)}: {', '.join(listed)}")


def test_every_listed_scheme_has_a_row_in_the_readme_table():
    table = README.read_text(encoding="utf-8").split("\n## Schemes", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)`", table, flags=re.M))
    assert sorted(set(rope_patch.list_schemes()) - rows) == []
