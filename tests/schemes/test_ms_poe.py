"""Ms-PoE (rope_patch/schemes/multiscale.py): exact against the paper's explicit per-head positions and against the
authors' computation, the prompt's head order kept for cached generation, padding-invariant, on eager / sdpa / flex,
stacked with a frequency scheme, reversible, and bad input refused at apply()."""

from __future__ import annotations

import pytest
import torch
from helpers.models import logits, tiny_model, token_batch
from helpers.reference_ms_poe import authors_forward, paper_forward

import rope_patch
from rope_patch import attention
from rope_patch.schemes.multiscale import ratios

L, PAD, NEW = 96, 7, 6
P = {"min_ratio": 1.2, "max_ratio": 1.8, "skip_layers": 1}  # the tiny models have 2 layers: one skipped, one not
# initializer_range 0.2: peaked attention, so the heads' outlier scores differ and the order is not the identity
INIT = {"initializer_range": 0.2}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several query blocks per call, so the block loops of the sdpa-style function are what gets tested."""
    monkeypatch.setattr(attention.settings, "BLOCK_ELEMENTS", 2 * 4 * L * 11)
    monkeypatch.setattr(attention.settings, "FUSED_BLOCK", 24)


def tiny(arch="llama", backend="sdpa", **kw):
    """A tiny model with peaked attention; its output head scaled down so the logits stay O(1) (float noise too)."""
    model = tiny_model(arch, attn_implementation=backend, **INIT, **kw)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.1)
    return model


def rule(model):
    """The scheme's attention rule on the patched model (it keeps the prompt's head order per layer)."""
    return getattr(model.model.layers[1].self_attn, attention.STATE).scores


def model_with(arch="llama", backend="sdpa", params=P, **kw):
    return rope_patch.apply(tiny(arch, backend, **kw), "ms_poe", **params)


def batch(padded: bool, n: int = L):
    return token_batch(n, 0, PAD if padded else 0)


def real(ids, kw):
    return kw["attention_mask"].bool() if "attention_mask" in kw else torch.ones_like(ids, dtype=torch.bool)


SETUPS = [("llama", b, p) for b in ("eager", "sdpa") for p in (False, True)] + [("qwen2", "sdpa", True),
                                                                               ("mistral", "eager", True)]


@pytest.mark.parametrize("arch,backend,padded", SETUPS,
                         ids=[f"{a}-{b}-{'pad' if p else 'nopad'}" for a, b, p in SETUPS])
def test_matches_paper_reference(arch, backend, padded):
    """Explicit per-head positions p/r_h, full attention, fp32; the heads' order is not the identity in every row."""
    model = model_with(arch, backend)
    ids, kw = batch(padded)
    got = logits(model, ids, **kw)
    want, orders = paper_forward(model, ids, P, kw.get("attention_mask"))
    assert (got - want)[real(ids, kw)].abs().max().item() <= 1e-5
    assert not torch.equal(orders[1], torch.arange(2).expand(2, 2))  # a non-trivial order is under test
    assert torch.equal(rule(model).orders[1], orders[1])


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("skip,seed", [(0, 1), (1, 6)])  # prompts whose head orders are not involutions
def test_matches_authors_code_on_mha(backend, skip, seed):
    """MHA (their target): rope_patch's per-KV-head ratios are their per-head ones, `cos[head_order]` included."""
    params = {**P, "skip_layers": skip}
    model = tiny("llama", backend, num_key_value_heads=4)
    ids = token_batch(L, seed)[0][:1]
    want = authors_forward(model, ids, params)
    _, orders = paper_forward(model, ids, params)
    order = orders[1][0]
    assert not torch.equal(order[order], torch.arange(4))  # not an involution: the inverse mapping would differ
    rope_patch.apply(model, "ms_poe", **params)
    assert (logits(model, ids) - want).abs().max().item() <= 1e-4


def test_authors_code_on_gqa_mixes_scales_and_rope_patch_does_not():
    """On GQA the authors' queries take their own ratio and the shared keys the group's first: a different model."""
    model = tiny("llama", "eager")
    ids = batch(False)[0][:1]
    authors = authors_forward(model, ids, P)
    rope_patch.apply(model, "ms_poe", **P)
    assert (logits(model, ids) - authors).abs().max().item() > 1e-3


