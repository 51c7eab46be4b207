"""Architectures: every RoPE folder of the installed transformers, every scheme family exact or refused clearly
(`test_every_rope_folder`, with the table in helpers/coverage.py), and in more depth (both backends, all eleven
attention-side schemes, cached decoding) the architectures added after the first 19 (`ADDED`), with `REFUSED` naming
what each cannot serve and why; the frequency schemes run in test_frequency.py over all of ARCHS.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from helpers import coverage
from helpers.models import ARCHS, NEWER_FOLDERS, VOCAB, absent_folders, logits, native_twin, tiny_model
from helpers.reference_any import forward as reference_forward

import rope_patch
from rope_patch.evaluation.retrieval import CACHE

ADDED = ["gpt_oss", "deepseek_v3", "ministral3", "qwen3_next", "cohere2", "exaone4", "olmo3", "ministral", "seed_oss",
         "ernie4_5", "falcon", "nemotron", "granitemoe", "glm4", "llama4_text"]
L = 40
PAD = 5

ATTENTION_SCHEMES = [
    ("alibi", {}),
    ("nope", {}),
    ("relative_bias", {"init": "alibi", "num_buckets": 16, "max_distance": 64}),
    ("sinusoidal", {}),
    ("learned_absolute", {"max_position_embeddings": 64}),
    ("self_extend", {"group_size": 4, "window_size": 12}),
    ("self_extend_logistic", {"group_size": 6, "window_size": 12, "growth_rate": 0.5}),
    ("rerope", {"window_size": 12}),
    ("leaky_rerope", {"window_size": 12, "factor": 4.0}),
    ("string", {"shift_size": 20, "window_size": 6}),
    ("dca", {"chunk_size": 24, "local_size": 4}),
    ("dpe", {"group_sizes": [4, 2], "window_size": 12}),
]
OWN_FUNCTION = {"alibi", "relative_bias", "self_extend", "self_extend_logistic", "rerope", "leaky_rerope", "string",
                "dca", "dpe"}
DEFERRED = {"self_extend", "self_extend_logistic", "rerope", "leaky_rerope", "string", "dca", "dpe"}
# arch -> {scheme: regex of the refusal}; every other (arch, scheme) pair must equal the reference
REFUSED = {
    f: {s: rf"{f} computes attention in its own module code" for s in OWN_FUNCTION}
    for f in coverage.OWN_CODE if f in ADDED
}
BACKENDS = {"gpt_oss": ["eager"]}  # gpt-oss has no sdpa in transformers

CASES = [(a, b, s, p) for a in ADDED for b in BACKENDS.get(a, ["eager", "sdpa"]) for s, p in ATTENTION_SCHEMES
         if s not in REFUSED.get(a, {})]
REFUSALS = [(a, s, p) for a in ADDED for s, p in ATTENTION_SCHEMES if s in REFUSED.get(a, {})]


def batch(n: int = L):
    ids = torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def true_positions(mask):
    """What generate passes: the schemes that read absolute positions (self_extend, dca) count from the first real
    token."""
    return {"position_ids": (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)}


def test_added_architectures_are_in_the_shared_table():
    assert set(ADDED) <= set(ARCHS) and len(ARCHS) >= 30


@pytest.mark.parametrize("arch", [a for a in ADDED if a not in REFUSED])
def test_reference_with_rope_is_the_model(arch):
    """Sanity of the reference: with r(i, j) = i − j it reproduces the unpatched model (global NoPE layers included)."""
    model = tiny_model(arch, attn_implementation="eager")
    ids, mask = batch()
    want = reference_forward(tiny_model(arch), model, ids, "rope", {}, mask, **true_positions(mask))
    real = mask.bool()
    got = logits(model, ids, attention_mask=mask, **true_positions(mask))
    assert (got - want)[real].abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch,backend,scheme,params", CASES, ids=[f"{a}-{b}-{s}" for a, b, s, _ in CASES])
def test_attention_scheme_matches_reference(arch, backend, scheme, params):
    model = tiny_model(arch, attn_implementation=backend)
    rope_patch.apply(model, scheme, **params)
    with torch.no_grad():  # learned tables start at a known value: perturb them so the lookup itself is tested
        for name in ("rope_patch_relative_bias", "rope_patch_position_embeddings"):
            if hasattr(model, name):
                getattr(model, name).weight.add_(0.3 * torch.randn_like(getattr(model, name).weight))
    ids, mask = batch()
    got = logits(model, ids, attention_mask=mask, **true_positions(mask))
    want = reference_forward(tiny_model(arch, attn_implementation=backend), model, ids, scheme, params, mask,
                             **true_positions(mask))
    real = mask.bool()
    assert (got - want)[real].abs().max().item() <= 1e-5
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids, attention_mask=mask),
                       logits(tiny_model(arch, attn_implementation=backend), ids, attention_mask=mask))


@pytest.mark.parametrize("arch,scheme,params", REFUSALS, ids=[f"{a}-{s}" for a, s, _ in REFUSALS])
def test_attention_scheme_is_refused_with_the_reason(arch, scheme, params):
    model = tiny_model(arch)
    ids, mask = batch()
    before, config = logits(model, ids, attention_mask=mask), model.config.to_dict()
    with pytest.raises(ValueError, match=REFUSED[arch][scheme]):
        rope_patch.apply(model, scheme, **params)
    assert rope_patch.current(model) is None and model.config.to_dict() == config
    assert torch.equal(logits(model, ids, attention_mask=mask), before)


@pytest.mark.parametrize("arch", ["cohere2", "exaone4", "qwen3_next"])
@pytest.mark.parametrize("scheme,params",
                         [("rerope", {"window_size": L}), ("string", {"shift_size": L, "window_size": 8}),
                                           ("self_extend", {"group_size": 4, "window_size": L})])
def test_degenerate_repositioning_is_the_model(arch, scheme, params):
    """A window ≥ the sequence moves no position: exactly the model, also on its global NoPE layers (which must stay
    unrotated) and on a hybrid model whose linear-attention layers are not attention modules."""
    ids, mask = batch()
    for backend in ("eager", "sdpa"):
        model = tiny_model(arch, attn_implementation=backend)
        want = logits(model, ids, attention_mask=mask)
        rope_patch.apply(model, scheme, **params)
        assert (logits(model, ids, attention_mask=mask) - want)[mask.bool()].abs().max().item() <= 1e-5, backend


# ---- DeepSeek-V3: the softmax scale that transformers derives from rope_parameters at init -------------------------
def _scales(model):
    return [layer.self_attn.scaling for layer in model.model.layers]


def test_deepseek_yarn_mscale_sets_the_attention_scale_as_a_native_model_and_remove_restores_it():
    model = tiny_model("deepseek_v3")
    shipped = _scales(model)
    assert shipped[0] != 32**-0.5  # the tiny config ships yarn ×4 with mscale_all_dim = 1: mscale² is in the scale
    ids = torch.randint(3, VOCAB, (1, 3 * 32), generator=torch.Generator().manual_seed(0))
    before = logits(model, ids)
    for scheme, params in (("yarn", dict(factor=8.0, mscale=1.0, mscale_all_dim=0.5)), ("default", {}),
                           ("linear", dict(factor=2.0))):
        rope_patch.apply(model, scheme, **params)
        twin = native_twin(model, model.config.rope_parameters, model.config.max_position_embeddings)
        assert _scales(model) == _scales(twin), scheme
        assert (logits(model, ids) - logits(twin, ids)).abs().max().item() <= 1e-5, scheme
    assert _scales(model) == [32**-0.5] * 2  # linear: no mscale_all_dim
    rope_patch.remove(model)
    assert _scales(model) == shipped and torch.equal(logits(model, ids), before)


def test_deepseek_dynamic_yarn_with_mscale_all_dim_is_refused():
    model = tiny_model("deepseek_v3")
    shipped = _scales(model)
    with pytest.raises(ValueError, match=r"dynamic_yarn: deepseek_v3 folds YaRN's mscale \(mscale_all_dim\) "
                                         r"into its attention scale"):
        rope_patch.apply(model, "dynamic_yarn", factor=4.0, mscale_all_dim=1.0)
    assert rope_patch.current(model) is None and _scales(model) == shipped
    rope_patch.apply(model, "dynamic_yarn", factor=4.0)  # without mscale_all_dim the scale does not depend on s
    assert _scales(model) == [32**-0.5] * 2


# ---- Ministral 3: Llama 4's attention temperature lives in rope_parameters -------------------------------------------
@pytest.mark.parametrize("scheme,params", [("linear", dict(factor=2.0)), ("default", {}), ("yarn", dict(factor=8.0))])
def test_ministral3_keeps_llama4_temperature_keys(scheme, params):
    model = tiny_model("ministral3")
    rope_patch.apply(model, scheme, **params)
    rope = model.config.rope_parameters
    assert rope["llama_4_scaling_beta"] == 0.1 and rope["original_max_position_embeddings"] == 32
    ids = torch.randint(3, VOCAB, (1, 3 * 32), generator=torch.Generator().manual_seed(0))
    twin = native_twin(model, rope, model.config.max_position_embeddings)
    assert (logits(model, ids) - logits(twin, ids)).abs().max().item() <= 1e-5


# ---- gpt-oss: attention sinks are kept (its own attention, or rope_patch's eager/sdpa functions) ---------------------
@pytest.mark.parametrize("scheme,params",
                         [("nope", {}), ("sinusoidal", {}), ("alibi", {}), ("rerope", {"window_size": 12})])
def test_gpt_oss_sinks_stay_in_effect(scheme, params):
    model = tiny_model("gpt_oss")
    rope_patch.apply(model, scheme, **params)
    ids, mask = batch()
    with_sinks = logits(model, ids, attention_mask=mask)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.add_(3.0)
    assert not torch.allclose(logits(model, ids, attention_mask=mask), with_sinks)


# ---- cached decoding = recomputation (sliding caches, qwen3_next's hybrid cache with linear-attention states) -------
DECODE = [("yarn", {"factor": 4.0}), ("nope", {}), ("alibi", {}), ("rerope", {"window_size": 12}),
          ("self_extend", {"group_size": 4, "window_size": 12}), ("dca", {"chunk_size": 24, "local_size": 4})]
DECODE_CASES = [(a, s, p) for a in ADDED for s, p in DECODE if s not in REFUSED.get(a, {})]


@pytest.mark.slow  # 72 rows × two generate calls: a third of this file's time
@pytest.mark.parametrize("arch,scheme,params", DECODE_CASES, ids=[f"{a}-{s}" for a, s, _ in DECODE_CASES])
def test_cached_decoding_equals_recomputation(arch, scheme, params):
    """Greedy decoding of a left-padded batch of 24-token prompts (past every window): same tokens, logits ≤ 1e-5."""
    model = tiny_model(arch, attn_implementation=BACKENDS.get(arch, ["sdpa"])[-1])
    rope_patch.apply(model, scheme, **params)
    ids, mask = batch(24)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
               attention_mask=mask)
    with torch.no_grad():
        cached, full = (model.generate(ids, use_cache=c, **gen) for c in (True, False))
    assert torch.equal(cached.sequences, full.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(cached.logits, full.logits, strict=True)) <= 1e-5


# Layers handed position ids or embeddings for more positions than their queries. Gemma 4's KV-shared layers (the last
# num_kv_shared_layers) read every key from an earlier layer, so in a prefill under generate's integer `logits_to_keep`
# the decoder runs them on the prompt's last token only (`_maybe_slice_kv_shared_inputs`), their position ids every
# token's: one query, 40 keys, 40 ids, no cached past. Qwen4-Exp hands its layers the embeddings of every cached key at
# each decoding step (its sparse indexer rotates them all again). Every attention-side scheme the coverage table has
# exact there, at its real setting (windows crossed while decoding), padded and not.
LONG_IDS = {"gemma4": "sdpa", "gemma4_unified": "eager", "qwen4_exp": "sdpa"}
LONG_ID_CASES = [(f, b, s, pad) for f, b in LONG_IDS.items() for s in coverage.ATTENTION
                 if coverage.expected(f, s) is None for pad in (True, False)]


@pytest.mark.parametrize("folder,backend,scheme,padded", LONG_ID_CASES,
                         ids=[f"{f}-{b}-{s}-{'pad' if p else 'nopad'}" for f, b, s, p in LONG_ID_CASES])
def test_cached_decoding_where_layers_get_more_positions_than_queries(folder, backend, scheme, padded):
    """Greedy generate with the cache, 6 tokens after a 40-token prompt: each step's logits are a forward over the
    whole sequence without a cache (Ms-PoE: with the prompt's head order, the prompt in the cache and the generated
    tokens in one call). Before, the ids were read as the queries' own: an IndexError (Gemma 4's cut prefill; on
    Qwen4-Exp in the apply-time check's decoding, which refused every re-positioning scheme), and Ms-PoE computed no
    head order in Gemma 4's cut prefill, so its first decoding step refused."""
    model = rope_patch.apply(tiny_model(folder, attn_implementation=backend), scheme, **coverage.ATTENTION[scheme][1])
    ids, kw, _ = coverage.batch(folder)
    mask = kw["attention_mask"] if padded else torch.ones_like(ids)
    n, new = ids.shape[1], 6
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        full = torch.cat([mask, torch.ones(2, new, dtype=mask.dtype)], dim=1)
        pos = (full.cumsum(-1) - 1).masked_fill(full == 0, 0)
        if scheme == "ms_poe":
            cache = getattr(model(ids, attention_mask=mask, position_ids=pos[:, :n]), CACHE)
            rest = model(out.sequences[:, n:-1], attention_mask=full[:, :-1], position_ids=pos[:, n:-1],
                         **{CACHE: cache}).logits
            want = torch.cat([model(ids, attention_mask=mask, position_ids=pos[:, :n]).logits[:, -1:], rest], dim=1)
        else:
            want = torch.stack([model(out.sequences[:, :n + t], attention_mask=full[:, :n + t], use_cache=False,
                                      position_ids=pos[:, :n + t]).logits[:, -1] for t in range(new)], dim=1)
    got = torch.stack(list(out.logits), dim=1)
    assert ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item() <= coverage.TOL


