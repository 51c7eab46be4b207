"""rope_patch.fix_length: a length-dependent RoPE frozen at the frequencies of a known final length N."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import VOCAB, WINDOW, logits, tiny_model

import rope_patch

L = WINDOW
N = 3 * L
PAIRS = 8  # tiny llama: head_dim 16
LONGROPE = dict(short_factor=[1.0 + i / 8 for i in range(PAIRS)], long_factor=[1.0 + i for i in range(PAIRS)],
                factor=4.0)
LENGTH_DEPENDENT = [
    ("dynamic", dict(factor=4.0)),
    ("dynamic_yarn", dict(factor=4.0)),
    ("longrope", LONGROPE),
    ("dynamic", dict(factor=4.0, cache_rotation="consistent")),
    ("dynamic_yarn", dict(factor=4.0, cache_rotation="consistent")),
]


def _ids(n, seed=5):
    torch.manual_seed(seed)
    return torch.randint(3, VOCAB, (2, n))


@pytest.mark.parametrize("scheme,params", LENGTH_DEPENDENT)
@pytest.mark.parametrize("n", [L // 2, L, L + 7, N - 1])
def test_prefill_of_n_tokens_is_the_first_n_positions_of_a_length_n_forward(scheme, params, n):
    model = tiny_model()
    rope_patch.apply(model, scheme, **params)
    ids = _ids(N)
    full = logits(model, ids)  # unfixed: the frequencies of an N-token forward
    model(_ids(N + 40))  # history: a longer input first (dynamic NTK keeps its grown base)
    fix = rope_patch.fix_length(model, N)
    assert fix and fix.length == N and rope_patch.fixed_length(model) == N
    assert torch.equal(logits(model, ids[:, :n]), full[:, :n])
    assert torch.equal(logits(model, ids), full)


@pytest.mark.parametrize("scheme,params", LENGTH_DEPENDENT)
def test_cached_decoding_to_n_equals_recomputation_at_n(scheme, params):
    model = tiny_model()
    rope_patch.apply(model, scheme, **params)
    ids = _ids(N)
    full = logits(model, ids)
    rope_patch.fix_length(model, N)
    prompt = L - 4  # the prompt fits the window, the decoding crosses it
    with torch.no_grad():
        out = model(ids[:, :prompt], use_cache=True)
        cache, steps = out.cache, [out.logits[:, -1]]
        for t in range(prompt, N):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits[:, -1])
    got = torch.stack(steps[:-1], dim=1)
    assert (got - full[:, prompt - 1 : N - 1]).abs().max() <= 1e-5


@pytest.mark.parametrize("scheme,params", LENGTH_DEPENDENT)
def test_release_and_remove_are_bit_exact(scheme, params):
    model = tiny_model()
    ids = _ids(N)
    vanilla = logits(model, ids)
    rope_patch.apply(model, scheme, **params)
    before = logits(model, ids)
    short_before = logits(model, ids[:, : L - 3])
    rope_patch.fix_length(model, 2 * N)
    assert not torch.equal(logits(model, ids[:, : L - 3]), short_before)  # frozen at 2N, not at L − 3
    released = rope_patch.fix_length(model, None)
    assert not released and released.previous == 2 * N and rope_patch.fixed_length(model) is None
    assert torch.equal(logits(model, ids[:, : L - 3]), short_before)
    assert torch.equal(logits(model, ids), before)
    rope_patch.fix_length(model, N)
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), vanilla)
    assert "rope_patch" not in model.model.rotary_emb._modules


def test_a_second_fix_replaces_the_first_and_a_new_scheme_drops_it():
    model = tiny_model()
    rope_patch.apply(model, "dynamic", factor=4.0)
    ids = _ids(N)
    at_n = logits(model, ids)
    rope_patch.fix_length(model, 2 * N)
    second = rope_patch.fix_length(model, N)
    assert second.previous == 2 * N and torch.equal(logits(model, ids), at_n)
    rope_patch.apply(model, "yarn", factor=4.0)
    assert rope_patch.fixed_length(model) is None


def test_frozen_frequencies_stay_fp32_across_a_cast_and_copy_independently():
    model = tiny_model()
    rope_patch.apply(model, "dynamic", factor=4.0)
    rope_patch.fix_length(model, N)
    frozen = model.model.rotary_emb.inv_freq.clone()
    twin = copy.deepcopy(model)
    model.to(torch.bfloat16)
    logits(model, _ids(L // 2))
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, frozen)
    assert rope_patch.fixed_length(twin) == N
    rope_patch.fix_length(twin, None)
    assert rope_patch.fixed_length(twin) is None and rope_patch.fixed_length(model) == N


def test_per_layer_type_rope_is_frozen_per_layer_type():
    model = tiny_model("gemma3_text")
    rope_patch.apply(model, "dynamic", factor=4.0)
    ids = _ids(N)
    full = logits(model, ids)
    fix = rope_patch.fix_length(model, N)
    assert "layer types" in fix.reason
    assert torch.equal(logits(model, ids[:, : L - 5]), full[:, : L - 5])


@pytest.mark.parametrize("scheme,params", [("yarn", dict(factor=4.0)), ("linear", dict(factor=2.0)),
                                           ("self_extend", dict(group_size=2, window_size=8))])
def test_schemes_that_do_not_depend_on_the_length_are_left_alone(scheme, params):
    model = tiny_model()
    rope_patch.apply(model, scheme, **params)
    ids = _ids(N)
    before = logits(model, ids)
    fix = rope_patch.fix_length(model, N)
    assert not fix and fix.length is None
    assert f"{rope_patch.current(model).name}'s frequencies do not depend on the sequence length" in fix.reason
    assert rope_patch.fixed_length(model) is None and torch.equal(logits(model, ids), before)


def test_unpatched_models():
    model = tiny_model()
    fix = rope_patch.fix_length(model, N)
    assert not fix and "not patched" in fix.reason
    native = tiny_model(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    ids = _ids(N)
    before = logits(native, ids)
    with pytest.raises(ValueError, match=r"rope_type 'dynamic'.*rope_patch.apply\(model, 'dynamic'"):
        rope_patch.fix_length(native, N)
    assert torch.equal(logits(native, ids), before) and rope_patch.current(native) is None


@pytest.mark.parametrize("bad,error", [(0, ValueError), (-3, ValueError), (True, TypeError), ("64", TypeError),
                                       (2.5, TypeError)])
def test_bad_lengths_are_refused_and_the_model_is_untouched(bad, error):
    model = tiny_model()
    rope_patch.apply(model, "dynamic", factor=4.0)
    rope_patch.fix_length(model, N)
    ids = _ids(L)
    before = logits(model, ids)
    with pytest.raises(error, match="fix_length: parameter `length`"):
        rope_patch.fix_length(model, bad)
    assert rope_patch.fixed_length(model) == N and torch.equal(logits(model, ids), before)


@pytest.mark.parametrize("scheme", ["dynamic", "dynamic_yarn"])
def test_passkey_generation_freezes_at_the_final_length_and_lets_go_afterwards(scheme):
    """The evaluation's greedy decoding (rope_patch.evaluation.retrieval) goes through fix_length: a prompt shorter
    than the window whose generation crosses it decodes as a full recompute at the final length would."""
    from rope_patch.evaluation.retrieval import greedy_generate

    model = tiny_model()
    rope_patch.apply(model, scheme, factor=4.0)
    prompt, new = _ids(L - 3), 6
    got = greedy_generate(model, prompt, new)
    assert rope_patch.fixed_length(model) is None
    rope_patch.fix_length(model, L - 3 + new)
    seq = prompt
    for _ in range(new):
        seq = torch.cat([seq, logits(model, seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, seq[:, L - 3 :])


def test_a_stack_with_a_length_dependent_frequency_scheme_is_frozen_too():
    """dynamic_yarn under Self-Extend: the attention-side scheme rotates with the rotary's frequencies, which the fix
    freezes like those of a plain frequency scheme."""
    model = tiny_model()
    rope_patch.apply(model, ["dynamic_yarn:4", "self_extend:group_size=2,window_size=8"])
    ids = _ids(N)
    full = logits(model, ids)
    fix = rope_patch.fix_length(model, N)
    assert fix and fix.reason.startswith("dynamic_yarn(factor=4.0")
    assert torch.equal(logits(model, ids[:, : L - 5]), full[:, : L - 5])
    rope_patch.fix_length(model, None)
    assert not torch.equal(logits(model, ids[:, : L - 5]), full[:, : L - 5])


# A table rotary (GPT-J, CodeGen: sin/cos rows at integer positions) holds one fixed set of frequencies: the
# length-dependent schemes are refused on it, and the `update` its patched forward carries (rotary.TableGrowth) only
# appends rows of those frequencies. fix_length has nothing to freeze there and must say so: the evaluations call it
# (evaluation.common.at_length) before every perplexity window and passkey prompt of a patched model.
TABLE_PATCHES = [None, "yarn:2", "linear:2", "self_extend:group_size=2,window_size=8", "rerope:window_size=8", "alibi"]


@pytest.mark.parametrize("folder", ["gptj", "codegen"])
@pytest.mark.parametrize("spec", TABLE_PATCHES, ids=[s or "unpatched" for s in TABLE_PATCHES])
def test_a_table_rotary_has_nothing_to_fix(folder, spec):
    from rope_patch.evaluation.common import at_length
    from rope_patch.lengths import length_dependent

    model = tiny_model(folder)
    if spec is not None:
        rope_patch.apply(model, spec)
    ids = _ids(N)
    before = logits(model, ids)
    assert length_dependent(model) == []
    fix = rope_patch.fix_length(model, N)
    assert not fix and fix.length is None and rope_patch.fixed_length(model) is None
    assert "nothing to fix" in fix.reason
    if spec is not None:  # a patched model's evaluation (an unpatched one goes through prepare_rotary instead)
        with at_length(model, N):
            assert torch.equal(logits(model, ids), before)
    assert torch.equal(logits(model, ids), before)


# Granite-SWA rotates with one rotary module per base (`rotary_embs`); the one built from the model's config
# (`rotary_emb`, where a patch keeps its state) is left unused by the model's code. A length-dependent scheme follows ℓ
# on every rotary module the model has, so every one of them must be frozen.
SEVERAL_ROTARIES = [("dynamic", dict(factor=4.0)), ("dynamic_yarn", dict(factor=4.0)),
                    ("dynamic_yarn:4+self_extend:group_size=2,window_size=8", {})]


@pytest.mark.parametrize("folder", ["granite_swa", "granitemoe_swa"])
@pytest.mark.parametrize("scheme,params", SEVERAL_ROTARIES, ids=[s for s, _ in SEVERAL_ROTARIES])
def test_every_rotary_module_is_frozen(folder, scheme, params):
    from rope_patch.discovery import find_target
    from rope_patch.lengths import length_dependent

    model = tiny_model(folder)
    assert len(find_target(model).rotaries) > 1
    vanilla = logits(model, _ids(N))
    rope_patch.apply(model, scheme, **params)
    ids = _ids(N)
    full = logits(model, ids)  # unfixed: the frequencies of an N-token forward
    short = logits(model, ids[:, : L - 5])
    assert (short - full[:, : L - 5]).abs().max() > 1e-2  # the scheme follows the length on this model
    assert length_dependent(model) == [""]
    fix = rope_patch.fix_length(model, N)
    assert fix and rope_patch.fixed_length(model) == N
    assert length_dependent(model) == []
    # bit-identical for the frequency schemes; Self-Extend's attention on Granite-SWA differs by ~2e-6 between a prefix
    # and the whole input already without a length-dependent scheme under it
    assert (logits(model, ids[:, : L - 5]) - full[:, : L - 5]).abs().max() <= (1e-5 if "+" in scheme else 0)
    assert torch.equal(logits(model, ids), full)
    rope_patch.fix_length(model, None)
    assert torch.equal(logits(model, ids[:, : L - 5]), short)
    rope_patch.fix_length(model, N)
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), vanilla)
