"""bench/gpu_check.sh is the prepared check for a CUDA machine (issues 14, 39): its CPU dry run must keep working, so
the one run a lent GPU allows is not spent on a broken script. Eager flex on CPU, the tiny shape (`--shape tiny`);
the plan of the real run (a Llama-3.2-1B shape at 64k and 128k) is checked without running it."""

from __future__ import annotations

import json

import pytest
from helpers.scripts import load_script

KEYS = {"forward": "length", "decode": "prompt", "lora": "length", "exact": None}


def _key(row):
    return (row["case"], row["scheme"], row.get(KEYS[row["case"]]) if KEYS[row["case"]] else None)


def _dry(gc, tmp_path, *extra):
    out = tmp_path / "gpu_check.json"
    argv = ["--device", "cpu", "--no-compile", "--shape", "tiny", "--decode-new", "2", "--out", str(out), *extra]
    return gc.main(argv), json.loads(out.read_text()), gc.parse_args(argv)


@pytest.fixture
def gc(monkeypatch):
    from rope_patch.attention import settings

    monkeypatch.setattr(settings, "FLEX_COMPILE", settings.FLEX_COMPILE)  # the script sets it; later tests read it
    return load_script("bench/gpu_check.py")


@pytest.mark.slow
def test_the_cpu_dry_run_measures_every_planned_row(gc, tmp_path):
    """Every case once on a few schemes (a bias, a declared scheme, DCA's own flex path, a frequency scheme): every
    planned row is in the JSON, in the plan's order, measured (no row skipped or failed here)."""
    code, result, args = _dry(gc, tmp_path, "--lengths", "128", "--decode-prompt", "64", "--lora-length", "128",
                              "--schemes", "self_extend", "dca", "alibi", "yarn")
    rows = result["rows"]
    assert [_key(r) for r in rows] == [_key(r) for r in gc.plan(args)]
    bad = [r for r in rows if "error" in r or "skipped" in r]
    assert code == 0 and not bad, bad
    by_case = {c: {r["scheme"]: r for r in rows if r["case"] == c} for c in gc.CASES}
    assert list(by_case["forward"]) == ["vanilla", "self_extend", "dca", "yarn"]
    assert all(r["time_s"] > 0 and r["time_x_vanilla"] > 0 for r in by_case["forward"].values())
    assert list(by_case["exact"]) == ["alibi", "self_extend", "dca"]
    assert all(r["ok"] and r["max_abs_diff"] <= 1e-4 for r in by_case["exact"].values())
    assert list(by_case["decode"]) == ["vanilla", "self_extend", "dca", "yarn"]
    for r in by_case["decode"].values():  # the cached step equals recomputation (fp32 on CPU)
        assert r["ok"] and r["recompute_rel_diff"] <= 1e-4 and r["ms_per_token"] > 0, r
    # the re-positioning scheme caches a key copy per position map, the others the same as vanilla
    assert by_case["decode"]["self_extend"]["cache_x_vanilla"] > 1 and by_case["decode"]["yarn"]["cache_x_vanilla"] == 1
    assert list(by_case["lora"]) == ["vanilla", "yarn", "self_extend"]
    assert all(r["time_s"] > 0 and r["trainable"] > 0 for r in by_case["lora"].values())
    assert all("on_target" in r for c in ("forward", "decode", "lora") for r in rows if r["case"] == c
               and r["scheme"] != "vanilla")


def test_past_the_budget_every_planned_row_is_written_as_skipped(gc, tmp_path):
    """The whole default plan of the tiny shape with no budget left: no row dropped, each skipped with the reason."""
    code, result, args = _dry(gc, tmp_path, "--budget-s", "0")
    rows = result["rows"]
    assert code == 0 and [_key(r) for r in rows] == [_key(r) for r in gc.plan(args)]
    assert all(r["skipped"] == "budget" for r in rows)
    assert {r["case"] for r in rows} == set(gc.CASES)


def test_a_broken_row_is_recorded_and_fails_the_run(gc, tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "EXACT", {"rerope": gc.EXACT["rerope"], "alibii": {}})
    code, result, _ = _dry(gc, tmp_path, "--cases", "exact")
    exact = {r["scheme"]: r for r in result["rows"]}
    assert code == 1 and list(exact) == ["rerope", "alibii"]
    assert exact["rerope"]["ok"] and "Unknown position-encoding scheme" in exact["alibii"]["error"]


def test_the_real_plan_puts_64k_forward_of_every_length_extending_scheme_first(gc):
    """The GPU run's plan (built on the meta device): the 64k forward of vanilla and every scheme suggest() names for
    64k (YaRN standing for the frequency schemes; STRING on top of YaRN) first, then exactness, the 128k forward,
    decoding after a 32k prompt, the LoRA step at 32k."""
    rows = gc.plan(gc.parse_args([]))
    cases = [(r["case"], r.get("length") or r.get("prompt")) for r in rows]
    order = ["forward@65536", "exact@None", "forward@131072", "decode@32768", "lora@32768"]
    assert list(dict.fromkeys(f"{c}@{n}" for c, n in cases)) == order
    first = [r["scheme"] for r in rows if r["case"] == "forward" and r["length"] == 65536]
    assert first[0] == "vanilla" and set(first[1:]) == set(gc.PRIORITY)
    assert {r["scheme"] for r in rows if r["case"] == "forward" and r["length"] == 131072} == set(first)
    assert [r["scheme"] for r in rows if r["case"] == "exact"] == list(gc.EXACT)
    string = next(r for r in rows if r["scheme"] == "string" and r["case"] == "forward")
    assert string["_run"][0].startswith("yarn:") and "+string:" in string["_run"][0]
    assert all(r["_run"][1] == ("sdpa" if r["scheme"] in ("vanilla", "yarn") else "flex_attention")
               for r in rows if r["case"] == "forward")
    assert [r["scheme"] for r in rows if r["case"] == "lora"] == ["vanilla", "yarn", "self_extend"]
    assert set(gc.EXACT) >= {"self_extend_logistic", "dpe", "sink", "lm_infinite", "ms_poe"}


def test_the_results_file_is_named_after_the_device(gc):
    assert gc.short_name("NVIDIA H200") == "h200"
    assert gc.short_name("NVIDIA H100 80GB HBM3") == "h100"


def test_the_default_output_is_ignored_and_not_the_checkout_root(gc):
    """Without --out the check writes out/gpu_check.json in the checkout (git ignores out/), never the root."""
    import subprocess

    from helpers.scripts import ROOT

    assert gc.OUT == ROOT / "out" / "gpu_check.json"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", "out/gpu_check.json"], cwd=ROOT)
    assert ignored.returncode == 0
