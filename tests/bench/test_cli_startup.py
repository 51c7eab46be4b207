"""bench/cli_startup.py (issue 29) keeps running: every case ends with its exit status, the summary has the medians,
the ratios, the load and the import profile. Timings are not asserted (a benchmark, not a timed test); the bare
`import torch` is swapped for a cheaper stand-in to keep this test short."""

from __future__ import annotations

import json
import sys

from helpers.scripts import load_script


def test_the_startup_benchmark_writes_its_summary(tmp_path, monkeypatch):
    bench = load_script("bench/cli_startup.py")
    real = bench.cases

    def cheaper(cli):
        todo = real(cli)
        todo["import_torch"] = ([sys.executable, "-c", "import json"], 0)  # stand-in: the schema, not the number
        return todo

    monkeypatch.setattr(bench, "cases", cheaper)
    out = tmp_path / "startup.json"
    assert bench.main(["--reps", "1", "--out", str(out)]) in (0, 1)  # 1: the stand-in makes the target unmeetable
    summary = json.loads(out.read_text())
    assert list(summary["cases"]) == ["help", "argument_error", "list", "import_torch", "python"]
    assert summary["cases"]["help"]["command"] == "rope-patch --help"
    assert summary["cases"]["argument_error"]["command"] == "rope-patch compare --model tiny --lengths 1k"
    for case in summary["cases"].values():
        assert len(case["times_s"]) == 1 and case["median_s"] > 0 and case["x_import_torch"] > 0
    assert summary["cases"]["import_torch"]["x_import_torch"] == 1
    assert len(summary["machine"]["loadavg_start"]) == 3 and summary["reps"] == 1
    profile = summary["import_profile_help"]
    assert not profile["torch_imported"] and not profile["transformers_imported"] and profile["top_cumulative_ms"]
