"""--bucket-size: finer position buckets from the same forward passes (one decoder forward per batch of windows)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import VOCAB, tiny_model

from rope_patch.evaluation import perplexity
from rope_patch.evaluation.perplexity import evaluate_perplexity, fixed_buckets


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def stream():
    return torch.randint(3, VOCAB, (1000,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("longest,size,expected", [
    (64, 16, [(0, 16), (16, 32), (32, 48), (48, 64)]),
    (64, 24, [(0, 24), (24, 48), (48, 64)]),
    (64, 64, [(0, 64)]),
    (10, 1, [(i, i + 1) for i in range(10)]),
])
def test_fixed_buckets(longest, size, expected):
    assert fixed_buckets(longest, size) == expected


@pytest.mark.parametrize("size", [0, -3, 65])
def test_fixed_buckets_refuse_sizes_outside_the_window(size):
    with pytest.raises(ValueError, match=r"between 1 and the longest length \(64\).*--bucket-size"):
        fixed_buckets(64, size)


def _count_forwards(monkeypatch):
    calls = []
    real = perplexity.token_nll

    def counted(model, ids):
        calls.append(ids.shape)
        return real(model, ids)

    monkeypatch.setattr(perplexity, "token_nll", counted)
    return calls


@pytest.mark.parametrize("size", [None, 32, 8, 1])
def test_bucket_size_adds_no_forward_and_pools_to_the_whole(model, stream, monkeypatch, size):
    calls = _count_forwards(monkeypatch)
    res = evaluate_perplexity(model, stream, [32, 64], n_tokens=256, bucket_size=size, tokens_per_batch=128)
    assert calls == [torch.Size([4, 32]), torch.Size([4, 32]), torch.Size([2, 64]), torch.Size([2, 64])]
    b = res["buckets"]
    assert b[0]["start"] == (1 if size == 1 else 0) and b[-1]["end"] == 64  # position 0 is never predicted
    assert all(x["end"] == y["start"] for x, y in zip(b, b[1:], strict=False))
    if size is not None:
        assert all(x["end"] - x["start"] == size for x in b[:-1])
    # the buckets partition the predicted tokens of the longest length: their pooled NLL is the length's
    whole = next(r for r in res["lengths"] if r["length"] == 64)
    assert sum(x["n_tokens"] for x in b) == whole["n_tokens"]
    pooled = sum(x["nll"] * x["n_tokens"] for x in b) / whole["n_tokens"]
    assert math.isclose(pooled, whole["nll"], rel_tol=1e-9)


def test_bucket_size_and_buckets_are_exclusive(model, stream):
    with pytest.raises(ValueError, match="either buckets or bucket_size"):
        evaluate_perplexity(model, stream, [32], n_tokens=64, buckets=[(0, 8)], bucket_size=8)
