"""bench/attention.py (issue 29) keeps running: every scheme gets its memory, steady time and first call (the median
of its rounds of fresh processes), the load beside every row, and the table its ratios. Timings are not asserted (a
benchmark, not a timed test); a 64-token input keeps the subprocesses short."""

from __future__ import annotations

import json
import sys

import pytest
from helpers.scripts import ROOT, load_script


@pytest.mark.slow
def test_the_prefill_benchmark_writes_every_scheme(tmp_path, monkeypatch, capsys):
    bench = load_script("bench/attention.py")
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["attention.py", "--lengths", "64", "--schemes", "rope", "alibi",
                                      "--repeats", "1", "--first-runs", "2", "--naive-max", "0", "--json", str(out)])
    monkeypatch.setattr(bench, "__file__", str(ROOT / "bench" / "attention.py"))
    bench.main()
    rows = json.loads(out.read_text())
    assert [r["scheme"] for r in rows] == ["rope", "alibi"]
    for r in rows:
        assert r["length"] == 64 and r["peak_mb"] > 0 and r["time_s"] > 0
        assert len(r["first_runs_s"]) == 2 and min(r["first_runs_s"]) <= r["first_s"] <= max(r["first_runs_s"])
        assert len(r["load"]) == 2
    table = capsys.readouterr().out
    assert "| rope | 64 |" in table and "| alibi | 64 |" in table