# Refused since the decoding sweep: a scheme that hides the middle keys where attention reads only a sparse indexer's
# chosen keys (a query whose picks all lie in the middle has no key left: its output differed between cached decoding
# and recomputation), and DCA / Ms-PoE where a layer re-reads every cached key's position at copy 0's positions
HIDES, REREADS = "hides every key between the first tokens and its window", "reads every key's position"
DECODING_REFUSALS = [(f, s, why[0]) for f, row in coverage.REFUSED.items() for s, why in row.items()
                     if why[0] in (HIDES, REREADS) and f not in absent_folders()]  # rows of newer releases: skipped


@pytest.mark.parametrize("folder,scheme,phrase", DECODING_REFUSALS, ids=[f"{f}-{s}" for f, s, _ in DECODING_REFUSALS])
def test_schemes_whose_decoding_cannot_be_exact_are_refused_at_apply(folder, scheme, phrase):
    model = tiny_model(folder, attn_implementation=coverage.backend(folder))
    ids, kw, _ = coverage.batch(folder)
    before = logits(model, ids, **kw)
    with pytest.raises(ValueError, match=re.escape(phrase)):
        rope_patch.apply(model, scheme, **coverage.ATTENTION[scheme][1])
    assert rope_patch.current(model) is None and torch.equal(logits(model, ids, **kw), before)


