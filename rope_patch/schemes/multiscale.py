"""Ms-PoE, Multi-scale Positional Encoding: a position-interpolation ratio per attention head.

Zhang, Chen, Liu, Yao, Ruwase, Chen, Wu & Wang 2024, "Found in the Middle: How Language Models Use Long Contexts
Better via Plug-and-Play Multi-scale Positional Encoding" (arXiv:2403.04797, §3); reference code VITA-Group/Ms-PoE
`utils/modify_arch/llama.py` (read at a46c3d1). Head h rotates its queries and keys at p/r_h instead of p, so its
relative distances shrink by r_h (RoPE's long-term decay relaxed, the middle of the context less faint), with
ratios spread between `min_ratio` and `max_ratio`:

    r_k = min_ratio + (max_ratio − min_ratio)·k/n,   k = 0 … n − 1   (n ratio slots: max_ratio itself is never used)

and which head takes which ratio decided from the prompt: heads whose last prompt query puts more attention weights
above 3× the mean (the paper's "position-aware" heads, its outlier score) are ordered first. It does not extend the
context (the paper runs it inside the window): it helps the model use the middle of a context that already fits.

What rope_patch decided, and why:

(a) How the per-head positions reach the heads: as position copies of the layer (attention/copies.py), one copy per
    ratio slot plus one at position 0 for the outlier score; the attention function then gives each head the
    queries and keys of its ratio's copy. The copies run the layer's own code, so whatever a layer does after RoPE
    (q/k norms, partial rotary, interleaved pairs, a shipped or stacked frequency scaling) is exact, on every
    architecture the apply-time check proves. The price: the attention layer's projections run on (n + 1)·b rows
    (4× on SmolLM2's 3 KV heads, 33× on an MHA model with 32 heads: Llama 2, the authors' Vicuna). The cache keeps
    what a head reads: once a prompt has fixed the order, KV head g's keys of its ratio alone (`Layout.chosen`), so
    the cache is vanilla's and a decoding step reads one key set, as vanilla's does. The prompt's keys are stored
    after its attention computed the order (attention/copies.py `CacheView`). Exception: a layer that reads another
    layer's cached keys (KV sharing: Gemma 3n, Gemma 4) would need them in its own order, so on such models (found
    by the apply-time check) the cache keeps all n + 1 key sets ((n + 2)/2 of vanilla's) and a one-row step reads
    each KV head's set in place (`MultiScaleScores.logits`), copying none. A per-head rotation inside the attention
    function (deferred RoPE) would run the projections once, but is exact only where nothing sits between RoPE and
    the scores.
(b) GQA: one ratio per KV head (n = number of KV heads), shared by the query heads of its group, whose outlier
    scores are averaged. The authors' code targets MHA (Llama 2 / Vicuna): on GQA it rotates each query head with its
    own ratio and the shared keys with the ratio of the group's first query head, so q and k of the other heads
    sit at different scales and their logits stop being a function of i − j. Per-query-head ratios with the keys
    repeated (repeat_kv) would need G key sets per KV head in the cache (H copies); per KV head keeps the scheme a
    relative encoding at n = Hkv copies. On MHA both are the authors' computation.
(c) The head order is computed from the prompt as the authors do: at a call whose queries are all its keys (a
    prefill, with or without a cache), from q and k at position 0 (the un-rotated ones on a plain RoPE layer, as
    the authors' code reads them before rotation) of the last query against every real key of its row, per row of
    the batch (the last slot: a real token under left padding, as generate pads; a right-padded row would be ordered
    by a pad's query); cached calls reuse that order (the cache holds keys rotated with it). Each fresh prompt
    recomputes it, where the authors' code keeps the first prompt's order until a manual `_reset()`. Consequence:
    generation without a cache recomputes the order from each longer input, so it is not the cached generation; cached
    generation equals a full forward with the prompt's order (tests/schemes/test_ms_poe.py). The order is kept per layer
    on the scheme's attention rule, so one model serves one generation at a time.
    Which head takes which ratio follows the code: it sorts the heads by outlier score (most outliers first, ties in
    head order) and indexes its per-ratio tables with that permutation (`cos[head_order]`), so head g takes ratio
    slot order[g]; the paper's wording (the k-th most position-aware head takes r_k) is the inverse permutation.
(d) Layers: the first `skip_layers` keep vanilla RoPE (the authors' scripts apply Ms-PoE to layers 2 … 31 of
    Vicuna-7B's 32), every later layer takes the ratios. Unset, it is their 2, or one less than the model's layers
    on a model of at most two (so some layer keeps Ms-PoE); a value that leaves no layer is refused.

Parameter names: `min_ratio` / `max_ratio` are the authors' `compress_ratio_min` / `compress_ratio_max` (their
rotary's `min_cratio` / `max_cratio`), defaults 1.2 / 1.8 as in their scripts; `skip_layers` stands for their
`apply_layers` list. Their `head_type="normal"` (a fixed order, used in their script for some answer positions) is
not offered: the paper's method is the outlier order.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn.attention.flex_attention import BlockMask

from .. import attention
from .. import validation as check
from ..registry import register_scheme
from .base import Suggestion
from .common import AttentionScheme, attention_modules
from .positions import Affine

RATIO_RANGE = (1.0, 64.0)
DEFAULT_SKIP = 2  # the authors' scripts: `--apply_layers 2,...,31` on Vicuna-7B's 32 layers
OUTLIER = 3.0  # a weight above 3× the row's mean weight is an outlier (the authors' `_calculate_outlier`)


def ratios(min_ratio: float, max_ratio: float, n: int) -> list[float]:
    """The n ratio slots r_k = min + (max − min)·k/n (the authors' `_set_cos_sin_cache`)."""
    return [min_ratio + (max_ratio - min_ratio) * k / n for k in range(n)]


def visible_keys(call: attention.AttentionCall) -> torch.Tensor:
    """(b|1, k) bool: the keys the last query row may attend: its row of the mask the attention function received
    (`scratch["attention_mask"]`: a boolean or additive tensor, or flex's BlockMask), all keys without one, and only
    its own segment of a packed row."""
    mask, k_len, dev = call.scratch.get("attention_mask"), call.key.shape[2], call.key.device
    if mask is None:
        seen = torch.ones(1, k_len, dtype=torch.bool, device=dev)
    elif isinstance(mask, BlockMask):
        seen = attention.mask_rows(mask, call.query.shape[3] - 1, 1, k_len)[:, 0, 0]
    else:
        row = mask[:, 0, -1, :]
        seen = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    q_len = call.query.shape[3]
    same = call.segments(slice(q_len - 1, q_len), 0, k_len)
    return seen if same is None else seen & same.reshape(-1, k_len)


PER_HEAD = attention.Geometry((attention.Region(chosen=True),))  # every key, each KV head at its own ratio's copy


class MultiScaleScores(attention.Declared):
    """One region over every key, each KV head (and its query heads) reading its ratio's copy, `1 + order[g]`
    (`Region.chosen`); copy 0 (position 0) gives the outlier scores of a prefill. A layer handed over as one copy (a
    layer the scheme skips) attends as the model does. `orders[layer_idx]` (b, Hkv): the prompt's head order. After the
    prompt the cache hands back one key set, each head's ratio set (`chosen_sets`), except on a model whose layers
    share keys (module docstring, (a))."""

    def __init__(self, geometry: attention.Geometry = PER_HEAD):
        super().__init__(geometry)
        self.orders: dict[int, torch.Tensor] = {}
        self.chosen: dict[int, list[int]] = {}  # orders[layer][0] as a list (no device read per step)

    def begin(self, call):
        hkv = call.key.shape[1]
        if len(call.queries) > 1:  # not a skipped layer
            if len(call.queries) < hkv + 1 or len(call.queries) > hkv + 2:  # the check adds one copy of its own
                raise attention.NotProven(f"ms_poe: the layer has {hkv} key/value heads but {len(call.queries) - 1} "
                                          "ratio copies (read from its config at apply time)")
            layer = call.module.layer_idx
            if call.prompt:  # its order (from its last query), for this call and the cached ones after
                self.orders[layer] = head_order(call.queries[0][:, :, :, -1:], call.keys[0], visible_keys(call), call)
                self.chosen[layer] = self.orders[layer][0].tolist()  # one row's, read by its decoding steps
            self.chosen_sets(layer, call.query.shape[0])  # a cached call without its prompt's order: the error now
        super().begin(call)

    def chosen_sets(self, layer_idx, rows):
        """Key set 1 + order[g] for KV head g (set 0: position 0, read only by a prompt's order), or a clear error
        where no prompt computed the order for `rows` rows."""
        order = self.orders.get(layer_idx)
        if order is None or order.shape[0] != rows:
            raise ValueError(
                f"ms_poe: a cached call (layer {layer_idx}, batch {rows}) without the head order of its prompt "
                f"({'none computed' if order is None else f'the last prompt had batch {order.shape[0]}'}): "
                "the order is computed when a call's queries are all its keys (the prompt). Start from the "
                "prompt with an empty cache (model.generate does).")
        return order + 1

    def chosen_copies(self, call):
        return range(1, call.key.shape[1] + 1)  # the ratio copies (not position 0, nor the check's own)

    def logits(self, call, rows, start, end):
        if (len(call.queries) == 1 or len(call.keys) == 1 or call.query.shape[0] > 1
                or call.query.shape[3] > attention.settings.DECODE_ROWS):
            return super().logits(call, rows, start, end)
        # an optimisation (test_ms_poe.py: its steps equal the whole sequence's logits): a decoding step of one row with
        # every key set cached (KV sharing), each KV head's scores read its ratio's set in place, where gathering
        # the chosen heads would copy every cached key at every step
        chosen = self.chosen[call.module.layer_idx]
        return torch.cat([call.qk(call.queries[1 + s][:, g:g + 1, :, rows], call.keys[1 + s][:, g:g + 1, start:end])
                          for g, s in enumerate(chosen)], dim=1)


def head_order(q_last: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, call) -> torch.Tensor:
    """(b, Hkv) int64: each KV head's ratio slot. q_last (b, Hkv, G, 1, d), keys (b, Hkv, k, d) at position 0; visible
    (b|1, k) the real keys. A query head's outlier score is the fraction of the real keys whose weight exceeds
    3× the mean weight 1/n (the authors' `_calculate_outlier`, on the last query: their `[:, -1]`); a KV head's is its
    query heads' mean; heads sorted by score, most outliers first, ties in head order."""
    s = call.qk(q_last, keys).masked_fill(~visible[:, None, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    n = visible.sum(-1).clamp(min=1).to(p.dtype)[:, None, None, None, None]
    score = ((p > OUTLIER / n).sum(-1, keepdim=True) / n).mean(dim=(2, 3, 4))  # (b, Hkv)
    return torch.argsort(-score, dim=-1, stable=True)


@register_scheme
@dataclasses.dataclass(frozen=True)
class MsPoE(AttentionScheme):
    """Ms-PoE (Zhang et al. 2024, arXiv:2403.04797; VITA-Group/Ms-PoE): each KV head's queries and keys at p/r, its own
    ratio r in [min_ratio, max_ratio), the heads ordered by the outlier score of the prompt's attention; the first
    `skip_layers` layers keep vanilla RoPE. The module docstring says what was decided and why."""

    name = "ms_poe"
    aliases = ("mspoe", "multiscale_poe")
    bare_param = "max_ratio"
    changes = "the positions of each attention head (p/r_h, r_h from the prompt's attention)"
    min_ratio: float = 1.2
    max_ratio: float = 1.8
    skip_layers: int | None = None  # None: the authors' 2, fewer on a model of at most 2 layers (one keeps Ms-PoE)

    @classmethod
    def suggestion(cls, n, window):
        """The authors' scripts: ratios 1.2 … 1.8, layers from the third on. For contexts that fit (N ≤ L): Ms-PoE
        helps the model use the middle of a context, it does not extend it."""
        if n > window:
            return None
        return Suggestion.of(cls.name, {"min_ratio": 1.2, "max_ratio": 1.8},
                             f"ratios 1.2 … 1.8 per head, layers 2 on (Zhang et al. 2024, VITA-Group/Ms-PoE scripts); "
                             f"N = {n} ≤ L = {window}: it helps use the middle of the context, it does not extend it")

    @classmethod
    def search_space(cls, window, target):
        return {"min_ratio": [1.0, 1.2, 1.5], "max_ratio": [1.8, 2.0, 2.5]}

    def __post_init__(self):
        n = self.name
        low, high = RATIO_RANGE
        hint = "Positions p become p/r: r = 1 is vanilla RoPE; the authors use 1.2 … 1.8."
        self._set("min_ratio", check.number(n, "min_ratio", self.min_ratio, ge=low, le=high, hint=hint))
        self._set("max_ratio", check.number(n, "max_ratio", self.max_ratio, ge=low, le=high, hint=hint))
        if self.max_ratio < self.min_ratio:
            raise ValueError(f"{n}: parameter `max_ratio` must be at least `min_ratio`, "
                             f"got min_ratio={self.min_ratio}, max_ratio={self.max_ratio}. The authors use "
                             "min_ratio=1.2, max_ratio=1.8.")
        if self.skip_layers is not None:
            self._set("skip_layers", check.integer(n, "skip_layers", self.skip_layers, ge=0, le=100_000,
                                                   hint="The first skip_layers layers keep vanilla RoPE "
                                                        "(the authors: 2)."))

    def resolve(self, target):
        layers = {m.layer_idx for m in attention_modules(target.model)}
        if any(i < 0 for i in layers):
            raise ValueError(f"{self.name}: {target.model_type} runs one attention module at several depths (layer_idx "
                             "-1, a shared block): the prompt's head order is kept per layer, "
                             "and one module cannot keep one per depth for cached decoding. Ms-PoE is not supported on "
                             "this model; the frequency schemes are.")
        count = len(layers)
        if not count:  # no layer attends through transformers' interface: the common checks refuse, with the reason
            return self
        if self.skip_layers is None:  # the authors' 2 of 32; at least one layer keeps Ms-PoE on a tiny model
            return self.replace(skip_layers=min(DEFAULT_SKIP, count - 1))
        if self.skip_layers >= count:
            raise ValueError(f"{self.name}: parameter `skip_layers` leaves no layer to apply to: the model has "
                             f"{count} attention layers, got skip_layers={self.skip_layers}. Use a smaller value (the "
                             "authors skip 2 of 32).")
        return self

    def layout(self, module):
        if module.layer_idx < (DEFAULT_SKIP if self.skip_layers is None else self.skip_layers):
            return None
        n = _kv_heads(module)
        # copy 0 at position 0 (un-rotated q and k on a plain RoPE layer, for the outlier score), then p ↦ p / r_k
        return attention.Layout((Affine(0, 0), *(Affine(r, 0) for r in ratios(self.min_ratio, self.max_ratio, n))),
                                key_copies=tuple(range(n + 1)), chosen=True)

    def build(self, target):
        return MultiScaleScores(), None


def _kv_heads(module) -> int:
    """The layer's number of key/value heads: its query heads over its `num_key_value_groups` where it has them (layers
    of one model can differ: MiMo-V2-Flash's sliding layers), else its config's count. The attention function checks
    it against the keys it receives (a mismatch is refused by the apply-time check)."""
    cfg = getattr(module, "config", None)
    heads = getattr(module, "num_heads", None) or getattr(cfg, "num_attention_heads", None)
    groups = getattr(module, "num_key_value_groups", None)
    if isinstance(heads, int) and isinstance(groups, int) and groups > 0 and heads % groups == 0:
        return heads // groups
    for name in ("num_key_value_heads", "num_attention_heads"):
        value = getattr(module, name, None) or getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"ms_poe: cannot read the number of key/value heads of {type(module).__name__}")
