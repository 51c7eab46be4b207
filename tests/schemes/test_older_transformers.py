"""Frequency schemes at the old end of the supported transformers window (5.19, SGLang's pin, inside vLLM 0.34's
range; `make test-compat` runs this file there): what a release before 5.21 cannot run on a natively configured model
either is refused at apply() with the version found and the one needed, the model left as it was; from 5.21 on the
same patch equals a natively built model, also on a second forward past the window."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from helpers.models import VOCAB, WINDOW, logits, native_twin, tiny_model
from packaging.version import Version

import rope_patch

OLD = Version(transformers.__version__) < Version("5.21")
PAIRS = 8  # head_dim 16
LONGROPE = dict(factor=4.0, short_factor=[1.0 + 0.1 * i for i in range(PAIRS)],
                long_factor=[1.0 + 0.5 * i for i in range(PAIRS)])
# (arch, scheme, params, what the refusal names) for the releases before 5.21
CASES = [
    # RoPE per layer type (sliding / full): the longrope update loses its cached long set on the second long forward
    ("gemma3_text", "longrope", LONGROPE, "longrope update fails on a model with RoPE per layer type"),
    ("olmo3", "longrope", LONGROPE, "longrope update fails on a model with RoPE per layer type"),
    # DeepSeek's attention scale reads `factor` under every non-default rope type; p_rope (`proportional`) has none
    ("deepseek_v3", "p_rope", dict(partial_rotary_factor=0.5), "computes its softmax scale at init"),
]
REFUSED_BEFORE_5_21 = {(arch, scheme) for arch, scheme, _, _ in CASES}


@pytest.mark.parametrize("arch,scheme,params,refusal", CASES, ids=[f"{a}-{s}" for a, s, _, _ in CASES])
def test_refused_before_5_21_and_native_from_it(arch, scheme, params, refusal):
    model = tiny_model(arch)
    ids = torch.randint(3, VOCAB, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))  # past the window
    before, config = logits(model, ids), model.config.to_dict()
    if OLD:
        with pytest.raises(ValueError, match=re.escape(refusal)) as err:
            rope_patch.apply(model, scheme, **params)
        # what was found, what is needed, what to do
        assert f"transformers {transformers.__version__}" in str(err.value)
        assert "pip install -U 'transformers>=5.21'" in str(err.value)
        assert rope_patch.current(model) is None and model.config.to_dict() == config
        assert torch.equal(logits(model, ids), before)
        return
    rope_patch.apply(model, scheme, **params)
    first, second = logits(model, ids), logits(model, ids)  # the second long forward is the one 5.19-5.20 fail on
    twin = native_twin(model, model.config.rope_parameters, model.config.max_position_embeddings)
    assert torch.equal(first, second) and (first - logits(twin, ids)).abs().max().item() <= 1e-5
