"""Stacks: a frequency scheme, an attention-side scheme and modifiers on one model (rope_patch/schemes/stack.py).

Every composition is checked against a reference that does not use the stack: the attention-side scheme applied alone
to a model built natively by transformers with the frequency scheme's rope_parameters (so `yarn + self_extend` is
Self-Extend on a YaRN model), and `logn` as a forward hook on q_proj that scales each token's query by the formula,
written here with `math` (RoPE is linear: scaling q before the rotation equals scaling it after). Plus: cached decoding
equals recomputation, remove() is bit-exact, copies and pickles are independent, two models of one config carry
different stacks, saves round-trip, and every pair that does not compose is refused at apply() with the model left
as it was.
"""

from __future__ import annotations

import copy
import json
import math
import pickle

import pytest
import torch
from helpers.models import WINDOW, logits, native_twin, tiny_config, tiny_model, token_batch

import rope_patch
from rope_patch.persistence import FORMAT, MANIFEST
from rope_patch.rotary import BackendChanged
from rope_patch.schemes.stack import Stack
from rope_patch.specs import parse_scheme_spec, parse_spec

L = 3 * WINDOW
PAD = 5
TOL = 1e-5


def batch(padded: bool, n: int = L, seed: int = 0):
    return token_batch(n, seed, PAD if padded else 0)


def native(model, freq_spec: str):
    """`model`'s weights in a model built by transformers with `freq_spec`'s native rope_parameters."""
    probe = copy.deepcopy(model)
    rope_patch.apply(probe, freq_spec)
    cfg = rope_patch.native_config(probe)
    twin = native_twin(model, cfg["rope_parameters"], cfg["max_position_embeddings"])
    twin.set_attn_implementation(model.config._attn_implementation)
    return twin


def logn_factor(p: int, kind: str, window: int, attn_scale: float = 0.1, floor_scale: float = 8192) -> float:
    """Su 2023 / Qwen-1: max(1, log_L(p + 1)); Llama 4: 1 + attn_scale·log(⌊(p + 1)/floor_scale⌋ + 1)."""
    if kind == "llama4":
        return 1.0 + attn_scale * math.log(math.floor((p + 1) / floor_scale) + 1)
    return max(1.0, math.log(p + 1, window))


