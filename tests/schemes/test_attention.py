"""Attention-side schemes: exact against a plain-math reference, cached = recomputed, padding-invariant, reversible."""

from __future__ import annotations

import pytest
import torch
from helpers.models import logits, tiny_model, token_batch
from helpers.reference import alibi_slopes as ref_slopes
from helpers.reference import forward as reference_forward
from helpers.schemes import cases
from transformers import DynamicCache

import rope_patch
from rope_patch import attention
from rope_patch.schemes.bias import alibi_slopes

L = 96
PAD = 7  # left padding of row 0 in padded batches

# scheme, params: every attention-side scheme of tests/helpers/schemes.py (dca and ms_poe have their own references
# and files, test_dca.py and test_ms_poe.py) and, after them, settings that reach other code paths; every test below
# runs over them
SCHEMES = cases("attention", without=("dca", "ms_poe")) + [
    ("alibi", {"max_bias": 4.0}),
    ("relative_bias", {"num_buckets": 8, "max_distance": 20}),  # max_distance < block: the far keys as one constant
    ("self_extend", {"group_size": 3, "window_size": 10}),
    ("rerope", {"window_size": 40}),  # window > block: the fast path's four-way key split
    ("string", {"shift_size": 20, "window_size": 6}),  # split S = 20 < block: the band path
    ("string", {"shift_size": 40, "window_size": 16}),  # split S = 40 > block: the four-way key split
    ("dpe", {"group_sizes": [2, 4, 8, 16, 16, 8, 4, 2], "window_size": 40}),  # one group per pair, W > block
    ("sink", {"window_size": 40, "sink_size": 2}),  # window > block: the four-way key split, sinks cut from it
    ("sink", {"window_size": 1, "sink_size": 0}),  # each token sees itself only (no recent key, no sink)
]
IDS = [f"{s}-{i}" for i, (s, _) in enumerate(SCHEMES)]
# run through rope_patch's attention
CUSTOM = {"alibi", "relative_bias", "self_extend", "rerope", "leaky_rerope", "string", "dpe", "sink"}
BACKENDS = ["eager", "sdpa"]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several (uneven) query blocks per call even at test lengths, so the block loop is what gets tested (the
    fused fast path runs for inference without a padding mask, the materialised path otherwise)."""
    monkeypatch.setattr(attention.settings, "BLOCK_ELEMENTS", 2 * 4 * L * 11)
    monkeypatch.setattr(attention.settings, "FUSED_BLOCK", 24)


def batch(padded: bool, n: int = L, seed: int = 0):
    return token_batch(n, seed, PAD if padded else 0)


def patched_model(arch, backend, scheme, params, seed=0):
    model = tiny_model(arch, seed=seed, attn_implementation=backend)
    rope_patch.apply(model, scheme, **params)
    # learned tables start at a known value (ALiBi / sinusoidal): perturb them so the lookup itself is tested
    with torch.no_grad():
        for name in ("rope_patch_relative_bias", "rope_patch_position_embeddings"):
            if hasattr(model, name):
                getattr(model, name).weight.add_(0.3 * torch.randn_like(getattr(model, name).weight))
    return model


# llama: every backend × padding; the other GQA layouts (qwen2: q/k/v biases; mistral: sliding-window config)
# on the harder padded case of each backend
REF_SETUPS = [("llama", b, p) for b in BACKENDS for p in (False, True)] + [("qwen2", "sdpa", True),
                                                                           ("mistral", "eager", True)]


@pytest.mark.parametrize("arch,backend,padded", REF_SETUPS,
                         ids=[f"{a}-{b}-{'pad' if p else 'nopad'}" for a, b, p in REF_SETUPS])
@pytest.mark.parametrize("scheme,params", SCHEMES, ids=IDS)
def test_matches_reference(scheme, params, arch, backend, padded):
    model = patched_model(arch, backend, scheme, params)
    ids, kw = batch(padded)
    got = logits(model, ids, **kw)
    want = reference_forward(model, ids, scheme, params, kw.get("attention_mask"))
    real = kw["attention_mask"].bool() if padded else torch.ones_like(ids, dtype=torch.bool)
    assert (got - want)[real].abs().max().item() <= 1e-5


def test_reference_rope_is_vanilla():
    """The reference's relative-angle formulation reproduces the unpatched model (sanity check of the reference)."""
    model = tiny_model("llama")
    ids, kw = batch(True)
    want = reference_forward(model, ids, "rope", {}, kw["attention_mask"])
    real = kw["attention_mask"].bool()
    assert (logits(model, ids, **kw) - want)[real].abs().max().item() <= 1e-5


