"""Additive attention biases: ALiBi (fixed slopes) and T5/Shaw relative-position buckets (learned).

Both remove the rotation and add b_h(i − j) to the logits of query i and key j: a declared geometry of one region
over every key with a `Bias` (attention/geometry.py), from which attention/declared.py derives every backend. On the
fused and flex paths the bias is never a (heads, L, L) tensor (the materialised path builds it per query block).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .. import attention, discovery
from .. import validation as check
from ..discovery import PatchSite
from ..registry import register_scheme
from .base import UNBOUNDED
from .common import AttentionScheme, DeviceTables, attention_modules, execution_device, table_dtype

MODULE_NAME = "rope_patch_relative_bias"  # attribute under which relative_bias attaches its table to the model


def alibi_slopes(n_heads: int, max_bias: float = 8.0) -> list[float]:
    """Press et al. 2022 (arXiv:2108.12409, §3 and their reference code): for n a power of two,
    m_h = 2^(−max_bias·h/n), h = 1..n. Otherwise take the n′ = 2^⌊log2 n⌋ slopes of n′ heads, then every other slope
    of the 2n′-head sequence (the ones that interleave with them) until n heads have one."""

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = [2.0 ** (-max_bias * h / closest) for h in range(1, closest + 1)]
    if closest == n_heads:
        return slopes
    return slopes + alibi_slopes(2 * closest, max_bias)[0::2][: n_heads - closest]


class AlibiBias(attention.Bias):
    """−m_h·(i − j) with the slopes of the call's query head count (layers may differ in it: heterogeneous configs);
    `max_bias` None: all slopes 0 (the apply-time check's identity setting)."""

    def __init__(self, max_bias: float | None):
        self.max_bias = max_bias
        self._by_heads: dict[int, torch.Tensor] = {}

    def slopes(self, heads: int) -> torch.Tensor:
        """(H,) float32, one per query head (GQA: not per kv head)."""
        if heads not in self._by_heads:
            values = alibi_slopes(heads, self.max_bias) if self.max_bias is not None else [0.0] * heads
            self._by_heads[heads] = torch.tensor(values, dtype=torch.float32)
        return self._by_heads[heads]

    def by_distance(self, call, distance):
        slopes = self.slopes(call.query.shape[1] * call.query.shape[2]).to(call.query.device)
        return -slopes[:, None] * distance.float()  # score(i, j) −= m_h·(i − j)

    def probe(self):
        return AlibiBias(None)  # slopes 0: the model without positions (NoPE)


class AlibiScores(attention.Declared):
    """ALiBi's declared attention, plus its flash-attention form."""

    def flash_slopes(self, device, heads: int = 0):
        # flash_attn: fp32 (H,), bias −slope·|i − j|; asked with no head count: "has a flash form" (common.py)
        return self.geometry.bias.slopes(heads or 1).to(device=device, dtype=torch.float32)


@register_scheme
@dataclasses.dataclass(frozen=True)
class Alibi(AttentionScheme):
    """ALiBi (Press, Smith & Lewis 2022, "Train Short, Test Long", arXiv:2108.12409): no position embedding; each
    head h adds −m_h·(i − j) to the logit of query i and key j, with geometric slopes m_h = 2^(−8h/n) (`max_bias`
    = 8) and the paper's rule for head counts that are not a power of two (`alibi_slopes`)."""

    name = "alibi"
    aliases = ("attention_linear_bias",)
    bare_param = "max_bias"
    max_bias: float = 8.0

    def __post_init__(self):
        # ≤ 64: the last head's slope 2^(−max_bias) stays a normal fp32 number (config.ALIBI_MAX_BIAS says why)
        self._set("max_bias", check.number(
            self.name, "max_bias", self.max_bias, gt=0.0, le=check.ALIBI_MAX_BIAS,
            hint="Slopes are 2^(−max_bias·h/n); the paper and BLOOM use 8. Beyond ~126 the last heads' fp32 slopes "
                 "underflow to 0 (NoPE on those heads)."))

    def served_length(self, window):
        # the bias grows linearly with the distance, however far (the paper's "train short, test long")
        return UNBOUNDED

    def build(self, target):
        return AlibiScores(attention.Geometry((attention.Region(),), bias=AlibiBias(self.max_bias))), None

    def distance_bias(self, distances, num_heads):
        """−m_h·Δ per head h (`alibi_slopes`), float64."""
        if num_heads is None:
            raise TypeError("alibi: the bias needs num_heads (the slopes depend on the head count); pass num_heads= "
                            "or model= / config=.")
        n = check.integer(self.name, "num_heads", num_heads, ge=1)
        slopes = torch.tensor(alibi_slopes(n, self.max_bias), dtype=torch.float64)
        return -slopes[:, None] * distances.to(torch.float64)[None, :]


# ------------------------------------------------------------------------------------------------------------------
def t5_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's causal (`bidirectional=False`) bucket of n = max(i − j, 0) (Raffel et al. 2020, arXiv:1910.10683 §2.1;
    transformers' T5Attention._relative_position_bucket): n itself for n < num_buckets/2, then log-spaced buckets
    up to max_distance, the last bucket beyond."""
    n = distance.clamp(min=0)
    exact = num_buckets // 2
    large = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                     * (num_buckets - exact)).long()
    return torch.where(n < exact, n, large.clamp(max=num_buckets - 1))


def bucket_start(num_buckets: int, max_distance: int) -> torch.Tensor:
    """The smallest distance of each bucket (its representative for the ALiBi initialisation)."""
    exact = num_buckets // 2
    b = torch.arange(num_buckets, dtype=torch.float64)
    log_spaced = torch.ceil(exact * (max_distance / exact) ** ((b - exact) / (num_buckets - exact)))
    return torch.where(b < exact, b, log_spaced).float()


class RelativeBias(nn.Module):
    """Learned per-layer, per-head bias table w[layer, head, bucket]; attached to the model so optimizers, peft's
    `modules_to_save` and `state_dict` see it."""

    def __init__(self, num_layers: int, num_heads: int, num_buckets: int, max_distance: int):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.weight = nn.Parameter(torch.zeros(num_layers, num_heads, num_buckets))

    def forward(self, layer_idx: int) -> torch.Tensor:
        """(heads, buckets) of one layer. Attention calls the module (not its weight) so that a wrapper such as
        peft's ModulesToSaveWrapper routes to the copy it trains."""
        return self.weight[layer_idx]

    def extra_repr(self):
        layers, heads, buckets = self.weight.shape
        return f"layers={layers}, heads={heads}, num_buckets={buckets}, max_distance={self.max_distance}"


class BucketBias(attention.Bias, DeviceTables):
    """w_{layer,h}[bucket(i − j)], read from the model's table at call time (peft may have replaced it by a wrapper
    since); `owner` None: an all-zero table (the apply-time check's identity setting)."""

    def __init__(self, owner: nn.Module | None, num_buckets: int, max_distance: int):
        self.owner, self.num_buckets, self.max_distance = owner, num_buckets, max_distance
        self.flat_after = max_distance  # every farther distance is in the last bucket

    def probe(self):
        return BucketBias(None, self.num_buckets, self.max_distance)

    def table(self, call) -> torch.Tensor:
        heads = call.query.shape[1] * call.query.shape[2]  # the table has rows for the most heads any layer has
        if self.owner is None:
            return torch.zeros(heads, self.num_buckets, device=call.query.device)
        # on the layer's device (layers spread over devices by a device_map read one table)
        return getattr(self.owner, MODULE_NAME)(call.module.layer_idx)[:heads].to(call.query.device)  # (H, buckets)

    def buckets(self, distance: torch.Tensor) -> torch.Tensor:
        """t5_bucket(distance), read from a table of the buckets of distances 0 … max_distance (made once per device):
        every farther distance is in the last bucket, as is max_distance itself. Two operations per lookup instead
        of t5_bucket's dozen, on every layer of every decoding step."""
        table = self.on_device(distance.device, lambda d: t5_bucket(torch.arange(self.max_distance + 1, device=d),
                                                                    self.num_buckets, self.max_distance))
        return table.index_select(0, distance.clamp(0, self.max_distance))

    def by_distance(self, call, distance):
        # index_select: 5x faster than advanced indexing for one row of a decoding step
        return self.table(call).index_select(1, self.buckets(distance)).float()


@register_scheme
@dataclasses.dataclass(frozen=True)
class RelativeBiasScheme(AttentionScheme):
    """Learned relative-position bias (Shaw, Uszkoreit & Vaswani 2018, arXiv:1803.02155; bucketed as in T5, Raffel
    et al. 2020, arXiv:1910.10683): no rotation; logit(i, j) += w_{layer,h}[bucket(i − j)] with T5's causal buckets
    (`num_buckets`, exact below num_buckets/2, log-spaced to `max_distance`, clipped beyond). Unlike T5 every layer
    has its own table. `init`: 'zeros' (NoPE at start) or 'alibi' (w = −m_h·(first distance of the bucket), i.e.
    ALiBi exactly for distances < num_buckets/2). The table is a trainable module `rope_patch_relative_bias` on the
    model; `remove` detaches it."""

    name = "relative_bias"
    aliases = ("t5_bias", "relative_position_bias", "shaw")
    num_buckets: int = 32
    max_distance: int = 128
    init: str = "zeros"

    def __post_init__(self):
        n = self.name
        low, high = check.NUM_BUCKETS_RANGE
        self._set("num_buckets", check.integer(n, "num_buckets", self.num_buckets, ge=low, le=high,
                                               hint="Half are exact distances, half log-spaced (T5: 32)."))
        # t5_bucket divides by ln(max_distance / (num_buckets // 2)): it must be > 0, so max_distance > num_buckets // 2
        exact = self.num_buckets // 2
        self._set("max_distance", check.integer(
            n, "max_distance", self.max_distance, ge=exact + 1, le=check.POSITIONS_MAX,
            hint=f"The log-spaced buckets run from num_buckets//2 = {exact} (where the exact ones end) to max_distance "
                 "(T5: 128 for 32 buckets), farther distances share the last bucket. Raise max_distance or lower "
                 "num_buckets."))
        self._set("init", check.choice(n, "init", self.init, ("zeros", "alibi")))

    def _table(self, target: PatchSite) -> RelativeBias:
        # one row per layer index (the table is looked up by `layer_idx`): hybrid models (qwen3_next) have attention
        # modules on some layers only, and their rows for the other (linear-attention) layers stay unused
        modules = attention_modules(target.model)
        layers = 1 + max((m.layer_idx for m in modules), default=-1)
        heads = discovery.query_heads(target.config)
        table = RelativeBias(layers, heads, self.num_buckets, self.max_distance)
        if self.init == "alibi":
            slopes = torch.tensor(alibi_slopes(heads))
            with torch.no_grad():
                table.weight.copy_(-slopes[:, None] * bucket_start(self.num_buckets, self.max_distance))
        # where the attention layers that read it compute (accelerate's execution device under offloading); with none,
        # prepare() refuses the model after build() returns
        device = execution_device(modules[0]) if modules else None
        return table.to(device=device, dtype=table_dtype(target.model))

    def served_length(self, window):
        return UNBOUNDED  # distances ≥ max_distance share the last bucket

    def build(self, target):
        if hasattr(target.model, MODULE_NAME):
            raise ValueError(f"{self.name}: the model already has an attribute {MODULE_NAME!r}.")
        table = self._table(target)  # one object: the scores read it, the model owns it (optimizer, state_dict)
        bias = BucketBias(target.model, self.num_buckets, self.max_distance)
        scores = attention.Declared(attention.Geometry((attention.Region(),), bias=bias))
        return scores, lambda log: log.add_module(target.model, MODULE_NAME, table)
