"""Public API: apply / remove / patched / current, per instance and reversible, wrappers unwrapped."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from helpers.models import WINDOW, logits, rope_folders, tiny_model

import rope_patch

SCHEMES = [
    ("default", dict(rope_theta=500_000)),
    ("linear", dict(factor=2)),
    ("ntk", dict(factor=4)),
    ("dynamic", dict(factor=4)),
    ("yarn", dict(factor=8)),
    ("llama3", dict(factor=8)),
    ("longrope", dict(factor=4, short_factor=[1.0] * 8, long_factor=[4.0] * 8)),
    ("p_rope", dict(partial_rotary_factor=0.25)),
]
IDS = [s for s, _ in SCHEMES]


def _state(model):
    """Everything a patch may touch, for bit-exact comparison."""
    rot = model.model.rotary_emb
    return (
        {k: v.clone() for k, v in rot._buffers.items()},
        {k: copy.deepcopy(v) for k, v in vars(rot).items() if not k.startswith("_") and k != "config"},
        rot.config is model.config,
        copy.deepcopy(model.config.to_dict()),
    )


def _same_state(a, b):
    assert a[0].keys() == b[0].keys()
    assert all(torch.equal(a[0][k], b[0][k]) and a[0][k].dtype == b[0][k].dtype for k in a[0])
    assert a[1] == b[1] and a[2] == b[2] and a[3] == b[3]


@pytest.fixture
def ids():
    return torch.randint(3, 97, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme,params", SCHEMES, ids=IDS)
def test_remove_restores_bit_identical_logits_and_state(scheme, params, ids):
    model = tiny_model()
    before, state = logits(model, ids), _state(model)
    assert rope_patch.apply(model, scheme, **params) is model
    assert not torch.equal(logits(model, ids), before)
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)
    _same_state(_state(model), state)
    assert rope_patch.current(model) is None


@pytest.mark.parametrize("scheme,params", SCHEMES, ids=IDS)
def test_reapply_equals_fresh_apply(scheme, params, ids):
    fresh = tiny_model()
    rope_patch.apply(fresh, scheme, **params)
    model = tiny_model()
    rope_patch.apply(model, "yarn", factor=16, original_max_position_embeddings=8)
    logits(model, ids)  # let dynamic-style updates run before replacing
    rope_patch.apply(model, "dynamic", factor=3)
    logits(model, ids)
    rope_patch.apply(model, scheme, **params)
    assert torch.equal(logits(model, ids), logits(fresh, ids))
    assert model.config.max_position_embeddings == fresh.config.max_position_embeddings
    assert model.config.rope_parameters == fresh.config.rope_parameters


def test_current_reports_resolved_scheme():
    model = tiny_model()
    assert rope_patch.current(model) is None
    rope_patch.apply(model, "YaRN", factor=4)
    scheme = rope_patch.current(model)
    assert scheme.name == "yarn" and scheme.factor == 4.0 and scheme.original_max_position_embeddings == WINDOW
    assert model.config.max_position_embeddings == 4 * WINDOW
    rope_patch.remove(model)
    assert model.config.max_position_embeddings == WINDOW


def test_remove_on_unpatched_model_is_noop(ids):
    model = tiny_model()
    before = logits(model, ids)
    rope_patch.remove(rope_patch.remove(model))
    assert torch.equal(logits(model, ids), before)


def test_scheme_object_and_aliases():
    a, b, c = tiny_model(), tiny_model(), tiny_model()
    rope_patch.apply(a, rope_patch.as_scheme("linear", factor=2))
    rope_patch.apply(b, "pi", factor=2)
    rope_patch.apply(c, "Position-Interpolation", factor=2)
    assert rope_patch.current(a) == rope_patch.current(b) == rope_patch.current(c)


def test_patched_context_manager_restores_previous_patch_also_on_error(ids):
    model = tiny_model()
    rope_patch.apply(model, "linear", factor=2)
    linear = logits(model, ids)
    with rope_patch.patched(model, "yarn", factor=8):
        assert rope_patch.current(model).name == "yarn"
    assert torch.equal(logits(model, ids), linear) and rope_patch.current(model).name == "linear"
    with pytest.raises(RuntimeError, match="boom"), rope_patch.patched(model, "ntk", factor=2):
        raise RuntimeError("boom")
    assert torch.equal(logits(model, ids), linear)


# A table rotary (GPT-J, CodeGen) whose rows a frequency scheme rescaled is known as a rotary by its patch state only
# (discovery._table_rotaries); the patch that comes back after a temporary one (patched(), refusal(), suggest()'s
# trials) holds such rows before its state is attached again.
TABLE_PATCHES = [("gptj", "yarn:2", "linear:2"), ("gptj", "linear:2", "self_extend:group_size=2,window_size=8"),
                 ("codegen", "ntk:2", "rerope:window_size=8"), ("gptj", "yarn:2", "yarn:2")]


@pytest.mark.parametrize("folder,before,during", TABLE_PATCHES)
def test_patched_and_refusal_put_a_table_rotarys_patch_back(folder, before, during):
    if folder not in rope_folders():  # transformers < 5.2x: GPT-J / CodeGen build their table without a rotary module
        pytest.skip(f"{folder} has no rotary module in transformers {transformers.__version__}")
    model = tiny_model(folder)
    ids = torch.randint(3, 97, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    vanilla = logits(model, ids)
    rope_patch.apply(model, before)
    applied, patched = rope_patch.current(model), logits(model, ids)
    with rope_patch.patched(model, during):
        assert not torch.equal(logits(model, ids), patched) or during == before
    assert rope_patch.current(model) == applied and torch.equal(logits(model, ids), patched)
    assert rope_patch.api.refusal(model, during) is None
    assert rope_patch.current(model) == applied and torch.equal(logits(model, ids), patched)
    rope_patch.remove(model)
    assert rope_patch.current(model) is None and torch.equal(logits(model, ids), vanilla)


def test_two_models_carry_different_schemes(ids):
    a, b, untouched = tiny_model(), tiny_model(), tiny_model()
    base = logits(untouched, ids)
    rope_patch.apply(a, "yarn", factor=8)
    rope_patch.apply(b, "linear", factor=2)
    la, lb = logits(a, ids), logits(b, ids)
    solo_a = tiny_model()
    rope_patch.apply(solo_a, "yarn", factor=8)
    assert torch.equal(la, logits(solo_a, ids)) and not torch.equal(la, lb)
    assert torch.equal(logits(untouched, ids), base)  # no class or module state changed
    assert type(untouched.model.rotary_emb).forward is type(a.model.rotary_emb).forward
    assert untouched.model.rotary_emb.config is untouched.config


def test_bare_decoder_and_causal_lm_share_the_patch(ids):
    model = tiny_model()
    rope_patch.apply(model.model, "linear", factor=2)
    assert rope_patch.current(model).name == "linear"
    rope_patch.remove(model)
    assert rope_patch.current(model.model) is None


def test_peft_model_is_unwrapped(ids):
    import peft
    model = tiny_model()
    lora = peft.get_peft_model(model,
                               peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    before = logits(lora, ids)
    rope_patch.apply(lora, "yarn", factor=4)
    assert rope_patch.current(model).name == "yarn"
    patched = logits(lora, ids)
    merged = lora.merge_and_unload()  # the patch lives on the base model's rotary: merging keeps it
    torch.testing.assert_close(logits(merged, ids), patched, atol=1e-5, rtol=1e-5)
    rope_patch.remove(merged)
    torch.testing.assert_close(logits(merged, ids), before, atol=1e-5, rtol=1e-5)


def test_never_moves_the_model_and_frequencies_follow_its_device():
    model = tiny_model()
    rope_patch.apply(model, "llama3", factor=8)
    assert model.model.rotary_emb.inv_freq.device == next(model.parameters()).device
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_list_schemes_in_a_fresh_process_lists_the_built_in_schemes():
    """The first call of the lazy package loads the scheme modules (it returned [] before anything else did)."""
    import subprocess
    import sys

    code = "import rope_patch; print(' '.join(rope_patch.list_schemes()))"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert fresh == rope_patch.list_schemes() and {"yarn", "self_extend", "alibi"} <= set(fresh)


def test_list_schemes_and_register_custom_scheme(ids):
    import dataclasses

    shipped = {"default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope", "p_rope"}
    assert shipped <= set(rope_patch.list_schemes())

    @dataclasses.dataclass(frozen=True)
    class HalfTheta(rope_patch.FrequencyScheme):
        """A user scheme: vanilla RoPE at half the base."""

        name = "test_half_theta"

        def rope_parameters(self, ctx):
            return self._params(ctx, "default") | {"rope_theta": ctx.rope_theta / 2}

    rope_patch.register_scheme(HalfTheta)
    try:
        model = tiny_model()
        rope_patch.apply(model, "test_half_theta")
        ref = tiny_model()
        rope_patch.apply(ref, "default", rope_theta=5000)
        assert torch.equal(logits(model, ids), logits(ref, ids))
        with pytest.raises(ValueError, match="already registered"):
            rope_patch.register_scheme(HalfTheta, name="yarn")
    finally:
        from rope_patch import registry

        registry._SCHEMES.pop("test_half_theta", None)


def test_a_composite_model_points_at_its_language_model():
    """Gemma 3's image-text model keeps RoPE in its text config: apply() says where to apply instead (one line,
    the model untouched), and the language model takes the patch and gives it back bit-exactly."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=64,
                                        sliding_window=8),
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=28, patch_size=14), mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    ids = torch.randint(5, 300, (1, 3 * 64))
    before = logits(model, ids)
    with pytest.raises(TypeError, match=r"apply the patch to the language model, "
                                        r"rope_patch.apply\(model.model.language_model, ...\)"):
        rope_patch.apply(model, "yarn", factor=4.0)
    assert torch.equal(logits(model, ids), before)
    rope_patch.apply(model.model.language_model, "yarn", factor=4.0)
    assert not torch.equal(logits(model, ids), before)
    rope_patch.remove(model.model.language_model)
    assert torch.equal(logits(model, ids), before)
