"""Position ids that are not the slots (rope_patch/attention/protocol.py): a distance is the difference of position
ids, as the rotary embedding has it. PoSE (Zhu et al. 2024) skips ids between chunks of a training window; packed
rows restart their ids at 0 for each sequence. Without a cache every attention-side scheme decides its regions
(window, groups, chunks, shift) and its bias by those differences, and masks the keys of an earlier segment of a
packed row. A first forward into an empty cache (an eval-mode forward's default) is served the same way; a cache
that already holds keys is refused with such ids, and so is a later step reading keys such ids wrote (the cache keeps
no ids beside its keys)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import VOCAB, logits, tiny_model
from helpers.reference_any import forward as reference_forward
from transformers import DynamicCache

import rope_patch
from rope_patch.attention import settings
from rope_patch.evaluation.retrieval import CACHE

N = 80
POSE = torch.cat([torch.arange(40), torch.arange(300, 340)])[None]  # one skip of 260 ids
PACKED = torch.cat([torch.arange(40), torch.arange(40)])[None]  # two sequences in one row
RESTART_3 = torch.cat([torch.arange(30), torch.arange(25), torch.arange(25)])[None]
SHAPES = {"pose": (POSE, True), "packed": (PACKED, False), "three-sequences": (RESTART_3, False)}
SCHEMES = [
    ("self_extend", {"group_size": 4, "window_size": 30}),
    ("rerope", {"window_size": 100}),  # 100 covers the slots, not the ids: the far region is used across the skip
    ("leaky_rerope", {"window_size": 30, "factor": 2.0}),
    ("string", {"shift_size": 50, "window_size": 8}),
    ("dca", {"chunk_size": 60, "local_size": 4}),
    ("alibi", {}),
    ("relative_bias", {"init": "alibi", "num_buckets": 16, "max_distance": 64}),
]
CASES = [(s, p, shape, be) for s, p in SCHEMES for shape in SHAPES for be in ("eager", "sdpa")]


def _ids():
    return torch.randint(3, VOCAB, (2, N), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme,params,shape,backend", CASES,
                         ids=[f"{s}-{shape}-{be}" for s, _, shape, be in CASES])
def test_gapped_and_restarting_ids_equal_the_reference(scheme, params, shape, backend):
    """PoSE's ids with an all-ones mask (transformers then sees one sequence), packed rows without a mask
    (transformers masks across the restarts): the reference places every pair by its ids (helpers/reference_any)."""
    positions, with_mask = SHAPES[shape]
    ids, pos = _ids(), positions.expand(2, N)
    mask = torch.ones_like(ids) if with_mask else None
    model = tiny_model("llama", attn_implementation=backend)
    rope_patch.apply(model, scheme, **params)
    kw = dict(position_ids=pos, use_cache=False, **({"attention_mask": mask} if mask is not None else {}))
    got = logits(model, ids, **kw)
    want = reference_forward(tiny_model("llama", attn_implementation=backend), model, ids, scheme, params, mask,
                             position_ids=pos, use_cache=False)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("scheme,params", [("rerope", {"window_size": 400}), ("self_extend", {"group_size": 4,
                                                                                                "window_size": 400})])
def test_a_window_covering_the_ids_is_the_model_at_those_ids(scheme, params):
    """Before, the attention path read one offset per row: PoSE's ids ran as contiguous positions (4.5e-3 off)."""
    ids, pos = _ids(), POSE.expand(2, N)
    model = tiny_model("llama", attn_implementation="sdpa")
    kw = dict(position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False)
    want = logits(model, ids, **kw)
    rope_patch.apply(model, scheme, **params)
    assert (logits(model, ids, **kw) - want).abs().max().item() <= 1e-5


def test_left_padding_is_not_a_gap():
    """generate gives pads the id 1: consecutive real tokens still step by 1, so the slots' arithmetic serves."""
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    model = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(model, "self_extend", group_size=4, window_size=12)
    logits(model, ids, attention_mask=mask, position_ids=pos)  # with the default cache: not refused


