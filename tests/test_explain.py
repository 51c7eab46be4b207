"""`rope_patch.analysis.explain` / `rope-patch explain`: the numbers the theory page (docs/theory.md) quotes (d = 128,
b = 10 000, L = 4096, a Llama-2-7B-like RoPE) come from this command."""

from __future__ import annotations

import math

import pytest

from rope_patch import analysis
from rope_patch.cli import main

LLAMA2 = dict(head_dim=128, rope_theta=10000.0, max_position_embeddings=4096)
# scheme, field, value quoted in docs/theory.md
QUOTED = [
    ("default", "turns", 46),
    ("default", "decay_at_zero", 32.5),
    ("default", "decay_max", 11.4),
    ("default", "decay_mean", 5.3),
    ("default:500000", "turns", 32),
    ("default:500000", "longest_wavelength", 2.56e6),
    ("linear:8", "decay_mean", 8.1),
    ("yarn:8", "decay_mean", 6.5),
    ("yarn:8", "unchanged", 21),
    ("yarn:8", "interpolated", 18),
    ("yarn:8", "attention_scaling", 1.208),
    ("llama3:8", "unchanged", 36),
]


@pytest.mark.parametrize("spec,field,quoted", QUOTED, ids=[f"{s}-{f}" for s, f, _ in QUOTED])
def test_guide_numbers(spec, field, quoted):
    value = getattr(analysis.explain(spec, **LLAMA2), field)
    assert value == pytest.approx(quoted, rel=0.01 if isinstance(quoted, float) else 0)


def test_pairs_split_into_kept_interpolated_and_blended():
    e = analysis.explain("yarn:8", **LLAMA2)
    assert e.n_pairs == 64 and e.unchanged + e.interpolated < e.n_pairs  # the rest is YaRN's ramp
    assert analysis.explain("linear:8", **LLAMA2).interpolated == 64
    assert analysis.explain("default", **LLAMA2).interpolated is None


def test_cli_prints_them(capsys):
    assert main(["explain", "yarn:8", "llama3:8"]) == 0
    out = capsys.readouterr().out
    assert "pairs unchanged (θ′ = θ): 21 of 64" in out and "pairs fully interpolated (θ′ = θ/s): 18 of 64" in out
    assert "pairs unchanged (θ′ = θ): 36 of 64" in out and "logits × 1.459" in out


def test_cli_bad_spec_is_one_line(capsys):
    assert main(["explain", "yarnn:8"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean 'yarn'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_config_takes_a_zoo_name_and_never_the_hub(capsys):
    assert main(["explain", "yarn:4+string:shift_size=100,window_size=16", "--config", "tiny"]) == 0
    out = capsys.readouterr().out  # rope-tiny: head_dim 64 (32 pairs), window 256
    assert "yarn (s=4) + string (S=100, W=16): 32 rotating pairs, pre-training window L = 256" in out
    assert main(["explain", "yarn:4", "--config", "no-such-model"]) == 2  # a name, not a hub download
    err = capsys.readouterr().err
    assert "Unknown model 'no-such-model'" in err and len(err.strip().splitlines()) == 1


def test_the_cli_explains_each_layer_type_of_a_per_layer_type_config(tmp_path, capsys):
    """`rope-patch explain --config` on a model whose RoPE is per layer type (Gemma 3: θ 1e4 on its sliding layers,
    1e6 on its full ones) prints each type's layout, named; it showed the full layers' alone, unnamed."""
    from helpers.models import tiny_model

    from rope_patch.cli import main

    tiny_model("gemma3_text", layer_types=["sliding_attention", "full_attention"], sliding_window=8).config \
        .save_pretrained(tmp_path)
    assert main(["explain", "yarn:8", "--config", str(tmp_path)]) == 0
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("yarn")]
    assert sorted(h.rsplit("(", 1)[1] for h in heads) == ["full_attention layers)", "sliding_attention layers)"]
    assert main(["explain", "yarn:8", "--config", "tiny"]) == 0
    assert "layers)" not in capsys.readouterr().out



# spec, the header's pair count, pairs that rotate: p-RoPE keeps the rotation of its fraction p of the pairs (the
# fastest); ALiBi and NoPE remove it from every pair; the rest rotate every pair
ROTATING = [("yarn:8", "64 rotating pairs", 64), ("p_rope:0.25", "64 pairs, 16 rotating", 16),
            ("alibi", "64 pairs, none rotating", 0), ("nope", "64 pairs, none rotating", 0)]


@pytest.mark.parametrize("spec,header,rotating", ROTATING, ids=[s for s, _, _ in ROTATING])
def test_the_header_counts_the_pairs_that_rotate(spec, header, rotating):
    """Before: `n_pairs` (rotary_dim / 2) was printed as "rotating pairs" whatever the scheme, so p_rope:0.25 and
    alibi read "64 rotating pairs" while 16 and none rotate (θ′ = 0)."""
    e = analysis.explain(spec, **LLAMA2)
    assert e.lines()[0].split(": ", 1)[1] == header + ", pre-training window L = 4096"
    assert e.n_pairs == 64 and e.n_rotating == rotating


# a length-dependent scheme, explained at its extended window N = s·L (as the plots draw it): (spec, N, unchanged,
# fully interpolated, the static scheme that has the same frequencies there)
AT_LENGTH = [("longrope:factor=4,short_factor=1/1/1/1/1/1/1/1,long_factor=4/4/4/4/4/4/4/4", 16384, 0, 8, "linear:4"),
             ("dynamic:4", 16384, 1, None, None)]


@pytest.mark.parametrize("spec,n,unchanged,interpolated,same", AT_LENGTH, ids=["longrope", "dynamic"])
def test_a_length_dependent_scheme_is_explained_at_one_length(spec, n, unchanged, interpolated, same):
    """Before: the pair counts came from the load-time frequencies (longrope's short factors, dynamic's vanilla RoPE)
    and the decay bound from ℓ = L + 1 (longrope's long factors): longrope all-4 long factors read "pairs unchanged 8 of
    8" above a decay bound equal to linear×4's. Every number now holds at ℓ = N, and the header says so."""
    e = analysis.explain(spec, head_dim=16, rope_theta=10000.0, max_position_embeddings=4096)
    assert e.seq_len == n and f"at ℓ = {n:,}" in e.lines()[0]
    assert e.unchanged == unchanged
    if interpolated is not None:
        assert e.interpolated == interpolated
    if same:
        twin = analysis.explain(same, head_dim=16, rope_theta=10000.0, max_position_embeddings=4096)
        assert (e.decay_mean, e.decay_max, e.turns) == (twin.decay_mean, twin.decay_max, twin.turns)
    if spec.startswith("dynamic"):  # FORMULAS: b·((s·ℓ/L) − (s − 1))^(d/(d−2)), at ℓ = s·L: b·13^(16/14) for s = 4
        base = 10000.0 * 13 ** (16 / 14)
        assert e.longest_wavelength == pytest.approx(2 * math.pi * base ** (14 / 16), rel=1e-5)
    assert analysis.explain("yarn:4", head_dim=16, rope_theta=10000.0, max_position_embeddings=4096).seq_len is None
