"""Bad input raises at apply() with what was expected, what was found and what to do; the model is unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import WINDOW, logits, tiny_model

import rope_patch

BAD = [
    # scheme, params, exception, message fragment
    ("yarnn", {}, ValueError, "Did you mean 'yarn'"),
    ("rope_scaling_magic", {}, ValueError, "Available: "),
    (3, {}, TypeError, "must be a str"),
    ("yarn", dict(factr=4), TypeError, "Did you mean 'factor'"),
    ("yarn", dict(factor="4"), TypeError, "must be a number, got str"),
    ("yarn", {}, TypeError, "missing required parameter `factor`"),
    ("linear", dict(factor=0), ValueError, ">= 1.0"),
    ("linear", dict(factor=0.5), ValueError, "shrink"),
    ("linear", dict(factor=float("nan")), ValueError, "finite"),
    ("linear", dict(factor=True), TypeError, "must be a number, got bool"),
    ("default", dict(rope_theta=-1), ValueError, "rope_theta"),
    ("dynamic", dict(factor=2, original_max_position_embeddings=0), ValueError, ">= 1"),
    ("dynamic", dict(factor=2, original_max_position_embeddings=12.5), TypeError, "must be an integer"),
    ("yarn", dict(factor=4, beta_fast=1, beta_slow=2), ValueError, "beta_fast` must be > `beta_slow"),
    ("yarn", dict(factor=4, truncate="yes"), TypeError, "True or False"),
    ("llama3", dict(factor=8, low_freq_factor=4, high_freq_factor=1), ValueError, "low_freq_factor` must be <"),
    ("longrope", dict(factor=4, long_factor=[1.0] * 8), TypeError, "missing required parameter `short_factor`"),
    ("longrope", dict(factor=4, short_factor=[1.0] * 3, long_factor=[1.0] * 8), ValueError, "must have rotary_dim/2 = 8"),
    ("longrope", dict(factor=4, short_factor="1,2", long_factor=[1.0] * 8), TypeError, "list of numbers"),
    ("longrope", dict(factor=4, short_factor=[1.0] * 8, long_factor=[0.0] * 8), ValueError, "long_factor\\[0\\]"),
    ("p_rope", dict(partial_rotary_factor=1.5), ValueError, "<= 1.0"),
    ("p_rope", {}, TypeError, "partial_rotary_factor"),
    ("ntk", dict(factor=2, alpha=2), TypeError, "not both"),
]


@pytest.mark.parametrize("scheme,params,exc,match", BAD, ids=[f"{s}-{i}" for i, (s, *_) in enumerate(BAD)])
@pytest.mark.parametrize("patched_first", [False, True], ids=["clean", "patched"])
def test_bad_input_raises_and_leaves_model_unchanged(scheme, params, exc, match, patched_first):
    model = tiny_model()
    if patched_first:
        rope_patch.apply(model, "linear", factor=2)
    ids = torch.randint(3, 97, (1, 2 * WINDOW), generator=torch.Generator().manual_seed(0))
    before, config, current = logits(model, ids), model.config.to_dict(), rope_patch.current(model)
    with pytest.raises(exc, match=match):
        rope_patch.apply(model, scheme, **params)
    assert torch.equal(logits(model, ids), before)
    assert model.config.to_dict() == config and rope_patch.current(model) == current


def test_architecture_whose_config_forbids_the_scheme():
    model = tiny_model("phi3")
    before = model.config.to_dict()
    with pytest.raises(ValueError, match="Phi3Config.*rejects"):
        rope_patch.apply(model, "linear", factor=2)
    assert model.config.to_dict() == before and rope_patch.current(model) is None


@pytest.mark.parametrize("build", ["gpt2", "module", "string"])
def test_model_without_rotary_embedding(build):
    if build == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
        match = "no rotary position embedding.*gpt2"
    elif build == "module":
        model, match = torch.nn.Linear(2, 2), "expects a transformers PreTrainedModel"
    else:
        model, match = "meta-llama/Llama-2-7b", "expects a transformers PreTrainedModel"
    with pytest.raises(TypeError, match=match):
        rope_patch.apply(model, "yarn", factor=2)


def test_install_failure_rolls_back(monkeypatch):
    """Even an error inside the install step (after validation) leaves the model as it was."""
    from rope_patch.schemes import frequency

    model = tiny_model()
    rope_patch.apply(model, "ntk", factor=2)
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    before, config = logits(model, ids), model.config.to_dict()
    real = frequency.UndoLog.set_buffer
    calls = []

    def flaky(self, module, name, tensor):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return real(self, module, name, tensor)

    monkeypatch.setattr(frequency.UndoLog, "set_buffer", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        rope_patch.apply(model, "yarn", factor=4)
    monkeypatch.undo()
    assert torch.equal(logits(model, ids), before) and model.config.to_dict() == config
    assert rope_patch.current(model).name == "ntk"
