"""The committed rope-tiny searches (eval/results/tiny/tune_longrope-1k-n8*/, docs/guides/tuning.md): each log is a
valid, finished search whose individuals all satisfy the constraint, its best spec applies to rope-tiny, and (slow)
re-measuring the best spec on the acceptance text gives the logged perplexity."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import rope_patch
from rope_patch import zoo
from rope_patch.evaluation.common import read_tokens
from rope_patch.tuning import load_log, split_heldout
from rope_patch.tuning.objective import perplexities

RESULTS = Path(__file__).resolve().parents[2] / "eval" / "results" / "tiny"
# the default search (seeded with PI / NTK / YaRN ×4), and one seeded with YaRN's small-window betas as well
LOGS = {"default_init": RESULTS / "tune_longrope-1k-n8" / "search_log.json",
        "init_yarn_beta2": RESULTS / "tune_longrope-1k-n8-init_yarn_beta2" / "search_log.json"}


@pytest.fixture(scope="module", params=sorted(LOGS))
def log(request):
    return load_log(LOGS[request.param])


def test_the_committed_search_is_complete_and_constrained(log):
    s = log["settings"]
    assert log["status"] == "done" and s["scheme"] == "longrope" and s["method"] == "evolution"
    assert s["window"] == 256 and s["target"] == 1024
    e = s["evolution"]
    assert len(log["evaluations"]) == e["population"] + e["generations"] * (e["mutations"] + e["crossovers"])
    for rec in log["evaluations"]:
        f = rec["params"]["long_factor"]
        assert len(f) == 32 and all(a <= b for a, b in zip(f, f[1:], strict=False))
        assert 1.0 <= f[0] and f[-1] <= e["max_factor"]
        assert math.isfinite(rec["objective"])
    assert min(r["objective"] for r in log["evaluations"]) == log["best"]["objective"]
    first, second = log["split"]["tuning_tokens"], log["split"]["acceptance_tokens"]
    assert first[0] == 0 and first[1] == second[0] and second[1] == log["heldout"]["tokens"]


def test_the_best_spec_applies_to_rope_tiny(log):
    model, _ = zoo.load_model("tiny")
    rope_patch.apply(model, log["best"]["spec"])
    scheme = rope_patch.current(model)
    assert scheme.name == "longrope" and list(scheme.long_factor) == log["best"]["params"]["long_factor"]
    assert list(scheme.short_factor) == [1.0] * 32 and scheme.factor == 4.0


@pytest.mark.slow
def test_the_logged_acceptance_perplexity_is_reproduced(log):
    model, tokenizer = zoo.load_model("tiny")
    ids, info = read_tokens(tokenizer)
    assert info["sha256"] == log["heldout"]["sha256"]
    _, acceptance, split = split_heldout(ids)
    assert split == log["split"]
    acc = log["acceptance"]
    row = next(r for r in acc["rows"] if r["spec"] == log["best"]["spec"])
    ppl = perplexities(model, acceptance, log["best"]["spec"], [1024], acc["n_tokens"])
    assert ppl[1024] == pytest.approx(row["perplexity"]["1024"], rel=1e-4)


def test_the_searched_longrope_beats_pi_ntk_and_yarn_at_4x_within_5_percent_in_the_window(log):
    rows = {r["spec"]: r["perplexity"] for r in log["acceptance"]["rows"]}
    searched = rows[log["best"]["spec"]]
    for baseline in ("linear:4", "ntk:4", "yarn:4"):
        assert searched["1024"] < rows[baseline]["1024"], baseline
    assert searched["256"] <= 1.05 * rows["default"]["256"]
    if "yarn:factor=4,beta_fast=2" in log["settings"].get("init", []):  # seeded with it, the search beats it too
        assert searched["1024"] < rows["yarn:factor=4,beta_fast=2"]["1024"]
