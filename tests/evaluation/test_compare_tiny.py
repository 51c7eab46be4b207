"""Integration: a small `compare` on the shipped model rope-tiny (window 256) shows the phenomena it exists for.

Slow-marked but sized for CI (about a minute on 2 cores): 4 schemes x 2 lengths (256, 8x the window) of
perplexity on the same 8192 held-out tokens, passkey at 256 and 1024 (30 prompts per scheme and length).

What the shipped model shows (README: vanilla 71.9 -> 120.5 perplexity from 256 to 2048 tokens, yarn x8 111.1,
dynamic x4 108.8; passkey 67% in the window and 0% at 1024 for vanilla, 100% at 1024 for yarn x8), asserted with
margins: vanilla's perplexity at 2048 is at least 1.5x its in-window value and every extension scheme stays below
it; vanilla's passkey collapses past the window while yarn keeps retrieving. The issue's target of >= 90%
in-window passkey is not reached by this model (62% on 50 prompts, models/rope-tiny/README.md): the test holds
the model to what it does, not to the target.
"""

from __future__ import annotations

import pytest
import torch

from rope_patch.evaluation.compare import run_compare
from rope_patch.models import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a 6M model gains little from a second thread, and loses a lot on a busy machine
    try:
        model, tok = load_model("tiny")  # shipped in models/rope-tiny: a missing model is a failure, not a skip
        yield run_compare(model, tok, ["default", "yarn:8", "ntk:8", "dynamic:4"], [256, 2048],
                          passkey_lengths=[256, 1024], depths=[0.1, 0.5, 0.9], passkey_samples=10, windows_at_longest=4)
    finally:
        torch.set_num_threads(before)


def _ppl(result, scheme, length):
    return next(r["perplexity"] for r in result["records"] if r["scheme"] == scheme and r["length"] == length)


def test_vanilla_degrades_past_the_window(result):
    assert _ppl(result, "default", 2048) > 1.5 * _ppl(result, "default", 256)


@pytest.mark.parametrize("scheme", ["yarn:8", "ntk:8", "dynamic:4"])
def test_extension_schemes_degrade_less(result, scheme):
    vanilla, extended = _ppl(result, "default", 2048), _ppl(result, scheme, 2048)
    assert extended < vanilla, (scheme, extended, vanilla)


def _passkey(result, scheme, length):
    return next(r["passkey_accuracy"] for r in result["records"] if r["scheme"] == scheme and r["length"] == length)


def test_passkey_in_window_and_past_it(result):
    assert _passkey(result, "default", 256) >= 0.5
    assert _passkey(result, "default", 1024) <= 0.1  # vanilla cannot retrieve at 4x its window
    assert _passkey(result, "yarn:8", 1024) >= 0.5  # yarn x8 can, without fine-tuning