CACHED = [(s, p, shape) for s, p in SCHEMES[:6] for shape in ("pose", "packed")]


@pytest.mark.parametrize("scheme,params,shape", CACHED, ids=[f"{s}-{shape}" for s, _, shape in CACHED])
def test_gapped_ids_into_the_default_cache_equal_the_forward_without_one(scheme, params, shape):
    """An eval-mode forward makes a cache by default: its first forward holds only its own keys, whose ids the
    attention reads, so it is served exactly (it was refused). A later step that would read those keys is refused: the
    cache keeps no ids beside them."""
    model = rope_patch.apply(tiny_model("llama", attn_implementation="sdpa"), scheme, **params)
    ids, pos = _ids(), SHAPES[shape][0].expand(2, N)
    kw = dict(position_ids=pos, attention_mask=torch.ones_like(ids))
    want = logits(model, ids, **kw, use_cache=False)
    with torch.no_grad():
        out = model(ids, **kw)  # use_cache: the config's True
    assert getattr(out, CACHE) is not None
    assert (out.logits - want).abs().max().item() <= 1e-6
    step = dict(position_ids=pos[:, -1:] + 1, attention_mask=torch.ones(2, N + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"cache holds keys written at position ids with gaps or restarts .* run the "
                                         r"whole sequence again in one forward"):
        logits(model, ids[:, :1], **{CACHE: getattr(out, CACHE)}, use_cache=True, **step)


def test_gapped_ids_into_a_cache_that_holds_keys_are_refused_and_an_empty_one_is_served():
    model = rope_patch.apply(tiny_model("llama", attn_implementation="sdpa"), "self_extend", group_size=4,
                             window_size=30)
    ids, pos = _ids(), POSE.expand(2, N)
    kw = dict(attention_mask=torch.ones_like(ids), use_cache=True)
    want = logits(model, ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False)
    got = logits(model, ids, position_ids=pos, **{CACHE: DynamicCache(config=model.config)}, **kw)
    assert (got - want).abs().max().item() <= 1e-6
    with torch.no_grad():
        cache = getattr(model(ids[:, :10], use_cache=True), CACHE)  # a prompt at consecutive ids
    with pytest.raises(ValueError, match=r"gaps or restarts .* together with a KV cache that already holds keys"):
        logits(model, ids[:, 10:], position_ids=pos[:, 10:] - 20, **{CACHE: cache}, **kw)



def test_a_cache_emptied_after_gapped_ids_is_served_again():
    """The mark of gapped keys goes with the keys: a cache reset after such a forward is an empty cache again, and a
    prompt at consecutive ids then decodes on it (it was refused as holding gapped keys)."""
    model = rope_patch.apply(tiny_model("llama", attn_implementation="sdpa"), "self_extend", group_size=4,
                             window_size=30)
    ids, pos = _ids(), POSE.expand(2, N)
    cache = DynamicCache(config=model.config)
    logits(model, ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=True, **{CACHE: cache})
    cache.reset()
    want = logits(model, ids, use_cache=False)
    prompt = logits(model, ids[:, :-1], use_cache=True, **{CACHE: cache})
    step = logits(model, ids[:, -1:], use_cache=True, **{CACHE: cache})
    assert (torch.cat([prompt, step], dim=1) - want).abs().max().item() <= 1e-5

def test_gapped_ids_on_flex_are_refused(monkeypatch):
    monkeypatch.setattr(settings, "FLEX_COMPILE", False)
    model = tiny_model("llama", attn_implementation="flex_attention")
    rope_patch.apply(model, "rerope", window_size=12)
    ids = _ids()
    with pytest.raises(ValueError, match=r"not supported on the flex_attention backend"):
        logits(model, ids, position_ids=POSE.expand(2, N), use_cache=False)
