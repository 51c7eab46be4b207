"""PoSE position ids, and the transformers mask trap: skipped position ids must not become a block-diagonal mask."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.models import tiny_model
from transformers import DynamicCache

from rope_patch.training.pose import pose_inputs, pose_position_ids, validate_pose


def has_skips(position_ids: torch.Tensor) -> bool:
    """True when some step between neighbouring position ids is not +1 (what transformers reads as packing)."""
    return bool((torch.diff(position_ids, dim=-1) != 1).any())


@torch.no_grad()
def attends_across_skips(model, input_ids: torch.Tensor, position_ids: torch.Tensor, *, with_mask: bool = True) -> bool:
    """Whether the last token's logits depend on the first token when the row's position ids skip ahead.

    With a causal mask over the whole row they do; with transformers' packed-sequence (block-diagonal) mask they
    cannot. `with_mask=False` calls the model the naive way (position_ids only) to show the trap.
    """
    kwargs = pose_inputs(input_ids, position_ids)
    if not with_mask:
        kwargs.pop("attention_mask")
    changed = input_ids.clone()
    vocab = model.get_input_embeddings().weight.shape[0]
    changed[:, 0] = (changed[:, 0] + 1) % vocab
    # use_cache=False as in training: with a cache transformers skips the packed-sequence detection.
    a = model(**kwargs, use_cache=False).logits[:, -1]
    b = model(**{**kwargs, "input_ids": changed}, use_cache=False).logits[:, -1]
    return bool((a - b).abs().max() > 0)


@pytest.mark.parametrize("n_chunks", [1, 2, 3, 5])
def test_position_ids_are_increasing_chunks_within_the_target(n_chunks):
    rng = random.Random(0)
    for _ in range(200):
        ids = pose_position_ids(64, 512, n_chunks, rng)
        steps = torch.diff(torch.tensor(ids))
        assert len(ids) == 64 and ids[0] == 0 and ids[-1] <= 511
        assert (steps >= 1).all()  # non-decreasing skips: positions strictly increase
        assert int((steps != 1).sum()) <= n_chunks - 1  # at most one jump per chunk boundary


def test_relative_distances_cover_the_target_window():
    rng = random.Random(1)
    spans = [pose_position_ids(64, 1024, 2, rng)[-1] for _ in range(500)]
    assert max(spans) >= 1000  # distances near the target occur ...
    assert min(spans) <= 100  # ... and so do short ones (skip 0 is possible)


@pytest.mark.parametrize("args,match", [((64, 32, 2), "shorter than the training rows"), ((64, 128, 0), "n_chunks"),
                                        ((64, 128, 65), "exceeds"), ((0, 128, 2), "train_length")])
def test_validation_names_the_field(args, match):
    with pytest.raises(ValueError, match=match):
        validate_pose(*args)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_transformers_reads_skips_as_packing_and_the_mask_fixes_it(impl):
    model = tiny_model(attn_implementation=impl)
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11] + list(range(80, 92)))
    assert has_skips(pos)
    # The trap: position ids alone -> block-diagonal mask -> the second chunk cannot see the first.
    assert not attends_across_skips(model, ids, pos, with_mask=False)
    # The fix used by the recipe: an explicit all-ones mask keeps one causal sequence.
    assert attends_across_skips(model, ids, pos)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_pose_forward_equals_token_by_token_decoding(impl):
    """Reference semantics: decode the row one token at a time with a KV cache, each token at its PoSE position;
    a token sees every earlier token (causal) with RoPE at the skipped positions. The training forward must agree."""
    model = tiny_model(attn_implementation=impl)
    ids = torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([pose_position_ids(20, 200, 3, random.Random(3))])
    with torch.no_grad():
        full = model(**pose_inputs(ids, pos), use_cache=False).logits
        cache, steps = DynamicCache(config=model.config), []
        for t in range(ids.shape[1]):
            out = model(input_ids=ids[:, t : t + 1], position_ids=pos[:, t : t + 1],
                        attention_mask=torch.ones(1, t + 1, dtype=torch.long),
                        cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits[:, -1])
    assert (full[0] - torch.cat(steps)).abs().max().item() <= 1e-5


def test_gradients_flow_across_the_skip():
    model = tiny_model().train()
    ids = torch.randint(3, 97, (1, 16), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor(list(range(8)) + list(range(50, 58)))
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    kw = pose_inputs(ids, pos)
    kw.pop("input_ids")
    model(inputs_embeds=emb, **kw, use_cache=False).logits[0, -1].sum().backward()
    assert emb.grad[0, :8].abs().sum() > 0  # the last token's output depends on the first chunk


def test_pose_inputs_shape_check():
    with pytest.raises(ValueError, match="must match"):
        pose_inputs(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))
