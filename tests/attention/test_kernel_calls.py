"""Issue 39: the flex path of every attention-side scheme makes a constant number of kernel calls per layer,
independent of the sequence length (no per-block Python loop), the count the GPU path will make on CUDA.

Runs on the CPU with the kernel substituted: `rope_patch.attention.flex.flex_attention`, the one name through which
`flex_call` (and so every scheme's flex path: attention/declared.py, rules.py, schemes/bias.py, chunked.py,
multiscale.py, cached.py) reaches `torch.nn.attention.flex_attention.flex_attention` when settings.FLEX_COMPILE is
off, is replaced by a stand-in that counts its calls and returns zeros of the right shape (and a zero log-sum-exp
where one is asked for). Everything around the kernel runs as it is: transformers' BlockMask, the scheme's rotations,
its band / region BlockMasks (`band_block_mask`, DCA's `_region_block_mask`), the log-sum-exp merge. So a 1-layer,
1-head (16 dims) Llama runs 8k and 32k tokens, the issue's lengths, in about a second each; uncompiled flex on the
CPU would materialise 32k × 32k scores. A second test checks at 256 tokens that the real (eager) kernel is called as
often as the stand-in, i.e. that the stand-in changes nothing on the path that leads to it.

The schemes are tests/helpers/schemes.py's rows of family "attention" less those that run no attention function of
their own (nope, sinusoidal, learned_absolute), with the rows' parameters: windows, groups and chunks of 4–48 tokens,
so at both lengths every region a scheme declares is reached (the most calls it can make).
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_model
from helpers.schemes import rows

import rope_patch
from rope_patch.attention import flex, settings

LENGTHS = (8192, 32768)
SCHEMES = rows("attention", without=("nope", "sinusoidal", "learned_absolute"))
BIASES = ("alibi", "relative_bias")  # one call with a score_mod
MOST = 3  # the re-positioning schemes: one call per region, at most three (DCA: intra, successive, inter)


def _params(row) -> dict:
    params = dict(row.params)
    if row.name == "ms_poe":
        params["skip_layers"] = 0  # the one layer runs Ms-PoE (the row skips one of the usual two)
    return params


def _model(row, monkeypatch):
    monkeypatch.setattr(settings, "FLEX_COMPILE", False)  # compiled CPU flex is refused at apply() (test_backends)
    model = tiny_model("llama", attn_implementation="flex_attention", num_hidden_layers=1, num_attention_heads=1,
                       num_key_value_heads=1, hidden_size=16, head_dim=16, intermediate_size=16)
    rope_patch.apply(model, row.name, **_params(row))
    return model


def _count(model, monkeypatch, length: int, kernel) -> int:
    """Kernel calls of one forward of `length` tokens (batch 1, no cache) through `kernel`."""
    calls = []

    def counting(q, k, v, *args, **kwargs):
        calls.append(q.shape[2])
        return kernel(q, k, v, *args, **kwargs)

    ids = torch.randint(3, 97, (1, length), generator=torch.Generator().manual_seed(length))
    with monkeypatch.context() as m:
        m.setattr(flex, "flex_attention", counting)
        with torch.no_grad():
            model.model(ids, use_cache=False)
    assert all(n == length for n in calls), calls  # each call covers every query: no blocks of rows
    return len(calls)


def stand_in(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
             return_aux=None, **kwargs):
    """The CPU kernel substituted: flex_attention's signature and output shapes (out (b, H, q, dv), and the
    log-sum-exp (b, H, q) where `return_lse` / `return_aux` asks for it), zeros, no scores."""
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    if return_lse or return_aux is not None:
        return out, q.new_zeros(q.shape[:3], dtype=torch.float32)  # flex_call reads `.lse` or the tensor itself
    return out


@pytest.mark.slow
@pytest.mark.parametrize("row", SCHEMES, ids=[r.name for r in SCHEMES])
def test_kernel_calls_per_layer_do_not_grow_with_the_length(row, monkeypatch):
    model = _model(row, monkeypatch)
    counts = {n: _count(model, monkeypatch, n, stand_in) for n in LENGTHS}  # 1 layer: calls per layer
    assert counts[LENGTHS[0]] == counts[LENGTHS[1]], f"{row.name}: kernel calls per layer grow with the length"
    assert 1 <= counts[LENGTHS[0]] <= (1 if row.name in BIASES else MOST), f"{row.name}: {counts}"


@pytest.mark.slow
@pytest.mark.parametrize("row", SCHEMES, ids=[r.name for r in SCHEMES])
def test_the_stand_in_takes_the_real_kernels_path(row, monkeypatch):
    """At 256 tokens the real uncompiled kernel is called exactly as often as the stand-in."""
    model = _model(row, monkeypatch)
    real = flex.flex_attention
    assert _count(model, monkeypatch, 256, real) == _count(model, monkeypatch, 256, stand_in)
