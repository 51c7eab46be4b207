"""`logn`: the position-dependent query temperature (rope_patch/schemes/logn.py).

References: the formulas written here with `math`; transformers' own Llama 4 (`attn_temperature_tuning=True`, which
scales the queries of its NoPE layers), exact to 0 in fp32 on eager and sdpa, prefill and cached decoding; and a
forward hook scaling the query where the model's attention receives it (after q_proj, after Qwen3's q_norm).
The Llama 4 temperature rows live here (the frequency and attention-side rows: ARCHS["llama4_text"]): `llama4_model`
builds a tiny Llama4ForCausalLM with two RoPE and two NoPE layers.
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from helpers.models import VOCAB, WINDOW, logits, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

import rope_patch
from rope_patch import attention
from rope_patch.rotary import BackendChanged
from rope_patch.schemes.logn import LogN, Positions, QueryTemperature

L = 3 * WINDOW
TOL = 1e-5

# (kind, window, attn_scale, floor_scale, position, expected factor), by hand from the papers' formulas
FACTORS = [
    ("logn", 32, 0, 1, 0, 1.0),
    ("logn", 32, 0, 1, 31, 1.0),  # p + 1 = L: log_L L = 1
    ("logn", 32, 0, 1, 1023, 2.0),  # log_32 1024
    ("logn", 4096, 0, 1, 4096 ** 1.5 - 1, 1.5),
    ("llama4", 0, 0.1, 8192, 0, 1.0),
    ("llama4", 0, 0.1, 8192, 8190, 1.0),  # ⌊8191/8192⌋ = 0
    ("llama4", 0, 0.1, 8192, 8191, 1 + 0.1 * math.log(2)),
    ("llama4", 0, 0.1, 8192, 3 * 8192 - 1, 1 + 0.1 * math.log(4)),
    ("llama4", 0, 0.5, 4, 10, 1 + 0.5 * math.log(3)),
]


@pytest.mark.parametrize("kind,window,attn_scale,floor_scale,p,expected", FACTORS)
def test_factor_follows_the_formula(kind, window, attn_scale, floor_scale, p, expected):
    t = QueryTemperature(kind, window, attn_scale, floor_scale, "sdpa", True, Positions())
    assert t.factor(torch.tensor([p])).item() == pytest.approx(expected, rel=1e-6)


# ---- Llama 4 -------------------------------------------------------------------------------------------------------
def llama4_config(**kw):
    base = dict(hidden_size=64, intermediate_size=96, intermediate_size_mlp=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                max_position_embeddings=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_local_experts=2,
                num_experts_per_tok=1, no_rope_layer_interval=2, attn_scale=0.5, floor_scale=8,
                attn_temperature_tuning=False)
    return AutoConfig.for_model("llama4_text", **{**base, **kw})


def llama4_model(backend="sdpa", seed=0, **kw):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(llama4_config(**kw), attn_implementation=backend).eval()


def llama4_native(model, **kw):
    """The same weights, with transformers' own temperature tuning (and `kw` config changes)."""
    cfg = llama4_config(**{"attn_temperature_tuning": True, **kw})
    twin = AutoModelForCausalLM.from_config(cfg, attn_implementation=model.config._attn_implementation).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def ids_(n=L, b=2, seed=0):
    return torch.randint(3, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_llama4_nope_layers_equal_transformers_temperature_tuning(backend):
    model = llama4_model(backend)
    assert model.config.no_rope_layers == [1, 0, 1, 0]
    native = llama4_native(model)
    ids = ids_()
    before = logits(model, ids)
    rope_patch.apply(model, "logn:kind=llama4,layers=nope")
    scheme = rope_patch.current(model)
    assert (scheme.attn_scale, scheme.floor_scale) == (0.5, 8.0)  # read from the model's config
    assert (logits(model, ids) - logits(native, ids)).abs().max().item() <= TOL
    assert (before - logits(native, ids)).abs().max().item() > 1e-3  # the temperature is visible
    rope_patch.apply(model, "logn:kind=llama4")  # every layer: not what Llama 4 does
    assert (logits(model, ids) - logits(native, ids)).abs().max().item() > 1e-3
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_llama4_cached_decoding_equals_transformers(backend):
    model = llama4_model(backend)
    native = llama4_native(model)
    rope_patch.apply(model, "logn:kind=llama4,layers=nope")
    ids = ids_(n=20, b=1)
    gen = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        ours, full, theirs = (m.generate(ids, use_cache=c, **gen)
                              for m, c in ((model, True), (model, False), (native, True)))
    assert torch.equal(ours.sequences, theirs.sequences) and torch.equal(ours.sequences, full.sequences)
    for a, b in ((ours, theirs), (ours, full)):
        assert max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True)) <= TOL


