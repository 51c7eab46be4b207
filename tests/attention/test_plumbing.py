"""The apply-time plumbing check (rope_patch/attention/plumbing.py): what it catches, what it costs, how it is
skipped."""

from __future__ import annotations

import pytest
import torch
from helpers.coverage import backend, batch
from helpers.models import logits, tiny_model, token_batch

import rope_patch
from rope_patch.attention import plumbing

# The ten architectures on which the old design (the rotary made the identity, q and k rotated inside the attention
# function) was silently wrong: layers without RoPE rotated anyway, q/k norms or a query scale after RoPE moved in
# front of it, a sparse indexer fed un-rotated keys. `cache_rotation="consistent"` still rotates that way (cached keys
# are re-rotated at every step by definition), so it is that design with no structural support: the check must
# refuse it on each of them, naming the layer.
SILENT = {
    "afmoe": "layer 1", "cohere2_moe": "layer 1", "exaone_moe": "layer 1", "flint": "layer 0", "kolibri1": "layer 1",
    "lara_mini": "layer 2",  # their full-attention layers use no RoPE
    "hunyuan_v1_dense": "layer 0", "hunyuan_v1_moe": "layer 0",  # q/k RMSNorm after RoPE
    "dory": "layer 0",  # a per-channel query scale after RoPE
    "qwen4_exp": "layer 1",  # a sparse indexer that rotates with the position embeddings
}


@pytest.mark.parametrize("folder", sorted(SILENT))
def test_the_check_catches_rotation_inside_attention_where_the_layer_does_more(folder):
    model = tiny_model(folder, attn_implementation=backend(folder))
    ids, kw, _ = batch(folder)
    before, config = logits(model, ids, **kw), model.config.to_dict()
    with pytest.raises(ValueError, match=rf"apply-time check .* does not hold: \w+ \({SILENT[folder]}\): its output"):
        rope_patch.apply(model, "dynamic", factor=2.0, cache_rotation="consistent")
    assert rope_patch.current(model) is None and model.config.to_dict() == config
    assert torch.equal(logits(model, ids, **kw), before)


@pytest.mark.parametrize("folder", ["llama", "qwen3", "gemma2"])
def test_the_same_design_passes_where_rope_is_the_last_thing_before_the_scores(folder):
    model = tiny_model(folder, attn_implementation=backend(folder))
    rope_patch.apply(model, "dynamic", factor=2.0, cache_rotation="consistent")
    assert rope_patch.current(model) is not None


def test_an_architecture_is_checked_once_per_process_and_check_false_skips_it(monkeypatch):
    runs = []
    original = plumbing.run
    monkeypatch.setattr(plumbing, "run", lambda *a: (runs.append(a), original(*a))[1])
    monkeypatch.setattr(plumbing, "CHECKED", {})
    rope_patch.apply(tiny_model("llama", attn_implementation="sdpa"), "self_extend", group_size=4, window_size=12)
    rope_patch.apply(tiny_model("llama", attn_implementation="sdpa", seed=1), "self_extend", group_size=2,
                     window_size=8)
    assert len(runs) == 1  # another model of the same architecture, scheme family and backend
    rope_patch.apply(tiny_model("qwen3", attn_implementation="sdpa"), "rerope", window_size=12, check=False)
    assert len(runs) == 1
    rope_patch.apply(tiny_model("qwen3", attn_implementation="sdpa"), "rerope", window_size=12)
    assert len(runs) == 2


def test_a_declared_rule_that_hides_keys_is_checked_apart_from_one_that_does_not(monkeypatch):
    """Every declared scheme runs one rule class (`Declared`): the verdict is kept per region kind, so ReRoPE's pass on
    an architecture does not stand for LM-Infinite, which hides keys (refused where a layer gets no positions), while
    another ReRoPE window reuses it."""
    runs = []
    original = plumbing.run
    monkeypatch.setattr(plumbing, "run", lambda *a: (runs.append(a), original(*a))[1])
    monkeypatch.setattr(plumbing, "CHECKED", {})
    rope_patch.apply(tiny_model("llama", attn_implementation="sdpa"), "rerope", window_size=12)
    rope_patch.apply(tiny_model("llama", attn_implementation="sdpa"), "rerope", window_size=8)
    assert len(runs) == 1
    rope_patch.apply(tiny_model("llama", attn_implementation="sdpa"), "lm_infinite", local_size=12, global_size=4)
    assert len(runs) == 2


def test_a_model_whose_layers_run_other_copies_is_checked_again(monkeypatch):
    """The verdict is kept per copies run by each layer too: on Gemma 3n, whose later layers read earlier layers' keys,
    Ms-PoE on every layer passes, and skipping the first (whose keys a later layer reads, rotated the model's way) is
    refused with the layer that reads them, also after the first passed."""
    monkeypatch.setattr(plumbing, "CHECKED", {})
    params = {"min_ratio": 1.2, "max_ratio": 1.8}
    rope_patch.apply(tiny_model("gemma3n", attn_implementation="sdpa"), "ms_poe", **params, skip_layers=0)
    model = tiny_model("gemma3n", attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"layer 2\): it reads keys another layer stored .*patch both "
                                         r"layers or neither"):
        rope_patch.apply(model, "ms_poe", **params, skip_layers=1)
    assert rope_patch.current(model) is None


