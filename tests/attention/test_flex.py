"""rope_patch's compiled flex_attention (attention/flex.py `compiled_flex`): a function of its own, one memory layout
for every call, and past its variant limit a clear error, never torch's uncompiled fallback (which materialises every
score: 133× the time and 165× the memory of vanilla sdpa at 32k on an H200, after a few schemes in one process).

Compiled here with dynamo's eager backend: torch's compiled CPU flex kernel is refused at apply() (test_backends), and
the guards, recompiles and the limit are dynamo's whatever the backend."""

from __future__ import annotations

import pytest
import torch
from helpers.models import logits, tiny_model, token_batch
from helpers.reference import forward as reference_forward

import rope_patch
from rope_patch.attention import flex, settings

# one-call and two-call (merged by log-sum-exp) schemes, parameters for the tiny model's window
SCHEMES = [
    ("alibi", {}),
    ("relative_bias", {"init": "alibi", "num_buckets": 16, "max_distance": 64}),
    ("self_extend", {"group_size": 4, "window_size": 16}),
    ("rerope", {"window_size": 16}),
    ("string", {"shift_size": 20, "window_size": 6}),
]


@pytest.fixture
def compiled(monkeypatch):
    """flex compiled (dynamo, eager backend) from a clean dynamo cache; the models are patched uncompiled first, as
    apply() refuses the compiled kernel on CPU."""
    torch._dynamo.reset()
    eager_backend = torch.compile(flex._flex_attention, backend="eager")
    monkeypatch.setattr(flex, "compiled_flex", lambda: eager_backend)

    def patched(scheme, params):
        monkeypatch.setattr(settings, "FLEX_COMPILE", False)
        model = tiny_model("llama", attn_implementation="flex_attention")
        rope_patch.apply(model, scheme, **params)
        monkeypatch.setattr(settings, "FLEX_COMPILE", True)
        return model

    yield patched
    torch._dynamo.reset()


def test_schemes_in_one_process_stay_compiled_and_exact(compiled):
    """Five schemes, two lengths each, in one process: every call compiled (the variants grow with the kinds of call,
    not with the calls or lengths: 5 here, 7 without the one layout), and the logits those of the paper references."""
    for scheme, params in SCHEMES:
        model = compiled(scheme, params)
        for n in (80, 112):
            ids = token_batch(n, 0, 0)[0]
            got = logits(model, ids)
            assert (got - reference_forward(model, ids, scheme, params, None)).abs().max().item() <= 1e-5, (scheme, n)
    # one or two per scheme (one call kind, or the near and far calls)
    assert 0 < flex.compiled_variants() <= len(SCHEMES) + 1


def test_a_call_past_the_limit_raises_instead_of_running_uncompiled(compiled, monkeypatch):
    """torch's own limit (8) would run every later call of a new kind eagerly without a word; here it is an error that
    says what to do."""
    monkeypatch.setattr(settings, "FLEX_RECOMPILES", 1)
    model = compiled("alibi", {})
    logits(model, token_batch(80, 0, 0)[0])
    other = compiled("rerope", {"window_size": 16})
    with pytest.raises(RuntimeError, match="FLEX_RECOMPILES.*uncompiled.*sdpa backend"):
        logits(other, token_batch(80, 0, 0)[0])


def test_the_memory_layout_of_the_inputs_makes_no_variant(compiled):
    """The projections reach flex transposed, a cache's key sets as slices of one tensor: one variant for both."""
    q = torch.randn(1, 3, 4, 16, 8).permute(0, 2, 1, 3, 4)[..., 0, :]  # (1, 4, 3, 8) with a stride no copy has
    k, v = torch.randn(1, 2, 24, 8)[:, :, :12], torch.randn(1, 2, 12, 8)
    kwargs = dict(scale=0.3, enable_gqa=True)
    first = flex._run_compiled(q, k, v, **kwargs)
    second = flex._run_compiled(q.contiguous(), k.contiguous(), v, **kwargs)
    assert torch.equal(first, second) and flex.compiled_variants() == 1