VANILLA_SETUPS = [("llama", "eager"), ("llama", "sdpa"), ("qwen2", "sdpa"), ("gemma2", "eager"), ("cohere", "eager")]


@pytest.mark.parametrize("arch,backend", VANILLA_SETUPS, ids=[f"{a}-{b}" for a, b in VANILLA_SETUPS])
@pytest.mark.parametrize("scheme,params", [
    ("self_extend", {"group_size": 4, "window_size": L}),
    ("self_extend", {"group_size": 1, "window_size": 8}),
    ("rerope", {"window_size": L}),
    ("leaky_rerope", {"window_size": 8, "factor": 1.0}),
    ("string", {"shift_size": L, "window_size": 8}),  # S ≥ the sequence length: no distance is shifted
    ("dpe", {"group_sizes": [2, 4, 8, 3], "window_size": L}),
    ("dpe", {"group_sizes": [1, 1, 1, 1], "window_size": 8}),
    ("self_extend_logistic", {"group_size": 6, "window_size": L, "growth_rate": 0.5}),
], ids=["se-window", "se-group1", "rerope-window", "leaky-k1", "string-shift", "dpe-window", "dpe-group1",
        "self-window"])
def test_degenerate_settings_equal_vanilla_rope(scheme, params, arch, backend):
    """cohere rotates interleaved pairs: the model's own apply_rotary_pos_emb is reused, so it works too."""
    model = tiny_model(arch, attn_implementation=backend)
    ids, kw = batch(True)
    want = logits(model, ids, **kw)
    rope_patch.apply(model, scheme, **params)
    real = kw["attention_mask"].bool()
    assert (logits(model, ids, **kw) - want)[real].abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("scheme,params", SCHEMES, ids=IDS)
def test_eager_and_sdpa_agree(scheme, params, arch):
    """The dense (eager) and blocked (sdpa) functions compute the same thing, also with Gemma 2's softcap."""
    ids, kw = batch(True)
    real = kw["attention_mask"].bool()
    outs = []
    for backend in BACKENDS:
        model = patched_model(arch, "eager", scheme, params, seed=1)
        if backend == "sdpa" and scheme in CUSTOM:
            model.set_attn_implementation(attention.BLOCKED)
        outs.append(logits(model, ids, **kw))
    assert (outs[0] - outs[1])[real].abs().max().item() <= 1e-5


GEN_SETUPS = [("llama", "eager"), ("qwen2", "sdpa"), ("gemma2", "eager")]  # gemma2: no sdpa in transformers
NEW = 6


@pytest.mark.parametrize("arch,backend", GEN_SETUPS, ids=[f"{a}-{b}" for a, b in GEN_SETUPS])
@pytest.mark.parametrize("scheme,params", SCHEMES, ids=IDS)
def test_generate_with_cache_equals_recomputation(scheme, params, arch, backend):
    """Greedy decoding of a left-padded batch (prompt 24 > every window, so decode steps cross it)."""
    assert_cached_decoding_equals_recomputation(patched_model(arch, backend, scheme, params), n=24)


def assert_cached_decoding_equals_recomputation(model, n: int = 20):
    """Greedy decoding of a left-padded batch of `n`-token prompts, with and without the KV cache: same tokens, logits
    within 1e-5 at every step."""
    ids, kw = batch(True, n=n)
    kw.pop("position_ids")
    gen = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_logits=True,
               return_dict_in_generate=True, **kw)
    with torch.no_grad():
        cached, full = (model.generate(ids, use_cache=c, **gen) for c in (True, False))
    assert torch.equal(cached.sequences, full.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(cached.logits, full.logits, strict=True)) <= 1e-5


@pytest.mark.parametrize("scheme,params", [(s, p) for s, p in SCHEMES if s in CUSTOM],
                         ids=[i for i, (s, _) in zip(IDS, SCHEMES, strict=True) if s in CUSTOM])
