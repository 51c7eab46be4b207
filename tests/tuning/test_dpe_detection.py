"""DPE's detection sweep (rope_patch.tuning.dpe): its baseline 2N/L reads L, the window the model was pre-trained on,
as the rest of rope_patch does (suggest.pretraining_window), not the config's max_position_embeddings."""

from __future__ import annotations

import pytest
from helpers.models import WINDOW, tiny_model

import rope_patch
from rope_patch.tuning import detect_group_sizes


def plain():
    return tiny_model("llama")


def shipped_llama3():  # a checkpoint that ships with scaling (Llama 3.1: 8192 of 131072): L = 32, not 128
    return tiny_model("llama", max_position_embeddings=4 * WINDOW,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": WINDOW})


def patched_yarn():  # a model patched with yarn ×4 announces 4L: the sweep replaces that patch, L is still 32
    return rope_patch.apply(tiny_model("llama"), "yarn", factor=4)


@pytest.mark.parametrize("make", [plain, shipped_llama3, patched_yarn], ids=lambda f: f.__name__)
def test_the_baseline_is_2n_over_the_pretraining_window(make):
    """Before: L = model.config.max_position_embeddings, so a checkpoint shipped with scaling (Llama 3.1: 131072) or a
    model patched with an extending scheme got a baseline 4x too small here (2 instead of 8)."""
    model = make()
    before = rope_patch.current(model)
    seen = []

    def score(m):
        seen.append(rope_patch.current(m).group_sizes)
        return 0.0

    target = 4 * WINDOW
    detect_group_sizes(model, score, target=target, window_size=16, groups=2)
    baseline = 2 * target // WINDOW
    assert seen[0] == (1, baseline) and rope_patch.current(model) == before
