"""`Declared` on geometries no built-in scheme uses: every path it derives (materialised blocks, the fused flash path,
flex_attention) equals a direct dense computation of the declaration, written here from its definition (each pair's
region by its distance or chunk difference, that region's query copy against its key set, or each KV head's picked
pair, hidden elsewhere; plus the bias of its distance)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask

from rope_patch import attention
from rope_patch.attention import Geometry, Region

B, HKV, G, D = 2, 2, 2, 16
SETS = torch.tensor([[1, 0], [0, 1]])  # (b, Hkv): the pair each KV head of each row reads under `Region(chosen=True)`


class Slopes(attention.Bias):
    """−m_h·d, a different slope per query head (ALiBi's form)."""

    def by_distance(self, call, distance):
        return -torch.tensor([0.5, 0.25, 0.125, 0.0625])[:, None] * distance.float()


class Flat(attention.Bias):
    """A table per head, the same from distance 6 on (T5's last bucket's form)."""

    flat_after = 6

    def by_distance(self, call, distance):
        return torch.linspace(-1.0, 1.0, HKV * G * 7).view(HKV * G, 7)[:, distance.clamp(0, 6)]


class Picked(attention.Declared):
    def chosen_sets(self, layer_idx, rows):
        return SETS


GEOMETRIES = {
    "three bands": Geometry((Region(hi=8), Region(query=1, keys=1, lo=8, hi=20), Region(query=2, lo=20))),
    "narrow bands": Geometry((Region(hi=3), Region(query=1, keys=1, lo=3, hi=5), Region(query=2, lo=5))),
    "first tokens": Geometry((Region(hi=8), Region(query=1, keys=1, lo=8, first=5))),
    "a gap": Geometry((Region(hi=6), Region(query=1, lo=12))),  # distances 6 … 11 hidden
    "chunks": Geometry((Region(hi=1, chunk=10), Region(query=1, lo=1, hi=2, chunk=10),
                        Region(query=2, lo=2, chunk=10))),
    "a bias": Geometry((Region(),), bias=Slopes()),
    "a flat bias": Geometry((Region(),), bias=Flat()),
    "bands and a bias": Geometry((Region(hi=8), Region(query=1, keys=1, lo=8)), bias=Flat()),
    "each head's pair": Geometry((Region(chosen=True),)),
}
SHAPES = [(64, 64, 0), (16, 64, 0), (1, 64, 0), (64, 64, 3)]  # (queries, keys, offset: true position − slot)


def make_call(q_len: int, k_len: int, offset: int, seed: int = 0) -> attention.AttentionCall:
    g = torch.Generator().manual_seed(seed)
    queries = tuple(torch.randn(B, HKV, G, q_len, D, generator=g) for _ in range(3))
    keys = tuple(torch.randn(B, HKV, k_len, D, generator=g) for _ in range(2))
    value = torch.randn(B, HKV, k_len, D, generator=g)
    module = nn.Module()
    module.layer_idx = 0
    setattr(module, attention.STATE, SimpleNamespace(positionless=False, current=None))
    return attention.AttentionCall(module, queries[0], keys[0], value, D**-0.5, None,
                                   torch.arange(k_len - q_len, k_len), torch.full((1, 1), offset),
                                   queries=queries, keys=keys)


def dense(geometry: Geometry, call) -> torch.Tensor:
    """(b, H, q, dv): the declaration's attention, pair by pair."""
    q_len, k_len = call.query.shape[3], call.key.shape[2]
    i = call.q_slot[:, None] + int(call.offset)
    j = torch.arange(k_len)[None, :] + int(call.offset)
    s = torch.full((B, HKV, G, q_len, k_len), -math.inf)
    for r in geometry.regions:
        back = i - j if r.chunk is None else i.clamp(min=0) // r.chunk - j.clamp(min=0) // r.chunk
        inside = (back >= r.lo) & (back < r.hi) & (i >= j)
        if r.first is not None:
            inside &= j < r.first
        if r.chosen:  # KV head g of row b: query copy and key set SETS[b, g]
            q = torch.stack([torch.stack([call.queries[int(SETS[b, g])][b, g] for g in range(HKV)]) for b in range(B)])
            k = torch.stack([torch.stack([call.keys[int(SETS[b, g])][b, g] for g in range(HKV)]) for b in range(B)])
        else:
            q, k = call.queries[r.query], call.keys[r.keys]
        scores = torch.einsum("bkgqd,bknd->bkgqn", q, k) * call.scaling
        s = torch.where(inside, scores, s)
    if geometry.bias is not None:
        s = s + geometry.bias.by_distance(call, (i - j).reshape(-1)).view(HKV, G, q_len, k_len)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bkgqn,bknd->bkgqd", p, call.value).reshape(B, HKV * G, q_len, D)


def blocks(rule, call, rows_per_block: int, fused: bool) -> torch.Tensor:
    q_len = call.query.shape[3]
    out = []
    for r0 in range(0, q_len, rows_per_block):
        rows = slice(r0, min(q_len, r0 + rows_per_block))
        end = call.first_slot(rows) + rows.stop - rows.start
        parts = rule.fused(call, rows, end) if fused else None
        if parts is not None:
            out.append(attention.merge(parts))
            continue
        s = rule.logits(call, rows, 0, end)
        s = s.masked_fill(call.distance(rows, 0, end) < 0, torch.finfo(s.dtype).min)
        p = torch.softmax(s, dim=-1)
        out.append(torch.einsum("bkgqn,bknd->bkgqd", p, call.value[:, :, :end]).flatten(1, 2))
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"q{q}-k{k}-off{o}" for q, k, o in SHAPES])
@pytest.mark.parametrize("name", GEOMETRIES)
@pytest.mark.parametrize("path", ["materialised", "fused", "flex"])
def test_every_derived_path_is_the_declaration(name, shape, path, monkeypatch):
    geometry, call = GEOMETRIES[name], make_call(*shape)
    rule = Picked(geometry)
    rule.begin(call)
    want = dense(geometry, call)
    if path == "flex":
        monkeypatch.setattr(attention.settings, "FLEX_COMPILE", False)
        got = rule.flex(call, attention.causal_block_mask(call))
    else:  # blocks of 16 rows: several blocks, each cut by the bands' and the chunks' edges
        got = blocks(rule, call, 16, fused=path == "fused")
    assert (got - want).abs().max().item() <= 1e-5