GEN = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def generated(model, ids, mask=None):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, use_cache=True, **GEN)


def prompt_order_logits(model, ids, out, mask=None):
    """The logits of the generated tokens from one forward over the whole sequence with the prompt's head order:
    the paper reference where it has the architecture's layout (plain Llama-style layers), else the model itself
    with the prompt in its cache and the generated tokens in one cached call (a chunked prefill: the layer copies run
    one after another, the steps ran stacked)."""
    n = ids.shape[1]
    full = None if mask is None else torch.cat([mask, torch.ones(ids.shape[0], NEW, dtype=torch.long)], dim=1)
    if model.config.model_type in ("llama", "qwen2", "mistral"):
        _, prompt_orders = paper_forward(model, ids, P, mask)
        want, _ = paper_forward(model, out.sequences, P, full, orders=prompt_orders)
        return want[:, n - 1:n - 1 + NEW]
    prompt_order = {k: v.clone() for k, v in rule(model).orders.items()}
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        step = model(out.sequences[:, n:-1], attention_mask=None if full is None else full[:, :-1], cache=cache).logits
        last = model(ids, attention_mask=mask).logits[:, -1:]
    assert all(torch.equal(rule(model).orders[k], v) for k, v in prompt_order.items())
    return torch.cat([last, step], 1)


# gemma3n: its last layers read the keys of earlier ones (KV sharing), so the cache keeps every key set; no layer
# skipped (a skipped layer's keys, read by a later one, would have one set: the apply-time check refuses that)
CACHED = [("llama", "eager"), ("qwen2", "sdpa"), ("gemma2", "eager"), ("gemma3n", "sdpa")]
SHARING = {"gemma3n": {**P, "skip_layers": 0}}


@pytest.mark.parametrize("arch,backend", CACHED)
def test_cached_generation_equals_full_forward_with_the_prompt_order(arch, backend):
    """Greedy decoding of a left-padded batch with the KV cache: every step's logits are those of the whole sequence
    with the head order of the prompt."""
    model = model_with(arch, backend, SHARING.get(arch, P))
    ids, kw = batch(True, n=24)
    out = generated(model, ids, kw["attention_mask"])
    want = prompt_order_logits(model, ids, out, kw["attention_mask"])
    assert (torch.stack(list(out.logits), 1) - want).abs().max().item() <= 1e-5


# seed and row of a prompt whose order is not the heads' own (a swap the step must read)
ONE_ROW = [("llama", "eager", 0, 1), ("qwen2", "sdpa", 1, 0), ("gemma3n", "sdpa", 0, 0)]


