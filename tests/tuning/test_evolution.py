"""LongRoPE's evolutionary search: the monotonicity constraint λ_i ≤ λ_{i+1} holds for every individual the
operators and the search produce; the initial factors are PI's, NTK's and YaRN's; the search improves on them."""

from __future__ import annotations

import math
import random

import pytest
import torch
from helpers.models import WINDOW, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

import rope_patch
from rope_patch.tuning import (
    EvolutionSettings,
    SearchLog,
    crossover,
    evolve,
    initial_factors,
    longrope_params,
    monotone,
    mutate,
    spec_of,
    to_factors,
    to_genes,
)

TOP = 60


@st.composite
def monotone_genes(draw, n=None):
    n = n or draw(st.integers(2, 12))
    steps = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    out, k = [], 0
    for s in steps:
        k = min(TOP, k + s)
        out.append(k)
    return tuple(out)


@settings(max_examples=200, deadline=None)
@given(genes=monotone_genes(), seed=st.integers(0, 10_000), rate=st.floats(0.05, 1.0))
def test_mutation_keeps_the_constraint_and_the_bounds(genes, seed, rate):
    child = mutate(random.Random(seed), genes, TOP, rate, seen={genes})
    if child is not None:
        assert monotone(child) and 0 <= min(child) and max(child) <= TOP
        assert len(child) == len(genes) and child != genes


@settings(max_examples=200, deadline=None)
@given(data=st.data(), seed=st.integers(0, 10_000))
def test_crossover_keeps_the_constraint_and_mixes_the_parents(data, seed):
    n = data.draw(st.integers(2, 12))
    a, b = data.draw(monotone_genes(n)), data.draw(monotone_genes(n))
    child = crossover(random.Random(seed), a, b)
    if child is not None:
        assert monotone(child) and child not in (a, b)
        assert all(c in (x, y) for c, x, y in zip(child, a, b, strict=True))  # every gene from one parent


def test_a_crossover_that_breaks_the_constraint_is_refused():
    a, b = (0, 0, 0, 10), (5, 5, 5, 5)  # any span of b inside a makes a step down at its end or start
    rng = random.Random(0)
    for _ in range(50):
        child = crossover(rng, a, b)
        assert child is None or monotone(child)
    assert crossover(rng, a, a) is None


@settings(max_examples=100, deadline=None)
@given(factors=st.lists(st.floats(-3, 20, allow_nan=False), min_size=2, max_size=16))
def test_factors_on_the_grid_satisfy_the_constraint(factors):
    genes = to_genes(factors, 0.01, TOP)
    assert monotone(genes) and 0 <= min(genes) and max(genes) <= TOP
    assert all(1.0 <= f <= 1.0 + TOP * 0.01 + 1e-9 for f in to_factors(genes, 0.01))


def synthetic(optimum):
    """A smooth objective with a known monotone optimum: mean squared distance to it."""
    return lambda f: {"objective": sum((x - y) ** 2 for x, y in zip(f, optimum, strict=True)) / len(f)}


OPTIMUM = [1.0, 1.0, 1.2, 1.6, 2.2, 3.0, 3.9, 4.6]
INITIAL = {"linear": [4.0] * 8, "ntk": [4 ** (2 * i / 14) for i in range(8)], "yarn": [1, 1, 1.3, 2, 3, 4, 4, 4]}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_individual_of_a_search_satisfies_the_constraint(seed):
    log = SearchLog({"settings": {}})
    s = EvolutionSettings(population=8, generations=6)
    assert evolve(log, synthetic(OPTIMUM), INITIAL, s, 4.0, seed=seed) is None
    records = log.evaluations
    assert len(records) == s.resolved(4.0).planned_evaluations() == 8 + 6 * 4
    factors = [r["params"]["long_factor"] for r in records]
    assert all(all(a <= b for a, b in zip(f, f[1:], strict=False)) for f in factors)
    assert all(1.0 <= x <= 5.0 for f in factors for x in f)  # 1.25 × s
    assert len({tuple(f) for f in factors}) == len(factors)  # nothing evaluated twice
    assert [r["origin"] for r in records[:3]] == ["init:linear", "init:ntk", "init:yarn"]
    assert {r["generation"] for r in records} == set(range(7))
    best_init = min(r["objective"] for r in records[:3])
    assert log.data["best"]["objective"] < 0.5 * best_init  # the search improves on PI / NTK / YaRN


def test_initial_factors_are_pi_ntk_and_yarn():
    model = tiny_model("llama", head_dim=16)
    f = initial_factors(model, 4.0)
    d = 16
    assert f["linear"] == pytest.approx([4.0] * 8)
    assert f["ntk"] == pytest.approx([4 ** (2 * i / (d - 2)) for i in range(8)], rel=1e-5)
    yarn = f["yarn"]
    assert all(a <= b + 1e-9 for a, b in zip(yarn, yarn[1:], strict=False))
    assert yarn[-1] == pytest.approx(4.0) and yarn[0] < 4.0
    with rope_patch.patched(model, "yarn:4"):
        θ = rope_patch.discovery.find_target(model).rotary.inv_freq.double()
    base = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    assert (base / θ).tolist() == pytest.approx(yarn, rel=1e-5)
    assert rope_patch.current(model) is None  # read under patched(): the model is back as it was