def test_a_refused_check_can_be_overridden_and_then_gives_the_other_model():
    """check=False is the user's own risk: on HunYuan the old design is then what it was, a different model."""
    model = tiny_model("hunyuan_v1_dense", attn_implementation="sdpa")
    ids, kw, real = batch("hunyuan_v1_dense")
    before = logits(model, ids, **kw)
    rope_patch.apply(model, "dynamic", factor=2.0, cache_rotation="consistent", check=False)
    assert (logits(model, ids, **kw) - before)[real].abs().max() > 1e-2  # within the window dynamic is the model


def test_the_check_length_passes_every_window_the_layers_declare():
    model = tiny_model("gemma3_text", sliding_window=100)
    modules = [m for m in model.modules() if hasattr(m, "sliding_window")]
    assert plumbing.length(model, modules) == 116
    assert plumbing.length(tiny_model("llama"), []) == plumbing.MIN_LENGTH


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_check_accepts_a_scheme_in_every_dtype_and_backend(monkeypatch, dtype, attn):
    """float64 eager was refused ("nan relative"): its additive mask holds finfo(float64).min, -inf in float32 scores,
    so a left-pad query's row was NaN, and through the next layer's values so was every token of its row."""
    monkeypatch.setattr(plumbing, "CHECKED", {})
    model = tiny_model("llama", attn_implementation=attn).to(dtype)
    rope_patch.apply(model, "rerope", window_size=8)
    assert rope_patch.current(model) is not None


@pytest.mark.parametrize("scheme, params", [("rerope", {"window_size": 64}),
                                            ("self_extend", {"group_size": 2, "window_size": 64})])
def test_a_float64_eager_model_with_left_padding_keeps_its_tokens_finite_and_exact(scheme, params):
    """At a window over the input the scheme is the model: real tokens equal the model's own float64 sdpa logits
    (transformers' own float64 eager gives NaN for the whole left-padded row there); scores in float32 as always."""
    ids, kw = token_batch(20, pad=3)
    real = kw["attention_mask"].bool()
    want = logits(tiny_model("llama", attn_implementation="sdpa").to(torch.float64), ids, **kw)
    model = rope_patch.apply(tiny_model("llama", attn_implementation="eager").to(torch.float64), scheme, **params)
    got = logits(model, ids, **kw)
    assert torch.isfinite(got[real]).all()
    assert (got - want)[real].abs().max() <= 1e-6


def test_a_refusal_is_kept_per_architecture_and_dtype_like_a_pass(monkeypatch):
    """A check that does not hold is not run again for the same architecture, scheme family, backend and dtype (suggest
    tries each candidate on the model: a refused one cost the whole check on every call); the refusal says the same."""
    runs = []  # one per check run (its input is made once, whatever modes it tries)
    original = plumbing.native_inputs
    monkeypatch.setattr(plumbing, "native_inputs", lambda *a: (runs.append(a), original(*a))[1])
    monkeypatch.setattr(plumbing, "CHECKED", {})
    messages = []
    for dtype in (torch.float32, torch.float32, torch.float64):
        model = tiny_model("hunyuan_v1_dense", attn_implementation="sdpa").to(dtype)
        with pytest.raises(ValueError, match="apply-time check") as info:
            rope_patch.apply(model, "dynamic", factor=2.0, cache_rotation="consistent")
        messages.append(str(info.value))
        assert rope_patch.current(model) is None
    assert len(runs) == 3 - 1 and messages[0] == messages[1]  # the second float32 model: the kept refusal


def test_the_check_reads_the_models_cache_without_a_deprecation_warning(monkeypatch):
    """The check's model calls read the returned cache by the output class's own field name: asking for the
    deprecated `past_key_values` alias logged transformers' warning on every first attention-side apply."""
    import logging

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.Logger.warning_once.cache_clear()  # transformers logs it once per process
    handler = Keep()
    logging.getLogger("transformers").addHandler(handler)
    monkeypatch.setattr(plumbing, "CHECKED", {})  # the check runs
    try:
        rope_patch.apply(tiny_model("llama", attn_implementation="sdpa"), "rerope", window_size=8)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [m for m in messages if "deprecated" in m], messages


def test_the_check_runs_in_eval_mode_and_keeps_no_refusal_of_the_moment(monkeypatch):
    """A model in training mode (dropout) is checked in eval mode and given back in training mode; and a refusal
    that comes from an exception (here a forced one, as an out-of-memory error would be) is not kept: the next apply
    runs the check again."""
    monkeypatch.setattr(plumbing, "CHECKED", {})
    model = tiny_model("llama", attn_implementation="sdpa", attention_dropout=0.3).train()
    rope_patch.apply(model, "self_extend", group_size=4, window_size=12)
    assert all(m.training for m in model.modules())
    rope_patch.remove(model)
    monkeypatch.setattr(plumbing, "CHECKED", {})
    original = plumbing.run

    def tight(*args):
        raise torch.OutOfMemoryError("CPU out of memory (a test's)")

    monkeypatch.setattr(plumbing, "run", tight)
    fresh = tiny_model("llama", attn_implementation="sdpa")
    with pytest.raises(ValueError, match="raised OutOfMemoryError"):
        rope_patch.apply(fresh, "self_extend", group_size=4, window_size=12)
    assert not plumbing.CHECKED
    monkeypatch.setattr(plumbing, "run", original)
    rope_patch.apply(fresh, "self_extend", group_size=4, window_size=12)
    assert rope_patch.current(fresh) is not None
