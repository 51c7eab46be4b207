"""Checkpoints that ship with scaling (Llama 3.1/3.2 `llama3`, gpt-oss/Qwen `yarn`, Phi-3 `longrope`): the model as
loaded is the baseline, a scheme replaces the shipped scaling, `factor` is relative to the pre-training window the
config records, and attention-side schemes rotate with the shipped frequencies."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.models import VOCAB, logits, native_twin, tiny_model

import rope_patch

L, SHIPPED = 32, 128  # pre-training window recorded in the config, and the shipped (extended) window
SHIPS = {
    "llama3.1": ("llama", dict(max_position_embeddings=SHIPPED, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": L,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0})),
    "gpt-oss/qwen yarn": ("qwen2", dict(max_position_embeddings=SHIPPED, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": L})),
    "phi3 longrope": ("phi3",
                      dict(max_position_embeddings=SHIPPED, original_max_position_embeddings=L, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
        "long_factor": [1.0, 1.5, 2, 2.5, 3, 3.5, 4, 4]})),
}


def shipped(name: str, backend: str = "sdpa"):
    arch, kw = SHIPS[name]
    return tiny_model(arch, attn_implementation=backend, **kw)


@pytest.fixture
def ids():
    return torch.randint(3, VOCAB, (2, 3 * L), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(SHIPS))
def test_original_window_defaults_to_the_shipped_pretraining_window(name, ids):
    model = shipped(name)
    before = logits(model, ids)
    scheme = "longrope" if name.startswith("phi3") else "yarn"
    params = dict(short_factor=[1.0] * 8, long_factor=[8.0] * 8) if scheme == "longrope" else {}
    rope_patch.apply(model, scheme, factor=8, **params)
    applied = rope_patch.current(model)
    assert applied.original_max_position_embeddings == L  # not the shipped 128
    assert rope_patch.context_window(model) == 8 * L
    twin = native_twin(shipped(name), rope_patch.to_rope_parameters(None, model=model), 8 * L)
    assert (logits(model, ids) - logits(twin, ids)).abs().max().item() <= 1e-5
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


def test_a_scheme_that_shrinks_the_shipped_window_warns():
    model = shipped("llama3.1")
    with pytest.warns(UserWarning, match=r"replaces the 'llama3' scaling.*64 tokens.*shipped window of 128"):
        rope_patch.apply(model, "yarn", factor=2)  # 2 × 32 = 64 < 128: allowed
    assert model.config.max_position_embeddings == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rope_patch.apply(model, "yarn", factor=8)  # 256 ≥ 128: no warning


def test_default_on_a_shipped_model_is_unscaled_rope_over_the_pretraining_window(ids):
    model = shipped("llama3.1")
    with pytest.warns(UserWarning, match="shipped window"):
        rope_patch.apply(model, "default")
    assert model.config.rope_parameters["rope_type"] == "default" and model.config.max_position_embeddings == L
    plain = native_twin(shipped("llama3.1"), {"rope_type": "default", "rope_theta": 10000.0}, L)
    assert torch.equal(logits(model, ids), logits(plain, ids))


@pytest.mark.parametrize("name", list(SHIPS))
@pytest.mark.parametrize("scheme,params", [("self_extend", dict(group_size=2, window_size=1000)),
                                           ("rerope", dict(window_size=1000))], ids=["self_extend", "rerope"])
def test_attention_schemes_rotate_with_the_shipped_frequencies(name, scheme, params, ids):
    """A window past the text makes both schemes plain RoPE: the model as loaded, shipped scaling included."""
    model = shipped(name)
    before = logits(model, ids)
    rope_patch.apply(model, scheme, **params)
    assert (logits(model, ids) - before).abs().max().item() <= 1e-5


def test_an_original_window_above_the_models_window_is_refused(ids):
    model = shipped("llama3.1")
    before = logits(model, ids)
    with pytest.raises(ValueError, match=r"original_max_position_embeddings.*<= the model's "
                                         r"max_position_embeddings = 128"):
        rope_patch.apply(model, "yarn", factor=2, original_max_position_embeddings=4096)
    assert torch.equal(logits(model, ids), before) and rope_patch.current(model) is None


def test_learned_absolute_table_defaults_to_the_pretraining_window():
    model = shipped("llama3.1")
    rope_patch.apply(model, "learned_absolute")
    assert rope_patch.current(model).max_position_embeddings == L


def test_unscaled_checkpoint_keeps_its_window_as_pretraining_window():
    model = tiny_model()
    rope_patch.apply(model, "yarn", factor=4)
    assert rope_patch.current(model).original_max_position_embeddings == model.config.max_position_embeddings // 4
