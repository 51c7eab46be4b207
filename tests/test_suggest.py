"""rope_patch.suggest: the papers' parameter rules for a target length, table-driven over several L and N."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from helpers.models import VOCAB, logits, tiny_model
from helpers.reference import logistic_groups
from helpers.schemes import SCHEMES

import rope_patch
from rope_patch.api import refusal
from rope_patch.registry import get_scheme_class
from rope_patch.suggest import Suggestion, pretraining_window, specs_for_target, suggest

FACTOR = [r.name for r in SCHEMES if r.suggest == "factor"]  # factor s = N/L
SUGGESTED = {r.name for r in SCHEMES if r.suggest}  # every scheme with a rule (for N > L)

CASES = [(32, 16), (32, 32), (32, 33), (32, 96), (32, 256), (256, 200), (256, 1024), (256, 2048), (4096, 2048),
         (4096, 12288), (4096, 32768), (8192, 131072)]


def logistic_reach_over_budget(window, n):
    """No capacity below W = L/8 keeps SELF's largest position within ⅔·L (why no self_extend_logistic is suggested)."""
    w, r = window // 8, 0.02 * 4096 / window
    return all(w + logistic_groups(n - w, c, r)[n - 1 - w] > 2 * window / 3 for c in range(3, w))


def _by_name(suggestions):
    return {s.scheme: s for s in suggestions}


@pytest.fixture(scope="module")
def models():
    return {window: tiny_model(max_position_embeddings=window) for window in sorted({w for w, _ in CASES})}


