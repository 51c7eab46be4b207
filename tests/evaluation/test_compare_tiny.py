"""Integration: a small `compare` on the shipped model rope-tiny (window 256) shows the phenomena it exists for.

Slow-marked but sized for CI (about a minute on 2 cores): 5 schemes x 2 lengths (256, 8x the window) of
perplexity on the same 8192 held-out tokens, passkey at 256 and 1024 (30 prompts per scheme and length).

What the shipped model gives here: vanilla 77.9 -> 136.8 perplexity from 256 to 2048 tokens (1.76x); yarn x8
122.3 -> 125.0, ntk x8 106.5 -> 136.9, dynamic x4 77.9 -> 122.2, llama3 x8 94.7 -> 100.1; passkey 93% in the
window and 7% at 1024 for vanilla, 90% at 1024 for llama3 x8. Asserted with margins: vanilla's perplexity at 2048
is at least 1.5x its in-window value; every extension scheme grows less than that past the window (ntk x8 and yarn
x8 pay for it inside the window: on this model their absolute perplexity at 2048 is at or below vanilla's, not
much better); the issue's in-window passkey target (>= 90%) holds; vanilla's passkey collapses past the window
while llama3 x8 keeps retrieving without fine-tuning.
"""

from __future__ import annotations

import pytest

from rope_patch.evaluation.compare import run_compare
from rope_patch.zoo import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result():
    model, tok = load_model("tiny")  # shipped in rope_patch/data/rope-tiny: a missing model is a failure, not a skip
    return run_compare(model, tok, ["default", "yarn:8", "ntk:8", "dynamic:4", "llama3:8"], [256, 2048],
                       passkey_lengths=[256, 1024], depths=[0.1, 0.5, 0.9], passkey_samples=10, windows_at_longest=4)


def _ppl(result, scheme, length):
    return next(r["perplexity"] for r in result["records"] if r["scheme"] == scheme and r["length"] == length)


def test_vanilla_degrades_past_the_window(result):
    assert _ppl(result, "default", 2048) > 1.5 * _ppl(result, "default", 256)


@pytest.mark.parametrize("scheme", ["yarn:8", "ntk:8", "dynamic:4", "llama3:8"])
def test_extension_schemes_degrade_less(result, scheme):
    """Growth from 256 to 2048 tokens below vanilla's; absolute perplexity at 2048 no worse than vanilla's."""
    growth = {s: _ppl(result, s, 2048) / _ppl(result, s, 256) for s in ("default", scheme)}
    assert growth[scheme] < 0.95 * growth["default"], growth
    assert _ppl(result, scheme, 2048) <= 1.01 * _ppl(result, "default", 2048)


def _passkey(result, scheme, length):
    return next(r["passkey_accuracy"] for r in result["records"] if r["scheme"] == scheme and r["length"] == length)


def test_passkey_in_window_and_past_it(result):
    assert _passkey(result, "default", 256) >= 0.9  # the target for the shipped model
    assert _passkey(result, "default", 1024) <= 0.2  # vanilla cannot retrieve at 4x its window
    assert _passkey(result, "llama3:8", 1024) >= 0.7  # llama3 x8 can, without fine-tuning
