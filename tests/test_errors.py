"""Bad input raises at apply() with what was expected, what was found and what to do; the model is unchanged."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import WINDOW, logits, tiny_model

import rope_patch
from rope_patch import validation as check

BAD = [
    # scheme, params, exception, message fragment
    ("yarnn", {}, ValueError, "Did you mean 'yarn'"),
    ("rope_scaling_magic", {}, ValueError, "Available: "),
    (3, {}, TypeError, "must be a str"),
    ("yarn", dict(factr=4), TypeError, "Did you mean 'factor'"),
    ("yarn", dict(factor="4"), TypeError, r"must be a number in \[1, 1024\], got str"),
    ("yarn", {}, TypeError, "missing required parameter `factor`"),
    ("linear", dict(factor=0), ValueError, r"in \[1, 1024\]"),
    ("linear", dict(factor=0.5), ValueError, "shrink"),
    ("linear", dict(factor=float("nan")), ValueError, "finite"),
    ("linear", dict(factor=True), TypeError, r"must be a number in \[1, 1024\], got bool"),
    ("default", dict(rope_theta=-1), ValueError, "rope_theta"),
    ("dynamic", dict(factor=2, original_max_position_embeddings=0), ValueError, r"in \[1, 16777216\]"),
    ("dynamic", dict(factor=2, original_max_position_embeddings=12.5), TypeError, "must be an integer"),
    ("yarn", dict(factor=4, beta_fast=1, beta_slow=2), ValueError, "beta_fast` must be > `beta_slow"),
    ("yarn", dict(factor=4, truncate="yes"), TypeError, "True or False"),
    ("llama3", dict(factor=8, low_freq_factor=4, high_freq_factor=1), ValueError, "low_freq_factor` must be <"),
    ("longrope", dict(factor=4, long_factor=[1.0] * 8), TypeError, "missing required parameter `short_factor`"),
    ("longrope", dict(factor=4, short_factor=[1.0] * 3, long_factor=[1.0] * 8), ValueError,
     "must have rotary_dim/2 = 8"),
    ("longrope", dict(factor=4, short_factor="1,2", long_factor=[1.0] * 8), TypeError, "list of numbers"),
    ("longrope", dict(factor=4, short_factor=[1.0] * 8, long_factor=[0.0] * 8), ValueError, "long_factor\\[0\\]"),
    ("p_rope", dict(partial_rotary_factor=1.5), ValueError, r"in \[0, 1\]"),
    ("p_rope", {}, TypeError, "partial_rotary_factor"),
    ("ntk", dict(factor=2, alpha=2), TypeError, "not both"),
]


@pytest.mark.parametrize("scheme,params,exc,match", BAD, ids=[f"{s}-{i}" for i, (s, *_) in enumerate(BAD)])
@pytest.mark.parametrize("patched_first", [False, True], ids=["clean", "patched"])
def test_bad_input_raises_and_leaves_model_unchanged(scheme, params, exc, match, patched_first):
    model = tiny_model()
    if patched_first:
        rope_patch.apply(model, "linear", factor=2)
    ids = torch.randint(3, 97, (1, 2 * WINDOW), generator=torch.Generator().manual_seed(0))
    before, config, current = logits(model, ids), model.config.to_dict(), rope_patch.current(model)
    with pytest.raises(exc, match=match):
        rope_patch.apply(model, scheme, **params)
    assert torch.equal(logits(model, ids), before)
    assert model.config.to_dict() == config and rope_patch.current(model) == current


def test_architecture_whose_config_forbids_the_scheme():
    model = tiny_model("phi3")
    before = model.config.to_dict()
    with pytest.raises(ValueError, match="Phi3Config.*rejects"):
        rope_patch.apply(model, "linear", factor=2)
    assert model.config.to_dict() == before and rope_patch.current(model) is None


@pytest.mark.parametrize("build", ["gpt2", "module", "string"])
def test_model_without_rotary_embedding(build):
    if build == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
        match = "no rotary position embedding.*gpt2"
    elif build == "module":
        model, match = torch.nn.Linear(2, 2), "expects a transformers PreTrainedModel"
    else:
        model, match = "meta-llama/Llama-2-7b", "expects a transformers PreTrainedModel"
    with pytest.raises(TypeError, match=match):
        rope_patch.apply(model, "yarn", factor=2)


def test_install_failure_rolls_back(monkeypatch):
    """Even an error inside the install step (after validation) leaves the model as it was."""
    from rope_patch.schemes import frequency

    model = tiny_model()
    rope_patch.apply(model, "ntk", factor=2)
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    before, config = logits(model, ids), model.config.to_dict()
    real = frequency.UndoLog.set_buffer
    calls = []

    def flaky(self, module, name, tensor):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return real(self, module, name, tensor)

    monkeypatch.setattr(frequency.UndoLog, "set_buffer", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        rope_patch.apply(model, "yarn", factor=4)
    monkeypatch.undo()
    assert torch.equal(logits(model, ids), before) and model.config.to_dict() == config
    assert rope_patch.current(model).name == "ntk"


# ---- bounded numbers: every parameter of every scheme has a finite range, named in the message ------------------
# scheme, other params that make the scheme valid, parameter, range as the message states it, low, high, kind
# kind: "float" (closed [low, high]), "open" ((low, high]), "int" ([low, high] integers), "list" (one entry of a
# per-pair list; the message names `key[3]`).
FREQUENCY = ["default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope", "p_rope", "dynamic_yarn"]
PAIRS = 8  # rotary pairs of the tiny models (head_dim 16)
_NEEDS = {"linear": dict(factor=2), "ntk": dict(factor=2), "dynamic": dict(factor=2), "yarn": dict(factor=2),
          "llama3": dict(factor=2), "longrope": dict(factor=2, short_factor=[1.0] * PAIRS, long_factor=[1.0] * PAIRS),
          "p_rope": dict(partial_rotary_factor=0.5), "dynamic_yarn": dict(factor=2)}
BOUNDS = [
    *[(s, _NEEDS.get(s, {}), "rope_theta", "(1, 1e+12]", 1.0, 1e12, "open") for s in FREQUENCY],
    *[(s, {k: v for k, v in _NEEDS[s].items() if k != "factor"}, "factor", "[1, 1024]", 1.0, 1024.0, "float")
      for s in ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope", "dynamic_yarn")],
    ("ntk", {}, "alpha", "[1, 1024]", 1.0, 1024.0, "float"),
    *[(s, _NEEDS[s], "original_max_position_embeddings", "[1, 16777216]", 1, 1 << 24, "int")
      for s in ("dynamic", "yarn", "llama3", "dynamic_yarn")],
    ("longrope", _NEEDS["longrope"], "original_max_position_embeddings", "[2, 16777216]", 2, 1 << 24, "int"),
    ("yarn", dict(factor=4), "beta_fast", "[0.0001, 10000]", 1e-4, 1e4, "float"),
    ("yarn", dict(factor=4), "beta_slow", "[0.0001, 10000]", 1e-4, 1e4, "float"),
    ("yarn", dict(factor=4), "attention_factor", "[0.1, 10]", 0.1, 10.0, "float"),
    ("yarn", dict(factor=4), "mscale", "(0, 10]", 0.0, 10.0, "open"),
    ("yarn", dict(factor=4), "mscale_all_dim", "(0, 10]", 0.0, 10.0, "open"),
    ("llama3", dict(factor=8), "low_freq_factor", "[0.0001, 10000]", 1e-4, 1e4, "float"),
    ("llama3", dict(factor=8), "high_freq_factor", "[0.0001, 10000]", 1e-4, 1e4, "float"),
    ("longrope", dict(factor=4, long_factor=[1.0] * PAIRS), "short_factor", "[0.0001, 10000]", 1e-4, 1e4, "list"),
    ("longrope", dict(factor=4, short_factor=[1.0] * PAIRS), "long_factor", "[0.0001, 10000]", 1e-4, 1e4, "list"),
    ("longrope", _NEEDS["longrope"], "attention_factor", "[0.1, 10]", 0.1, 10.0, "float"),
    ("p_rope", {}, "partial_rotary_factor", "[0, 1]", 0.0, 1.0, "float"),
    ("alibi", {}, "max_bias", "(0, 64]", 0.0, 64.0, "open"),
    ("relative_bias", dict(max_distance=10_000), "num_buckets", "[2, 1024]", 2, 1024, "int"),
    ("relative_bias", dict(num_buckets=32), "max_distance", "[17, 16777216]", 17, 1 << 24, "int"),
    ("self_extend", dict(window_size=100_000_000), "group_size", "[1, 10000]", 1, 10_000, "int"),
    ("self_extend", dict(group_size=1), "window_size", "[1, 100000000]", 1, 100_000_000, "int"),
    ("rerope", {}, "window_size", "[1, 100000000]", 1, 100_000_000, "int"),
    ("leaky_rerope", dict(factor=16), "window_size", "[1, 100000000]", 1, 100_000_000, "int"),
    ("leaky_rerope", dict(window_size=8), "factor", "[1, 10000]", 1.0, 1e4, "float"),
    ("string", dict(window_size=1), "shift_size", "[1, 100000000]", 1, 100_000_000, "int"),
    ("string", dict(shift_size=100_000_000), "window_size", "[1, 100000000]", 1, 100_000_000, "int"),
    ("sinusoidal", {}, "rope_theta", "(1, 1e+12]", 1.0, 1e12, "open"),
    ("learned_absolute", {}, "max_position_embeddings", "[1, 4194304]", 1, 1 << 22, "int"),
]


def _bad_values(low, high, kind):
    """(label, value, exception) for one parameter: beyond each bound, absurd, NaN/inf, wrong types."""
    wrong_type = [("str", "1", TypeError), ("bool", True, TypeError)]
    if kind == "int":
        return [("too_small", low - 1, ValueError), ("too_large", high + 1, ValueError),
                ("huge", 10**30, ValueError), ("huge_float", 1e30, ValueError), ("fraction", low + 0.5, TypeError),
                ("nan", float("nan"), TypeError), ("inf", float("inf"), TypeError), *wrong_type]
    small = low if kind == "open" else math.nextafter(low, -math.inf)  # an open bound refuses the bound itself
    return [("too_small", small, ValueError), ("too_large", math.nextafter(high, math.inf), ValueError),
            ("huge", 1e308, ValueError), ("huge_int", 10**400, ValueError), ("nan", float("nan"), ValueError),
            ("inf", float("inf"), ValueError), ("-inf", float("-inf"), ValueError), *wrong_type]


OUT_OF_RANGE = [(scheme, base, key, text, label, value, exc)
                for scheme, base, key, text, low, high, kind in BOUNDS
                for label, value, exc in _bad_values(low, high, kind)]
_IDS = [f"{s}-{k}-{label}" for s, _, k, _, label, _, _ in OUT_OF_RANGE]


@pytest.fixture(scope="module")
def pristine():
    """One tiny model and its logits; every test patches a deep copy (bit-identical weights)."""
    model = tiny_model()
    ids = torch.randint(3, 97, (1, WINDOW + 8), generator=torch.Generator().manual_seed(0))
    return model, ids, logits(model, ids)


def _fresh(pristine):
    import copy

    model, ids, before = pristine
    return copy.deepcopy(model), ids, before


def _assert_unchanged(model, ids, before, config):
    assert torch.equal(logits(model, ids), before)
    assert model.config.to_dict() == config and rope_patch.current(model) is None


@pytest.mark.parametrize("scheme,base,key,text,label,value,exc", OUT_OF_RANGE, ids=_IDS)
def test_out_of_range_is_refused_with_the_range(pristine, scheme, base, key, text, label, value, exc):
    model, ids, before = _fresh(pristine)
    config = model.config.to_dict()
    named = key
    if key in ("short_factor", "long_factor"):
        value, named = [1.0] * 3 + [value] + [1.0] * (PAIRS - 4), f"{key}[3]"
    with pytest.raises(exc) as err:
        rope_patch.apply(model, scheme, **base, **{key: value})
    message = str(err.value)
    assert message.startswith(f"{scheme}: parameter `{named}` must be "), message
    assert text in message, message  # the allowed range
    _assert_unchanged(model, ids, before, config)


NEXT_ABOVE_1, NEXT_ABOVE_0 = math.nextafter(1.0, 2.0), math.nextafter(0.0, 1.0)
ACCEPTED = [  # the bounds themselves (or the nearest float inside an open bound) apply and give finite logits
    ("default", dict(rope_theta=1e12)),
    ("default", dict(rope_theta=NEXT_ABOVE_1)),
    ("linear", dict(factor=1)),
    ("linear", dict(factor=1024, rope_theta=1e12)),
    ("ntk", dict(factor=1024, rope_theta=1e12)),
    ("ntk", dict(alpha=1)),
    ("dynamic", dict(factor=1024, original_max_position_embeddings=1)),
    ("yarn", dict(factor=1024, beta_fast=1e4, beta_slow=1e-4, attention_factor=10)),
    ("yarn", dict(factor=1, attention_factor=0.1, original_max_position_embeddings=1)),
    ("yarn", dict(factor=4, mscale=10, mscale_all_dim=NEXT_ABOVE_0)),
    ("yarn", dict(factor=4, mscale=NEXT_ABOVE_0, mscale_all_dim=10, rope_theta=NEXT_ABOVE_1)),
    ("llama3", dict(factor=1024, low_freq_factor=1e-4, high_freq_factor=1e4)),
    ("longrope", dict(factor=1024, short_factor=[1e-4] * PAIRS, long_factor=[1e4] * PAIRS,
                      original_max_position_embeddings=2, attention_factor=10)),
    ("longrope", dict(factor=1, short_factor=[1e4] * PAIRS, long_factor=[1e-4] * PAIRS, attention_factor=0.1)),
    ("p_rope", dict(partial_rotary_factor=0)),  # the paper's 0-RoPE
    ("p_rope", dict(partial_rotary_factor=1)),
    ("p_rope", dict(partial_rotary_factor=1 / PAIRS)),  # one pair keeps rotating
    ("alibi", dict(max_bias=64)),
    ("alibi", dict(max_bias=NEXT_ABOVE_0)),
    ("relative_bias", dict(num_buckets=2, max_distance=2)),
    ("relative_bias", dict(num_buckets=1024, max_distance=513)),
    ("relative_bias", dict(num_buckets=32, max_distance=1 << 24, init="alibi")),
    ("self_extend", dict(group_size=1, window_size=2)),
    ("self_extend", dict(group_size=10_000, window_size=100_000_000)),
    ("self_extend", dict(group_size=4, window_size=8.0)),  # an integral float counts as an integer
    ("rerope", dict(window_size=1)),
    ("rerope", dict(window_size=100_000_000)),
    ("leaky_rerope", dict(window_size=1, factor=1)),
    ("leaky_rerope", dict(window_size=4, factor=1e4)),
    ("string", dict(shift_size=2, window_size=1)),
    ("string", dict(shift_size=100_000_000, window_size=99_999_999)),
    ("dynamic_yarn", dict(factor=1024, beta_fast=1e4, beta_slow=1e-4, attention_factor=10)),
    ("dynamic_yarn", dict(factor=1, original_max_position_embeddings=1)),
    ("sinusoidal", dict(rope_theta=1e12)),
    ("sinusoidal", dict(rope_theta=NEXT_ABOVE_1)),
    ("learned_absolute", dict(max_position_embeddings=WINDOW + 8)),
]


@pytest.mark.parametrize("scheme,params", ACCEPTED, ids=[f"{s}-{i}" for i, (s, _) in enumerate(ACCEPTED)])
def test_boundary_values_apply(pristine, scheme, params):
    model, ids, before = _fresh(pristine)
    rope_patch.apply(model, scheme, **params)
    applied = rope_patch.current(model)
    for key, value in params.items():
        if key != "alpha":  # ntk stores its synonym as `factor`
            assert getattr(applied, key) == (tuple(value) if isinstance(value, list) else value), key
    assert torch.isfinite(logits(model, ids)).all()
    rope_patch.remove(model)
    assert torch.equal(logits(model, ids), before)


@pytest.mark.parametrize("scheme,params", [
    ("learned_absolute", dict(max_position_embeddings=1 << 22)),  # a 4M-row table: too much to allocate in a test
    ("learned_absolute", dict(max_position_embeddings=1)),
    *[(s, dict(factor=2, original_max_position_embeddings=1 << 24)) for s in ("dynamic", "yarn", "llama3")],
    ("longrope",
     dict(factor=2, short_factor=[1.0] * PAIRS, long_factor=[1.0] * PAIRS, original_max_position_embeddings=1 << 24)),
])
def test_upper_bounds_that_the_tiny_model_cannot_take_validate(scheme, params):
    """The range check accepts them (the tiny model's window of 32 caps original_max_position_embeddings at apply)."""
    from rope_patch.registry import get_scheme_class

    scheme_obj = get_scheme_class(scheme).from_params(**params)
    assert all(getattr(scheme_obj, k) == (tuple(v) if isinstance(v, list) else v) for k, v in params.items())


def test_interdependent_checks_still_apply():
    """Each value in range, but not together: the pairwise rules keep their own messages."""
    with pytest.raises(ValueError, match="beta_fast` must be > `beta_slow"):
        rope_patch.apply(tiny_model(), "yarn", factor=4, beta_fast=1e-4, beta_slow=1e-4)
    with pytest.raises(ValueError, match="low_freq_factor` must be <"):
        rope_patch.apply(tiny_model(), "llama3", factor=4, low_freq_factor=1e4, high_freq_factor=1e4)
    with pytest.raises(ValueError, match="window_size` must be larger than `group_size"):
        rope_patch.apply(tiny_model(), "self_extend", group_size=10_000, window_size=10_000)


# ---- the shared validators themselves ----------------------------------------------------------------------------
@pytest.mark.parametrize("bounds,text", [
    (dict(ge=1, le=1024), "in [1, 1024]"), (dict(gt=0.0, le=10.0), "in (0, 10]"), (dict(ge=0.0, lt=1.0), "in [0, 1)"),
    (dict(gt=1.0, le=1e12), "in (1, 1e+12]"), (dict(ge=1e-4, le=1e4), "in [0.0001, 10000]"), (dict(ge=1), ">= 1"),
    (dict(gt=0.5), "> 0.5"), (dict(le=3), "<= 3"), (dict(lt=2.5), "< 2.5"), ({}, "real"),
])
def test_describe_range(bounds, text):
    assert check.describe_range(**bounds) == text


def test_number_lt_and_old_keywords():
    assert check.number("s", "k", 0.5, ge=0.0, lt=1.0) == 0.5
    with pytest.raises(ValueError, match=r"s: parameter `k` must be a finite number in \[0, 1\), got 1.0"):
        check.number("s", "k", 1.0, ge=0.0, lt=1.0)
    assert check.number("s", "k", 3, gt=2) == 3.0 and isinstance(check.number("s", "k", 3), float)
    with pytest.raises(ValueError, match="finite"):
        check.number("s", "k", float("nan"))  # unbounded still means finite
    assert check.integer("s", "k", 7, ge=1) == 7 and check.integer("s", "k", 4.0, le=4) == 4
    with pytest.raises(ValueError, match=r"must be an integer <= 4, got 5"):
        check.integer("s", "k", 5, le=4)
    assert check.number_list("s", "k", (1, 2.5), gt=0.0, le=3.0) == (1.0, 2.5)
    with pytest.raises(ValueError, match=r"`k\[1\]` must be a finite number in \(0, 3\], got 3.5"):
        check.number_list("s", "k", [1, 3.5], gt=0.0, le=3.0)


def test_p_rope_that_keeps_no_pair_is_refused_at_apply(pristine):
    model, ids, before = _fresh(pristine)
    config = model.config.to_dict()
    with pytest.raises(ValueError, match=r"keep at least one of this model's 8 rotary pairs"):
        rope_patch.apply(model, "p_rope", partial_rotary_factor=0.05)  # round(0.05 × 8) = 0
    _assert_unchanged(model, ids, before, config)


def _memory(monkeypatch, total):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"total": total})())