class ScaleQuery:
    """Reference logn: a forward hook on q_proj multiplying token t of row b by factor(positions[b, t])."""

    def __init__(self, factor):
        self.factor, self.positions = factor, None

    def __call__(self, module, inputs, out):
        # a re-positioned layer projects c stacked copies of its batch (rope_patch/attention/copies.py): every copy of
        # token t is at the same true position
        pos = self.positions
        pos = pos.repeat(out.shape[0] // pos.shape[0], 1) if pos.shape[0] > 1 else pos.expand(out.shape[0], -1)
        t = torch.tensor([[self.factor(int(p)) for p in row] for row in pos], dtype=out.dtype)
        return out * t[..., None]


def with_query_scale(model, factor):
    hook = ScaleQuery(factor)
    for layer in model.model.layers:
        layer.self_attn.q_proj.register_forward_hook(hook)
    return hook


def ref_logits(model, hook, ids, kw):
    hook.positions = kw.get("position_ids", torch.arange(ids.shape[1])[None])
    return logits(model, ids, **kw)


# ---- references ------------------------------------------------------------------------------------------------
# (frequency spec, attention spec): the stack equals the attention scheme applied to the natively configured model
FREQ_ATTN = [
    ("yarn:4", "self_extend:group_size=4,window_size=16"),
    ("yarn:4", "rerope:window_size=16"),
    ("linear:2", "leaky_rerope:window_size=16,factor=4"),
    ("llama3:4", "string:shift_size=40,window_size=16"),
    ("ntk:4", "dca:chunk_size=24,local_size=4"),
    ("default:500000", "self_extend:group_size=3,window_size=10"),
    ("yarn:4", "self_extend_logistic:group_size=6,window_size=16,growth_rate=0.5"),
    ("llama3:4", "self_extend_logistic:group_size=8,window_size=12,growth_rate=0.3"),
    ("yarn:4", "dpe:group_sizes=2/4/8/3,window_size=16"),
    ("yarn:2", "sink:window_size=16,sink_size=4"),
]
SETUPS = [("eager", False), ("sdpa", False), ("sdpa", True), ("eager", True)]


@pytest.mark.parametrize("backend,padded", SETUPS, ids=[f"{b}-{'pad' if p else 'nopad'}" for b, p in SETUPS])
@pytest.mark.parametrize("freq,attn", FREQ_ATTN, ids=[f"{f}+{a.split(':')[0]}" for f, a in FREQ_ATTN])
def test_frequency_plus_attention_equals_attention_on_native_frequency_model(freq, attn, backend, padded):
    model = tiny_model("llama", attn_implementation=backend)
    ref = native(model, freq)
    rope_patch.apply(ref, attn)
    rope_patch.apply(model, [freq, attn])
    ids, kw = batch(padded)
    got = logits(model, ids, **kw)
    assert (got - logits(ref, ids, **kw)).abs().max().item() <= TOL
    alone = tiny_model("llama", attn_implementation=backend)
    rope_patch.apply(alone, attn)
    assert (got - logits(alone, ids, **kw)).abs().max().item() > 20 * TOL  # the frequency part does something


def test_dynamic_yarn_under_rerope_is_yarn_of_the_current_length():
    """dynamic_yarn's per-length update keeps running under a deferred-RoPE scheme: at ℓ = 3L it is yarn ×3."""
    model = tiny_model("llama", attn_implementation="sdpa")
    ref = native(model, "yarn:3")
    rope_patch.apply(ref, "rerope:window_size=16")
    rope_patch.apply(model, "dynamic_yarn:4+rerope:window_size=16")
    ids, _ = batch(False, n=3 * WINDOW)
    assert (logits(model, ids) - logits(ref, ids)).abs().max().item() <= TOL


LOGN = [  # (stack, the stack without logn, logn kind, its attn_scale, floor_scale)
    ("logn", None, "logn", None, None),
    ("yarn:4+logn", "yarn:4", "logn", None, None),
    ("linear:2+logn:llama4", "linear:2", "llama4", 0.1, 8192),  # floor_scale 8192: t = 1 at these lengths
    ("yarn:4+logn:kind=llama4,attn_scale=0.5,floor_scale=8", "yarn:4", "llama4", 0.5, 8),
    ("logn:kind=llama4,attn_scale=0.3,floor_scale=4", None, "llama4", 0.3, 4),
]


@pytest.mark.parametrize("backend,padded", SETUPS, ids=[f"{b}-{'pad' if p else 'nopad'}" for b, p in SETUPS])
@pytest.mark.parametrize("spec,freq,kind,attn_scale,floor_scale", LOGN, ids=[s for s, *_ in LOGN])
def test_logn_equals_scaling_the_query(spec, freq, kind, attn_scale, floor_scale, backend, padded):
    model = tiny_model("llama", attn_implementation=backend)
    ref = native(model, freq) if freq else copy.deepcopy(model)
    extra = {} if attn_scale is None else {"attn_scale": attn_scale, "floor_scale": floor_scale}
    hook = with_query_scale(ref, lambda p: logn_factor(p, kind, WINDOW, **extra))
    rope_patch.apply(model, spec)
    ids, kw = batch(padded)
    got = logits(model, ids, **kw)
    assert (got - ref_logits(ref, hook, ids, kw)).abs().max().item() <= TOL
    if (kind, floor_scale) != ("llama4", 8192):
        hook.factor = lambda p: 1.0
        assert (got - ref_logits(ref, hook, ids, kw)).abs().max().item() > 20 * TOL  # the temperature does something


def test_logn_wraps_the_attention_function_of_cache_rotation_consistent():
    """dynamic_yarn with cache_rotation='consistent' runs rope_patch's attention function: logn wraps that one."""
    spec = "dynamic_yarn:factor=4,cache_rotation=consistent"
    model, ref = (tiny_model("llama", attn_implementation="sdpa") for _ in range(2))
    rope_patch.apply(ref, spec)
    hook = with_query_scale(ref, lambda p: logn_factor(p, "logn", WINDOW))
    rope_patch.apply(model, spec + "+logn")
    ids, kw = batch(True)
    assert (logits(model, ids, **kw) - ref_logits(ref, hook, ids, kw)).abs().max().item() <= TOL


ATTN_LOGN = ["self_extend:group_size=4,window_size=16", "rerope:window_size=16", "alibi", "nope", "sinusoidal",
             "relative_bias:init=alibi", "string:shift_size=40,window_size=16", "sink:window_size=16"]


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("attn", ATTN_LOGN, ids=[a.split(":")[0] for a in ATTN_LOGN])
def test_logn_composes_with_attention_side_schemes(attn, backend):
    """attention scheme + logn = the attention scheme with the query scaled (the q_proj hook, before any rotation)."""
    model = tiny_model("llama", attn_implementation=backend)
    ref = tiny_model("llama", attn_implementation=backend)
    rope_patch.apply(ref, attn)
    hook = with_query_scale(ref, lambda p: logn_factor(p, "logn", WINDOW))
    rope_patch.apply(model, [attn, "logn"])
    ids, kw = batch(True)
    assert (logits(model, ids, **kw) - ref_logits(ref, hook, ids, kw)).abs().max().item() <= TOL


# Granite-SWA rotates with one rotary module per base (`rotary_embs`) beside the unused one built from its config: the
# attention-side scheme patches each of them, and each checks on every forward that the model still runs the scheme's
# attention function, which logn wraps (its own name). logn must tell every one of them, not only the first.
SEVERAL_ROTARIES = ["rerope:window_size=16", "self_extend:group_size=4,window_size=16", "alibi"]


@pytest.mark.parametrize("folder", ["granite_swa", "granitemoe_swa"])
@pytest.mark.parametrize("attn", SEVERAL_ROTARIES, ids=[a.split(":")[0] for a in SEVERAL_ROTARIES])
def test_logn_over_an_attention_side_scheme_on_a_model_with_several_rotary_modules(folder, attn):
    from rope_patch.discovery import find_target

    model = tiny_model(folder)  # eager: transformers runs Granite-SWA on no sdpa path
    target = find_target(model)
    assert len(target.rotaries) > 1
    window = target.pretraining_window
    ref = copy.deepcopy(model)
    rope_patch.apply(ref, attn)
    hook = with_query_scale(ref, lambda p: logn_factor(p, "logn", window))
    ids, kw = batch(True, n=3 * window)
    before = logits(model, ids, **kw)
    rope_patch.apply(model, [attn, "logn"])
    assert (logits(model, ids, **kw) - ref_logits(ref, hook, ids, kw)).abs().max().item() <= TOL
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids, **kw), before)


