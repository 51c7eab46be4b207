"""The chunked loss (evaluation/common.py `token_nll`) on a Gemma 3 layout: the tied output embedding and the final
logit soft-capping (None in Gemma 3 270M's config, set here too) honoured, equal to the loss of the model's own logits
to 1e-5, on the default path and with the sliding layers windowed (attention/windowed.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import VOCAB, tiny_hybrid

from rope_patch.attention.windowed import windowed
from rope_patch.evaluation import common
from rope_patch.evaluation.common import token_nll


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("windowed_layers", [False, True])
def test_chunked_nll_equals_the_models_own_loss(monkeypatch, softcap, windowed_layers):
    model = tiny_hybrid(final_logit_softcapping=softcap)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as Gemma 3 ships
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 60))
    with torch.no_grad():
        logits = model(ids).logits  # the model's own head: soft-capping included
    if softcap is not None:
        assert logits.abs().max().item() <= softcap
    full = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    monkeypatch.setattr(common, "LOGITS_BUDGET_BYTES", 4 * VOCAB * 2 * 7)  # 7 positions per chunk
    if windowed_layers:
        with windowed(model):
            got = token_nll(model, ids)
    else:
        got = token_nll(model, ids)
    assert got.shape == (2, 59)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