@pytest.mark.parametrize("arch,backend,seed,row", ONE_ROW)
def test_one_row_decoding_reads_each_heads_chosen_keys(arch, backend, seed, row):
    """A one-row generation's steps score each KV head against its ratio's keys: the cache's only keys of the head
    where it keeps the chosen sets alone, the head's set in place where it keeps them all (gemma3n): every step's
    logits are those of the whole sequence with the prompt's head order."""
    model = model_with(arch, backend, SHARING.get(arch, P))
    ids = token_batch(24, seed)[0][row:row + 1]
    out = generated(model, ids)
    assert any(c != sorted(c) for c in rule(model).chosen.values())  # heads read other sets than their own
    assert (torch.stack(list(out.logits), 1) - prompt_order_logits(model, ids, out)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch,backend", CACHED)
def test_cache_keeps_the_chosen_keys_alone_unless_layers_share_keys(arch, backend):
    """Once the prompt fixed the order, the cache of a layer Ms-PoE applies to holds the model's key heads (each head's
    ratio set alone, vanilla's size); on a model whose layers read other layers' cached keys (gemma3n) every set,
    1 + KV heads of them, so that each layer reads its own order's."""
    params = SHARING.get(arch, P)
    model, vanilla = model_with(arch, backend, params), tiny(arch, backend)
    ids, kw = batch(True, n=24)
    shapes = []
    for m in (model, vanilla):
        with torch.no_grad():
            cache = m(ids, attention_mask=kw["attention_mask"], use_cache=True).past_key_values
            m(ids[:, :1], attention_mask=torch.ones(2, 25, dtype=torch.long), cache=cache)  # and a step after it
        shapes.append([tuple(layer.keys.shape) for layer in cache.layers if getattr(layer, "keys", None) is not None])
    shares = getattr(vanilla.config, "num_kv_shared_layers", 0)
    for i, (got, want) in enumerate(zip(*shapes, strict=True)):
        sets = vanilla.config.num_key_value_heads + 1 if shares and i >= params["skip_layers"] else 1
        assert got == (want[0], sets * want[1], *want[2:]), (i, got, want)


def test_layers_that_share_keys_are_refused_without_the_check():
    """With the apply-time check skipped, a layer that reads another layer's cached keys finds them as the storing
    layer's order picked them: a clear error at the cached prompt, not another model."""
    params = SHARING["gemma3n"]
    model = rope_patch.apply(tiny("gemma3n"), "ms_poe", **params, check=False)
    ids, kw = batch(True, n=24)
    checked = model_with("gemma3n", params=params)
    got, want = (logits(m, ids, **kw, use_cache=False) for m in (model, checked))
    assert (got - want)[real(ids, kw)].abs().max() <= 1e-5  # without a cache, nothing is shared through it
    with pytest.raises(attention.NotProven, match="another layer stored in the cache"):
        model(ids, **kw, use_cache=True)


def test_without_cache_each_input_is_its_own_prompt():
    """A forward without cache recomputes the order from its own last query (the authors' code would keep the first
    prompt's until `_reset()`): two different prompts through one model each equal their own reference."""
    model = model_with()
    for seed in (0, 1):
        ids, _ = token_batch(40, seed)
        want, _ = paper_forward(model, ids, P)
        assert (logits(model, ids) - want).abs().max().item() <= 1e-5


def test_cached_call_without_a_prompt_is_refused():
    model = model_with()
    ids, _ = batch(False, n=20)
    cache = model(ids, use_cache=True).past_key_values
    rule(model).orders.clear()
    with pytest.raises(ValueError, match="without the head order of its prompt"):
        model(ids[:, :1], cache=cache)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_left_padded_row_equals_sequence_alone(backend):
    model = model_with("qwen2", backend)
    ids, kw = batch(True)
    alone = logits(model, ids[:1, PAD:])
    assert (logits(model, ids, **kw)[:1, PAD:] - alone).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_eager_and_sdpa_agree(arch):
    """The dense (eager) and blocked (sdpa) functions, also with Gemma 2's softcap."""
    ids, kw = batch(True)
    outs = []
    for backend in (attention.DENSE, attention.BLOCKED):
        model = model_with(arch, "eager")
        model.set_attn_implementation(backend)
        outs.append(logits(model, ids, **kw))
    assert (outs[0] - outs[1])[real(ids, kw)].abs().max().item() <= 1e-5


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_flex_matches_paper_reference(padded, monkeypatch):
    """flex_attention (uncompiled on CPU: torch's compiled CPU flex is refused, schemes/test_backends.py), its
    BlockMask read for the last query's real keys."""
    monkeypatch.setattr(attention.settings, "FLEX_COMPILE", False)
    model = model_with("llama", "flex_attention")
    assert model.config._attn_implementation == attention.FLEX
    ids, kw = batch(padded)
    want, _ = paper_forward(model, ids, P, kw.get("attention_mask"))
    assert (logits(model, ids, **kw) - want)[real(ids, kw)].abs().max().item() <= 1e-5


@pytest.mark.parametrize("freq", ["yarn:4", "linear:2"])
def test_frequency_scheme_stacks_under_it(freq):
    """A frequency scheme under Ms-PoE: the ratio copies rotate with the patched frequencies, so the stack is Ms-PoE on
    the model natively configured with them."""
    ids, kw = batch(True)
    model, native = tiny(), tiny()
    rope_patch.apply(native, freq)
    params = dict(native.config.rope_parameters)
    native = rope_patch.remove(native)
    native.config.rope_parameters = params  # transformers' own scaling from the config, no rope_patch frequencies
    native.model.rotary_emb.__init__(native.config)
    rope_patch.apply(native, "ms_poe", **P)
    rope_patch.apply(model, [freq, "ms_poe:min_ratio=1.2,max_ratio=1.8,skip_layers=1"])
    got = logits(model, ids, **kw)
    assert (got - logits(native, ids, **kw))[real(ids, kw)].abs().max().item() <= 1e-5
    assert (got - logits(model_with(), ids, **kw))[real(ids, kw)].abs().max().item() > 1e-3


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_ratio_one_is_vanilla_and_remove_is_exact(backend):
    model, other = (tiny("llama", backend) for _ in range(2))
    ids, kw = batch(True)
    before = logits(model, ids, **kw)
    rope_patch.apply(model, "ms_poe", min_ratio=1.0, max_ratio=1.0, skip_layers=0)
    assert (logits(model, ids, **kw) - before)[real(ids, kw)].abs().max().item() <= 1e-5
    rope_patch.apply(model, "ms_poe", **P)
    assert not torch.equal(logits(model, ids, **kw), before) and torch.equal(logits(other, ids, **kw), before)
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids, **kw), before) and model.config._attn_implementation == backend
    assert not any(hasattr(m, attention.STATE) for m in model.modules())


