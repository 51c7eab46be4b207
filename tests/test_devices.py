"""Where a patch's tables live, and models whose weights are not all on one device (issue 28, item 6).

A table a scheme attaches (the T5 bias of relative_bias, the position table of learned_absolute) is made where the
module that reads it computes: with accelerate's offloading (device_map with offload, `cpu_offload`) the parameters
sit on the meta device and a hook brings them in per forward, so "the device of the first parameter" is meta; the
execution device is what counts. A model built on the meta device (no weights, no frequencies) is refused."""

from __future__ import annotations

import pytest
import torch
from accelerate import cpu_offload
from helpers.models import VOCAB, logits, tiny_model

import rope_patch

SCHEMES = [("relative_bias", {"init": "alibi"}), ("learned_absolute", {"max_position_embeddings": 64}),
           ("alibi", {}), ("self_extend", {"group_size": 4, "window_size": 12}), ("yarn", {"factor": 4.0})]


@pytest.mark.parametrize("scheme,params", SCHEMES, ids=[s for s, _ in SCHEMES])
def test_an_offloaded_model_gets_the_patch_of_a_loaded_one(scheme, params):
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    loaded = tiny_model("llama", attn_implementation="sdpa")
    rope_patch.apply(loaded, scheme, **params)
    offloaded = tiny_model("llama", attn_implementation="sdpa")
    cpu_offload(offloaded, execution_device="cpu")
    assert next(offloaded.parameters()).device.type == "meta"
    rope_patch.apply(offloaded, scheme, **params)
    for table in rope_patch.api.patch_modules(offloaded).values():
        assert table.weight.device.type == "cpu"  # the execution device, not the parameters' meta
    assert torch.equal(logits(offloaded, ids), logits(loaded, ids))
    rope_patch.remove(offloaded)
    assert torch.equal(logits(offloaded, ids), logits(tiny_model("llama", attn_implementation="sdpa"), ids))


@pytest.mark.parametrize("scheme,params", SCHEMES[1:2] + SCHEMES[3:], ids=["learned_absolute", "self_extend", "yarn"])
def test_a_model_without_weights_is_refused_and_left_alone(scheme, params):
    with torch.device("meta"):
        model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"holds no values yet .* on the meta device: the weights are "
                                         r"not materialised"):
        rope_patch.apply(model, scheme, **params)
    assert rope_patch.current(model) is None and "forward" not in vars(model.model.rotary_emb)
