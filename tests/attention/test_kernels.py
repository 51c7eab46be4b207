"""rope_patch/attention/kernels.py: `flash_partial` against a dense softmax written out, with and without the rows
its mask excludes entirely (`dead`) named by the caller."""

from __future__ import annotations

import types

import pytest
import torch

from rope_patch.attention import flash_partial

B, HKV, G, R, N, D = 2, 2, 3, 5, 7, 8
SCALE = D ** -0.5


def _dense(q, k, v, mask):
    """Per query head h (kv head h // G): softmax(q·k·scale + mask) v and the log-sum-exp, the mask broadcast."""
    scores = torch.einsum("bhgrd,bhnd->bhgrn", q.double(), k.double()) * SCALE + mask.double()
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("bhgrn,bhnd->bhgrd", torch.softmax(scores, -1).nan_to_num(), v.double())
    return out.reshape(B, HKV * G, R, -1), lse.reshape(B, HKV * G, R)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HKV, G, R, D, generator=g), torch.randn(B, HKV, N, D, generator=g),
            torch.randn(B, HKV, N, 4, generator=g))  # narrower values (MLA): padded to D and cut again


@pytest.mark.parametrize("shape", [(1, 1, 1, R, N), (1, HKV, G, R, N)], ids=["one head", "per head"])
def test_flash_partial_equals_dense_softmax_and_gives_excluded_rows_no_weight(shape):
    q, k, v = _inputs()
    mask = torch.zeros(shape)
    mask[..., 1, :] = float("-inf")  # row 1: no key, on every head
    mask[..., 3, 4:] = float("-inf")  # row 3: the first 4 keys only
    if shape[1] > 1:
        mask[:, 1, 2, 0, :] = float("-inf")  # row 0 of one query head only
    call = types.SimpleNamespace(scaling=SCALE)
    read, given = flash_partial(call, q, k, v, mask=mask), None
    if shape[1] == 1:  # a caller that knows the dead rows (the declared regions) passes them, (r,)
        given = flash_partial(call, q, k, v, mask=mask, dead=torch.isneginf(mask).all(-1).flatten())
    want_out, want_lse = _dense(q, k, v, mask)
    dead = torch.isneginf(want_lse)
    for out, lse in [read] + ([given] if given is not None else []):
        assert torch.equal(torch.isneginf(lse), dead)
        assert torch.allclose(lse[~dead].double(), want_lse[~dead], atol=1e-5)
        assert torch.allclose(out[~dead].double(), want_out[~dead], atol=1e-5)
    if given is not None:
        assert torch.equal(read[0], given[0]) and torch.equal(read[1], given[1])
