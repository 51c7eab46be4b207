"""Every RoPE folder of the installed transformers (`helpers.models.rope_folders()`: a `*RotaryEmbedding` and a
`*ForCausalLM` class in its modeling file) gets a tiny random model from `tiny_model(folder)` that

- builds: the folder's own causal LM, small, with every kind of layer its default config has;
- runs a left-padded batch (2 rows × 40 tokens, row 0 padded by 5, the position ids generate passes) to finite
  logits, and row 0's real tokens get the logits they get alone (left padding is exact);
- reads its positions: a gap of 7 in the position ids from token 20 on changes the logits;
- is relative: all position ids + 7 leave the logits as they are, except for the models in SHIFT_VARIANT, which read
  absolute positions (an operation after RoPE that does not commute with the rotation, a position-dependent scale,
  compression blocks at absolute positions);
- generates 4 tokens greedily with its default cache.

A uniform shift cannot "change the logits" of a model whose only position encoding is RoPE (q_m·k_n depends on m − n
alone), so positions are shown to matter with the gap, and the uniform shift is the test of what reads absolute
positions.

What transformers itself cannot do with a folder is a row of a table below with its reason, and the row is checked to
still fail that way (a fix upstream fails the test, and the row can go). The models are built once per folder and
shared by the tests of this file (`_model`); all of them run in this one process (~15 s for the 125 folders of
transformers 5.25 on 2 CPU cores; older releases have fewer: `helpers.models.NEWER_FOLDERS`).
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from helpers.models import (
    ARCHS,
    FOLDER_OVERRIDES,
    GENERATE_INPUTS,
    INPUTS,
    LAYER_KIND_KEYS,
    NEWER_FOLDERS,
    PADDING_INEXACT,
    POSITION_IDS_IGNORED,
    WINDOW,
    causal_lm_class,
    logits,
    rope_folders,
    tiny_model,
    token_batch,
)
from packaging.version import Version

L, PAD, GAP_AT, SHIFT, NEW = 40, 5, 20, 7, 4
EXACT = 1e-4  # |Δ| / max |logit|: float noise is ≤ 1e-5 here (linear-attention kernels, several rotary tables)
MOVED = 5e-5  # a change in the positions must move the logits by more than this (the smallest seen: gemma, 4e-4)

# folder -> what in the model reads absolute positions (its logits change when every position id moves by 7)
SHIFT_VARIANT = {
    "hunyuan_v1_dense": "q/k RMSNorm (per-channel weights) after RoPE",
    "hunyuan_v1_moe": "q/k RMSNorm (per-channel weights) after RoPE",
    "dory": "per-channel query scale (sqk²) after RoPE",
    "ministral3": "Llama 4 attention temperature: queries scaled by 1 + β·log(1 + ⌊pos / original_max⌋)",
    "beam": "global NoPE layers scale queries by exp(0.1·log1p((pos + 1) / 2048))",
    "inkling2": "queries and relative-bias states scaled by 1 + α·log(max((pos + 1) / log_scaling_n_floor, 1))",
    "deepseek_v4": "compressed-key blocks and their causal visibility ((pos + 1) // compress_rate) "
                   "by absolute position",
    "recurrent_gemma": "the RG-LRU resets its state (and input normalisation) where position_ids == 0",
}
# folder -> why its tiny model lacks a kind of layer its default config has
MISSING_KINDS = {
    "smollm3": "ARCHS' entry, kept as it is: both layers rotate (the default has a NoPE layer every 4th)",
}
# (folders that are also ARCHS keys keep ARCHS' model: its config, init and weights, not perturbed)
FOLDERS = sorted(rope_folders())


@functools.cache
def _model(folder: str):
    return tiny_model(folder)


def _batch():
    ids, kw = token_batch(L, pad=PAD)
    return ids, kw, kw["attention_mask"].bool()


def _forward(folder, model, ids, **kw):
    out = logits(model, ids, **INPUTS.get(folder, {}), **kw)
    return out, out.shape[1]  # csm's depth decoder returns no logits for position 0: aligned from the right


def _relative(a, b, real):
    return ((a - b)[real].abs().max() / b[real].abs().max()).item()


def test_the_tables_name_installed_folders_only():
    """The folders come from the installed transformers; a row for a folder it no longer has is stale."""
    assert len(FOLDERS) >= 100 and {"llama", "gemma3", "deepseek_v3", "qwen3_next"} <= set(FOLDERS)
    installed = Version(transformers.__version__)
    newer = {f for f, release in NEWER_FOLDERS.items() if installed < Version(release)}
    assert not newer & set(FOLDERS)  # a folder of the installed release is no newer one
    for table in (INPUTS, GENERATE_INPUTS, POSITION_IDS_IGNORED, PADDING_INEXACT, SHIFT_VARIANT, MISSING_KINDS,
                  FOLDER_OVERRIDES):
        assert set(table) <= set(FOLDERS) | newer


@pytest.mark.parametrize("folder", FOLDERS)
def test_builds_small_with_every_kind_of_layer(folder):
    model = _model(folder)
    assert type(model) is causal_lm_class(folder)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    default = type(model.config)()
    missing = [key for key in LAYER_KIND_KEYS if isinstance(want := getattr(default, key, None), list) and want
               and not set(want) <= set(getattr(model.config, key, None) or ())]
    assert bool(missing) == (folder in MISSING_KINDS), missing


@pytest.mark.parametrize("folder", FOLDERS)
def test_left_padded_forward_is_finite_and_exact(folder):
    model = _model(folder)
    ids, kw, real = _batch()
    out, n = _forward(folder, model, ids, **kw)
    real = real[:, -n:]
    assert torch.isfinite(out[real]).all()
    alone, m = _forward(folder, model, ids[:1, PAD:], position_ids=torch.arange(L - PAD)[None])
    err = _relative(out[:1, -m:], alone, torch.ones_like(alone[..., 0], dtype=torch.bool))
    if folder in PADDING_INEXACT:
        assert err > 1e-3, f"left padding is exact now: drop {folder} from PADDING_INEXACT"
    else:
        assert err <= EXACT


@pytest.mark.parametrize("folder", sorted(f for f, why in PADDING_INEXACT.items() if why.startswith("DeepSeek sparse")))
def test_sparse_attention_padding_is_exact_when_the_indexer_keeps_every_key(folder):
    model = tiny_model(folder, index_topk=64)
    ids, kw, _ = _batch()
    out = logits(model, ids, **kw)
    alone = logits(model, ids[:1, PAD:], position_ids=torch.arange(L - PAD)[None])
    assert (out[0, PAD:] - alone[0]).abs().max() / alone.abs().max() <= EXACT


@pytest.mark.parametrize("folder", FOLDERS)
def test_positions_matter(folder):
    """A gap of 7 in the position ids from token 20 on changes the relative distances across it, so the logits."""
    model = _model(folder)
    ids, kw, real = _batch()
    out, n = _forward(folder, model, ids, **kw)
    gap = kw["position_ids"] + SHIFT * (torch.arange(L) >= GAP_AT)
    moved, _ = _forward(folder, model, ids, attention_mask=kw["attention_mask"], position_ids=gap)
    change = _relative(moved, out, real[:, -n:])
    if folder in POSITION_IDS_IGNORED:
        assert change == 0, f"position_ids reach the model now: drop {folder} from POSITION_IDS_IGNORED"
    else:
        assert change > MOVED


@pytest.mark.parametrize("folder", FOLDERS)
def test_uniform_shift_changes_only_the_models_that_read_absolute_positions(folder):
    model = _model(folder)
    ids, kw, real = _batch()
    out, n = _forward(folder, model, ids, **kw)
    shifted, _ = _forward(folder, model, ids, attention_mask=kw["attention_mask"],
                          position_ids=kw["position_ids"] + SHIFT)
    change = _relative(shifted, out, real[:, -n:])
    if folder in SHIFT_VARIANT:
        assert change > MOVED, f"{folder} is relative now: drop it from SHIFT_VARIANT"
    else:
        assert change <= EXACT


@pytest.mark.parametrize("folder", FOLDERS)
def test_greedy_generate(folder):
    model = _model(folder)
    ids, kw, _ = _batch()
    extra = {**INPUTS.get(folder, {}), **GENERATE_INPUTS.get(folder, dict)()}
    out = model.generate(ids, attention_mask=kw["attention_mask"], max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         **extra)
    assert out.shape == (2, L + NEW) and torch.equal(out[:, :L], ids)


def test_default_cache_fails():
    ids, kw, _ = _batch()
    with pytest.raises(AttributeError, match="num_hidden_layers"):
        logits(_model("blt"), ids, **kw)


def test_generate_needs_its_inputs():
    ids, kw, _ = _batch()
    with pytest.raises(KeyError, match="backbone_last_hidden_state"):
        _model("csm").generate(ids, attention_mask=kw["attention_mask"], max_new_tokens=NEW, do_sample=False)


def test_archs_folders_keep_their_weights_and_new_folders_are_perturbed():
    """ARCHS entries are built as they always were (no noise); the other folders get initializer_range 0.1 and
    `perturb`'s noise on the parameters initialised to a constant (norm weights here)."""
    llama = tiny_model("llama")
    assert llama.config.initializer_range == 0.02 and "llama" in ARCHS
    assert torch.equal(llama.model.norm.weight, torch.ones(64))
    assert torch.equal(tiny_model("llama", perturbed=False).model.norm.weight, llama.model.norm.weight)
    arcee = tiny_model("arcee")
    assert arcee.config.initializer_range == 0.1 and arcee.config.max_position_embeddings == WINDOW
    assert not torch.equal(arcee.model.norm.weight, torch.ones(64))
    plain = tiny_model("arcee", perturbed=False)
    assert torch.equal(plain.model.norm.weight, torch.ones(64))
    assert torch.equal(plain.model.layers[0].self_attn.q_proj.weight, arcee.model.layers[0].self_attn.q_proj.weight)