def test_unpadded_decoding_on_the_fused_path_equals_eager(scheme, params):
    """Without padding the sdpa-style function takes the fused log-sum-exp path, also for one-token decode steps."""
    ids, _ = batch(False, n=24)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    runs = []
    for backend in BACKENDS:
        model = patched_model("llama", backend, scheme, params)
        with torch.no_grad():
            runs.append(model.generate(ids, use_cache=True, **gen))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert max((a - b).abs().max().item() for a, b in zip(runs[0].logits, runs[1].logits, strict=True)) <= 1e-5


@pytest.mark.parametrize("packed", [False, True], ids=["slots", "packed"])
@pytest.mark.parametrize("scheme,params", [(s, p) for s, p in SCHEMES if s in CUSTOM],
                         ids=[i for i, (s, _) in zip(IDS, SCHEMES, strict=True) if s in CUSTOM])
def test_one_row_blocks_equal_dense(scheme, params, packed, monkeypatch):
    """Blocks of one query row (a decoding step's shape) build no causal mask: every key before the row's end is its
    past. Forced on a whole prefill (grad on: the materialised path, a budget of one row per block), with slot
    positions and with a packed row whose ids restart (the segment mask alone then applies), against the dense
    function."""
    monkeypatch.setattr(attention.settings, "BLOCK_ELEMENTS", 1)
    ids, _ = batch(False, n=40)
    kw = {"use_cache": False}
    if packed:
        kw["position_ids"] = torch.cat([torch.arange(23), torch.arange(17)])[None].expand(2, -1)
    model = patched_model("llama", "sdpa", scheme, params)
    with torch.enable_grad():
        blocked = model(ids, **kw).logits.detach()
    model.set_attn_implementation(attention.DENSE)
    with torch.no_grad():
        dense = model(ids, **kw).logits
    assert (blocked - dense).abs().max().item() <= 1e-5


# the fused path's kernel adds the bias as a mask of its own dtype: float64 queries read a float32 mask as garbage
DTYPE_TOLERANCE = [(torch.float32, 1e-5), (torch.float64, 1e-6), (torch.bfloat16, 2e-2)]


@pytest.mark.parametrize("dtype,tolerance", DTYPE_TOLERANCE, ids=[str(d)[6:] for d, _ in DTYPE_TOLERANCE])
@pytest.mark.parametrize("scheme,params", [(s, p) for s, p in SCHEMES if s in CUSTOM],
                         ids=[i for i, (s, _) in zip(IDS, SCHEMES, strict=True) if s in CUSTOM])
def test_fused_path_in_every_dtype_and_chunked_prefill_equals_dense(scheme, params, dtype, tolerance):
    """The fused path (no padding, no grad) against the dense function, in each dtype, and a prefill in two chunks
    over a cache (queries after cached keys: the fused path with q_len < k_len) against one call."""
    ids, _ = batch(False)
    model = patched_model("llama", "sdpa", scheme, params).to(dtype)
    with torch.no_grad():
        fused = model(ids).logits.float()
        cache = DynamicCache(config=model.config)
        chunks = [model(part, cache=cache, use_cache=True).logits.float() for part in (ids[:, :37], ids[:, 37:])]
        model.set_attn_implementation(attention.DENSE)
        dense = model(ids).logits.float()
    assert (fused - dense).abs().max().item() <= tolerance
    assert (torch.cat(chunks, 1) - fused).abs().max().item() <= tolerance


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme,params", SCHEMES, ids=IDS)
def test_left_padded_row_equals_sequence_alone(scheme, params, backend):
    model = patched_model("qwen2", backend, scheme, params)
    ids, kw = batch(True)
    alone = logits(model, ids[:1, PAD:])
    assert (logits(model, ids, **kw)[:1, PAD:] - alone).abs().max().item() <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme,params", SCHEMES, ids=IDS)
def test_remove_restores_model_exactly(scheme, params, backend):
    model = tiny_model("llama", attn_implementation=backend)
    other = tiny_model("llama", attn_implementation=backend)  # a second model in the same process
    ids, kw = batch(True)
    before, other_before = logits(model, ids, **kw), logits(other, ids, **kw)
    names = set(dict(model.named_modules()))
    rope_patch.apply(model, scheme, **params)
    assert rope_patch.current(model).name == scheme
    assert not torch.equal(logits(model, ids, **kw), before)
    assert other.config._attn_implementation == backend and torch.equal(logits(other, ids, **kw), other_before)
    if scheme in CUSTOM:
        assert model.config._attn_implementation != backend
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids, **kw), before)
    assert model.config._attn_implementation == backend
    assert set(dict(model.named_modules())) == names
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks
    assert "forward" not in vars(model.model.rotary_emb)
    assert not any(hasattr(m, attention.STATE) for m in model.modules())


