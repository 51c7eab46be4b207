"""bench/decode.py (issue 29) keeps running: every attention-side scheme's model is patched at the benchmark's settings,
prefilled and stepped beside vanilla's, and each row carries its ratio to vanilla and its cache's size. Timings are
not asserted (a benchmark, not a timed test); a 64-token prompt on the 2-layer model keeps it short."""

from __future__ import annotations

import json

from helpers.models import tiny_model
from helpers.schemes import cases
from helpers.scripts import load_script

import rope_patch
from rope_patch.attention.protocol import STATE


def runs_own_attention(scheme: str, params: dict) -> bool:
    """Does the patched model attend through rope_patch's attention function (its modules carry its state)? The
    schemes that keep the model's own attention (no position in attention to re-place) need no decode row."""
    model = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(model, scheme, **params)
    return any(hasattr(m, STATE) for m in model.modules())


def test_the_decode_benchmark_covers_every_attention_scheme(tmp_path):
    bench = load_script("bench/decode.py")
    attention_side = {name for name, params in cases("attention") if runs_own_attention(name, params)}
    assert {"alibi", "self_extend", "ms_poe"} <= attention_side and "nope" not in attention_side
    assert attention_side <= set(bench.schemes(4096)), "a new attention-side scheme has no decode benchmark row"
    out = tmp_path / "decode.json"
    bench.main(["--model", "2-layer", "--prompts", "64", "--new", "2", "--rounds", "1", "--out", str(out)])
    (result,) = json.loads(out.read_text())
    rows = {row["scheme"]: row for row in result["rows"]}
    assert set(rows) == set(bench.schemes(4096))
    assert rows["vanilla"]["ratio"] == 1.0 and rows["vanilla"]["cache_ratio"] == 1.0
    for row in rows.values():
        assert row["ms_per_token"] > 0 and row["cache_mb"] > 0 and len(row["round_ratios"]) == 1
    # the schemes that read two position maps of a key cache both (values once): 1.5x vanilla's cache
    assert rows["self_extend"]["cache_ratio"] == 1.5 and rows["alibi"]["cache_ratio"] == 1.0
    assert len(result["load_before"]) == 3


def test_the_decode_benchmark_takes_fewer_layers_and_the_cpu_clock(tmp_path):
    bench = load_script("bench/decode.py")
    out = tmp_path / "decode.json"
    bench.main(["--model", "smollm2", "--layers", "1", "--clock", "cpu", "--prompts", "32", "--new", "2", "--rounds",
                "2", "--schemes", "rerope", "--out", str(out)])
    (result,) = json.loads(out.read_text())
    assert (result["layers"], result["clock"]) == (1, "process_time")
    assert [row["scheme"] for row in result["rows"]] == ["vanilla", "rerope"]
    assert all(row["ms_per_token"] > 0 and len(row["round_ratios"]) == 2 for row in result["rows"])
