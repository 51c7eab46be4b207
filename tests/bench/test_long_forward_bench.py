"""bench/long_forward.py keeps running: both paths on the random hybrid past its sliding window, the same loss from
both, a peak and a time per path. Timings and memory are not asserted (a benchmark, not a timed test)."""

from __future__ import annotations

import json

import pytest
from helpers.scripts import load_script


@pytest.mark.slow
def test_the_long_forward_benchmark_runs_both_paths(tmp_path, capsys):
    bench = load_script("bench/long_forward.py")
    out = tmp_path / "rows.json"
    rows = bench.main(["--model", "hybrid", "--length", "700", "--threads", "1", "--json", str(out)])
    assert [r["path"] for r in rows] == ["default", "windowed"] and all(r["length"] == 700 for r in rows)
    assert abs(rows[0]["mean_nll"] - rows[1]["mean_nll"]) <= 1e-5  # past the window of 512: the same model
    assert all(r["time_s"] > 0 and r["peak_rss_mb"] >= 0 and len(r["load"]) == 2 for r in rows)
    assert json.loads(out.read_text())["rows"] == rows
    assert "| windowed | 700 |" in capsys.readouterr().out