def test_regions_may_not_overlap_or_mix_distances_and_chunks():
    with pytest.raises(ValueError, match="overlapping"):
        Geometry((Region(hi=8), Region(query=1, lo=6)))
    with pytest.raises(ValueError, match="not both"):
        Geometry((Region(hi=1, chunk=4), Region(query=1, lo=8)))


@pytest.mark.parametrize("path", ["materialised", "flex"])
def test_a_bias_reaches_the_keys_a_mask_opens_after_the_query(path, monkeypatch):
    """A mask that opens the future (a prefix-LM's) lets the bias count there too: at the negative distance i − j,
    as ALiBi's −m·(i − j) has it, on the materialised path and flex alike."""
    call = make_call(16, 16, 0)
    rule = attention.Declared(Geometry((Region(),), bias=Slopes()))
    rule.begin(call)
    distance = call.q_slot[:, None] - torch.arange(16)[None, :]
    s = torch.einsum("bkgqd,bknd->bkgqn", call.query, call.key) * call.scaling
    want = s + Slopes().by_distance(call, distance.reshape(-1)).view(HKV, G, 16, 16)  # every key, the future's too
    if path == "flex":
        monkeypatch.setattr(attention.settings, "FLEX_COMPILE", False)
        everything = create_block_mask(lambda b, h, q, k: q >= 0, None, None, 16, 16, device="cpu")
        got = rule.flex(call, everything)
        want = torch.einsum("bkgqn,bknd->bkgqd", torch.softmax(want, dim=-1), call.value).flatten(1, 2)
    else:
        got = rule.logits(call, slice(0, 16), 0, 16)
    assert (got - want).abs().max().item() <= 1e-5