def test_initial_factors_of_given_specs():
    model = tiny_model("llama", head_dim=16)
    f = initial_factors(model, 4.0, ["linear:2", "yarn:factor=4,beta_fast=4,beta_slow=0.25"])
    assert list(f) == ["linear:2", "yarn:factor=4,beta_fast=4,beta_slow=0.25"]
    assert f["linear:2"] == pytest.approx([2.0] * 8)
    assert f["yarn:factor=4,beta_fast=4,beta_slow=0.25"] != pytest.approx(initial_factors(model, 4.0)["yarn"])


def test_the_searched_spec_is_a_longrope_scheme_apply_accepts():
    model = tiny_model("llama", head_dim=16)
    factors = to_factors(to_genes([1, 1.1, 1.5, 2, 2.5, 3, 4, 4.5], 0.01, 400), 0.01)
    params = longrope_params(factors, 4.0, WINDOW)
    rope_patch.apply(model, spec_of("longrope", params))
    scheme = rope_patch.current(model)
    assert scheme.name == "longrope" and list(scheme.long_factor) == factors and list(scheme.short_factor) == [1.0] * 8
    assert scheme.factor == 4.0 and scheme.original_max_position_embeddings == WINDOW
    scale = rope_patch.discovery.find_target(model).rotary.attention_scaling
    assert scale == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(WINDOW)))  # LongRoPE's attention factor kept


def _patched_ratio(model, spec: str, layer_type: str | None) -> list[float]:
    """θ_i / θ′_i as the model's rotary holds them under `spec` (its `inv_freq` or `<layer type>_inv_freq` buffer)."""
    name = f"{layer_type}_inv_freq" if layer_type else "inv_freq"
    rotary = rope_patch.discovery.find_target(model).rotary
    base = getattr(rotary, name).double().clone()
    with rope_patch.patched(model, spec):
        return (base / getattr(rotary, name).double()).tolist()


# (arch, {seed key: (spec, layer type)}): a rotary per layer type (Gemma 3: bases 1e6 / 1e4) gets YaRN's seed of
# each layer type, its ramp depending on the base; PI's and NTK's do not depend on it and stay one seed each
SEEDS = [("gemma3", {"linear": ("linear:4", "full_attention"), "ntk": ("ntk:4", "full_attention"),
                     "yarn (full_attention layers)": ("yarn:4", "full_attention"),
                     "yarn (sliding_attention layers)": ("yarn:4", "sliding_attention")}),
         ("llama", {"linear": ("linear:4", None), "ntk": ("ntk:4", None), "yarn": ("yarn:4", None)})]


@pytest.mark.parametrize(("arch", "seeds"), SEEDS, ids=[a for a, _ in SEEDS])
def test_initial_factors_per_layer_type(arch, seeds):
    """Before: initial_factors read `rotary.inv_freq`, which a per-layer-type rotary (Gemma 3) does not have, so
    `rope-patch tune --scheme longrope` on Gemma 3 failed with an AttributeError before its first evaluation."""
    model = tiny_model(arch)
    got = initial_factors(model, 4.0)
    assert list(got) == list(seeds)
    for key, (spec, layer_type) in seeds.items():
        assert got[key] == pytest.approx(_patched_ratio(model, spec, layer_type), rel=1e-6), key
    assert rope_patch.current(model) is None


def test_initial_factors_of_a_sin_cos_table_rotary():
    """GPT-J's rotary is a sin/cos table (no inv_freq buffer): PI's factors are s, NTK-aware's s^(2i/(d−2)) over the
    rotary dimensions d, YaRN's between 1 and s (before: AttributeError)."""
    model = tiny_model("gptj")
    d = model.config.rotary_dim
    got = initial_factors(model, 4.0)
    assert got["linear"] == pytest.approx([4.0] * (d // 2))
    assert got["ntk"] == pytest.approx([4 ** (2 * i / (d - 2)) for i in range(d // 2)], rel=1e-5)
    assert got["yarn"][0] == pytest.approx(1.0) and got["yarn"][-1] == pytest.approx(4.0)


def test_a_length_dependent_seed_is_read_at_the_target():
    """dynamic NTK is vanilla up to the window and rescales past it: seeding long factors (which serve the target)
    with it reads its frequencies at the target (before: at load time, all factors 1, PI-free vanilla RoPE)."""
    model = tiny_model("llama", head_dim=16)
    got = initial_factors(model, 4.0, ["dynamic:4"], seq_len=4 * WINDOW)["dynamic:4"]
    with rope_patch.patched(model, "dynamic:4"):
        rotary = rope_patch.discovery.find_target(model).rotary
        base = rotary.original_inv_freq.double()
        model(torch.zeros(1, 4 * WINDOW, dtype=torch.long))  # transformers rescales for this length
        want = (base / rotary.inv_freq.double()).tolist()
    assert got == pytest.approx(want, rel=1e-6) and got[-1] > 1.5


def test_a_seed_that_stops_pairs_rotating_is_refused():
    """p_rope zeroes θ′ of the low-frequency pairs: θ/θ′ is infinite and no rescale factor expresses it (before:
    OverflowError from to_genes, reported as an unexpected error)."""
    with pytest.raises(ValueError, match=r"--init 'p_rope:0.5' stops 4 of 8 pairs rotating .*Seed with schemes"):
        initial_factors(tiny_model("llama", head_dim=16), 4.0, ["p_rope:0.5"])
