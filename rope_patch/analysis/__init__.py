"""The theory of position encodings as numbers: frequencies, wavelengths, the long-term-decay bound, angles,
expected attention scores and effective relative distances, for any scheme and any model.

Pure functions on tensors; no model is needed. Every function takes the scheme in one of these forms

    "yarn:8", "default:500000", "yarn:factor=8,beta_fast=16"   a spec string (as on the command line)
    "yarn", factor=8                                           a name plus parameters
    rope_patch.as_scheme("yarn", factor=8)                     a Scheme object

and the model's RoPE either as numbers (`head_dim`, `rope_theta`, `max_position_embeddings` = the original
training window L, `partial_rotary_factor`), or read from a transformers `config=` or a loaded `model=` (whose
applied scheme, `rope_patch.current(model)`, is used when `scheme` is None).

Every number comes from the scheme objects themselves, so the analysis and the patch cannot disagree: frequency
schemes through the very code that patches a model (`FrequencyScheme.inv_freq`, i.e. transformers' own
`ROPE_INIT_FUNCTIONS`: θ′_i and the cos/sin scale bit for bit, tests/test_analysis.py checks them against
`model.model.rotary_emb`), attention schemes through `Scheme.keeps_rotation` and `Scheme.relative_position`
(the positions their attention functions rotate with):

    scheme            rotation θ_i          relative distance seen by attention        additive bias
    alibi             none (θ_i = 0)        Δ                                          −m_h·Δ (Press et al. 2022)
    nope              none                  Δ                                          0     (Kazemnejad et al. 2023)
    relative_bias     none                  Δ                                          learned T5 buckets (not modelled)
    sinusoidal        none                  (absolute, added to the embeddings)        0     (Vaswani et al. 2017)
    learned_absolute  none                  (absolute, learned table)                  0
    self_extend       model's θ_i           Δ < W: Δ; else ⌊i/G⌋ − ⌊j/G⌋ + W − ⌊W/G⌋    0     (Jin et al. 2024)
    self_extend_      model's θ_i           Δ < W: Δ; else W + f(i − W) − f(j), f the   0     (Dang et al. 2025)
      logistic                              logistic groups (sizes 1 … C − 1)
    rerope            model's θ_i           min(Δ, W)                                  0     (Su 2023)
    leaky_rerope      model's θ_i           Δ < W: Δ; else W + (Δ − W)/k (k = factor)  0     (Su 2023)
    string            model's θ_i           Δ < S: Δ; else Δ − S + W                   0     (An et al. 2024)
    dca               model's θ_i           chunk positions, all ≤ chunk_size           0     (An et al. 2024)

Notation: head dim d, pair i = 0..d/2−1, base b, θ_i = b^(−2i/d), wavelength λ_i = 2π/θ_i, original
window L, relative distance Δ = m − n.

Sequence-length dependent schemes: dynamic NTK changes θ with the current length ℓ and LongRoPE switches from its
short to its long factors once ℓ > L. `frequencies(..., seq_len=ℓ)` gives the numbers at length ℓ (exactly what
transformers' `dynamic_rope_update` installs at that length); without `seq_len` they are the ones at load time
(ℓ ≤ L). The distance-based functions default to ℓ = max(distances) + 1, the shortest sequence that contains
all the requested distances.

    spec.py         AnalysisSpec: a scheme as the analysis sees it (spec strings, names + parameters, Scheme objects)
    layout.py       the model's RoPE from numbers, a config or a loaded model (its unpatched view)
    frequencies.py  θ′_i, cos/sin scale, wavelengths
    distances.py    the relative positions attention schemes rotate with; ALiBi's bias
    scores.py       the long-term-decay bound, angles, expected scores
    explain.py      the numbers `rope-patch explain` prints
"""

from .distances import (
                        alibi_slopes,
                        attention_bias,
                        dca_distance,
                        effective_distance,
                        leaky_rerope_distance,
                        rerope_distance,
                        self_extend_distance,
                        string_distance,
)
from .explain import Explanation, explain
from .frequencies import Frequencies, Wavelengths, frequencies, wavelengths
from .scores import ExpectedScore, angles, decay_bound, decay_bound_at_zero, expected_score
from .spec import AnalysisSpec, as_spec

__all__ = [
    "AnalysisSpec", "ExpectedScore", "Explanation", "Frequencies", "Wavelengths", "alibi_slopes", "angles", "as_spec",
    "attention_bias", "dca_distance", "decay_bound", "decay_bound_at_zero", "effective_distance", "expected_score",
    "explain", "frequencies", "leaky_rerope_distance", "rerope_distance", "self_extend_distance", "string_distance",
    "wavelengths",
]