def test_three_parts_yarn_self_extend_logn():
    model = tiny_model("llama", attn_implementation="sdpa")
    ref = native(model, "yarn:4")
    rope_patch.apply(ref, "self_extend:group_size=4,window_size=16")
    hook = with_query_scale(ref, lambda p: logn_factor(p, "logn", WINDOW))
    rope_patch.apply(model, "yarn:4+self_extend:group_size=4,window_size=16+logn")
    stack = rope_patch.current(model)
    assert [p.name for p in stack.schemes] == ["yarn", "self_extend", "logn"]
    ids, kw = batch(True)
    assert (logits(model, ids, **kw) - ref_logits(ref, hook, ids, kw)).abs().max().item() <= TOL


# ---- cached decoding --------------------------------------------------------------------------------------------
STACKS = ["yarn:4+self_extend:group_size=4,window_size=16", "yarn:4+logn",
          "logn:kind=llama4,attn_scale=0.5,floor_scale=4",
          "linear:2+rerope:window_size=16+logn", "alibi+logn", "dca:chunk_size=24,local_size=4+logn",
          "yarn:2+sink:window_size=16,sink_size=4"]


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("spec", STACKS)
def test_cached_decoding_equals_recomputation(spec, backend):
    """Greedy decoding of a left-padded batch (prompts past the window) with and without the KV cache."""
    model = tiny_model("llama", attn_implementation=backend)
    rope_patch.apply(model, spec)
    ids, kw = batch(True, n=40)
    kw.pop("position_ids")
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
               return_dict_in_generate=True, **kw)
    with torch.no_grad():
        cached, full = (model.generate(ids, use_cache=c, **gen) for c in (True, False))
    assert torch.equal(cached.sequences, full.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(cached.logits, full.logits, strict=True)) <= TOL


# ---- reversibility, copies, ownership ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", STACKS)
def test_remove_restores_the_model_bit_exactly(spec):
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, kw = batch(True)
    before, names = logits(model, ids, **kw), set(dict(model.named_modules()))
    rope_patch.apply(model, spec)
    assert not torch.equal(logits(model, ids, **kw), before)
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids, **kw), before)
    assert rope_patch.current(model) is None and model.config._attn_implementation == "sdpa"
    assert set(dict(model.named_modules())) == names and not model.model._forward_pre_hooks
    assert "forward" not in vars(model.model.rotary_emb)
    assert not any(k.startswith("_rope_patch") for m in model.modules() for k in vars(m))


