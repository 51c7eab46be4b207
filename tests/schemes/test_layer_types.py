"""`layer_types=`: a frequency scheme on chosen layer types of a model with RoPE per layer type (Gemma 3's
sliding_attention / full_attention), the other types keeping the model's own RoPE bit for bit; exact against a model
transformers builds natively from the same per-layer-type rope_parameters."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import WINDOW, logits, native_twin, tiny_model
from helpers.text import char_tokenizer
from test_older_transformers import OLD
from transformers import AutoModelForCausalLM

import rope_patch
from rope_patch import serving
from rope_patch.specs import parse_scheme_spec

GEMMA3 = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)  # θ 1e4 / 1e6 per type
TYPES = ("full_attention", "sliding_attention")
PAIRS = 8  # head_dim 16
# scheme, params, window the native twin is built with (None: the patched config's)
STATIC = [
    ("default", dict(rope_theta=50_000.0), None),
    ("linear", dict(factor=4.0), None),
    ("ntk", dict(factor=4.0), None),
    ("yarn", dict(factor=2.0), None),
    ("yarn", dict(factor=8.0, beta_fast=16.0, beta_slow=2.0, attention_factor=1.2), None),
    ("llama3", dict(factor=8.0), None),
    ("p_rope", dict(partial_rotary_factor=0.5), None),
    ("dynamic", dict(factor=4.0), WINDOW),  # transformers' dynamic starts scaling at max_position_embeddings
    ("longrope", dict(factor=4.0, short_factor=[1.0 + 0.1 * i for i in range(PAIRS)],
                      long_factor=[1.0 + 0.5 * i for i in range(PAIRS)]), None),
]
CASES = [(s, p, w, lt) for s, p, w in STATIC for lt in TYPES]


def _ids():
    return torch.randint(3, 97, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))  # past window and slide


def _state(model):
    rot = model.model.rotary_emb
    return ({k: v.clone() for k, v in rot._buffers.items()},
            {k: v for k, v in vars(rot).items() if k.endswith(("attention_scaling", "rope_type"))},
            json.dumps(model.config.rope_parameters, sort_keys=True), model.config.max_position_embeddings)


def _same_state(a, b) -> bool:
    return (a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            and a[1:] == b[1:])


@pytest.mark.parametrize("scheme,params,native_window,chosen", CASES,
                         ids=[f"{s}-{i // 2}-{lt}" for i, (s, _, _, lt) in enumerate(CASES)])
def test_chosen_layer_type_matches_native_and_others_stay_bit_identical(scheme, params, native_window, chosen):
    if OLD and scheme == "longrope":
        pytest.skip("longrope on a per-layer-type model needs transformers >= 5.21 (refused before)")
    model = tiny_model("gemma3_text", **GEMMA3)
    ids, rot = _ids(), model.model.rotary_emb
    other = next(lt for lt in TYPES if lt != chosen)
    before, unpatched = logits(model, ids), _state(model)
    original = json.loads(unpatched[2])

    rope_patch.apply(model, scheme, layer_types=chosen, **params)
    got = logits(model, ids)
    assert not torch.equal(got, before)  # the chosen layers changed
    # the public config: the chosen type's scaled entry (as the all-types patch writes it), the other as loaded
    entry = model.config.rope_parameters[chosen]
    assert model.config.rope_parameters[other] == original[other]
    everywhere = tiny_model("gemma3_text", **GEMMA3)
    rope_patch.apply(everywhere, scheme, **params)
    assert entry == everywhere.config.rope_parameters[chosen] and entry != original[chosen]
    # the layer type left alone: its buffers and cos/sin scale exactly the unpatched ones
    for name in (f"{other}_inv_freq", f"{other}_original_inv_freq"):
        assert torch.equal(rot._buffers[name], unpatched[0][name])
    assert getattr(rot, f"{other}_attention_scaling") == unpatched[1][f"{other}_attention_scaling"]
    assert rot.rope_type[other] == original[other]["rope_type"]
    # exact against transformers built natively from {"chosen": scaled, "other": its own entry}, same weights
    twin = native_twin(model, model.config.rope_parameters, native_window or model.config.max_position_embeddings)
    assert (got - logits(twin, ids)).abs().max().item() <= 1e-5

    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before) and _same_state(_state(model), unpatched)


@pytest.mark.parametrize("scheme,params", [(s, p) for s, p, _ in STATIC], ids=[s for s, _, _ in STATIC])
def test_every_layer_type_named_is_the_scheme_without_layer_types(scheme, params):
    if OLD and scheme == "longrope":
        pytest.skip("longrope on a per-layer-type model needs transformers >= 5.21 (refused before)")
    ids = _ids()
    plain, named = tiny_model("gemma3_text", **GEMMA3), tiny_model("gemma3_text", **GEMMA3)
    rope_patch.apply(plain, scheme, **params)
    rope_patch.apply(named, scheme, layer_types="sliding_attention/full_attention".split("/"), **params)
    assert torch.equal(logits(plain, ids), logits(named, ids))
    assert _same_state(_state(plain), _state(named))


def test_spec_and_python_forms():
    assert parse_scheme_spec("yarn:factor=2,layer_types=full_attention").layer_types == ("full_attention",)
    both = parse_scheme_spec("yarn:factor=2,layer_types=full_attention/sliding_attention")
    assert both.layer_types == ("full_attention", "sliding_attention")
    model = tiny_model("gemma3_text", **GEMMA3)
    rope_patch.apply(model, "yarn", factor=2, layer_types=["full_attention"])
    assert rope_patch.current(model).layer_types == ("full_attention",)
    rope_patch.apply(model, "yarn:2", layer_types=("full_attention",))
    assert rope_patch.current(model).layer_types == ("full_attention",)
    assert rope_patch.current(model).params()["layer_types"] == ("full_attention",)
    # a str names several joined by '/', as in the spec (a keyword and the spec give one scheme)
    rope_patch.apply(model, "yarn", factor=2, layer_types="sliding_attention/full_attention")
    assert rope_patch.current(model).layer_types == ("sliding_attention", "full_attention")


# (arch, overrides, spec or (scheme, params), error, message)
REFUSED = [
    ("llama", {}, "yarn:factor=2,layer_types=full_attention", ValueError,
     r"llama has one RoPE \(a flat rope_parameters\) for all its layers\. Leave layer_types unset"),
    ("gemma3_text", GEMMA3, "yarn:factor=2,layer_types=ful_attention", ValueError,
     r"not a layer type of gemma3_text, whose RoPE layer types are full_attention, sliding_attention\. "
     r"Did you mean 'full_attention'\?"),
    ("gemma3_text", GEMMA3, ("yarn", dict(factor=2, layer_types=[])), ValueError, r"must name at least one"),
    ("gemma3_text", GEMMA3, ("yarn", dict(factor=2, layer_types=[3])), TypeError, r"`layer_types`\[0\] must be"),
    ("gemma3_text", GEMMA3, ("yarn", dict(factor=2, layer_types=5)), TypeError, r"must be a name or a list"),
    ("gemma3_text", GEMMA3, "dynamic_yarn:factor=2,layer_types=full_attention", ValueError,
     r"dynamic_yarn: layer_types cannot be combined with its own per-forward frequency update.*default, linear, "
     r"ntk, yarn, llama3, p_rope, and dynamic / longrope"),
    ("gemma3_text", GEMMA3, "dynamic:factor=2,layer_types=full_attention,cache_rotation=consistent", ValueError,
     r"cannot be combined with cache_rotation='consistent'"),
    # a kept layer type whose own RoPE is dynamic reads the window the scheme changes
    ("gemma3_text", dict(GEMMA3, rope_parameters={
        "full_attention": dict(rope_type="dynamic", factor=2.0, rope_theta=1e6),
        "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
     "yarn:factor=2,layer_types=sliding_attention", ValueError,
     r"the full_attention layers that layer_types leaves keep gemma3_text's own 'dynamic' RoPE"),
    # one frequency scheme per layer type would need a stack of two: refused, and the message says so
    ("gemma3_text", GEMMA3, "yarn:factor=2,layer_types=full_attention+linear:factor=2,layer_types=sliding_attention",
     ValueError, r"a stack holds one frequency scheme, so giving each layer type its own \(layer_types\) is not "
     r"supported"),
]


@pytest.mark.parametrize("arch,overrides,spec,error,message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refused_at_apply_with_the_model_left_as_it_was(arch, overrides, spec, error, message):
    model = tiny_model(arch, **overrides)
    ids = _ids()
    before, state = logits(model, ids), _state(model)
    with pytest.raises(error, match=message):
        if isinstance(spec, str):
            rope_patch.apply(model, spec)
        else:
            rope_patch.apply(model, spec[0], **spec[1])
    assert rope_patch.current(model) is None and _same_state(_state(model), state)
    assert torch.equal(logits(model, ids), before)


def test_refused_on_a_patched_model_keeps_its_patch():
    model = tiny_model("gemma3_text", **GEMMA3)
    ids = _ids()
    rope_patch.apply(model, "yarn:factor=2,layer_types=full_attention")
    patched, state = logits(model, ids), _state(model)
    with pytest.raises(ValueError, match="Did you mean 'sliding_attention'"):
        rope_patch.apply(model, "linear:factor=2,layer_types=sliding_atention")
    assert rope_patch.current(model).name == "yarn" and _same_state(_state(model), state)
    assert torch.equal(logits(model, ids), patched)


def test_resonance_rounds_only_the_chosen_layer_type():
    model = tiny_model("gemma3_text", **GEMMA3)
    rot, ids = model.model.rotary_emb, _ids()
    x, pos = torch.zeros(1, 3 * WINDOW, 16), torch.arange(3 * WINDOW)[None]
    own = {lt: rot(x, pos, lt) for lt in TYPES}
    rope_patch.apply(model, "yarn:factor=2,layer_types=full_attention,resonance=true")
    assert all(torch.equal(a, b) for a, b in zip(rot(x, pos, "sliding_attention"), own["sliding_attention"],
                                                 strict=True))
    assert not torch.equal(rot(x, pos, "full_attention")[0], own["full_attention"][0])
    plain = tiny_model("gemma3_text", **GEMMA3)
    rope_patch.apply(plain, "yarn:factor=2,resonance=true")  # every layer type: the full one is the same
    assert all(torch.equal(a, b) for a, b in zip(rot(x, pos, "full_attention"),
                                                 plain.model.rotary_emb(x, pos, "full_attention"), strict=True))
    logits(model, ids)  # runs
    rope_patch.remove(model)
    assert all(torch.equal(a, b) for lt in TYPES for a, b in zip(rot(x, pos, lt), own[lt], strict=True))


def test_frequencies_without_a_patch_of_a_kept_layer_type_are_the_models_own():
    """`FrequencyScheme.inv_freq` (what rope_patch.analysis computes from) gives the model's own RoPE for a layer type
    that layer_types leaves, and the installed frequencies for a chosen one."""
    from rope_patch.discovery import find_target

    model = tiny_model("gemma3_text", **GEMMA3)
    rot, target = model.model.rotary_emb, find_target(model)
    contexts = target.contexts()
    scheme = parse_scheme_spec("yarn:factor=2,layer_types=full_attention").resolve(target)
    kept, scale = scheme.inv_freq(contexts["sliding_attention"])
    assert torch.equal(kept, rot.sliding_attention_inv_freq) and scale == 1.0
    chosen, scale = scheme.inv_freq(contexts["full_attention"])
    rope_patch.apply(model, scheme)
    assert torch.equal(chosen, rot.full_attention_inv_freq) and scale == rot.full_attention_attention_scaling != 1.0


def test_save_reload_and_export(tmp_path):
    """config.json holds the per-layer-type form transformers builds natively; vLLM serves it (it reads each layer
    type's entry), SGLang's Gemma 3 code replaces every layer's RoPE by default: refused there."""
    model, ids = tiny_model("gemma3_text", **GEMMA3), _ids()
    rope_patch.apply(model, "yarn", factor=4, layer_types=["full_attention"])
    rope_patch.save_pretrained(model, tmp_path, tokenizer=char_tokenizer())
    rope = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert rope["full_attention"]["rope_type"] == "yarn"
    assert rope == rope_patch.to_rope_parameters("yarn:factor=4,layer_types=full_attention",
                                                 model=tiny_model("gemma3_text", **GEMMA3))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert (logits(plain, ids) - logits(model, ids)).abs().max().item() <= 1e-5
    again = rope_patch.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert torch.equal(logits(again, ids), logits(model, ids))
    assert rope_patch.current(again) == rope_patch.current(model)
    info = serving.export(tmp_path, "vllm", write=False)
    assert info["rope_parameters"]["sliding_attention"] == rope["sliding_attention"]
    assert info["rope_parameters"]["full_attention"]["rope_type"] == "yarn" and info["context_length"] == 4 * WINDOW
    with pytest.raises(ValueError, match="its full_attention layers.*replaces the config's rope_parameters"):
        serving.export(tmp_path, "sglang", write=False)
    with pytest.raises(ValueError, match="keyed by layer type.*pass model="):
        rope_patch.to_rope_parameters("yarn:factor=4,layer_types=full_attention")


def test_rope_parameters_of_a_patched_model_keep_the_unpatched_entries():
    """`to_rope_parameters(..., model=)` of a model that already carries a patch: the types the new scheme leaves get
    the model's unpatched entries, what apply() installs (it removes the earlier patch first)."""
    spec = "linear:factor=2,layer_types=sliding_attention"
    fresh = rope_patch.to_rope_parameters(spec, model=tiny_model("gemma3_text", **GEMMA3))
    model = tiny_model("gemma3_text", **GEMMA3)
    rope_patch.apply(model, "yarn:factor=4,layer_types=full_attention")
    assert rope_patch.to_rope_parameters(spec, model=model) == fresh
    rope_patch.apply(model, spec)
    assert model.config.rope_parameters == fresh


def test_the_served_window_is_the_chosen_types():
    """A model whose layer types ship different windows (full_attention: YaRN ×4 over 32 of its 128): the window a
    scheme on the sliding layers announces is theirs, in the config and in `context_window` alike."""
    shipped = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
               "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                  "original_max_position_embeddings": 32}}
    model = tiny_model("gemma3_text", **GEMMA3, rope_parameters=shipped, max_position_embeddings=128)
    rope_patch.apply(model, "linear:factor=2,layer_types=sliding_attention")
    assert rope_patch.context_window(model) == model.config.max_position_embeddings


@pytest.mark.parametrize("spec", ["linear:2", "yarn:2", "default:rope_theta=50000", "dynamic:2", "llama3:4",
                                  "yarn:2,layer_types=full_attention"])
def test_rope_parameters_of_a_per_layer_type_model_are_what_apply_writes(spec):
    """`to_rope_parameters(spec, model=)` of a model with RoPE per layer type is keyed by layer type, with or without
    layer_types: the config apply() writes (it gave a flat entry with one type's θ)."""
    model = tiny_model("gemma3_text", **GEMMA3)
    want = rope_patch.to_rope_parameters(spec, model=model)
    rope_patch.apply(model, spec)
    assert model.config.rope_parameters == want
