"""DPE (`dpe`, Lu et al. 2025, arXiv:2504.18857): exact against the authors' computation (LuLuLuyi/DPE, re-written in
helpers/reference_dpe.py) in prefill and in their decode path; the paper's per-pair reference, cache, padding and
the backends run in test_attention.py with every attention-side row. Here also: the frequency groups of rotate-half,
interleaved and one-tensor rotaries, the suggestion, the detection sweep and bad input."""

from __future__ import annotations

import pytest
import torch
from helpers.models import WINDOW, logits, tiny_model
from helpers.reference_dpe import forward as authors_forward

import rope_patch
from rope_patch.attention.copies import stack_embeddings
from rope_patch.schemes.dimensions import Dpe, frequency_groups
from rope_patch.tuning import detect_group_sizes

# (group sizes, W, length): sizes dividing W, where the code's prefill (W − W/s) and decode (W − ⌊W/s⌋) agree
CASES = [
    ([2, 4, 8, 16, 16, 8, 4, 2], 32, 96),  # one pair per group (head_dim 16), the recommended shape of the sizes
    ([1, 2, 4, 8], 16, 70),  # two pairs per group, a group at its true positions
    ([4, 4, 4, 4], 16, 50),  # every group alike: Self-Extend
    ([2, 8, 2, 4], 64, 40),  # the sequence inside the window: plain RoPE (the code's `max < W` branch)
]
IDS = [f"{'-'.join(map(str, s))}-w{w}-n{n}" for s, w, n in CASES]


def ids_of(n, seed=0):
    return torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("sizes,window,n", CASES, ids=IDS)
