"""Table rotaries (GPT-J, CodeGen): a rotary module that indexes a buffer of sin/cos rows by position id, built at init
from a base the config does not record (`create_sinusoidal_positions`), returning (sin, cos); attention rotates
interleaved pairs of the first `rotary_dim` coordinates with them.

rope_patch reads that layout from the module (discovery.SinCosTable); the frequency schemes install a table of the
scheme's frequencies, the re-positioning schemes run the layer's own lookup at the moved positions. The references
here are written from GPT-J's code: the table as `create_sinusoidal_positions` builds it, of transformers' own
frequencies (`ROPE_INIT_FUNCTIONS`) for the scheme's rope_parameters; and a GPT-J built with a longer table (its first
rows are the short one's) where a scheme runs past the model's table."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.models import VOCAB, logits, roundtrip, tiny_model
from helpers.reference_any import forward as reference_forward
from transformers import AutoModelForCausalLM, PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gptj.modeling_gptj import GPTJRotaryEmbedding

import rope_patch
from rope_patch.discovery import find_target, sincos_table

FOLDERS = ["gptj", "codegen"]
ROWS = 128  # the tiny models' table (max_position_embeddings, tests/helpers/models.py)


def batch(n: int, seed: int = 0):
    return torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def table_of(model) -> torch.Tensor:
    return next(m for m in model.modules() if "embed_positions" in m._buffers).embed_positions


def with_table(model, rope: dict, rows: int):
    """`model` with its table built as `create_sinusoidal_positions` builds it ([sin | cos] rows at 0 … rows − 1), of
    the frequencies and cos/sin scale transformers' init function gives for `rope` (its `default` for a new base)."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": cfg.rotary_dim / head_dim, **rope}
    if rope["rope_type"] == "default":
        dim = cfg.rotary_dim
        inv_freq, scale = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    else:
        standalone = PreTrainedConfig(rope_parameters=rope, head_dim=head_dim, hidden_size=cfg.hidden_size,
                                      num_attention_heads=cfg.num_attention_heads, max_position_embeddings=rows)
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](standalone)
    angles = torch.arange(rows, dtype=torch.int64).float()[:, None] * inv_freq.float()
    twin = copy.deepcopy(model)
    next(m for m in twin.modules() if "embed_positions" in m._buffers).embed_positions = torch.cat(
        (torch.sin(angles) * scale, torch.cos(angles) * scale), dim=1)
    return twin


# ---- discovery ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("folder", FOLDERS)
def test_the_table_layout_is_read_from_the_module(folder):
    site = find_target(tiny_model(folder))
    layout = site.table
    assert (layout.buffer, layout.rows, layout.pairs, layout.rope_theta) == ("embed_positions", ROWS, 4, 10000.0)
    assert layout.sin_first and layout.returns_sin_first
    ctx = site.contexts()[None]
    assert (ctx.head_dim, ctx.rotary_dim, ctx.max_position_embeddings) == (16, 8, ROWS)


@pytest.mark.parametrize("base", [10000.0, 500000.0, 1e6, 12345.6])
def test_the_base_is_read_exactly_from_a_full_size_table(base):
    """GPT-J-6B's table (2048 rows, rotary_dim 64) of any base: read back exactly (the shortest decimal that rebuilds
    the table bit for bit)."""
    from transformers import GPTJConfig

    rotary = GPTJRotaryEmbedding(GPTJConfig(n_positions=2048, rotary_dim=64, n_embd=256, n_head=4))
    dim = 64
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    angles = torch.arange(2048, dtype=torch.int64).float()[:, None] * inv_freq
    rotary.embed_positions = torch.cat((torch.sin(angles), torch.cos(angles)), dim=1)
    layout = sincos_table(rotary)
    assert layout is not None and layout.rope_theta == base and layout.pairs == 32


def test_a_table_cast_to_bf16_is_read_and_given_back():
    """`model.to(torch.bfloat16)` rounds the table (the model then rotates with the rounded rows): still read as the
    same RoPE, and remove() gives the rounded table back."""
    model = tiny_model("gptj", attn_implementation="sdpa").to(torch.bfloat16)
    assert find_target(model).table.rope_theta == 10000.0
    ids = batch(40)
    before = logits(model, ids)
    rope_patch.apply(model, "self_extend", group_size=4, window_size=16)
    rope_patch.remove(model)
    assert table_of(model).dtype == torch.bfloat16 and torch.equal(logits(model, ids), before)


