"""Additive attention biases: ALiBi (fixed slopes) and T5/Shaw relative-position buckets (learned).

Both remove the rotation and add b_h(i − j) to the logits of query i and key j. The bias is never a (heads, L, L)
tensor: the fused path reads it from one (heads, L) vector by distance, the materialised path builds it per query
block.
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
from .common import AttachModule, AttentionScheme, DeviceTables, attention_modules, execution_device, table_dtype

MODULE_NAME = "rope_patch_relative_bias"  # attribute under which relative_bias attaches its table to the model


def alibi_slopes(n_heads: int, max_bias: float = 8.0) -> list[float]:
    """Press et al. 2022 (arXiv:2108.12409, §3 and their reference code): for n a power of two,
    m_h = 2^(−max_bias·h/n), h = 1..n. Otherwise take the n′ = 2^⌊log2 n⌋ slopes of n′ heads, then every other slope
    of the 2n′-head sequence (the ones that interleave with them) until n heads have one."""

    def power_of_two(n):
        return [2.0 ** (-max_bias * h / n) for h in range(1, n + 1)]

    if math.log2(n_heads).is_integer():
        return power_of_two(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return power_of_two(closest) + alibi_slopes(2 * closest, max_bias)[0::2][: n_heads - closest]


def _heads(q: torch.Tensor) -> torch.Tensor:
    """(b, Hkv, G, q, d) → (b, H, q, d), query head h = kv head h // G (repeat_kv order)."""
    return q.flatten(1, 2)


class DistanceBias(attention.AttentionRule):
    """An additive bias b_h(i − j) of the distance alone, per query head. On the fused path it is one kernel call per
    query block with the bias as a strided view of one (H, keys) vector (`attention.flash_distance_partial`)."""

    def by_distance(self, call, distance: torch.Tensor) -> torch.Tensor:
        """(H, n) float32: b_h(d) for the distances `distance` (n,) ≥ 0, query heads in the call's order."""
        raise NotImplementedError

    def logits(self, call, rows, start, end):
        return call.qk(call.query[:, :, :, rows], call.key[:, :, start:end]) + self.bias(call, rows, start, end)

    def bias(self, call, rows, start, end) -> torch.Tensor:
        """(1|b, Hkv, G, r, end − start) float32: b_h(i − j) looked up for every score's distance (one gather or
        multiply per score; a decoding step's row is one (H, keys) lookup). With gapped ids, a bias per element of
        the batch (distances of position ids)."""
        dist = call.distance(rows, start, end)  # (r, w), or (b, 1, 1, r, w) with gapped ids
        heads = call.query.shape[1:3]
        bias = self.by_distance(call, dist.reshape(-1))  # (H, n)
        if not call.gapped:
            return bias.view(1, *heads, *dist.shape)
        b, r, w = dist.shape[0], dist.shape[-2], dist.shape[-1]
        return bias.view(-1, b, r, w).transpose(0, 1).reshape(b, *heads, r, w)

    def fused_rows(self, heads):
        return 1024  # nothing is materialised on the fused path

    def fused(self, call, rows, end):
        return [self.near(call, rows, end, 0)]

    def near(self, call, rows, end, start):
        """The Partial of key slots [start, end) through the bias-by-distance view."""
        if "by_distance" not in call.scratch:  # once per call: every distance a block meets, the future at −inf
            distance = torch.arange(1 - call.query.shape[3], call.key.shape[2], device=call.query.device)
            bias = self.by_distance(call, distance.clamp(min=0)).masked_fill(distance < 0, float("-inf"))
            # float32 for half-precision queries (the kernel adds a float32 mask exactly); float64 queries want theirs
            call.scratch["by_distance"] = bias.to(torch.promote_types(call.query.dtype, torch.float32)).contiguous()
        return attention.flash_distance_partial(call, rows, end, call.scratch["by_distance"], start)


class AlibiScores(DistanceBias):
    """−m_h·(i − j) with the slopes of the call's query head count (layers may differ in it: heterogeneous configs);
    `max_bias` None: all slopes 0 (the apply-time check's identity setting)."""

    def __init__(self, max_bias: float | None):
        self.max_bias = max_bias
        self._by_heads: dict[int, torch.Tensor] = {}

    def heads_slopes(self, heads: int) -> torch.Tensor:
        """(H,) float32, one per query head (GQA: not per kv head)."""
        if heads not in self._by_heads:
            values = alibi_slopes(heads, self.max_bias) if self.max_bias is not None else [0.0] * heads
            self._by_heads[heads] = torch.tensor(values, dtype=torch.float32)
        return self._by_heads[heads]

    def probe(self, length):
        return AlibiScores(None)  # slopes 0: the model without positions (NoPE)

    def by_distance(self, call, distance):
        slopes = self.heads_slopes(call.query.shape[1] * call.query.shape[2]).to(call.query.device)
        return -slopes[:, None] * distance.float()  # score(i, j) −= m_h·(i − j)

    def flex(self, call, block_mask):
        """One flex_attention call; the bias is a score_mod (nothing of size L×L): s − m_h·(i − j), i − j in slots."""
        slopes = self.heads_slopes(call.query.shape[1] * call.query.shape[2]).to(call.query.device)  # flex: query head
        first = torch.tensor(call.key.shape[2] - call.query.shape[3], device=call.query.device)

        def alibi(score, b, h, qi, kv):
            return score - slopes[h] * (qi + first - kv)

        return attention.flex_call(call, _heads(call.query), call.key, call.value, block_mask, alibi)

    def flash_slopes(self, device, heads: int = 0):
        # flash_attn: fp32 (H,), bias −slope·|i − j|; asked with no head count: "has a flash form" (common.py)
        return self.heads_slopes(heads or 1).to(device=device, dtype=torch.float32)