def test_llama4_refuses_a_second_temperature():
    native = llama4_native(llama4_model())
    ids = ids_()
    before = logits(native, ids)
    for spec in ("logn:kind=llama4,layers=nope", "logn", "yarn:4+logn"):
        with pytest.raises(ValueError, match="attn_temperature_tuning.*twice"):
            rope_patch.apply(native, spec)
        assert rope_patch.current(native) is None and torch.equal(logits(native, ids), before)


@pytest.mark.parametrize("spec", ["yarn:4", "linear:2", "llama3:4", "yarn:4+logn:kind=llama4,layers=nope"])
def test_llama4_frequency_schemes_and_stacks_equal_native(spec):
    """Llama 4's rotary returns one complex tensor (freqs_cis): the frequency schemes run through it unchanged."""
    model = llama4_model()
    ids = ids_()
    before = logits(model, ids)
    probe = llama4_model()
    rope_patch.apply(probe, spec.split("+")[0])
    native = llama4_native(model, attn_temperature_tuning="logn" in spec, **rope_patch.native_config(probe))
    rope_patch.apply(model, spec)
    assert (logits(model, ids) - logits(native, ids)).abs().max().item() <= TOL
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


def test_llama4_left_padding_uses_the_true_position():
    """Llama 4's layers get no position_ids; the decoder's (what generate passes) are recorded for them, so a left-
    padded row equals the sequence alone (transformers' own counts cache slots and shifts it)."""
    model = llama4_model()
    rope_patch.apply(model, "logn:kind=llama4,layers=nope")
    ids = ids_(n=40)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    padded = logits(model, ids, attention_mask=mask, position_ids=pos)
    assert (padded[:1, 6:] - logits(model, ids[:1, 6:])).abs().max().item() <= TOL


# ---- where the query is scaled ---------------------------------------------------------------------------------
class ScaleOutput:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, module, inputs, out):
        n = out.shape[1]
        t = torch.tensor([self.factor(p) for p in range(n)], dtype=out.dtype)
        return out * t.view(1, n, *([1] * (out.dim() - 2)))


def logn_ref(p):
    return max(1.0, math.log(p + 1, WINDOW))


@pytest.mark.parametrize("arch,where",
                         [("llama", "q_proj"), ("qwen2", "q_proj"), ("qwen3", "q_norm"), ("olmo2", "q_norm")])
def test_the_query_is_scaled_where_attention_receives_it(arch, where):
    """After Qwen3's / OLMo2's q_norm (which would undo a scale at q_proj), after llama's q_proj."""
    model = tiny_model(arch, attn_implementation="sdpa")
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if hasattr(m, where) and hasattr(m, "layer_idx"):
            getattr(m, where).register_forward_hook(ScaleOutput(logn_ref))
    rope_patch.apply(model, "logn")
    ids = ids_()
    assert (logits(model, ids) - logits(ref, ids)).abs().max().item() <= TOL


def test_smollm3_nope_layers():
    model = tiny_model("smollm3", attn_implementation="sdpa", num_hidden_layers=4, no_rope_layer_interval=2)
    nope = [i for i, r in enumerate(model.config.no_rope_layers) if not r]
    assert 0 < len(nope) < 4
    ref = copy.deepcopy(model)
    for i in nope:
        ref.model.layers[i].self_attn.q_proj.register_forward_hook(ScaleOutput(logn_ref))
    rope_patch.apply(model, "logn:layers=nope")
    ids = ids_()
    assert (logits(model, ids) - logits(ref, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_backward_equals_the_reference(backend):
    model = tiny_model("llama", attn_implementation=backend).train()
    ref = copy.deepcopy(model)
    for layer in ref.model.layers:
        layer.self_attn.q_proj.register_forward_hook(ScaleOutput(logn_ref))
    rope_patch.apply(model, "yarn:2+logn")
    rope_patch.apply(ref, "yarn:2")
    ids = ids_()
    for m in (model, ref):
        m(ids, labels=ids).loss.backward()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    assert all(torch.isfinite(a).all() for a, _ in grads)
    assert max((a - b).abs().max().item() for a, b in grads) <= 1e-5


def test_flex_backends(monkeypatch):
    """transformers' compiled flex_attention wrapped as it is; a stack with an attention-side scheme wraps rope_patch's
    flex function (run eagerly here: the compiled CPU kernel refuses the log-sum-exp merge, see attention/)."""
    monkeypatch.setattr(attention.settings, "FLEX_COMPILE", False)
    ids = ids_()
    for spec in ("logn", "yarn:2+self_extend:group_size=4,window_size=16+logn"):
        flex = tiny_model("llama", attn_implementation="flex_attention")
        sdpa = tiny_model("llama", attn_implementation="sdpa")
        for m in (flex, sdpa):
            rope_patch.apply(m, spec)
        assert flex.config._attn_implementation == "rope_patch_logn_flex"
        assert (logits(flex, ids) - logits(sdpa, ids)).abs().max().item() <= TOL


# ---- state, copies, saves ------------------------------------------------------------------------------------------
# Blt's cross-attention (patches <-> bytes) runs through transformers' attention interface too, without positions: no
# scheme patches it (rope_patch.attention.calls.stand_in), and logn, which switches the model's backend to its wrapper,
# must run it as the model has it. attn_scale=0 makes t(p) = 1: only the wrapping is left, which must change nothing.
@pytest.mark.parametrize("under", [None, "alibi", "rerope:window_size=8", "yarn:2"])
def test_attention_modules_without_positions_run_as_the_model_has_them(under):
    from helpers.models import INPUTS

    model, kw = tiny_model("blt"), INPUTS["blt"]
    ids = ids_(n=70, b=1)
    vanilla = logits(model, ids, **kw)
    ref = copy.deepcopy(model)
    if under is not None:
        rope_patch.apply(ref, under)
    expected = logits(ref, ids, **kw)
    parts = [] if under is None else [under]
    rope_patch.apply(model, [*parts, "logn:kind=llama4,attn_scale=0"])
    assert torch.equal(logits(model, ids, **kw), expected)
    rope_patch.apply(model, [*parts, "logn"])
    assert not torch.equal(logits(model, ids, **kw), expected)  # the self-attention queries are scaled
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids, **kw), vanilla)


