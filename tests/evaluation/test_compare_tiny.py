"""Integration: a small `compare` on the shipped model rope-tiny (window 256) shows the phenomena it exists for.

Slow-marked but sized for CI (under a minute on 2 cores): 4 schemes x 2 lengths (256, 8x the window) of
perplexity on the same 8192 held-out tokens, passkey in the window only (30 prompts per scheme).

Margins (rope-tiny's reference behaviour, ../shared/NOTES.md: vanilla 81 -> 156 from 256 to 2048 tokens, YaRN x8
92, dynamic x4 93): vanilla's perplexity at 2048 is at least 1.5x its in-window value, and each extension scheme
stays at least 10% below vanilla at 2048.
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
                          passkey_lengths=[256], depths=[0.1, 0.5, 0.9], passkey_samples=10, windows_at_longest=4)
    finally:
        torch.set_num_threads(before)


def _ppl(result, scheme, length):
    return next(r["perplexity"] for r in result["records"] if r["scheme"] == scheme and r["length"] == length)


def test_vanilla_degrades_past_the_window(result):
    assert _ppl(result, "default", 2048) > 1.5 * _ppl(result, "default", 256)


@pytest.mark.parametrize("scheme", ["yarn:8", "ntk:8", "dynamic:4"])
def test_extension_schemes_degrade_less(result, scheme):
    vanilla, extended = _ppl(result, "default", 2048), _ppl(result, scheme, 2048)
    assert extended < 0.9 * vanilla, (scheme, extended, vanilla)


def test_in_window_passkey(result):
    acc = next(r["passkey_accuracy"] for r in result["records"] if r["scheme"] == "default" and r["length"] == 256)
    assert acc >= 0.9
