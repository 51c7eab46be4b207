"""SELF, `self_extend_logistic` (Dang et al. 2025, arXiv:2505.17296): Self-Extend whose groups grow along a logistic
curve. Checked against the authors' computation (alexeipc/SELF-LLM at e8d729e: the grouping kernel
self_extend_patch/attn_method/logistic.cu and the attention of self_extend_patch/Llama.py's `self_extend_forward`,
written again below in plain torch), against Self-Extend where the schedule degenerates to one group size, with a KV
cache at the authors' setting, and refused with a clear message on bad parameters. The reference written from the
paper (helpers.reference.logistic_groups) runs through every suite of tests/helpers/schemes.py's row."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import logits, tiny_model, token_batch
from helpers.reference import decoder_forward, inv_freq, rotate_half
from test_attention import assert_cached_decoding_equals_recomputation

import rope_patch
from rope_patch.schemes.positions import LogisticGroups


# ---- the authors' computation, written again -------------------------------------------------------------------
def authors_group_positions(n: int, window_size: int, rate: float, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logistic.cu's `async_generator` (prefill): (group query positions, group key positions) of tokens 0 … n − 1.

    freq_group: size class i = 1 … C − 2 holds the groups [⌈x_i⌉, ⌊x_{i+1}⌋] (less one where x_{i+1} is an integer),
    x_i = (log(i·C − i) − log(C − i))/rate; classes C − 1 and C are left zero ((0, 0): one group each) and class 0 ends
    at −1. The host loop launches, for each class i whose count and next class's count are positive, gpu_key_group_id:
    token id ≥ presum gets groups[i − 1].last + ⌈(id − presum)/i⌉, written for id ≤ presum + i·count_i (every id for
    i = C − 1), 0 < id, and group ≤ n; then presum += i·count_i. Launches run in order, so a later one overwrites.
    gpu_query_group_id: W for i < W, else W + key[i − W]."""
    c = int(capacity)

    def inverse(y):  # gs_inverse_generating_function
        return (math.log(y * c - y) - math.log(c - y)) / rate

    first, last = [0] * (c + 1), [0] * (c + 1)  # cudaMemset(groups, 0)
    for i in range(1, c - 1):
        lower, upper = inverse(i), inverse(i + 1)
        first[i], last[i] = math.ceil(lower), math.floor(upper)
        if upper == math.floor(upper):
            last[i] -= 1
    last[0] = -1
    key = torch.zeros(n, dtype=torch.int32)
    ids = torch.arange(n)
    presum = 0
    for i in range(1, c):
        count, next_count = last[i] - first[i] + 1, last[i + 1] - first[i + 1] + 1
        if count <= 0 or next_count <= 0:
            continue
        size = i  # next_group_size = last_group_size + 1, last_group_size = i − 1
        group = last[i - 1] + torch.div(ids - presum + size - 1, size, rounding_mode="floor")
        max_n = presum + size * (last[i] - first[i] + 1)
        write = (ids >= presum) & ((ids <= max_n) | (size == c - 1)) & (ids > 0) & (group <= n)
        key = torch.where(write, group.to(torch.int32), key)
        presum += i * count
    query = torch.where(ids < window_size, window_size, window_size + key[(ids - window_size).clamp(min=0)])
    return query, key


def authors_forward(model, ids, params):
    """Llama.py's eager `self_extend_forward` (q_len = kv_len, one unpadded sequence per row) as the scores of the
    plain decoder of helpers.reference: neighbour logits of q and k rotated at their positions, group logits of q and k
    rotated at the kernel's positions, merged where i − j < W (the tril masks of the code), then one softmax."""
    n = ids.shape[1]
    w = params["window_size"]
    gq, gk = authors_group_positions(n, w, params.get("growth_rate", 0.02), params["group_size"])

    def rotate(x, positions):  # apply_rotary_pos_emb with the model's cos/sin at `positions`
        ang = positions.float()[:, None] * inv_freq(model.config, x.shape[-1])
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        return x * cos + rotate_half(x) * sin

    def scores(layer_idx, q, k, pos):
        scale = q.shape[-1] ** -0.5
        neighbor = rotate(q, pos[0]) @ rotate(k, pos[0]).transpose(-1, -2) * scale
        group = rotate(q, gq) @ rotate(k, gk).transpose(-1, -2) * scale
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        return torch.where(i - j < w, neighbor, group)

    with torch.no_grad():
        return decoder_forward(model, ids, scores)


# ---- the positions ---------------------------------------------------------------------------------------------
# (n, W, rate, C): the authors' setting (PG19 script: W = 512, C = 16, rate 0.02), other capacities and rates; all
# with every size class non-empty, where the kernel is well-formed
KERNEL_CASES = [(4096, 512, 0.02, 16), (4096, 512, 0.02, 33), (2000, 64, 0.1, 8), (2000, 64, 0.5, 8),
                (3000, 32, 0.05, 4),
                (96, 16, 0.5, 6), (40, 12, 0.5, 6), (300, 16, 1.0, 2)]


@pytest.mark.parametrize("n,window,rate,capacity", KERNEL_CASES)
def test_positions_equal_the_authors_kernel(n, window, rate, capacity):
    query, key = authors_group_positions(n, window, rate, capacity)
    p = torch.arange(n)
    assert torch.equal(LogisticGroups(capacity, rate)(p), key.long())
    assert torch.equal(LogisticGroups(capacity, rate, window)(p), query.long())