def test_ratio_slots_follow_the_authors():
    """r_k = min + (max − min)·k/n: max_ratio itself is never used (their `_set_cos_sin_cache`)."""
    assert ratios(1.2, 1.8, 3) == pytest.approx([1.2, 1.4, 1.6])
    assert rope_patch.as_scheme("ms_poe") == rope_patch.as_scheme("ms_poe", min_ratio=1.2, max_ratio=1.8)
    model = rope_patch.apply(tiny_model("llama", num_hidden_layers=4), "ms_poe")
    assert rope_patch.current(model).skip_layers == 2  # the authors' default ...
    assert rope_patch.current(rope_patch.apply(tiny_model("llama"), "ms_poe")).skip_layers == 1  # ... one layer kept


BAD = [
    (dict(min_ratio=1.8, max_ratio=1.2), ValueError, "`max_ratio` must be at least `min_ratio`"),
    (dict(min_ratio=0.5), ValueError, "min_ratio"),
    (dict(max_ratio="2"), TypeError, "max_ratio"),
    (dict(skip_layers=-1), ValueError, "skip_layers"),
    (dict(skip_layers=2), ValueError, "leaves no layer"),  # the tiny models have 2 layers
    (dict(compress_ratio_min=1.2), TypeError, "unknown parameter"),
]


@pytest.mark.parametrize("params,error,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_fails_at_apply_and_leaves_model_unchanged(params, error, words):
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, _ = batch(False)
    before = logits(model, ids)
    with pytest.raises(error, match=words):
        rope_patch.apply(model, "ms_poe", **params)
    assert rope_patch.current(model) is None and model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model, ids), before)


def test_suggested_for_contexts_that_fit_only():
    model = tiny_model("llama")
    specs = {s.scheme: s.spec for s in rope_patch.suggest(model, 32)}
    assert specs.get("ms_poe") == "ms_poe:min_ratio=1.2,max_ratio=1.8"
    assert "ms_poe" not in {s.scheme for s in rope_patch.suggest(model, 128)}


def test_packed_row_orders_by_its_last_sequence_alone():
    """A packed row (position ids restarting, no cache): the last query's outlier scores count only its own segment's
    keys, so the second sequence gets the logits it gets alone."""
    model = model_with()
    a, b = token_batch(30, 2)[0][:1], token_batch(40, 3)[0][:1]
    pos = torch.cat([torch.arange(30), torch.arange(40)])[None]
    packed = logits(model, torch.cat([a, b], dim=1), position_ids=pos, use_cache=False)[:, 30:]
    alone = logits(model, b, position_ids=torch.arange(40)[None], use_cache=False)
    assert (packed - alone).abs().max().item() <= 1e-5
