"""A patch owns what it changes: shared config objects, copies, pickles, backend switches and dtype/device moves.

Every test here failed before the undo log became data held inside the model (closures over the original objects,
the user's config written in place, fp32 buffers restored into a cast model)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from helpers.models import VOCAB, WINDOW, logits, roundtrip, tiny_config, tiny_model
from helpers.schemes import cases
from transformers import LlamaForCausalLM

import rope_patch
from rope_patch.rotary import BackendChanged

ALL = cases()  # every scheme (tests/helpers/schemes.py)
IDS = [s for s, _ in ALL]


@pytest.fixture
def ids():
    return torch.randint(3, VOCAB, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(0))


def twins(n: int = 2, backend: str = "sdpa"):
    """`n` models built from ONE config object (transformers keeps it: they and the caller share it), same weights."""
    cfg = tiny_config("llama")
    cfg._attn_implementation = backend
    torch.manual_seed(0)
    models = [LlamaForCausalLM(cfg).eval() for _ in range(n)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    assert all(m.config is cfg for m in models)
    return cfg, models


# ---- 1. shared config objects ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme,params", ALL, ids=IDS)
def test_patch_leaves_shared_config_and_bystander_untouched(scheme, params, ids, tmp_path):
    cfg, (a, b) = twins()
    before_cfg, before_b = copy.deepcopy(cfg.to_dict()), logits(b, ids)
    rope_patch.apply(a, scheme, **params)
    assert a.config is not cfg and cfg.to_dict() == before_cfg
    assert torch.equal(logits(b, ids), before_b)  # the bystander runs as before (alibi used to make it raise)
    assert rope_patch.current(b) is None
    b.save_pretrained(tmp_path)
    assert LlamaForCausalLM.from_pretrained(tmp_path).config.rope_parameters == cfg.rope_parameters
    third = LlamaForCausalLM(cfg).eval()  # built from the user's config while `a` is patched: plain RoPE
    third.load_state_dict(b.state_dict())
    assert torch.equal(logits(third, ids), before_b)
    rope_patch.apply(third, "linear", factor=2)  # and can be patched on its own
    rope_patch.remove(third)
    rope_patch.remove(a)
    assert a.config is cfg and a.model.rotary_emb.config is cfg and a.model.layers[0].self_attn.config is cfg
    saved_by_b = ("architectures", "dtype")  # b.save_pretrained wrote these into the shared config itself
    assert torch.equal(logits(a, ids), before_b)
    assert ({k: v for k, v in cfg.to_dict().items() if k not in saved_by_b}
            == {k: v for k, v in before_cfg.items() if k not in saved_by_b})


def test_two_models_from_one_config_carry_different_schemes(ids):
    cfg, (a, b, c) = twins(3)
    rope_patch.apply(a, "yarn", factor=4)
    rope_patch.apply(b, "alibi")
    ya, al = logits(a, ids), logits(b, ids)
    assert not torch.equal(ya, al) and not torch.equal(ya, logits(c, ids))
    fresh_a, fresh_b = tiny_model(attn_implementation="sdpa"), tiny_model(attn_implementation="sdpa")
    rope_patch.apply(fresh_a, "yarn", factor=4)
    rope_patch.apply(fresh_b, "alibi")
    assert torch.equal(ya, logits(fresh_a, ids)) and torch.equal(al, logits(fresh_b, ids))


def test_user_edits_of_the_config_while_patched_survive_remove():
    cfg, (a,) = twins(1)
    rope_patch.apply(a, "yarn", factor=4)
    a.config.use_cache = False  # the user's own change, made while patched
    a.config.my_note = "kept"
    rope_patch.remove(a)
    assert a.config is cfg and cfg.use_cache is False and cfg.my_note == "kept"
    # patch's own fields revert
    assert cfg.rope_parameters["rope_type"] == "default" and cfg.max_position_embeddings == WINDOW


# ---- 2./3. copies and pickles ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("scheme,params", ALL, ids=IDS)
def test_copies_are_independent_patched_models(scheme, params, how, ids):
    model = tiny_model(attn_implementation="sdpa")
    base = logits(model, ids)
    rope_patch.apply(model, scheme, **params)
    patched_out = logits(model, ids)
    dup = roundtrip(model, how)
    assert torch.equal(logits(dup, ids), patched_out)
    assert rope_patch.current(dup) == rope_patch.current(model)
    tables = rope_patch.api.patch_modules(dup)
    for table in tables.values():  # a learned table of the copy is the copy's own
        with torch.no_grad():
            next(table.parameters()).add_(1.0)
    assert torch.equal(logits(model, ids), patched_out)
    rope_patch.remove(dup)
    assert rope_patch.current(dup) is None and rope_patch.current(model) is not None
    assert torch.equal(logits(dup, ids), base)
    assert torch.equal(logits(model, ids), patched_out)  # removing the copy's patch leaves the original patched
    rope_patch.remove(dup)  # a second remove is a no-op
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), base)


def test_torch_load_in_a_fresh_process(tmp_path, ids):
    """The attention functions are registered when a pickled patched model is loaded, in a process that never
    imported rope_patch itself."""
    model = tiny_model(attn_implementation="sdpa")
    rope_patch.apply(model, "self_extend", group_size=2, window_size=8)
    torch.save({"model": model, "ids": ids, "logits": logits(model, ids)}, tmp_path / "m.pt")
    code = (
        "import torch, sys\n"
        f"d = torch.load({str(tmp_path / 'm.pt')!r}, weights_only=False)\n"
        "with torch.no_grad(): out = d['model'](d['ids']).logits\n"
        "assert 'rope_patch' in sys.modules\n"
        "print(torch.equal(out, d['logits']))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "True"


def test_patched_restores_previous_patch_with_its_learned_table(ids):
    model = tiny_model(attn_implementation="sdpa")
    rope_patch.apply(model, "relative_bias", init="alibi")
    table = rope_patch.api.patch_modules(model)["rope_patch_relative_bias"]
    out = logits(model, ids)
    with rope_patch.patched(model, "yarn", factor=4):
        assert rope_patch.current(model).name == "yarn"
    assert rope_patch.api.patch_modules(model)["rope_patch_relative_bias"] is table
    assert torch.equal(logits(model, ids), out)


# ---- 4. backend switches --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme,params", [("alibi", {}), ("self_extend", dict(group_size=2, window_size=8)),
                                           ("relative_bias", {})], ids=["alibi", "self_extend", "relative_bias"])
def test_switching_backend_after_an_attention_scheme_raises_then_reapply_follows(scheme, params, ids):
    model = tiny_model(attn_implementation="eager")
    rope_patch.apply(model, scheme, **params)
    model.set_attn_implementation("sdpa")
    with pytest.raises(BackendChanged, match=r"set_attn_implementation.*rope_patch\.apply.*rope_patch\.remove"):
        logits(model, ids)
    rope_patch.apply(model, rope_patch.current(model))  # re-apply: picks the user's new backend
    assert model.config._attn_implementation == "rope_patch_blocked"
    fresh = tiny_model(attn_implementation="sdpa")
    rope_patch.apply(fresh, scheme, **params)
    torch.testing.assert_close(logits(model, ids), logits(fresh, ids), atol=1e-5, rtol=0)
    rope_patch.remove(model)
    assert model.config._attn_implementation == "sdpa"  # the user's switch is kept


def test_backend_switch_is_fine_for_schemes_that_keep_the_models_attention(ids):
    model = tiny_model(attn_implementation="eager")
    rope_patch.apply(model, "nope")
    out = logits(model, ids)
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(logits(model, ids), out, atol=1e-5, rtol=0)


# ---- 6. dtype and device moves --------------------------------------------------------------------------------------
CASTS = {
    "bf16": lambda m: m.to(torch.bfloat16),
    "half": lambda m: m.half(),
    "bf16-and-back": lambda m: m.to(torch.bfloat16).float(),
}


CAST = [s for s in ALL if s[0] in ("yarn", "linear", "dynamic", "self_extend", "alibi", "p_rope")]


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("scheme,params", CAST, ids=[s for s, _ in CAST])
def test_remove_after_a_cast_equals_a_never_patched_model_cast_alike(scheme, params, cast, ids):
    model, twin = tiny_model(attn_implementation="sdpa"), tiny_model(attn_implementation="sdpa")
    rope_patch.apply(model, scheme, **params)
    CASTS[cast](model)
    CASTS[cast](twin)
    rot = model.model.rotary_emb
    logits(model, ids)
    assert rot.inv_freq.dtype == torch.float32  # the patch's frequencies stay fp32 while patched
    rope_patch.remove(model)
    for name, buf in twin.model.rotary_emb._buffers.items():
        assert rot._buffers[name].dtype == buf.dtype and torch.equal(rot._buffers[name], buf), name
    assert torch.equal(logits(model, ids), logits(twin, ids))


@pytest.mark.parametrize("scheme,params", [("yarn", dict(factor=4)), ("alibi", {})], ids=["yarn", "alibi"])
def test_patched_frequencies_stay_fp32_after_a_cast(scheme, params, ids):
    """apply, then .to(bf16): the patched model runs on the fp32 frequencies it would have had if loaded in bf16."""
    model = tiny_model(attn_implementation="sdpa")
    loaded_bf16 = tiny_model(attn_implementation="sdpa")
    for p in loaded_bf16.parameters():  # from_pretrained(dtype=bf16): weights bf16, inv_freq fp32
        p.data = p.data.to(torch.bfloat16)
    rope_patch.apply(model, scheme, **params)
    rope_patch.apply(loaded_bf16, scheme, **params)
    model.to(torch.bfloat16)
    assert torch.equal(logits(model, ids), logits(loaded_bf16, ids))


def test_device_moves_reach_the_saved_buffers():
    model = tiny_model()
    rope_patch.apply(model, "yarn", factor=4)
    model.to("meta")
    rope_patch.remove(model)
    assert all(b.device.type == "meta" for b in model.model.rotary_emb.buffers())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


# ---- 10. small things a user trips over ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec,name,params", [
    ("yarn:4", "yarn", dict(factor=4.0)),
    ("self_extend:group_size=4,window_size=16", "self_extend", dict(group_size=4, window_size=16)),
    ("default:500000", "default", dict(rope_theta=500000.0)),
])
def test_apply_accepts_spec_strings(spec, name, params):
    model = tiny_model(attn_implementation="sdpa")
    rope_patch.apply(model, spec)
    applied = rope_patch.current(model)
    assert applied.name == name and all(getattr(applied, k) == v for k, v in params.items())


def test_apply_spec_string_and_keyword_clash_is_refused():
    with pytest.raises(TypeError, match="factor"):
        rope_patch.apply(tiny_model(), "yarn:4", factor=8)


def test_learned_absolute_does_not_consume_the_global_rng():
    model = tiny_model()
    torch.manual_seed(7)
    rope_patch.apply(model, "learned_absolute")
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))


@pytest.mark.parametrize("scheme,params",
                         [("relative_bias", {}), ("learned_absolute", dict(max_position_embeddings=128))],
                         ids=["relative_bias", "learned_absolute"])
def test_reapplying_a_learned_scheme_keeps_its_trained_table_and_another_scheme_warns(scheme, params, ids):
    model = tiny_model(attn_implementation="eager")
    rope_patch.apply(model, scheme, **params)
    (table,) = rope_patch.api.patch_modules(model).values()
    with torch.no_grad():
        next(table.parameters()).add_(0.5)  # "trained"
    out = logits(model, ids)
    model.set_attn_implementation("sdpa")
    rope_patch.apply(model, rope_patch.current(model))  # e.g. after a backend switch: the same scheme
    torch.testing.assert_close(logits(model, ids), out, atol=1e-5, rtol=0)
    with pytest.warns(UserWarning, match="learned tables of the previous patch .* were discarded"):
        rope_patch.apply(model, "alibi")


@pytest.mark.parametrize("patched_first", [False, True], ids=["clean", "patched"])
def test_an_apply_that_fails_midway_leaves_the_shared_config_untouched(patched_first, monkeypatch, ids):
    """The install writes the private config before it fails: nothing of it may reach the user's config object."""
    from rope_patch.undo import UndoLog

    cfg, (a, b) = twins()
    if patched_first:
        rope_patch.apply(a, "ntk", factor=2)
    before_cfg, before_a, before_b = copy.deepcopy(cfg.to_dict()), logits(a, ids), logits(b, ids)
    real, calls = UndoLog.set_buffer, []

    def flaky(self, module, name, tensor):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return real(self, module, name, tensor)

    monkeypatch.setattr(UndoLog, "set_buffer", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        rope_patch.apply(a, "yarn", factor=4)
    monkeypatch.undo()
    assert cfg.to_dict() == before_cfg
    assert torch.equal(logits(a, ids), before_a) and torch.equal(logits(b, ids), before_b)
    assert (a.config is cfg) == (not patched_first)
