"""The documentation: the site builds with `mkdocs build --strict` (a broken link, a missing page, an API name that
mkdocstrings cannot resolve fail it), and the README stays a front door. Every ```python block of README.md and
docs/**/*.md runs as a test of its own (conftest.py at the root, pytest-markdown-docs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\S*)(.*)$")


def fences(path: Path) -> list[tuple[int, str]]:
    """(line, info string) of every opening fence of a Markdown file."""
    out, inside = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if line.startswith("```"):
            if not inside:
                out.append((number, line[3:].strip()))
            inside = not inside
    return out


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor, printed on every build
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "rope_patch.apply" in api and "Patch the position encoding" in api  # mkdocstrings read the docstrings


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def entries(nav):
        for item in nav:
            for value in item.values():
                yield from (entries(value) if isinstance(value, list) else [value])

    nav = sorted(entries(config["nav"]))
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert nav == pages


def test_the_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    lines = text.split("\n")
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail to docs/"
    first = "\n".join(lines[:60])
    assert "make demo" in first and "make test" in first and "pip install" in first
    start = next(n for n, info in fences(README) if info == "python")
    end = lines.index("```", start)
    assert end < 60, "the README's runnable example ends past its 60th line"
    assert "load_model(\"tiny\")" in "\n".join(lines[start:end]) and "rope_patch.remove" in "\n".join(lines[start:end])


@pytest.mark.parametrize("path", [README, *sorted(DOCS.rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_are_tested_or_say_why_not(path):
    """A ```python block runs as a test; one that cannot (`{.python notest}`) says why in the sentence before it.
    Shell commands are ```bash (or ```text for output), never an unmarked fence."""
    lines = path.read_text(encoding="utf-8").split("\n")
    for number, info in fences(path):
        assert info, f"{path.name}:{number}: a fence without a language (```bash, ```python, ```text)"
        if "notest" in info:
            before = "\n".join(lines[max(0, number - 4):number - 1])
            assert "sketch" in before or "not run" in before or "yours" in before, \
                f"{path.name}:{number}: a notest block needs its reason beside it"
