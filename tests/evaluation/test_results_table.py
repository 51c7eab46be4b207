"""The terminal table of `compare` (rope_patch/evaluation/results.py rich_table): a long scheme spec, such as the
ones `compare --target` takes from rope_patch.suggest, wraps between its parts, never inside one."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

import rope_patch
from rope_patch.evaluation.results import rich_table, spec_cell

SPECS = ["default", "self_extend_logistic:group_size=9,window_size=32,growth_rate=0.32",
         "leaky_rerope:window_size=64,factor=5.03", "yarn:4+self_extend:group_size=4,window_size=1024",
         "sink:sink_size=4,window_size=252"]
LENGTHS = [256, 512, 1024, 2048]


def _result() -> dict:
    records = [{"scheme": s, "length": L, "perplexity": 100.0 + i, "passkey_accuracy": 0.5}
               for i, s in enumerate(SPECS) for L in LENGTHS]
    return {"model": {"name": "tiny", "window": 256}, "schemes": [{"spec": s, "label": s} for s in SPECS],
            "records": records}


@pytest.mark.parametrize("spec", SPECS)
def test_a_cell_is_the_same_scheme(spec):
    """The spaced form still reads as the spec (copy it into --schemes or rope_patch.apply)."""
    assert rope_patch.as_scheme(spec_cell(spec)) == rope_patch.as_scheme(spec)


@pytest.mark.parametrize("width", [80, 100, 140])
def test_specs_wrap_between_their_parts(width):
    console = Console(record=True, width=width)
    console.print(rich_table(_result()))
    shown = console.export_text()
    assert "…" not in shown
    cells = [line.split("│")[1].strip() for line in shown.splitlines() if line.startswith("│")]
    words = {w for cell in cells for w in cell.split()}
    parts = {p for spec in SPECS for p in re.findall(r"[^:,+]+[:,]?", spec)}
    assert parts <= words, f"parts broken across lines: {sorted(parts - words)}"