@register_scheme
@dataclasses.dataclass(frozen=True)
class Alibi(AttentionScheme):
    """ALiBi (Press, Smith & Lewis 2022, "Train Short, Test Long", arXiv:2108.12409): no position embedding; each
    head h adds −m_h·(i − j) to the logit of query i and key j, with geometric slopes m_h = 2^(−8h/n) (`max_bias`
    = 8) and the paper's rule for head counts that are not a power of two (`alibi_slopes`)."""

    keeps_rotation = False  # position-free: no rotation (analysis: θ′ = 0)
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
        return AlibiScores(self.max_bias), None

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


class RelativeBiasScores(DistanceBias, DeviceTables):
    def __init__(self, owner: nn.Module, num_buckets: int, max_distance: int):
        # The table is looked up on its owner at call time: peft may have replaced it by a wrapper since.
        self.owner, self.num_buckets, self.max_distance = owner, num_buckets, max_distance

    def probe(self, length):
        return _ZeroTable(self.num_buckets, self.max_distance)  # a zero bias: the model without positions (NoPE)

    def table(self, call) -> torch.Tensor:
        heads = call.query.shape[1] * call.query.shape[2]  # the table has rows for the most heads any layer has
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

    def fused(self, call, rows, end):
        """Keys at distance ≥ max_distance from every row of the block all fall in the last bucket: a per-head
        constant, i.e. plain attention through the fused kernel (no mask to add) with that constant added to its
        log-sum-exp. Only the nearer keys (block + max_distance − 1 of them) go through the bias-by-distance view."""
        start = max(0, call.first_slot(rows) - self.max_distance + 1)
        near = self.near(call, rows, end, start)
        if start == 0:
            return [near]
        out, lse = attention.flash_partial(call, call.query[:, :, :, rows], call.key[:, :, :start],
                                           call.value[:, :, :start])
        last = self.table(call)[:, -1].float().view(1, -1, 1)  # (1, H, 1)
        return [(out, lse + last), near]

    def flex(self, call, block_mask):
        """One flex_attention call; the score_mod reads the per-call (H, k_len) bias-by-distance vector, so the
        table lookup costs O(L), not O(L²). Future keys (masked anyway) read distance 0."""
        k_len = call.key.shape[2]
        by_distance = self.by_distance(call, torch.arange(k_len, device=call.key.device))  # (H, k_len)
        first = torch.tensor(k_len - call.query.shape[3], device=call.query.device)

        def bias(score, b, h, qi, kv):
            return score + by_distance[h, (qi + first - kv).clamp(min=0)]

        return attention.flex_call(call, _heads(call.query), call.key, call.value, block_mask, bias)


class _ZeroTable(RelativeBiasScores):
    """The relative bias with an all-zero table (the identity setting the apply-time check runs)."""

    def __init__(self, num_buckets: int, max_distance: int):
        super().__init__(None, num_buckets, max_distance)

    def table(self, call) -> torch.Tensor:
        return torch.zeros(call.query.shape[1] * call.query.shape[2], self.num_buckets, device=call.query.device)


@register_scheme
@dataclasses.dataclass(frozen=True)
class RelativeBiasScheme(AttentionScheme):
    """Learned relative-position bias (Shaw, Uszkoreit & Vaswani 2018, arXiv:1803.02155; bucketed as in T5, Raffel
    et al. 2020, arXiv:1910.10683): no rotation; logit(i, j) += w_{layer,h}[bucket(i − j)] with T5's causal buckets
    (`num_buckets`, exact below num_buckets/2, log-spaced to `max_distance`, clipped beyond). Unlike T5 every layer
    has its own table. `init`: 'zeros' (NoPE at start) or 'alibi' (w = −m_h·(first distance of the bucket), i.e.
    ALiBi exactly for distances < num_buckets/2). The table is a trainable module `rope_patch_relative_bias` on the
    model; `remove` detaches it."""

    keeps_rotation = False  # position-free: no rotation (analysis: θ′ = 0)
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
        cfg = target.config
        # one row per layer index (the table is looked up by `layer_idx`): hybrid models (qwen3_next) have attention
        # modules on some layers only, and their rows for the other (linear-attention) layers stay unused
        modules = attention_modules(target.model)
        layers = 1 + max((m.layer_idx for m in modules), default=-1)
        heads = discovery.query_heads(cfg)
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
        scores = RelativeBiasScores(target.model, self.num_buckets, self.max_distance)
        return scores, AttachModule(target.model, MODULE_NAME, table)
