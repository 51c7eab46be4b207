"""bench/gpu_check.sh is the prepared check for a CUDA machine (issue 14): its CPU dry run must keep working, so the
one run a lent GPU allows is not spent on a broken script. Eager flex on CPU, a 2-layer SmolLM2-shaped model."""

from __future__ import annotations

import json
import sys

import pytest
from helpers.scripts import load_script


@pytest.mark.slow
@pytest.mark.parametrize("broken", [None, "alibii"])
def test_the_cpu_dry_run_measures_every_case_and_fails_on_a_bad_one(tmp_path, monkeypatch, broken):
    from rope_patch.attention import settings

    gc = load_script("bench/gpu_check.py")
    monkeypatch.setattr(settings, "FLEX_COMPILE", settings.FLEX_COMPILE)  # the script sets it; later tests read it
    monkeypatch.setitem(gc.SMOLLM2, "num_hidden_layers", 2)  # the shape of the rest is the real model's
    if broken:
        monkeypatch.setattr(gc, "EXACT", {"rerope": gc.EXACT["rerope"], broken: {}})
    out = tmp_path / "gpu_check.json"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu", "--no-compile", "--lengths", "64",
                                      "--decode-prompt", "64", "--decode-new", "2", "--out", str(out)])
    assert gc.main() == (1 if broken else 0)
    rows = json.loads(out.read_text())["rows"]
    exact = {r["scheme"]: r for r in rows if r["case"] == "exact"}
    assert list(exact) == list(gc.EXACT)
    for scheme, row in exact.items():
        if scheme == broken:
            assert "Unknown position-encoding scheme" in row["error"]
        else:
            assert row["ok"] and row["max_abs_diff"] <= 1e-4, row
    speed = [r for r in rows if r["case"] == "speed"]
    assert [r["scheme"] for r in speed] == list(gc.SPEED)
    assert all(r["time_s"] > 0 and r["length"] == 64 and "error" not in r for r in speed), speed
    assert all(r["time_x_vanilla"] > 0 for r in speed)
    decode = [r for r in rows if r["case"] == "decode"]
    assert [r["scheme"] for r in decode] == list(gc.SPEED)
    assert all(r["ms_per_token"] > 0 and r["prompt"] == 64 and r["time_x_vanilla"] > 0 for r in decode), decode
    # the re-positioning schemes cache more than vanilla (a key copy per position map), the others the same
    assert all(r["cache_x_vanilla"] >= 1 for r in decode)
    assert {r["scheme"]: r["cache_x_vanilla"] for r in decode}["yarn"] == 1


def test_the_default_output_is_ignored_and_not_the_checkout_root():
    """Without --out the check writes out/gpu_check.json in the checkout (git ignores out/), never the root."""
    import subprocess

    from helpers.scripts import ROOT

    gc = load_script("bench/gpu_check.py")
    assert gc.OUT == ROOT / "out" / "gpu_check.json"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", "out/gpu_check.json"], cwd=ROOT)
    assert ignored.returncode == 0
