"""The API reference (docs/reference/*.md, `::: name` rendered by mkdocstrings with griffe's Google-style parser)
shows one entry per Returns / Yields section: griffe starts a new item at every line indented like the first, so a
description that wraps must indent its continuation lines (the `patched` "Yields" rendered as two rows)."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe")

DOCS = Path(__file__).resolve().parents[1] / "docs"
RENDERED = sorted({m for page in DOCS.rglob("*.md") for m in re.findall(r"^::: ([\w.]+)", page.read_text("utf-8"),
                                                                              flags=re.M)})


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _documented(obj):
    """The object and, for a class, its public methods (mkdocstrings renders them too)."""
    yield obj
    if inspect.isclass(obj):
        for name, member in vars(obj).items():
            if not name.startswith("_") and inspect.isfunction(member):
                yield member


def test_the_reference_pages_are_found():
    # with no directive the parametrized test below would collect nothing and pass
    assert "rope_patch.patched" in RENDERED, "the ::: directives of docs/reference/ were not found"


@pytest.mark.parametrize("dotted", RENDERED)
def test_a_returns_or_yields_section_is_one_entry(dotted):
    for obj in _documented(_resolve(dotted)):
        doc = inspect.getdoc(obj)
        if not doc:
            continue
        for section in griffe.Docstring(doc, parser="google").parse(warnings=False):
            if section.kind.value in ("returns", "yields"):
                assert len(section.value) == 1, (
                    f"{dotted} ({getattr(obj, '__qualname__', obj)}): its {section.kind.value.title()} section renders "
                    f"as {len(section.value)} rows; indent the continuation lines of the description")