def test_deepseek_scale_survives_plain_save_reload_deepcopy_and_remove(tmp_path):
    """A plain save_pretrained reloads to the patched model (transformers recomputes the scale from the saved
    rope_parameters), and a deep copy's undo log restores the copy's own attention modules."""
    import copy

    from transformers import AutoModelForCausalLM

    model = tiny_model("deepseek_v3")
    shipped = _scales(model)
    rope_patch.apply(model, "yarn", factor=8.0, mscale_all_dim=1.0)
    ids = torch.randint(3, VOCAB, (1, 3 * 32), generator=torch.Generator().manual_seed(1))
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert _scales(plain) == _scales(model)
    assert (logits(plain, ids) - logits(model, ids)).abs().max().item() <= 1e-5
    twin = copy.deepcopy(model)
    rope_patch.remove(twin)
    assert _scales(twin) == shipped and _scales(model) != shipped


@pytest.mark.parametrize("blocked", [False, True], ids=["dense", "blocked"])
def test_gpt_oss_sinks_on_the_fused_and_materialised_paths(blocked):
    """Without a padding mask the blocked function takes its fused log-sum-exp path (the sink is one more partial
    softmax), with one the materialised path (the sink is one more column): both equal the reference."""
    from rope_patch import attention

    params = {"window_size": 12}
    model = tiny_model("gpt_oss")
    rope_patch.apply(model, "rerope", **params)
    if blocked:
        model.set_attn_implementation(attention.BLOCKED)
    ids, mask = batch()
    for kw in ({}, {"attention_mask": mask}):
        want = reference_forward(tiny_model("gpt_oss"), model, ids, "rerope", params, kw.get("attention_mask"))
        real = kw["attention_mask"].bool() if kw else torch.ones_like(ids, dtype=torch.bool)
        assert (logits(model, ids, **kw) - want)[real].abs().max().item() <= 1e-5


