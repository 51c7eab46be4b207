"""rope_patch.context_window after every kind of scheme, and what `generate` is told (rope_patch/api.py).

An attention-side scheme serves the length its positions stay inside the trained window for (`served_length`, a fact
on its class); the config keeps the unpatched window (a plain save must reload the unpatched model), and generate's
"exceeded the model's predefined maximum length" reminder compares with the served window instead.
"""

from __future__ import annotations

import copy
import logging
import pickle
import warnings

import pytest
import torch
from helpers.models import WINDOW, tiny_model
from transformers.utils import logging as hf_logging

import rope_patch
from rope_patch.schemes.base import UNBOUNDED

L = WINDOW  # 32

# spec -> the window it serves on a model of window L, from the scheme's math
SERVED = {
    "self_extend:group_size=4,window_size=8": (L - 8) * 4 + 8,  # (L − W)·G + W
    "self_extend:group_size=3,window_size=8": 3 * (L - 8 + 8 // 3),  # G·(L − W + ⌊W/G⌋): G does not divide W
    "leaky_rerope:window_size=8,factor=4": 8 + 4 * (L - 1 - 8) + 1,  # W + (N − 1 − W)/k ≤ L − 1
    "string:shift_size=16,window_size=4": L + 16 - 4,  # N − 1 − S + W ≤ L − 1
    "dpe:group_sizes=2/4,window_size=8": min((L - 8) * 2 + 8, (L - 8) * 4 + 8),  # the smallest group decides
    "rerope:window_size=8": UNBOUNDED,
    "alibi": UNBOUNDED,
    "nope": UNBOUNDED,
    "dca": UNBOUNDED,
    "sink:window_size=16,sink_size=4": UNBOUNDED,
    "relative_bias": UNBOUNDED,
    "learned_absolute:max_position_embeddings=48": 48,
    "rerope:window_size=40": L,  # W ≥ L: no longer than the model's own
    "ms_poe": L,  # helps use the window, does not extend it
    "logn": L,
    "linear:4": 4 * L,
    "yarn:4+self_extend:group_size=4,window_size=8": (4 * L - 8) * 4 + 8,  # Self-Extend's groups within yarn's 4·L
    "yarn:4+rerope:window_size=8": UNBOUNDED,
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", attn_implementation="sdpa")


@pytest.mark.parametrize("spec", list(SERVED))
def test_context_window_is_the_length_the_scheme_serves(model, spec):
    with rope_patch.patched(model, spec):
        assert rope_patch.context_window(model) == SERVED[spec]
    assert rope_patch.context_window(model) == L


# A scheme written to extend whose sizes reach L within L tokens is accepted (it is exact) and says it extends nothing
UNSERVED = {
    "rerope:window_size=40": True,  # W ≥ L
    "self_extend:group_size=4,window_size=32": True,
    "sink:window_size=30,sink_size=4": True,  # S + W > L
    "dca:chunk_size=40": True,
    "lm_infinite:local_size=40": True,
    "rerope:window_size=8": False,
    "self_extend:group_size=4,window_size=8": False,
    "ms_poe": False,  # does not extend, by design: nothing to say
    "linear:4": False,
    "yarn:4+self_extend:group_size=4,window_size=40": False,  # W < yarn's 4·L
    "yarn:4+self_extend:group_size=4,window_size=128": True,  # W ≥ yarn's 4·L
}


@pytest.mark.parametrize("spec", list(UNSERVED))
def test_sizes_that_extend_nothing_are_said_at_apply(model, spec):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rope_patch.patched(model, spec):
            pass
    said = [str(w.message) for w in caught if "serves no input longer than" in str(w.message)]
    assert bool(said) == UNSERVED[spec], caught
    window = 4 * L if spec.startswith("yarn:4+") else L
    assert all(f"window of {window} tokens" in m for m in said)


def test_a_refused_patch_says_only_why(monkeypatch):
    from rope_patch.attention import plumbing

    def refuse(*args, **kwargs):
        raise ValueError("rerope: the apply-time check does not hold")

    monkeypatch.setattr(plumbing, "verify", refuse)
    model = tiny_model("llama", attn_implementation="sdpa")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError, match="does not hold"):
        warnings.simplefilter("always")
        rope_patch.apply(model, "rerope", window_size=999)
    assert not [w for w in caught if "serves no input longer than" in str(w.message)]


def test_self_extend_logistic_serves_the_longest_length_its_positions_fit():
    from rope_patch.schemes.positions import _reach

    scheme = rope_patch.as_scheme("self_extend_logistic:group_size=4,window_size=8,growth_rate=0.5")
    n = scheme.served_length(L)
    assert _reach(4, 0.5, n, 8) <= L - 1 < _reach(4, 0.5, n + 1, 8)


class _Reminders(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        if "predefined maximum length" in record.getMessage():
            self.lines.append(record.getMessage())


@pytest.fixture
def reminders():
    logger = hf_logging.get_logger("transformers.generation.stopping_criteria")
    handler = _Reminders()
    logger.addHandler(handler)
    hf_logging.set_verbosity_warning()
    logging.Logger.warning_once.cache_clear()  # transformers says it once per message and process
    yield handler.lines
    logger.removeHandler(handler)


def _generate(model, total: int):
    ids = torch.arange(3, 3 + 8)[None]
    logging.Logger.warning_once.cache_clear()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_length=total, min_length=total, do_sample=False,
                   pad_token_id=0)


def test_generate_is_told_the_served_window(model, reminders):
    served = SERVED["self_extend:group_size=4,window_size=8"]
    _generate(model, L + 4)
    assert len(reminders) == 1 and f"({L})" in reminders[0]  # vanilla: past L
    reminders.clear()
    config = model.config
    with rope_patch.patched(model, "self_extend:group_size=4,window_size=8"):
        _generate(model, L + 4)
        assert reminders == []  # inside the served window: no reminder
        _generate(model, served + 2)
        assert len(reminders) == 1 and f"({served})" in reminders[0]  # past it: the served window is named
        assert model.config.max_position_embeddings == L  # the config keeps the unpatched window (saves)
    reminders.clear()
    assert "_get_stopping_criteria" not in vars(model) and model.config is config
    _generate(model, L + 4)
    assert len(reminders) == 1 and f"({L})" in reminders[0]  # removed: the original behaviour


def test_an_unbounded_scheme_is_never_reminded(model, reminders):
    with rope_patch.patched(model, "rerope:window_size=8"):
        _generate(model, 3 * L)
    assert reminders == []


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_tells_generate_its_own_window(how, reminders):
    original = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(original, "rerope:window_size=8")
    twin = copy.deepcopy(original) if how == "deepcopy" else pickle.loads(pickle.dumps(original))
    rope_patch.remove(original)
    _generate(twin, 2 * L)
    assert reminders == []
    assert all(vars(twin)[name].model is twin for name in ("_get_stopping_criteria", "_prepare_generated_length"))
    _generate(original, 2 * L)
    assert len(reminders) == 1


@pytest.mark.parametrize("spec", ["self_extend:group_size=4,window_size=8", "rerope:window_size=8", "yarn:4"])
def test_generate_continues_an_input_past_the_config_window_by_default(model, spec):
    # no max_new_tokens: transformers caps its default (20 new tokens) at config.max_position_embeddings, which for
    # an attention-side scheme keeps the unpatched L, and refused the input as longer than max_length
    ids = torch.arange(3, 3 + L + 8)[None]
    with rope_patch.patched(model, spec):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
        assert out.shape[1] == min(ids.shape[1] + 20, SERVED.get(spec, 4 * L))
    assert "_prepare_generated_length" not in vars(model)
    with pytest.raises(ValueError, match="max_length"):  # removed: transformers' own behaviour again
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