def test_a_buffer_that_is_not_a_rope_table_is_no_rotary():
    model = tiny_model("gptj")
    rotary = table_of(model)
    table = next(m for m in model.modules() if "embed_positions" in m._buffers)
    table.embed_positions = torch.randn_like(rotary)  # a learned or random table: not sin/cos of one base
    with pytest.raises(TypeError, match="has no rotary position embedding module"):
        rope_patch.apply(model, "yarn", factor=4.0)
    rope_patch.remove(model)  # a no-op on such a model


# ---- frequency schemes ----------------------------------------------------------------------------------------------
FREQUENCY = [
    ("linear", {"factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ("yarn", {"factor": 4.0}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ROWS}),
    ("llama3", {"factor": 4.0}, {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": ROWS,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    ("default", {"rope_theta": 5e5}, {"rope_type": "default", "rope_theta": 5e5}),
]


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("scheme,params,rope", FREQUENCY, ids=[s for s, *_ in FREQUENCY])
def test_frequency_scheme_equals_a_table_of_transformers_frequencies(folder, scheme, params, rope):
    """Past the model's own table too (160 tokens > 128 rows: the unpatched model has no row there)."""
    model = tiny_model(folder, attn_implementation="sdpa")
    ids = batch(160)
    short = batch(40)
    before = logits(model, short)
    rope_patch.apply(model, scheme, **params)
    rows = int(params.get("factor", 1) * ROWS)
    assert table_of(model).shape[0] == max(rows, ROWS)
    want = with_table(tiny_model(folder, attn_implementation="sdpa"), rope, 4 * ROWS)
    assert (logits(model, ids) - logits(want, ids)).abs().max().item() <= 1e-5
    rope_patch.remove(model)
    assert torch.equal(logits(model, short), before) and table_of(model).shape[0] == ROWS


def test_the_table_grows_with_the_scheme_frequencies_past_its_window():
    """yarn ×4 installs 4·128 rows; 600 tokens need more: the rows past them are yarn's too."""
    model = tiny_model("gptj", attn_implementation="sdpa")
    rope_patch.apply(model, "yarn", factor=4.0)
    ids = batch(600)
    got = logits(model, ids)
    assert table_of(model).shape[0] >= 600
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ROWS}
    want = with_table(tiny_model("gptj", attn_implementation="sdpa"), rope, 1024)
    assert (got - logits(want, ids)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("spec",
                         ["dynamic:4", "dynamic_yarn:4", "longrope:factor=4,short_factor=1/1/1/1,long_factor=4/4/4/4"])
def test_length_dependent_schemes_are_refused_and_the_model_is_untouched(spec):
    model = tiny_model("gptj")
    ids = batch(40)
    before = logits(model, ids)
    with pytest.raises(ValueError, match="follow the sequence length.*fixed sin/cos table"):
        rope_patch.apply(model, spec)
    assert rope_patch.current(model) is None and torch.equal(logits(model, ids), before)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("scheme,params",
                         [("yarn", {"factor": 4.0}), ("self_extend", {"group_size": 4, "window_size": 16})])
def test_copies_are_independent(scheme, params, how):
    model = tiny_model("gptj", attn_implementation="sdpa")
    ids = batch(160)
    base = logits(model, batch(40))
    rope_patch.apply(model, scheme, **params)
    out = logits(model, ids)
    dup = roundtrip(model, how)
    assert torch.equal(logits(dup, ids), out) and rope_patch.current(dup) == rope_patch.current(model)
    rope_patch.remove(dup)
    assert torch.equal(logits(dup, batch(40)), base) and torch.equal(logits(model, ids), out)
    rope_patch.remove(model)
    assert torch.equal(logits(model, batch(40)), base)


def test_save_follows_the_rule_of_non_native_patches(tmp_path):
    """GPT-J's config has no rope_parameters: config.json keeps the model as it was (nothing written), the manifest
    records the patch as non-native, rope_patch.from_pretrained re-applies it, transformers alone loads the unpatched
    model, and the export refuses."""
    model = tiny_model("gptj", attn_implementation="sdpa")
    ids = batch(100)
    unpatched = logits(model, ids)
    rope_patch.apply(model, "yarn", factor=4.0)
    patched_out = logits(model, ids)
    rope_patch.save_pretrained(model, tmp_path)
    manifest = json.loads((tmp_path / "rope_patch.json").read_text())
    assert manifest["native"] is False and manifest["original"]["rope_parameters"] is None
    assert "rope_parameters" not in json.loads((tmp_path / "config.json").read_text())
    again = rope_patch.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert torch.equal(logits(again, ids), patched_out)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert rope_patch.current(plain) is None and torch.equal(logits(plain, ids), unpatched)
    with pytest.raises(ValueError, match="no native transformers/vLLM `rope_parameters` form.*sin/cos table"):
        rope_patch.to_rope_parameters(None, model=model)
    assert rope_patch.current(model).native is False
    assert rope_patch.as_scheme("yarn", factor=4.0).native  # the scheme object of the user is not marked


# ---- attention-side schemes -----------------------------------------------------------------------------------------
REPOSITIONING = [("self_extend", {"group_size": 4, "window_size": 16}), ("rerope", {"window_size": 16}),
                 ("string", {"shift_size": 60, "window_size": 8}), ("dca", {"chunk_size": 96, "local_size": 8})]


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("scheme,params", REPOSITIONING, ids=[s for s, _ in REPOSITIONING])
def test_repositioning_past_the_table_equals_the_reference(folder, scheme, params):
    """160 tokens on a model of 128 rows: the table grows (for the true positions and the moved ones), and the result
    equals the reference on a model built with a 256-row table (its first 128 rows are the short table's)."""
    model = tiny_model(folder, attn_implementation="sdpa")
    ids = batch(160)
    rope_patch.apply(model, scheme, **params)
    got = logits(model, ids)
    longer = tiny_model(folder, attn_implementation="sdpa", max_position_embeddings=2 * ROWS)
    longer.load_state_dict(model.state_dict())
    assert torch.equal(table_of(longer)[:ROWS], table_of(tiny_model(folder)))
    want = reference_forward(longer, model, ids, scheme, params)
    assert (got - want).abs().max().item() <= 1e-5
    rope_patch.remove(model)
    assert table_of(model).shape[0] == ROWS


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("n", [16, 100, 180])
def test_string_with_a_shift_past_the_table_start_equals_the_reference(folder, n):
    """STRING's far query copy sits at i − S + W: below 0 for the first S − W tokens, which have no far key. With S −
    W beyond the table's rows (a shift set for a long input, run on a short one) that was an IndexError at the first
    forward; those positions are floored at 0, and the result is the reference's at every length."""
    params = {"shift_size": 150, "window_size": 8}
    model = tiny_model(folder, attn_implementation="sdpa")
    ids = batch(n)
    rope_patch.apply(model, "string", **params)
    got = logits(model, ids)
    longer = tiny_model(folder, attn_implementation="sdpa", max_position_embeddings=2 * ROWS)
    longer.load_state_dict(model.state_dict())
    assert (got - reference_forward(longer, model, ids, "string", params)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("scheme,params", [("self_extend", {"group_size": 4, "window_size": 16}),
                                           ("yarn:4+self_extend", {})], ids=["self_extend", "yarn+self_extend"])
def test_cached_decoding_past_the_table_equals_recomputation(scheme, params):
    model = tiny_model("gptj", attn_implementation="sdpa")
    rope_patch.apply(model, scheme if params else [scheme.split("+")[0], "self_extend:group_size=4,window_size=16"],
                     **params)
    ids = batch(140)[:1]
    with torch.no_grad():
        out = model(ids[:, :120], use_cache=True)  # the prefill within the table, the steps past it
        cache, steps = out.cache, []
        for t in range(120, 140):
            step = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = step.cache
            steps.append(step.logits[:, -1])
    full = logits(model, ids)
    assert (torch.stack(steps, 1) - full[:, 120:140]).abs().max().item() <= 1e-4


def test_fractional_positions_are_refused_on_a_table():
    model = tiny_model("gptj")
    ids = batch(40)
    before = logits(model, ids)
    with pytest.raises(ValueError, match="fractional positions.*sin/cos table of integer positions"):
        rope_patch.apply(model, "leaky_rerope", window_size=16, factor=4.0)
    assert rope_patch.current(model) is None and torch.equal(logits(model, ids), before)


def test_alibi_removes_the_table_rotation():
    """The identity rotation in GPT-J's (sin, cos) order: sin = 0, cos = 1 (the order reversed would rotate every
    pair by 90 degrees, the same for q and k, so the scores alone cannot tell; the rotary's output can)."""
    model = tiny_model("gptj", attn_implementation="sdpa")
    rope_patch.apply(model, "alibi")
    rotary = next(m for m in model.modules() if "embed_positions" in m._buffers)
    sin, cos = rotary(torch.zeros(1, 3, 4), torch.arange(3)[None])
    assert torch.equal(sin, torch.zeros_like(sin)) and torch.equal(cos, torch.ones_like(cos))