def test_frequency_then_attention_scheme_replaces():
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, _ = batch(False)
    before = logits(model, ids)
    rope_patch.apply(model, "yarn", factor=4.0)
    rope_patch.apply(model, "rerope", window_size=16)
    want = reference_forward(model, ids, "rerope", {"window_size": 16})
    assert (logits(model, ids) - want).abs().max().item() <= 1e-5  # the yarn patch is gone, not stacked
    rope_patch.apply(model, "yarn", factor=4.0)
    assert model.config._attn_implementation == "sdpa"
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


BAD = [
    ("self_extend", dict(group_size=4, window_size=0), ValueError, "window_size"),
    ("self_extend", dict(group_size=0, window_size=8), ValueError, "group_size"),
    ("self_extend", dict(group_size=8, window_size=8), ValueError, "larger than `group_size`"),
    ("self_extend", dict(window_size=8), TypeError, "group_size"),
    ("rerope", dict(window_size=-3), ValueError, "window_size"),
    ("rerope", {}, TypeError, "window_size"),
    ("rerope", dict(window_size=2.5), TypeError, "window_size"),
    ("leaky_rerope", dict(window_size=8, factor=0.5), ValueError, "factor"),
    ("string", dict(shift_size=8, window_size=8), ValueError, "`shift_size` must be larger than `window_size`"),
    ("string", dict(shift_size=4, window_size=16), ValueError, "`shift_size` must be larger than `window_size`"),
    ("string", dict(window_size=8), TypeError, "missing required parameter `shift_size`"),
    ("string", dict(shift_size=32), TypeError, "missing required parameter `window_size`"),
    ("string", dict(shift_size=0, window_size=8), ValueError, r"`shift_size` must be an integer in \[1, 100000000\]"),
    ("string", dict(shift_size=10**9, window_size=8), ValueError, r"`shift_size` must be an integer in "
                                                                  r"\[1, 100000000\]"),
    ("string", dict(shift_size=32, window_size=-1), ValueError, r"`window_size` must be an integer in "
                                                                r"\[1, 100000000\]"),
    ("string", dict(shift_size=32.5, window_size=8), TypeError, "`shift_size` must be an integer"),
    ("string", dict(shift_size=32, window_size=float("nan")), TypeError, "`window_size` must be an integer"),
    ("string", dict(shift_size=32, window_size=8, shift_ratio=0.5), TypeError, "unknown parameter"),
    ("alibi", dict(max_bias=0), ValueError, "max_bias"),
    ("alibi", dict(slope=1), TypeError, "unknown parameter"),
    ("relative_bias", dict(init="xavier"), ValueError, "init"),
    ("relative_bias", dict(num_buckets=32, max_distance=8), ValueError, "max_distance"),
    ("learned_absolute", dict(max_position_embeddings=0), ValueError, "max_position_embeddings"),
    ("sinusoidal", dict(rope_theta=-1.0), ValueError, "rope_theta"),
]


@pytest.mark.parametrize("scheme,params,error,words", BAD, ids=[f"{s}-{i}" for i, (s, *_) in enumerate(BAD)])
def test_bad_input_fails_at_apply_and_leaves_model_unchanged(scheme, params, error, words):
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, _ = batch(False)
    before = logits(model, ids)
    with pytest.raises(error, match=words):
        rope_patch.apply(model, scheme, **params)
    assert rope_patch.current(model) is None and model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model, ids), before)


@pytest.mark.parametrize("scheme,params", [(s, p) for s, p in SCHEMES if s in CUSTOM][::2])
def test_unsupported_backend_and_static_cache_are_refused(scheme, params):
    model = tiny_model("llama", attn_implementation="sdpa")
    model.config._attn_implementation_internal = "flash_attention_3"  # as a model loaded with flash-attn 3 reads
    with pytest.raises(ValueError, match="attention backend 'flash_attention_3' is not supported"):
        rope_patch.apply(model, scheme, **params)
    assert rope_patch.current(model) is None
    model.config._attn_implementation_internal = "sdpa"
    model.generation_config.cache_implementation = "static"
    with pytest.raises(ValueError, match="static"):
        rope_patch.apply(model, scheme, **params)
    model.generation_config.cache_implementation = None
    rope_patch.apply(model, scheme, **params)
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=64)
    with pytest.raises(ValueError, match="static KV cache"):
        model(torch.ones(1, 4, dtype=torch.long), cache=cache)