def test_replacing_a_stack_and_patched_with_a_list():
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, _ = batch(False)
    before = logits(model, ids)
    rope_patch.apply(model, "yarn:4")
    yarn = logits(model, ids)
    with rope_patch.patched(model, ["linear:2", "rerope:window_size=16", "logn"]) as m:
        assert isinstance(rope_patch.current(m), Stack) and not torch.equal(logits(m, ids), yarn)
    assert rope_patch.current(model).name == "yarn" and torch.equal(logits(model, ids), yarn)
    rope_patch.apply(model, ["yarn:4", "logn"])  # replaces yarn by the stack
    rope_patch.apply(model, "yarn:4")  # and back to one scheme
    assert torch.equal(logits(model, ids), yarn)
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


@pytest.mark.parametrize("spec", ["yarn:4+self_extend:group_size=4,window_size=16+logn", "relative_bias+logn"])
def test_copies_and_pickles_are_independent_patched_models(spec):
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, kw = batch(True)
    before = logits(model, ids, **kw)
    rope_patch.apply(model, spec)
    patched = logits(model, ids, **kw)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert rope_patch.current(twin) == rope_patch.current(model)
        assert torch.equal(logits(twin, ids, **kw), patched)
        rope_patch.remove(twin)
        assert torch.equal(logits(twin, ids, **kw), before)
        assert torch.equal(logits(model, ids, **kw), patched)  # the original keeps its stack
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids, **kw), before)


def test_two_models_of_one_config_carry_different_stacks():
    cfg = tiny_config("llama")
    cfg._attn_implementation = "sdpa"
    cls = type(tiny_model("llama"))
    a, b, bystander = (cls(cfg).eval() for _ in range(3))  # all three hold the very `cfg` object
    for m in (b, bystander):
        m.load_state_dict(a.state_dict())
    ids, kw = batch(True)
    before = logits(a, ids, **kw)
    specs = {"a": "yarn:4+logn", "b": "linear:2+self_extend:group_size=4,window_size=16"}
    refs = {}
    for key, spec in specs.items():  # each stack on a model of its own config
        refs[key] = tiny_model("llama", attn_implementation="sdpa")
        refs[key].load_state_dict(a.state_dict())
        rope_patch.apply(refs[key], spec)
    rope_patch.apply(a, specs["a"])
    rope_patch.apply(b, specs["b"])
    assert torch.equal(logits(a, ids, **kw), logits(refs["a"], ids, **kw))
    assert torch.equal(logits(b, ids, **kw), logits(refs["b"], ids, **kw))
    assert torch.equal(logits(bystander, ids, **kw), before)
    assert cfg._attn_implementation == "sdpa" and cfg.rope_parameters["rope_type"] == "default"
    rope_patch.remove(a)
    assert torch.equal(logits(a, ids, **kw), before)
    assert torch.equal(logits(b, ids, **kw), logits(refs["b"], ids, **kw))


def test_backend_switch_after_a_stack_with_logn_raises():
    for spec in ("yarn:4+logn", "self_extend:group_size=4,window_size=16+logn"):
        model = tiny_model("llama", attn_implementation="sdpa")
        rope_patch.apply(model, spec)
        model.set_attn_implementation("eager")
        with pytest.raises(BackendChanged, match="re-apply|Re-apply"):
            logits(model, batch(False)[0])
        rope_patch.apply(model, rope_patch.current(model))  # re-applied for the new backend
        logits(model, batch(False)[0])


def test_casts_keep_the_frequency_part_in_fp32():
    model = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(model, "yarn:4+self_extend:group_size=4,window_size=16+logn")
    ids, _ = batch(False)
    expected = logits(model, ids)
    model.to(torch.bfloat16).float()
    assert (logits(model, ids) - expected).abs().max().item() <= 1e-2  # weights rounded, frequencies not
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


# ---- persistence and export --------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["yarn:4+logn:kind=llama4,attn_scale=0.5,floor_scale=8",
                                  "relative_bias:init=alibi+logn"])