def test_gpt_oss_sinks_are_refused_on_backends_without_a_sink_term():
    model = tiny_model("gpt_oss")
    model.config._attn_implementation_internal = "flex_attention"  # as a model loaded with flex reads
    with pytest.raises(ValueError, match=r"gpt_oss attention sinks: .* rope_patch's flex_attention function does not"):
        rope_patch.apply(model, "alibi")
    assert rope_patch.current(model) is None


@pytest.mark.parametrize("arch", ADDED)
def test_frequency_patch_removes_bit_exactly(arch):
    """yarn, then `linear` replacing it, then remove: the very logits of the model as built."""
    model = tiny_model(arch)
    ids, mask = batch()
    before = logits(model, ids, attention_mask=mask)
    rope_patch.apply(model, "yarn", factor=8.0)
    assert not torch.equal(logits(model, ids, attention_mask=mask), before)
    rope_patch.apply(model, "linear", factor=2.0)
    rope_patch.remove(model)
    assert rope_patch.current(model) is None and torch.equal(logits(model, ids, attention_mask=mask), before)


# ---- every RoPE folder of the installed transformers ---------------------------------------------------------------
@pytest.mark.slow  # 122 folders × 7 schemes, ~3 min on 2 cores
@pytest.mark.parametrize("folder", coverage.folders())
def test_every_rope_folder(folder):
    """Each scheme family exact (yarn against a natively built model; each attention-side scheme at its identity
    setting against the model and at a real setting against the reference; remove() bit-exact) or refused at apply()
    for the reason the table gives; remove() on the unpatched model a no-op. Never wrong, never a crash."""
    got = coverage.outcomes(folder)
    assert got.pop("remove_unpatched") == "exact"
    for scheme, outcome in got.items():
        want = coverage.expected(folder, scheme)
        if want is None:
            assert outcome == "exact", f"{folder} {scheme}: {outcome}"
        else:
            assert outcome.startswith("refused: ") and want[0] in outcome, f"{folder} {scheme}: {outcome}"


