"""save_pretrained / from_pretrained round trips and the native rope_parameters export."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import WINDOW, logits, tiny_model
from transformers import AutoModelForCausalLM

import rope_patch

NATIVE = [("default", dict(rope_theta=40_000)), ("ntk", dict(factor=4)), ("linear", dict(factor=4)),
          ("dynamic", dict(factor=4)), ("yarn", dict(factor=4)), ("llama3", dict(factor=8)),
          ("longrope", dict(factor=4, short_factor=[1.0] * 8, long_factor=[3.0] * 8))]


@pytest.fixture
def ids():
    return torch.randint(3, 97, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme,params", NATIVE, ids=[s for s, _ in NATIVE])
def test_native_schemes_reload_without_rope_patch(scheme, params, ids, tmp_path):
    model = tiny_model()
    rope_patch.apply(model, scheme, **params)
    rope_patch.save_pretrained(model, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert (logits(plain, ids) - logits(model, ids)).abs().max().item() <= 1e-5
    again = rope_patch.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert torch.equal(logits(again, ids), logits(model, ids))
    assert rope_patch.current(again) == rope_patch.current(model)
    manifest = json.loads((tmp_path / "rope_patch.json").read_text())
    assert manifest["scheme"] == rope_patch.current(model).name and manifest["native"]
    assert manifest["original"] == {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
                                    "max_position_embeddings": WINDOW}


def test_non_native_scheme_keeps_plain_config_and_reloads_through_rope_patch(ids, tmp_path):
    model = tiny_model()
    vanilla = logits(model, ids)
    rope_patch.apply(model, "dynamic_yarn", factor=4)  # transformers has no length-following YaRN
    rope_patch.save_pretrained(model, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert torch.equal(logits(plain, ids), vanilla)  # transformers alone sees the unpatched model
    again = rope_patch.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert torch.equal(logits(again, ids), logits(model, ids))
    with pytest.raises(ValueError, match="no native transformers/vLLM"):
        rope_patch.to_rope_parameters(rope_patch.current(model))


def test_adapter_round_trip(ids, tmp_path):
    import peft
    base = tiny_model()
    base.save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
    lora = peft.get_peft_model(model,
                               peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    rope_patch.apply(lora, "yarn", factor=4)
    rope_patch.save_pretrained(lora, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    again = rope_patch.from_pretrained(tmp_path / "adapter", attn_implementation="eager").eval()
    assert torch.equal(logits(again, ids), logits(lora.eval(), ids))
    assert rope_patch.current(again).name == "yarn"


def test_to_rope_parameters_and_vllm_overrides():
    from rope_patch.persistence import vllm_overrides

    got = rope_patch.to_rope_parameters("yarn:factor=4,original_max_position_embeddings=4096", rope_theta=500000.0)
    assert got == {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 4096}
    ntk = rope_patch.to_rope_parameters("ntk:8", rope_theta=10000.0, head_dim=128)
    assert ntk["rope_type"] == "default" and ntk["rope_theta"] == pytest.approx(10000 * 8 ** (128 / 126))
    with pytest.raises(ValueError, match="head_dim"):
        rope_patch.to_rope_parameters("ntk:8")
    model = tiny_model()
    assert rope_patch.to_rope_parameters("linear:2", model=model) == {"rope_type": "linear", "rope_theta": 10000.0,
                                                                      "factor": 2.0}
    assert json.loads(vllm_overrides(got, 16384).split("'")[1]) == {"rope_parameters": got,
                                                                    "max_position_embeddings": 16384}


@pytest.mark.parametrize("kwargs,lacking",
                         [(dict(head_dim=16), "pass rope_theta="), (dict(rope_theta=1e4), "pass head_dim="),
                                           ({}, "pass head_dim= and rope_theta=")])
def test_ntk_export_needs_head_dim_and_rope_theta(kwargs, lacking):
    """ntk's native form is a new rope_theta: without the model's theta the result would be a bare
    {"rope_type": "default"}, i.e. the scheme silently lost."""
    with pytest.raises(ValueError, match=f"base change.*{lacking} \\(or model=\\)"):
        rope_patch.to_rope_parameters("ntk:4", **kwargs)
    got = rope_patch.to_rope_parameters("ntk:4", head_dim=16, rope_theta=1e4)
    assert got == {"rope_type": "default", "rope_theta": pytest.approx(1e4 * 4 ** (16 / 14))}
    assert got == rope_patch.to_rope_parameters("ntk:4", model=tiny_model())  # tiny models: head_dim 16, theta 1e4


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        rope_patch.from_pretrained(tmp_path / "missing")