def test_copies_pickles_and_saves(tmp_path):
    model = tiny_model("llama", attn_implementation="sdpa")
    ids = ids_()
    before = logits(model, ids)
    rope_patch.apply(model, "logn:kind=llama4,attn_scale=0.5,floor_scale=4")
    patched = logits(model, ids)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(logits(twin, ids), patched)
        rope_patch.remove(twin)
        assert torch.equal(logits(twin, ids), before) and torch.equal(logits(model, ids), patched)
    rope_patch.save_pretrained(model, tmp_path)
    again = rope_patch.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert rope_patch.current(again) == rope_patch.current(model) and torch.equal(logits(again, ids), patched)


def test_bf16_keeps_the_query_dtype():
    model = tiny_model("llama", attn_implementation="sdpa").to(torch.bfloat16)
    rope_patch.apply(model, "logn")
    out = logits(model, ids_())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_backend_switch_raises_and_reapply_takes_the_new_backend():
    model = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(model, "logn")
    model.set_attn_implementation("eager")
    with pytest.raises(BackendChanged, match="logn"):
        logits(model, ids_())
    rope_patch.apply(model, rope_patch.current(model))
    assert model.config._attn_implementation == "rope_patch_logn_eager"


def test_spec_forms():
    assert LogN() == rope_patch.as_scheme("logn") == rope_patch.as_scheme("logn:logn")
    assert rope_patch.as_scheme("logn:llama4").kind == "llama4"
    assert rope_patch.as_scheme("attn_temperature_tuning").name == "logn"
    assert "logn" in rope_patch.list_schemes()


def test_cli_lists_and_explains_logn(capsys):
    from rope_patch.cli import main

    assert main(["list"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("logn "))
    assert "modifier" in line and "kind, attn_scale, floor_scale, layers" in line
    assert main(["explain", "logn"]) == 0  # the frequencies are the model's own: logn changes the temperature only
    assert "pairs unchanged (θ′ = θ): 64 of 64" in capsys.readouterr().out
    assert main(["explain", "yarn:8+logn"]) == 0  # a stack: the frequency part's numbers and the temperature
    out = capsys.readouterr().out
    # log(8L)/log(L), L = 4096
    assert "yarn (s=8) + logn" in out and "query temperature (logn" in out and "×1.25 at 8L" in out


def test_no_native_form():
    with pytest.raises(ValueError, match="logn has no native.*attention temperature"):
        rope_patch.to_rope_parameters("logn")


@pytest.mark.parametrize("spec", ["nope+logn:kind=llama4,layers=nope", "alibi+logn", "sinusoidal+logn"])
def test_llama4_stacks_with_schemes_that_remove_the_rotation(spec):
    """Llama 4's complex rotary becomes the identity 1 + 0i; logn on top; remove() is bit-exact."""
    model = llama4_model()
    ids = ids_()
    before = logits(model, ids)
    rope_patch.apply(model, spec)
    out = logits(model, ids)
    assert torch.isfinite(out).all() and (out - before).abs().max().item() > 1e-3
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)