def test_the_coverage_table_names_installed_folders_and_schemes():
    """Rows for folders of the installed release, or of a newer one (NEWER_FOLDERS: absent here, skipped); a folder
    NEWER_FOLDERS dates at or before the installed release is installed (else its row there is stale)."""
    folders = set(coverage.folders())
    assert set(coverage.REFUSED) <= folders | absent_folders()
    assert set(NEWER_FOLDERS) - absent_folders() <= folders
    assert all(set(row) <= set(coverage.SCHEMES) for row in coverage.REFUSED.values())
    exact = {s: sum(coverage.expected(f, s) is None for f in folders) for s in coverage.SCHEMES}
    assert min(exact.values()) >= 0.85 * len(folders), exact


def test_the_architecture_page_is_generated_from_the_table():
    """The page is generated for the newest release, and names it: on it, the page is the table's; on an older
    release of the supported window (5.19's CI pass) the rows are checked by test_every_rope_folder instead."""
    from helpers.scripts import ROOT

    committed = (ROOT / "docs" / "architectures.md").read_text(encoding="utf-8")
    generated_for = coverage.page_version(committed)
    if coverage.before(generated_for):
        pytest.skip(f"docs/architectures.md is generated for transformers {generated_for}, newer than the installed "
                    f"{transformers.__version__}")
    assert committed == coverage.page(), "docs/architectures.md is stale: run `cd tests && python -m helpers.coverage`"


