"""rope_patch.notices: a warning names the user's own line, whichever public call path led to it."""

from __future__ import annotations

import warnings

import pytest
from helpers.models import tiny_model

import rope_patch


def _apply(model):
    rope_patch.apply(model, "rerope", window_size=999)


def _patched(model):
    with rope_patch.patched(model, "rerope", window_size=999):
        pass


def _shrink(model):  # a scheme that serves less than the scaled window the checkpoint ships with
    rope_patch.apply(model, "yarn", factor=1.5)


SHIPPED = dict(max_position_embeddings=128, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 32})


def _replace(model):  # the learned table of relative_bias discarded by another scheme
    rope_patch.apply(model, "relative_bias")
    rope_patch.apply(model, "alibi")


@pytest.mark.parametrize("call,said,config", [
    (_apply, "serves no input longer", {}),
    (_patched, "serves no input longer", {}),
    (_shrink, "fewer than the shipped window", SHIPPED),
    (_replace, "learned tables of the previous patch", {}),
])
def test_a_warning_names_the_callers_line(call, said, config):
    model = tiny_model("llama", attn_implementation="sdpa", **config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(model)
    ours = [w for w in caught if said in str(w.message)]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, w.lineno, str(w.message)[:60])
                                                                 for w in caught]