def test_save_and_reload_round_trips_the_stack(spec, tmp_path):
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, kw = batch(True)
    before = logits(model, ids, **kw)
    rope_patch.apply(model, spec)
    with torch.no_grad():  # a trained table, not the initial one
        for p in rope_patch.api.patch_modules(model).values():
            p.weight.add_(0.1)
    expected = logits(model, ids, **kw)
    rope_patch.save_pretrained(model, tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["format"] == FORMAT == 3 and manifest["scheme"] == "stack" and manifest["native"] is False
    assert [p["scheme"] for p in manifest["params"]["schemes"]] == [p.name for p in rope_patch.current(model).schemes]
    again = rope_patch.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert rope_patch.current(again) == rope_patch.current(model)
    assert torch.equal(logits(again, ids, **kw), expected)
    rope_patch.remove(again)
    assert torch.equal(logits(again, ids, **kw), before)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert torch.equal(logits(plain, ids, **kw), before)  # without rope_patch: the unpatched model, not a third one


def test_single_scheme_saves_keep_format_2(tmp_path):
    model = tiny_model("llama")
    rope_patch.apply(model, ["yarn:4"])  # a list of one is that scheme
    assert rope_patch.current(model).name == "yarn"
    rope_patch.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / MANIFEST).read_text())["format"] == 2


def test_to_rope_parameters_refuses_a_stack_and_names_the_non_native_part():
    model = tiny_model("llama")
    rope_patch.apply(model, "yarn:4+logn")
    for call in (lambda: rope_patch.to_rope_parameters(None, model=model), lambda: rope_patch.native_config(model),
                 lambda: rope_patch.to_rope_parameters("yarn:4+logn")):
        with pytest.raises(ValueError, match=r"yarn \+ logn has no native.*logn is not "
                                             r"expressible.*to_rope_parameters\('yarn'"):
            call()


# On a table rotary (GPT-J, CodeGen) no frequency scheme has a native form (its config has no rope_parameters: a single
# one is refused by the export with that reason, Scheme.on_table): neither has a stack's frequency part, so the export
# names it among the parts it cannot express and does not offer to export it alone.
@pytest.mark.parametrize("folder,spec", [("gptj", "yarn:2+logn"), ("codegen", "linear:2+rerope:window_size=8"),
                                         ("gptj", "ntk:2+self_extend:group_size=2,window_size=8+logn")])
def test_a_stack_on_a_table_rotary_has_no_native_frequency_part(folder, spec):
    model = tiny_model(folder)
    rope_patch.apply(model, spec)
    freq = rope_patch.current(model).frequency
    with pytest.raises(ValueError, match=f"{freq.name}.*sin/cos table") as alone:
        rope_patch.to_rope_parameters(freq, model=model)
    assert "has no native" in str(alone.value)
    with pytest.raises(ValueError) as info:
        rope_patch.to_rope_parameters(None, model=model)
    parts = [p.name for p in rope_patch.current(model).schemes]
    assert f"{', '.join(parts)} are not expressible" in str(info.value)
    assert "exports the frequency part alone" not in str(info.value)
    assert "would be a third model" not in rope_patch.current(model).save_notice("out", manifest=True)


# ---- the API and the grammar ---------------------------------------------------------------------------------------
def test_spec_grammar_and_current():
    assert parse_spec("yarn:4+logn") == ("stack", {"schemes": ["yarn:4", "logn"]})
    assert parse_spec("default:1e+6") == ("default", {"rope_theta": 1e6})  # a '+' inside a number is no join
    assert parse_spec("logn:llama4") == ("logn", {"kind": "llama4"})
    stack = parse_scheme_spec("logn + yarn:factor=4,beta_fast=16")  # any order, spaces: installed freq first
    assert isinstance(stack, rope_patch.Stack) and [p.name for p in stack.schemes] == ["yarn", "logn"]
    assert stack == rope_patch.as_scheme(["logn", rope_patch.as_scheme("yarn", factor=4, beta_fast=16)])
    assert stack.frequency.factor == 4 and stack.attention is None and stack.modifiers[0].kind == "logn"
    assert str(stack) == "yarn(factor=4.0, beta_fast=16.0) + logn(kind='logn', layers='all')"
    model = tiny_model("llama")
    rope_patch.apply(model, "yarn:4")
    assert type(rope_patch.current(model)).__name__ == "Yarn"  # one scheme: the plain Scheme, as before
    rope_patch.apply(model, stack)
    assert rope_patch.current(model).frequency.original_max_position_embeddings == WINDOW  # resolved per part
    assert rope_patch.context_window(model) == 4 * WINDOW