# ---- DeepSeek-V4: attention over a sliding window and compressed memory, K = V ---------------------------------------
# Its layers append memory entries (one per block of m tokens, made by a compressor inside the layer and rotated at w·m,
# the block's first token) to the keys of a sliding window; the key tensor is also the value (K = V), and the output is
# rotated back at the query's position. The schemes place an entry as a key at w·m; a pair placed at (P_q, P_k) takes
# its value at P_k and is rotated back at P_q, as the layer treats a query at P_q and a key at P_k.
V4_SCHEMES = [s for s in ATTENTION_SCHEMES if s[0] in ("alibi", "self_extend", "rerope", "leaky_rerope",
                                                       "string", "dca")]


def test_deepseek_v4_reference_keeps_each_pairs_relative_position(monkeypatch):
    """The reference's placement of memory entries and K = V values: moving the far pairs (i − j ≥ 12, memory entries
    included) by 7 in both query and key must leave the model as it is (everything the layer does with positions is
    relative); it would not if the entries stayed at w·m, or the values or the output's inverse rotation stayed put."""
    import helpers.reference_any as reference_any

    def moved(scheme, params, i, j):
        i, j = torch.broadcast_tensors(i.float(), j.float())
        far = i - j >= 12
        return torch.where(far, i + 7, i), torch.where(far, j + 7, j)

    monkeypatch.setattr(reference_any, "pair_positions", moved)
    ids, _, real = coverage.batch("deepseek_v4")
    model = tiny_model("deepseek_v4")
    want = reference_any.forward(tiny_model("deepseek_v4"), model, ids, "rope", {})
    got = logits(model, ids)
    assert coverage._delta(got, want, real) <= 1e-5


@pytest.mark.slow  # ~1 min: six schemes, each with its apply-time check
@pytest.mark.parametrize("scheme,params", V4_SCHEMES, ids=[s for s, _ in V4_SCHEMES])
def test_deepseek_v4_memory_schemes_match_the_reference(scheme, params):
    """At the identity setting the model, at a real one the reference (memory entries at w·m), remove() bit-exact."""
    assert coverage.outcomes("deepseek_v4", (scheme,))[scheme] == "exact"


@pytest.mark.parametrize("scheme,params", V4_SCHEMES, ids=[s for s, _ in V4_SCHEMES])
def test_deepseek_v4_cached_decoding_is_recomputation(scheme, params):
    """Prefill 30 tokens into the cache, decode 14 one by one: the memory entries of every key copy and their
    positions kept on the cache layer (copies.MemoryLayerView) give what a forward over all 44 tokens gives. The
    indexer keeps every entry (index_topk 64): its top-k over the tiny model's scores, which tie at 0, is not the
    same for one query and for 44 even unpatched."""
    model = tiny_model("deepseek_v4", index_topk=64)
    rope_patch.apply(model, scheme, **params)
    ids = torch.randint(3, VOCAB, (2, 44), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :30], use_cache=True)
        cache = getattr(out, CACHE)  # `cache` from transformers 5.24, `past_key_values` before
        steps = [out.logits] + [model(ids[:, t:t + 1], **{CACHE: cache}, use_cache=True).logits for t in range(30, 44)]
    got = torch.cat(steps, dim=1)
    assert ((got - full).abs().max() / full.abs().max()).item() <= 1e-5


def test_deepseek_v4_two_region_schemes_read_values_per_key_copy():
    """The apply-time check finds the values rotating with the keys and picks the SPLIT hand-over for DeepSeek-V4; a
    model whose values do not move keeps reading them once."""
    from rope_patch.schemes.common import attention_modules

    for arch, mode in [("deepseek_v4", "split"), ("gpt_oss", "sequential")]:
        model = tiny_model(arch)
        rope_patch.apply(model, "rerope", window_size=12)
        modes = {vars(m)["forward"].cache_mode for m in attention_modules(model) if "forward" in vars(m)}
        assert modes == {mode}, arch


def test_deepseek_v4_dca_decides_memory_visibility_at_the_tokens_positions():
    """DCA moves every copy to chunk positions; on a layer that decides inside itself which memory entries a query sees
    (from its position ids) it runs one more copy at the tokens' own positions, whose mask is read."""
    from rope_patch import attention
    from rope_patch.schemes.common import attention_modules

    model = tiny_model("deepseek_v4")
    rope_patch.apply(model, "dca", chunk_size=24, local_size=4)
    for m in attention_modules(model):
        layout = vars(m)["forward"].layout
        assert layout.copies == 4 and attention.copies.own_copy(layout) == 3