def test_alibi_slopes_follow_press_et_al():
    assert alibi_slopes(8) == [2.0 ** -k for k in range(1, 9)]
    assert alibi_slopes(4) == [2.0 ** -k for k in (2, 4, 6, 8)]
    # 6 heads: the 4-head slopes, then every other slope of the 8-head sequence: 2^-1, 2^-3
    assert alibi_slopes(6) == [2.0 ** -k for k in (2, 4, 6, 8, 1, 3)]
    for n in (3, 5, 12, 20, 40):
        assert alibi_slopes(n) == pytest.approx(ref_slopes(n))
        assert len(set(alibi_slopes(n))) == n


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20), (2, 2), (64, 1000), (33, 17)])
def test_relative_bias_bucket_table_equals_t5_buckets(num_buckets, max_distance):
    """The rule reads buckets from a table of distances 0 … max_distance: equal to T5's bucket at every distance,
    the far ones (one last bucket) and negative ones (the future, bucket 0) included."""
    from rope_patch.schemes.bias import BucketBias, t5_bucket

    distance = torch.arange(-5, 50 * max_distance + 7)
    rule = BucketBias(None, num_buckets, max_distance)
    assert torch.equal(rule.buckets(distance), t5_bucket(distance, num_buckets, max_distance))


def test_relative_bias_is_trainable_and_alibi_init_is_alibi():
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, kw = batch(True, n=12)
    real = kw["attention_mask"].bool()
    rope_patch.apply(model, "alibi")
    alibi = logits(model, ids, **kw)
    rope_patch.apply(model, "relative_bias", init="alibi", num_buckets=32, max_distance=64)  # exact below 16
    assert (logits(model, ids, **kw) - alibi)[real].abs().max().item() <= 1e-5
    table = model.rope_patch_relative_bias.weight
    assert "rope_patch_relative_bias.weight" in model.state_dict()
    assert any(p is table for p in model.parameters())
    model.train()
    model(ids, labels=ids, **kw).loss.backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    rope_patch.remove(model)
    assert "rope_patch_relative_bias.weight" not in model.state_dict()


def test_learned_absolute_starts_as_sinusoidal_and_is_trainable():
    model = tiny_model("llama")
    ids, kw = batch(True, n=24)
    real = kw["attention_mask"].bool()
    rope_patch.apply(model, "sinusoidal")
    sin = logits(model, ids, **kw)
    rope_patch.apply(model, "learned_absolute")
    assert rope_patch.current(model).max_position_embeddings == model.config.max_position_embeddings
    assert (logits(model, ids, **kw) - sin)[real].abs().max().item() <= 1e-5
    model.train()
    model(ids, labels=ids, **kw).loss.backward()
    assert model.rope_patch_position_embeddings.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.ones(1, 40, dtype=torch.long))


@pytest.mark.parametrize("scheme,module", [("relative_bias", "rope_patch_relative_bias"),
                                           ("learned_absolute", "rope_patch_position_embeddings")])
def test_learned_tables_train_through_peft_modules_to_save(scheme, module):
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(model, scheme)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=[module]))
    assert any(module in n for n, p in peft_model.named_parameters() if p.requires_grad)
    ids, kw = batch(True, n=24)
    before = logits(peft_model, ids, **kw)
    with torch.no_grad():  # what an optimizer step does to the trained copy must reach attention / the embeddings
        getattr(model, module).modules_to_save["default"].weight.add_(0.5)
    assert not torch.allclose(logits(peft_model, ids, **kw), before)


@pytest.mark.parametrize("scheme,params", [("alibi", {}), ("self_extend", {"group_size": 2, "window_size": 4})])
def test_sliding_window_layers_keep_their_window(scheme, params):
    """mistral with a sliding window shorter than the text: the window comes from transformers' own sliding mask
    (and the sliding cache keeps only window − 1 keys, still contiguous), so cached decoding = recomputation and
    the dense and blocked functions agree."""
    model = tiny_model("mistral", attn_implementation="sdpa", sliding_window=8)
    rope_patch.apply(model, scheme, **params)
    assert_cached_decoding_equals_recomputation(model)
    ids, kw = batch(True, n=20)
    kw.pop("position_ids")
    blocked = logits(model, ids, **kw)
    model.set_attn_implementation(attention.DENSE)
    assert (logits(model, ids, **kw) - blocked)[kw["attention_mask"].bool()].abs().max().item() <= 1e-5
    rope_patch.remove(model)
    rope_patch.apply(model, "nope")
    unwindowed = tiny_model("mistral", attn_implementation="sdpa", sliding_window=None)
    rope_patch.apply(unwindowed, "nope")
    assert not torch.allclose(logits(model, ids, **kw), logits(unwindowed, ids, **kw))  # the window is in effect