def test_prefill_matches_the_authors_code(sizes, window, n, backend):
    ids = ids_of(n)
    want = authors_forward(tiny_model("llama"), ids, sizes, window)
    model = tiny_model("llama", attn_implementation=backend)
    rope_patch.apply(model, "dpe", group_sizes=sizes, window_size=window)
    assert (logits(model, ids) - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("sizes,window,n", CASES, ids=IDS)
def test_cached_decode_step_matches_the_authors_decode_path(sizes, window, n):
    """A prefill of n − 1 tokens into the cache, then the last token alone, against the code's q_len = 1 branch."""
    ids = ids_of(n, seed=1)
    want = authors_forward(tiny_model("llama"), ids, sizes, window, decode=True)
    model = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(model, "dpe", group_sizes=sizes, window_size=window)
    with torch.no_grad():
        past = model(ids[:, :-1], use_cache=True).past_key_values
        got = model(ids[:, -1:], cache=past, use_cache=True).logits
    assert (got - want).abs().max().item() <= 1e-4


def test_where_w_over_s_is_fractional_the_shift_is_the_decode_paths():
    """W = 16, s = 3: the code's prefill shifts grouped queries by W − W/3 = 10.67, its decode by W − ⌊W/3⌋ = 11.
    rope_patch takes the integer shift in both (so cached decoding equals recomputation): its prefill equals the
    code's prefill with the decode path's shift, and differs from the code's own."""
    ids = ids_of(60)
    model = tiny_model("llama")
    rope_patch.apply(model, "dpe", group_sizes=[3, 3, 3, 3], window_size=16)
    got = logits(model, ids)
    assert (got - authors_forward(tiny_model("llama"), ids, [3] * 4, 16, floor_shift=True)).abs().max().item() <= 1e-4
    assert (got - authors_forward(tiny_model("llama"), ids, [3] * 4, 16)).abs().max().item() > 1e-4


@pytest.mark.parametrize("arch", ["llama", "cohere", "glm"])
def test_equal_group_sizes_are_self_extend(arch):
    """Whatever the rotary layout (cohere and glm rotate interleaved pairs), one size for every group is Self-Extend."""
    ids = ids_of(80)
    dpe, se = tiny_model(arch), tiny_model(arch)
    rope_patch.apply(dpe, "dpe", group_sizes=[4] * 4, window_size=12)  # glm: partial rotary, 4 pairs
    rope_patch.apply(se, "self_extend", group_size=4, window_size=12)
    assert (logits(dpe, ids) - logits(se, ids)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch,interleaved", [("llama", False), ("cohere", True)])
def test_frequency_groups_follow_the_rotary_layout(arch, interleaved):
    """Element e of a rotate-half (cos, sin) is pair e mod d/2, of an interleaved one pair ⌊e/2⌋; with 4 groups of 8
    pairs (fastest first, as the code's index order), pair k is in group ⌊k/2⌋; and a grouped copy's element e is
    the rotary's at its group's positions."""
    model = tiny_model(arch)
    scheme = Dpe(group_sizes=(2, 3, 4, 8), window_size=16)
    rope_patch.apply(model, scheme)
    rotary = model.model.rotary_emb
    pos = torch.arange(40)[None]
    x = torch.zeros(1, 40, model.config.hidden_size)
    tagged = rotary(x, pos)
    e = torch.arange(16)
    pair = e // 2 if interleaved else e % 8
    assert torch.equal(frequency_groups(tagged, 4), pair // 2)
    q_map, _ = scheme.far_positions()
    cos, sin = q_map.embed(tagged, pos)
    for g, s in enumerate((2, 3, 4, 8)):
        c, sn = type(rotary).forward(rotary, x, torch.div(pos, s, rounding_mode="floor") + 16 - 16 // s)
        cols = pair // 2 == g
        assert torch.equal(cos[..., cols], c[..., cols]) and torch.equal(sin[..., cols], sn[..., cols])
    assert stack_embeddings(tagged, (q_map,), 1, "k")[0].shape == cos.shape


def test_suggestion_is_the_detection_baseline():
    """W = min(1024, L/8), every group at 2N/L (run_niah_detect.sh's baseline)."""
    s = Dpe.suggestion(1024, 256)
    assert s.params == {"group_sizes": [8] * 8, "window_size": 32}
    assert s.spec == "dpe:group_sizes=8/8/8/8/8/8/8/8,window_size=32"
    assert rope_patch.as_scheme(s.spec) == Dpe(group_sizes=[8] * 8, window_size=32)
    big = Dpe.suggestion(131072, 8192)
    assert big.params == {"group_sizes": [32] * 8, "window_size": 1024}
    assert Dpe.suggestion(256, 256) is None


def test_detection_runs_the_authors_sweep():
    """Group g at 1, 2, 4, … N/W with the others at 2N/L; the best score (ties: the smaller size) is kept; the model
    is left as it was."""
    model = tiny_model("llama")
    ids = ids_of(40)
    before = logits(model, ids)
    seen = []

    def score(m):
        scheme = rope_patch.current(m)
        seen.append(scheme.group_sizes)
        return -sum(abs(s - 4) for s in scheme.group_sizes)  # best at 4 in every group

    sizes = detect_group_sizes(model, score, target=4 * WINDOW, window_size=16, groups=4)
    assert sizes == [4, 4, 4, 4]
    assert seen[:4] == [(1, 8, 8, 8), (2, 8, 8, 8), (4, 8, 8, 8), (8, 8, 8, 8)]  # baseline 2N/L = 8, N/W = 8
    assert len(seen) == 4 * 4 and rope_patch.current(model) is None
    assert torch.equal(logits(model, ids), before)


@pytest.mark.parametrize("params,error,words", [
    ({"window_size": 16}, TypeError, "group_sizes"),
    ({"group_sizes": [2, 2.5], "window_size": 16}, TypeError, "must be an integer"),
    ({"group_sizes": [2, 0], "window_size": 16}, ValueError, "group_sizes[1]"),
    ({"group_sizes": [2, 16], "window_size": 16}, ValueError, "larger than every group size"),
    ({"group_sizes": [2] * 9, "window_size": 16}, ValueError, "at most 8 group sizes"),
])
def test_bad_input_fails_at_apply_and_leaves_the_model_unchanged(params, error, words):
    model = tiny_model("llama")
    ids = ids_of(40)
    before = logits(model, ids)
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        rope_patch.apply(model, "dpe", **params)
    assert rope_patch.current(model) is None and torch.equal(logits(model, ids), before)