def test_check_table_memory(monkeypatch):
    _memory(monkeypatch, 64 * 2**30)
    assert check.check_table_memory("learned_absolute", "max_position_embeddings", 1 << 20, 4096,
                                    torch.bfloat16) == 8 * 2**30
    with pytest.raises(ValueError) as err:  # 4M × 4096 × 4 bytes = 64 GiB > half of 64 GiB
        check.check_table_memory("learned_absolute", "max_position_embeddings", 1 << 22, 4096, torch.float32)
    message = str(err.value)
    assert message.startswith("learned_absolute: parameter `max_position_embeddings`=4194304 needs a 4194304 × 4096")
    assert "float32" in message and "64.0 GiB" in message and "of this machine's 64.0 GiB" in message
    assert "max_position_embeddings <= 2097152" in message  # what would fit
    # exactly half is allowed
    assert check.check_table_memory("t", "rows", 1 << 21, 4096, torch.float32) == 32 * 2**30


def test_check_table_memory_without_psutil(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    assert check.physical_memory() is None or check.physical_memory() > 0  # os.sysconf, where it exists
    assert check.check_table_memory("t", "rows", 8, 8, torch.float16) == 128


def test_learned_table_beyond_memory_is_refused_before_allocating(pristine, monkeypatch):
    model, ids, before = _fresh(pristine)
    config = model.config.to_dict()
    _memory(monkeypatch, 2**20)  # 1 MiB "machine": 4096 rows × 64 × fp32 = 1 MiB > half of it
    with pytest.raises(ValueError, match=r"learned_absolute: parameter `max_position_embeddings`=4096 .* GiB"):
        rope_patch.apply(model, "learned_absolute", max_position_embeddings=4096)
    _assert_unchanged(model, ids, before, config)