def test_group_sizes_grow_along_the_logistic_curve():
    """At the authors' setting the groups run 1, 2, …, C − 1 tokens, each size for the groups x with ⌊g(x)⌋ = size."""
    c, r = 16, 0.02
    f = LogisticGroups(c, r)(torch.arange(20_000))
    sizes = torch.bincount(f)[1:-1]  # group 0 holds tokens 0 and 1 (the kernel counts from 1); the last may be cut
    g = torch.tensor([c / (1 + (c - 1) * math.exp(-r * x)) for x in range(1, len(sizes) + 1)])
    assert torch.equal(sizes, g.floor().long().clamp(max=c - 1))
    assert sizes.max().item() == c - 1 and bool((sizes[1:] >= sizes[:-1]).all())


# ---- the model -------------------------------------------------------------------------------------------------
AUTHORS_SETTINGS = [
    ({"group_size": 6, "window_size": 16, "growth_rate": 0.5}, 96),
    ({"group_size": 16, "window_size": 32, "growth_rate": 0.02}, 256),  # the authors' C and rate: classes 1 … 5 reached
]


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("params,n", AUTHORS_SETTINGS, ids=["c6", "authors-c16"])
def test_logits_equal_the_authors_computation(params, n, backend):
    model = tiny_model("llama", attn_implementation=backend)
    ids = torch.randint(3, 97, (2, n), generator=torch.Generator().manual_seed(1))
    want = authors_forward(model, ids, params)
    rope_patch.apply(model, "self_extend_logistic", **params)
    assert (logits(model, ids) - want).abs().max().item() <= 1e-4


def test_a_constant_schedule_is_self_extend():
    """A rate so large that the curve reaches C − 1 at group 1: group 0 holds tokens 0 and 1 (g(0) = 1, the kernel
    counting from 1), every later group G = C − 1 tokens: f(t) = ⌊(t + G − 2)/G⌋. That is Self-Extend's grid ⌊j/G⌋
    moved by G − 2 tokens, and the query W + f(i − W) its ⌊i/G⌋ + W − ⌊W/G⌋ moved alike (G divides W): SELF on
    positions p is Self-Extend with G on positions p + G − 2."""
    c, w = 5, 16
    g = c - 1
    far_q, far_k = rope_patch.as_scheme("self_extend_logistic", group_size=c, window_size=w,
                                        growth_rate=100).far_positions()
    se_q, se_k = rope_patch.as_scheme("self_extend", group_size=g, window_size=w).far_positions()
    p = torch.arange(200)
    assert torch.equal(far_k(p), se_k(p + g - 2)) and torch.equal(far_q(p[w:]), se_q(p[w:] + g - 2))
    ids, kw = token_batch(96, 0, 7)
    se = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(se, "self_extend", group_size=g, window_size=w)
    want = logits(se, ids, attention_mask=kw["attention_mask"], position_ids=kw["position_ids"] + g - 2)
    model = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(model, "self_extend_logistic", group_size=c, window_size=w, growth_rate=100)
    real = kw["attention_mask"].bool()
    assert (logits(model, ids, **kw) - want)[real].abs().max().item() <= 1e-5


def test_cached_generation_across_every_group_size_equals_recomputation():
    """40-token prompts, W = 8: the far keys reach sizes 1 … 5 (C = 6, r = 0.5) while decoding."""
    model = tiny_model("qwen2", attn_implementation="sdpa")
    rope_patch.apply(model, "self_extend_logistic", group_size=6, window_size=8, growth_rate=0.5)
    assert max(rope_patch.current(model).far_positions()[1](torch.arange(40)).bincount()) == 5
    assert_cached_decoding_equals_recomputation(model, n=40)


def test_the_far_keys_are_cached_rotated_at_their_group():
    """The cache holds the keys of the true positions and of f(j) side by side (attention/copies.py), so each decode
    step rotates only the new token."""
    model = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(model, "self_extend_logistic", group_size=6, window_size=16, growth_rate=0.5)
    out = model(torch.randint(3, 97, (1, 50)), use_cache=True)
    keys = out.past_key_values.layers[0].keys
    assert keys.shape[1] == 2 * model.config.num_key_value_heads and keys.shape[2] == 50


@pytest.mark.parametrize("params,error,words", [
    ({"window_size": 16}, TypeError, ["missing required parameter `group_size`", "capacity"]),
    ({"group_size": 6}, TypeError, ["missing required parameter `window_size`"]),
    ({"group_size": 1, "window_size": 16}, ValueError, ["`group_size`", "got 1", "capacity"]),
    ({"group_size": 6, "window_size": 16, "growth_rate": 0}, ValueError, ["`growth_rate`", "got 0", "0.02"]),
    ({"group_size": 6, "window_size": 16, "growth_rate": float("nan")}, ValueError, ["`growth_rate`"]),
    ({"group_size": 16, "window_size": 16}, ValueError, ["`window_size` must be larger than `group_size`", "Raise"]),
])
def test_bad_parameters_are_refused_before_the_model_is_touched(params, error, words):
    model = tiny_model("llama")
    ids = torch.randint(3, 97, (1, 40))
    before = logits(model, ids)
    with pytest.raises(error) as info:
        rope_patch.apply(model, "self_extend_logistic", **params)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert rope_patch.current(model) is None and torch.equal(logits(model, ids), before)


def test_spec_alias_and_bare_value():
    assert rope_patch.as_scheme("self:16,window_size=512") == rope_patch.as_scheme(
        "self_extend_logistic", group_size=16, window_size=512, growth_rate=0.02)