def test_compare_accepts_stacked_specs():
    from rope_patch.evaluation.compare import parse_schemes

    (spec, scheme), = parse_schemes(["yarn:4+logn"])
    assert spec == "yarn:4+logn" and isinstance(scheme, Stack)


REFUSED = [  # (what is applied, error type, words the message must hold)
    (["yarn:4", "linear:2"], ValueError, ["yarn and linear are both frequency schemes", "at most one frequency"]),
    (["self_extend:group_size=4,window_size=16", "rerope:window_size=8"], ValueError, ["both attention-side"]),
    (["yarn:4", "alibi"], ValueError, ["alibi removes the rotation", "self_extend, rerope"]),
    (["linear:2", "nope"], ValueError, ["nope removes the rotation"]),
    (["ntk:2", "relative_bias"], ValueError, ["relative_bias removes the rotation"]),
    (["yarn:4", "sinusoidal"], ValueError, ["sinusoidal removes the rotation"]),
    (["yarn:4", "learned_absolute"], ValueError, ["learned_absolute removes the rotation"]),
    (["dynamic:4", "self_extend:group_size=4,window_size=16"], ValueError, ["dynamic rescales", "dynamic_yarn"]),
    (["logn", "yarn:4", "logn:llama4"], ValueError, ["logn is given twice"]),
    (["dynamic_yarn:factor=4,cache_rotation=consistent", "rerope:window_size=8"], ValueError,
     ["cache_rotation='consistent' runs its own attention function"]),
    ("yarn:4+", ValueError, ["empty part after '+'"]),
    ("+logn", ValueError, ["empty part"]),
    ([], ValueError, ["at least two"]),
    ("logn:kind=qwen", ValueError, ["kind", "logn", "llama4"]),
    ("logn:attn_scale=0.2", TypeError, ["belong to kind='llama4'"]),
    ("logn:kind=llama4,floor_scale=0", ValueError, ["floor_scale"]),
    ("logn:kind=llama4,attn_scale=-1", ValueError, ["attn_scale"]),
    ("logn:layers=nope", ValueError, ["no NoPE layers", "layers='all'"]),
    ("logn:layers=some", ValueError, ["layers"]),
    ([42, "logn"], TypeError, ["stack part must be"]),
]


@pytest.mark.parametrize("spec,error,words", REFUSED, ids=[str(s) for s, *_ in REFUSED])
def test_refused_at_apply_with_the_model_untouched(spec, error, words):
    model = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(model, "yarn:2")  # an existing patch must survive the failed apply
    ids, _ = batch(False)
    before, state = logits(model, ids), rope_patch.current(model)
    with pytest.raises(error) as info:
        rope_patch.apply(model, spec)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert rope_patch.current(model) == state and torch.equal(logits(model, ids), before)


def test_a_part_failing_at_prepare_leaves_the_model_untouched():
    """yarn prepares fine; self_extend then refuses the static cache: nothing of yarn is left either."""
    model = tiny_model("llama", attn_implementation="sdpa")
    model.generation_config.cache_implementation = "static"
    ids, _ = batch(False)
    before = logits(model, ids)
    with pytest.raises(ValueError, match="static"):
        rope_patch.apply(model, ["yarn:4", "self_extend:group_size=4,window_size=16"])
    assert rope_patch.current(model) is None and torch.equal(logits(model, ids), before)
    assert model.config.rope_parameters["rope_type"] == "default"


# ---- the docs' example ------------------------------------------------------------------------------------------
def test_the_composing_guide_example_runs_as_written():
    """The stack block of docs/guides/composing.md (the one after the model is loaded), executed as it stands on a
    tiny model of every suite's: the docs' own run of it (conftest.py at the root) uses rope-tiny."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "composing.md").read_text()
    code = page.split("```{.python continuation}\n", 1)[1].split("```", 1)[0]
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, _ = batch(False)
    before = logits(model, ids)
    seen = []
    exec(code, {"rope_patch": rope_patch, "model": model, "print": seen.append})  # noqa: S102
    assert [p.name for p in seen[0].schemes] == ["yarn", "self_extend", "logn"]
    assert rope_patch.current(model) is None and torch.equal(logits(model, ids), before)