@pytest.mark.parametrize("scheme,params", [("relative_bias", {}), ("learned_absolute", {"max_position_embeddings": 64}),
                                           ("self_extend", {"group_size": 2, "window_size": 8}),
                                           ("string", {"shift_size": 16, "window_size": 4}),
                                           ("dpe", {"group_sizes": [3, 1, 4, 8], "window_size": 16})])
def test_save_and_reload_keeps_scheme_and_learned_tables(scheme, params, tmp_path):
    model = patched_model("llama", "sdpa", scheme, params)
    ids, _ = batch(False, n=40)
    rope_patch.save_pretrained(model, tmp_path)
    again = rope_patch.from_pretrained(tmp_path).eval()
    assert rope_patch.current(again) == rope_patch.current(model)
    assert torch.equal(logits(again, ids), logits(model, ids))


TWO_REGION = [(s, p) for s, p in SCHEMES if s in ("self_extend", "rerope", "leaky_rerope", "string")]


@pytest.mark.parametrize("scheme,params", TWO_REGION, ids=[f"{s}-{i}" for i, (s, _) in enumerate(TWO_REGION)])
def test_backward_is_finite_and_equal_on_eager_and_sdpa(scheme, params):
    """Training through the deferred-RoPE schemes (left-padded batch: the materialised block path on sdpa): the
    dense and the blocked function give the same loss and the same gradient for every weight, and all are finite."""
    ids, kw = batch(True)
    labels = ids.masked_fill(kw["attention_mask"] == 0, -100)
    labels[0, PAD] = -100  # predicted by the last pad position, whose (fully masked) row is arbitrary
    grads, losses = [], []
    for backend in BACKENDS:
        model = patched_model("llama", backend, scheme, params).train()
        loss = model(ids, labels=labels, **kw).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert torch.isfinite(losses[0]) and (losses[0] - losses[1]).abs().item() <= 1e-5
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert g is not None and torch.isfinite(g).all(), name
        assert (g - grads[1][name]).abs().max().item() <= 1e-5, name
    assert any(g.abs().sum() > 0 for n, g in grads[0].items() if "q_proj" in n)  # attention is differentiated


@pytest.mark.parametrize("spec", ["string:32,window_size=8", "self_extend:4,window_size=16", "rerope:16",
                                  "dpe:2/8/2/8,window_size=16"])
def test_two_region_schemes_have_no_native_rope_parameters(spec):
    with pytest.raises(ValueError, match=r"no native transformers/vLLM `rope_parameters` form \(it "
                                         r"changes attention\)"):
        rope_patch.to_rope_parameters(spec)


def test_string_spec_value_is_the_shift_size():
    model = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(model, "string:48,window_size=12")
    assert rope_patch.current(model) == rope_patch.as_scheme("string", shift_size=48, window_size=12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_string_rotates_with_the_scaling_the_checkpoint_ships(backend):
    """Beyond the window STRING needs a frequency scheme with it: on a checkpoint whose config carries one (here
    linear ×2) it rotates near and far with those frequencies (the reference applies θ/2 too)."""
    params = {"shift_size": 20, "window_size": 6}
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    model = tiny_model("llama", attn_implementation=backend, rope_parameters=rope)
    rope_patch.apply(model, "string", **params)
    ids, kw = batch(True)
    want = reference_forward(model, ids, "string", params, kw["attention_mask"])
    assert model.config.rope_parameters["rope_type"] == "linear"
    real = kw["attention_mask"].bool()
    assert (logits(model, ids, **kw) - want)[real].abs().max().item() <= 1e-5
    unscaled = reference_forward(tiny_model("llama"), ids, "string", params, kw["attention_mask"])
    assert (unscaled - want)[real].abs().max().item() > 1e-3  # the shipped scaling is in effect