@pytest.mark.parametrize("window,n", CASES)
def test_rules_hold(models, window, n):
    found = suggest(models[window], n)
    assert all(isinstance(s, Suggestion) for s in found)
    got = _by_name(found)
    assert len(got) == len(found)  # one suggestion per scheme
    if n <= window:
        assert set(got) <= {"string", "ms_poe"}  # the schemes that help use a window the context fits in
    else:
        # self_extend, self_extend_logistic, dpe: where a group size below W meets the budget (below)
        assert SUGGESTED - {"self_extend", "self_extend_logistic", "dpe"} <= set(got) <= SUGGESTED
        assert [s.scheme for s in found][:len(FACTOR)] == FACTOR  # the frequency schemes first
        fast = min(32, max(2, window / 128))
        for name in FACTOR:
            beta = {"beta_fast": fast} if name in ("yarn", "dynamic_yarn") and fast != 32 else {}
            assert got[name].params == {"factor": pytest.approx(n / window), **beta}
            assert f"{n}/{window}" in got[name].reason
            if beta:
                assert f"= {fast:g}" in got[name].reason
        assert got["dca"].params == {"chunk_size": window * 3 // 4, "local_size": window // 8}
        assert got["rerope"].params == {"window_size": window // 2}
        # Han et al. 2024: the local branch is the window, 10 global tokens, every distance one the model was trained on
        assert got["lm_infinite"].params == {"local_size": window, "global_size": 10, "max_distance": window - 1}
        leaky = got["leaky_rerope"].params
        w, k = leaky["window_size"], leaky["factor"]
        assert w == window // 4 and w + (n - 1 - w) / k <= window - 1 < w + (n - 1 - w) / max(1.0, k - 0.01) + 1e-9
        assert not got["string"].alone and "compose it with a frequency scheme" in got["string"].reason
        stack = got["string"].reason.split("rope_patch.apply(model, ")[1].rstrip(")")
        if window <= 256:  # the stack the reason shows applies as written
            with rope_patch.patched(models[window], eval(stack)):
                pass
        assert str(n - 1 - got["string"].params["shift_size"]
                   + got["string"].params["window_size"]) in got["string"].reason
    if "self_extend" in got:
        g, w = got["self_extend"].params["group_size"], got["self_extend"].params["window_size"]
        budget = Fraction(2 * window, 3)
        assert w == window // 4 and g < w
        assert w + Fraction(n - w, g) <= budget  # the paper's rule holds ...
        assert g == 1 or w + Fraction(n - w, g - 1) > budget  # ... for the smallest G
        assert f"{w} + {n - w}/{g}" in got["self_extend"].reason
    elif n > window:
        assert 2.4 * n / window > window // 4 - 1  # skipped only where G would reach W
    if "self_extend_logistic" in got:  # Dang et al. 2025: W = L/8, r = 0.02·4096/L, the smallest C within ⅔·L
        p = got["self_extend_logistic"].params
        c, w, r = p["group_size"], p["window_size"], p["growth_rate"]
        assert w == window // 8 and c < w and r == pytest.approx(0.02 * 4096 / window, rel=1e-3)

        def reach(capacity):  # the last query's far position minus the first key's: W + f(N − 1 − W) − f(0)
            return w + logistic_groups(n - w, capacity, r)[n - 1 - w]

        assert reach(c) <= 2 * window / 3 and (c == 3 or reach(c - 1) > 2 * window / 3)
        assert f"largest position {reach(c)}" in got["self_extend_logistic"].reason
    elif n > window:
        assert window // 8 <= 3 or logistic_reach_over_budget(window, n)
    if "dpe" in got:  # the authors' W = 1024 (at most L/8), every group at the detection baseline 2N/L
        params = got["dpe"].params
        assert params == {"group_sizes": [round(2 * n / window)] * 8, "window_size": min(1024, window // 8)}
        assert params["group_sizes"][0] < params["window_size"]
    elif n > window:
        assert round(2 * n / window) >= min(1024, max(2, window // 8))  # skipped only where s would reach W
    if "string" in got:
        s, w = got["string"].params["shift_size"], got["string"].params["window_size"]
        assert s > w and w == max(1, min(128, window // 32)) and s == max(w + 1, round(n / 3))
        assert f"S = N/3 = {s}" in got["string"].reason and got["string"].alone == (n <= window)


@pytest.mark.parametrize("window,n", [c for c in CASES if c[0] <= 256])
def test_every_suggestion_applies_cleanly_and_remove_is_exact(models, window, n):
    model = models[window]
    ids = torch.randint(3, VOCAB, (1, 40))
    before = logits(model, ids)
    for s in suggest(model, n):
        rope_patch.apply(model, s.spec)
        applied = rope_patch.current(model)
        assert applied.name == s.scheme
        assert all(getattr(applied, k) == pytest.approx(v) for k, v in s.params.items())
        assert torch.isfinite(logits(model, ids)).all()
        rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


HYBRID = {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
          "max_position_embeddings": 32}


@pytest.mark.parametrize("arch,sliding,local", [
    ("gemma3_text", 8, True),  # per-layer-type RoPE, sliding layers inside L: frequency schemes on full_attention only
    ("gemma3_text", 32, True),  # a window of exactly L still never meets a distance past L
    ("gemma3_text", 33, False),  # a window past L meets distances past L: every layer
    ("gemma2", 8, False),  # one RoPE for every layer: layer_types cannot pick, the suggestions stay as they were
])
def test_a_hybrid_models_frequency_schemes_are_suggested_on_the_layers_that_see_past_the_window(arch, sliding, local):
    model = tiny_model(arch, sliding_window=sliding, **HYBRID)
    ids = torch.randint(3, VOCAB, (1, 40))
    before = logits(model, ids)
    found = suggest(model, 128)
    plain = _by_name(suggest(tiny_model(max_position_embeddings=32), 128))
    for s in found:
        picked = s.params.pop("layer_types", None)
        # dynamic_yarn's own per-forward update takes no layer_types: it stays on every layer
        want = "full_attention" if local and s.scheme in FACTOR and s.scheme != "dynamic_yarn" else None
        assert picked == want, s.spec
        assert (s.spec.endswith(",layer_types=full_attention") and "on full_attention only" in s.reason) == bool(want)
        if s.scheme in plain:
            assert s.params == plain[s.scheme].params  # the rule's numbers are the same
        rope_patch.apply(model, s.spec)
        assert tuple(getattr(rope_patch.current(model), "layer_types", None) or ()) == ((want,) if want else ())
        assert torch.isfinite(logits(model, ids)).all()
        rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


def test_the_window_is_the_model_as_loaded_also_under_a_patch_and_with_shipped_scaling():
    model = tiny_model(max_position_embeddings=256)
    rope_patch.apply(model, "yarn", factor=4.0)
    assert rope_patch.context_window(model) == 1024 and pretraining_window(model) == 256
    assert _by_name(suggest(model, 1024))["linear"].params == {"factor": 4}
    shipped = tiny_model(max_position_embeddings=1024, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256})
    assert pretraining_window(shipped) == 256
    assert _by_name(suggest(shipped, 2048))["yarn"].spec == "yarn:factor=8,beta_fast=2"
    assert _by_name(suggest(tiny_model(max_position_embeddings=4096), 8192))["yarn"].spec == "yarn:factor=2"


# L is the model as loaded, also under a patch: read from the patch's record of the unpatched config, which holds no
# rope_parameters for a table rotary (GPT-J, CodeGen: its RoPE is the sin/cos table the model builds) and no
# max_position_embeddings for RecurrentGemma (then the same refusal as on the unpatched model).
PATCHED_AS_LOADED = [("gptj", "yarn:2"), ("gptj", "self_extend:group_size=2,window_size=8"), ("gptj", "yarn:2+logn"),
                     ("codegen", "rerope:window_size=8"), ("recurrent_gemma", "rerope:window_size=8")]


@pytest.mark.parametrize("folder,spec", PATCHED_AS_LOADED)
def test_a_patched_model_is_suggested_for_as_loaded_whatever_its_config_records(folder, spec):
    model = tiny_model(folder)
    error = SUGGEST_REFUSES.get(folder)
    if error is None:
        window = pretraining_window(model)
        plain = [s.spec for s in suggest(model, 4 * window, check=False)]
    rope_patch.apply(model, spec, check=False)
    applied, ids = rope_patch.current(model), torch.randint(3, VOCAB, (1, 12))
    patched = logits(model, ids)
    if error is not None:
        with pytest.raises(error[0], match=error[1]):
            suggest(model, 128, check=False)
    else:
        assert pretraining_window(model) == window
        assert [s.spec for s in suggest(model, 4 * window, check=False)] == plain
    assert rope_patch.current(model) == applied and torch.equal(logits(model, ids), patched)  # the trials left it


def test_compare_scheme_lists():
    model = tiny_model(max_position_embeddings=256)
    listed = specs_for_target(model, 1024)
    assert listed[0] == "default" and "yarn:factor=4,beta_fast=2" in listed
    assert not any(s.startswith("string") for s in listed)
    filled = specs_for_target(model, 1024, ["default", "yarn", "yarn:8", "self_extend", "alibi", "loaded"])
    assert filled == ["default", "yarn:factor=4,beta_fast=2", "yarn:8", "self_extend:group_size=9,window_size=64",
                      "alibi", "loaded"]
    # the bare parts of a stack too, the parts with parameters as given
    stacked = specs_for_target(model, 1024, ["yarn+logn", "ntk:2+self_extend", "yarn:2+logn"])
    assert stacked == ["yarn:factor=4,beta_fast=2+logn", "ntk:2+self_extend:group_size=9,window_size=64", "yarn:2+logn"]


@pytest.mark.parametrize("n,error,match", [(1, ValueError, "target_length"), (True, TypeError, "target_length"),
                                           (256 * 1025, ValueError, "factors up to 1024")])
def test_bad_targets(n, error, match):
    with pytest.raises(error, match=match):
        suggest(tiny_model(max_position_embeddings=256), n)


def test_compare_parser_takes_a_target():
    from rope_patch.cli.main import build_parser

    args = build_parser().parse_args(["compare", "--target", "1024"])
    assert args.target == 1024 and args.schemes is None and args.lengths is None
    args = build_parser().parse_args(["compare", "--target", "1024", "--schemes", "yarn", "alibi"])
    assert args.schemes == ["yarn", "alibi"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compare", "--target", "4"])


# ---- a model whose every RoPE layer is local (sliding RoPE layers, global layers without RoPE) ----------------------
@pytest.mark.parametrize("arch,sliding,local", [
    ("beam", 8, True),  # the RoPE layers slide within L; the full_attention layers have no RoPE
    ("beam", 32, True),  # a window of exactly L still never meets a distance past L
    ("beam", 33, False),  # a window past L: the RoPE layers meet distances past L, every scheme as on any model
    ("cohere_compass", 8, True),
    ("ergo", 8, True),
])
def test_a_model_whose_rope_layers_are_all_local_gets_no_frequency_scheme(arch, sliding, local):
    model = tiny_model(arch, sliding_window=sliding)
    ids = torch.randint(3, VOCAB, (1, 40))
    before = logits(model, ids)
    found = suggest(model, 128, check=False)
    kinds = {s.scheme: get_scheme_class(s.scheme).kind for s in found}
    if local:  # only the schemes that hide keys, the one change that reaches the global layers (no positions there)
        assert set(kinds) == {"sink", "lm_infinite"}, [s.spec for s in found]
        assert all("changes the full_attention layers, which have no RoPE" in s.reason for s in found)
        plain = _by_name(suggest(tiny_model(max_position_embeddings=32), 128, check=False))
        assert all(s.params == plain[s.scheme].params for s in found)  # the rule's numbers are the same
    else:
        assert set(FACTOR) <= set(kinds) and "layer_types" not in str(found)
    assert _by_name(suggest(model, 24, check=False)).keys() <= {"string", "ms_poe"}  # N ≤ L: as on any model
    for s in found:
        rope_patch.apply(model, s.spec, check=False)
        assert torch.isfinite(logits(model, ids)).all()
        rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


# ---- only what apply() accepts -----------------------------------------------------------------------------------
# folder -> the schemes apply() refuses on its tiny model at 4·L, before or at install (so suggest leaves them out)
REFUSED = {
    "phi3": {"linear", "dynamic", "yarn", "dynamic_yarn", "llama3"},  # Phi3Config takes longrope only
    "gemma4": {"linear", "dynamic", "yarn", "dynamic_yarn", "llama3"},  # proportional RoPE: the width differs
    "mistral4": {"ntk", "dynamic_yarn"},  # the rotary gives fewer frequencies than those schemes
    "phimoe": {"linear", "dynamic"},  # the patched rotary fails at its first call (found at install, not prepare)
    "gpt_neox_japanese": {"rerope", "leaky_rerope", "dca", "lm_infinite", "sink", "string"},  # attention of its own
    "gptj": {"dynamic", "dynamic_yarn", "leaky_rerope", "dpe"},  # a sin/cos table of integer positions
}


@pytest.mark.parametrize("folder", sorted(REFUSED))
def test_suggest_leaves_out_what_apply_refuses(folder):
    from helpers.models import INPUTS

    model = tiny_model(folder)
    window = pretraining_window(model)
    ids = torch.randint(3, VOCAB, (1, 12))
    kw = INPUTS.get(folder, {})
    before = logits(model, ids, **kw)
    rules = _by_name(suggest(model, 4 * window, verify=False))  # every rule's suggestion, untried
    refused = {name for name, s in rules.items() if refusal(model, s.spec, check=False) is not None}
    assert refused == REFUSED[folder]
    found = _by_name(suggest(model, 4 * window, check=False))
    assert set(found) == set(rules) - refused - ({"string"} if not any(n in found for n in FACTOR) else set())
    assert torch.equal(logits(model, ids, **kw), before)  # the trials left the model bit for bit as it was
    for s in found.values():
        rope_patch.apply(model, s.spec, check=False)
        rope_patch.remove(model)


def test_suggest_on_a_patched_model_keeps_its_patch():
    model = tiny_model("phi3")
    rope_patch.apply(model, "ntk", factor=2.0)
    ids = torch.randint(3, VOCAB, (1, 40))
    before, applied = logits(model, ids), rope_patch.current(model)
    assert "yarn" not in _by_name(suggest(model, 128, check=False))
    assert rope_patch.current(model) == applied and torch.equal(logits(model, ids), before)
    assert isinstance(refusal(model, "yarn:4"), ValueError) and rope_patch.current(model) == applied
    assert torch.equal(logits(model, ids), before)


def test_a_model_on_the_meta_device_gets_the_rules_untried_or_a_clear_error():
    from helpers.models import tiny_config
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config(max_position_embeddings=256))
    with pytest.raises(ValueError, match=r"meta device.*verify=False"):
        suggest(meta, 1024)
    untried = suggest(meta, 1024, verify=False)
    assert [s.spec for s in untried] == [s.spec for s in suggest(tiny_model(max_position_embeddings=256), 1024)]


# ---- every folder: every suggestion at 4·L applies and runs --------------------------------------------------------
# folder -> (error, phrase): suggest itself refuses the model
SUGGEST_REFUSES = {
    "inkling2": (TypeError, "no rotary position embedding module"),
    "recurrent_gemma": (ValueError, "records no max_position_embeddings"),
}
# folders whose every RoPE layer attends within a window inside L (sliding RoPE layers, global layers without RoPE)
LOCAL_ROPE_ONLY = {"beam", "cohere_compass", "ergo"}
def _rope_folders():
    from helpers.coverage import folders

    return folders()


@pytest.mark.slow
@pytest.mark.parametrize("folder", _rope_folders())
def test_every_suggestion_applies_and_runs_on_every_folder(folder):
    from helpers.models import INPUTS

    model = tiny_model(folder)
    if folder in SUGGEST_REFUSES:
        error, phrase = SUGGEST_REFUSES[folder]
        with pytest.raises(error, match=phrase):
            suggest(model, 4 * pretraining_window(model))
        return
    window = pretraining_window(model)
    ids = torch.randint(3, VOCAB, (1, 12))
    kw = INPUTS.get(folder, {})
    before = logits(model, ids, **kw)
    found = suggest(model, 4 * window)
    assert torch.equal(logits(model, ids, **kw), before)  # the trials left the model as it was
    kinds = {s.scheme: get_scheme_class(s.scheme).kind for s in found}
    if folder in LOCAL_ROPE_ONLY:
        assert set(kinds) == {"sink", "lm_infinite"}
    else:
        assert "frequency" in kinds.values()
    for s in found:
        rope_patch.apply(model, s.spec)
        assert torch.isfinite(logits(model, ids, **kw)).all(), s.spec
        rope_patch.remove(model)
    assert torch.equal(logits(model, ids, **kw), before)
