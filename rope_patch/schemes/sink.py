"""StreamingLLM: attention sinks and a rolling window, at constant memory.

Xiao, Tian, Chen, Han & Lewis 2024, "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024,
arXiv:2309.17453); reference code mit-han-lab/streaming-llm (read at 2e50426: `kv_cache.py`'s StartRecentKVCache,
`pos_shift/modify_llama.py`'s llama_pos_shift_attention_forward). Each query sees the first S tokens of the text (the
"attention sinks", `sink_size`, 4 in the paper) and the most recent ones; the tokens between are evicted from the KV
cache, and positions are taken inside the cache, not in the text.

Window. Query i sees key j when j < S (a sink) or i − j < W (`window_size`: the last W tokens, the query itself
included, as transformers' sliding windows count them); every other key is hidden. The authors' cache keeps S + R
keys between steps (`start_size` S, `recent_size` R), and the query attends to them and to itself: their R is
W − 1 here, and their default deployment "cache size = the pre-training window L" is S + W = L + 1 keys per query
(positions 0 … L); rope_patch's suggestion takes S + W = L, so the query sits at most at position L − 1.

Positions (the pos_shift form, derived). The authors rotate the cached keys, stored un-rotated, at their index in the
cache every step (`key_position_ids = arange(kv_seq_len)`) and the query at the last index. Once the text is longer
than the cache, query i sees S sinks at indices 0 … S − 1 and the window keys j ∈ (i − W, i] at indices
S + W − 1 − (i − j), the query at S + W − 1. RoPE's score depends only on the difference of the two indices
(RoFormer: rot(q, m)·rot(k, n) = rot(q, m − n)·k), so:
    window key j   index(query) − index(key) = i − j: exactly the true distance, so q at i and k at j give the same
                   score, whatever i is;
    sink key j     index(query) − index(key) = S + W − 1 − j: q at min(i, S + W − 1) against k at its true position j
                   (before the cache fills, min(i, ·) = i: the indices are the true positions).
So the keys can stay rotated at their own positions, rotated once when they are written, like vanilla RoPE: no
re-rotation per step (the feature request assumed one, which the pos_shift code does, but the scores do not need it;
the difference is the fp32 rounding of the angles, a few 1e-7 in the logits). The scheme is then a two-region rule on
the position copies of attention/copies.py: near (i − j < W) at the true positions, far (i − j ≥ W) only for the
sinks, with the query copy at min(i, S + W − 1), and every other far key hidden. The cache holds one key copy, as
vanilla.

Constant memory. Attention alone is exact with any dynamic cache: a plain `DynamicCache` keeps every key and the
rule hides the middle (memory grows with the text, left padding works). For constant memory pass a `SinkCache` to
`generate` (`SinkCache.for_model(model)`): its layers keep the S sinks and the last W − 1 keys and drop the rest,
as the authors' StartRecentKVCache does after every step. An explicit cache object rather than one installed behind
`generate`'s back: which cache to use is the caller's choice in transformers (`generate(..., cache=...)`), and
generate's own cache construction is private. A prefill (one forward over a long prompt) equals decoding the same
text token by token through the evicting cache (tests/schemes/test_sink.py). Sliding-window layers keep transformers'
own sliding cache layer (their window already bounds them).

Limits: a `SinkCache` takes unpadded batches (its layers evict the same slots of every row, and left padding puts each
row's sinks at other slots): it is refused with a left-padded `attention_mask`; a `DynamicCache` serves them.
StreamingLLM does not extend the context: a token evicted from the window is gone (the authors' README says so);
it keeps generation fluent past the window at fixed cost.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DynamicLayer,
    get_layer_types_and_kwargs,
)

from .. import attention
from .. import validation as check
from ..attention.protocol import module_state
from ..discovery import unwrap
from ..registry import register_scheme
from .base import UNBOUNDED, Suggestion
from .common import cache_arg, decoder
from .positions import TwoRegion, _check_window_size


@dataclasses.dataclass(frozen=True)
class Clamp:
    """p ↦ min(p, limit): the query's position against the sinks (S + W − 1 once the cache is full)."""

    limit: int

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        return p.clamp(max=self.limit)


class SinkScores(attention.Declared):
    """The sink geometry, with the sinks read from the cache: after a `SinkCache` layer evicted, its first
    `kept_head` = S slots are the sinks (`copies.Current.kept_head`) and the rest is the window, contiguous up to the
    queries, so slot distances are the pos_shift distances. Otherwise slot j is at position j + offset."""

    def begin(self, call):
        head = getattr(module_state(call.module).current, "kept_head", None)
        if head is not None and call.offset.numel() > 1 and bool((call.offset != call.offset[:1]).any()):
            raise ValueError(
                "sink: a SinkCache that evicted keys met a left-padded batch: its layers evict the same slots of "
                "every row, so the rows' sinks are not all kept. Generate unpadded rows one at a time with a "
                "SinkCache, or use the default DynamicCache (exact, keeps every key).")
        super().begin(call)

    def first_slots(self, call, first):
        head = getattr(module_state(call.module).current, "kept_head", None)
        if head is None:
            return super().first_slots(call, first)
        return torch.full((1, 1), head, dtype=torch.long, device=call.q_slot.device)


class SinkLayer(DynamicLayer):
    """A cache layer that keeps the first `sink_size` keys and the last `window_size` − 1 (the authors'
    StartRecentKVCache with recent_size = W − 1, applied after every forward); `update` hands back every key of the
    call (the kept ones and the new ones), so a prefill sees its whole prompt and the rule hides the middle.

    `get_seq_length` counts every token seen (positions and `generate` need it, as for transformers' sliding layers);
    `get_mask_sizes` gives the kept keys plus the queries, offset by the number evicted, so transformers' causal
    mask marks every kept key visible (its padding lookup reads the last columns of the 2-D mask: unpadded rows).
    Like any `DynamicLayer` it has no maximum length (`get_max_length` −1): the memory is bounded, the text is not."""

    is_croppable = False

    def __init__(self, sink_size: int, window_size: int, **kwargs):
        super().__init__()
        self.sink_size, self.window_size = sink_size, window_size
        self.cumulative_length = 0
        self.kept_head: int | None = None  # what the last update handed back: None contiguous, else sinks + run

    _stored = DynamicLayer.get_seq_length  # the keys it holds (its own `get_seq_length` counts every token seen)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.kept_head = self.sink_size if self.cumulative_length > self._stored() else None
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = self._evict(keys), self._evict(values)
        return keys, values

    def _evict(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-2]
        if n <= self.sink_size + self.window_size - 1:  # within what the layer keeps
            return x
        return torch.cat([x[..., :self.sink_size, :], x[..., n - (self.window_size - 1):, :]], dim=-2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self._stored()
        return stored + query_length, self.cumulative_length - stored

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def crop(self, tokens_to_remove: int) -> None:
        if self.cumulative_length > self._stored():
            raise RuntimeError("sink: a SinkCache layer that evicted keys cannot be cropped (the evicted keys are "
                               "gone).")
        super().crop(tokens_to_remove)
        self.cumulative_length = self._stored()

    def reset(self) -> None:
        super().reset()
        self.kept_head = None


class SinkCache(Cache):
    """StreamingLLM's KV cache for a model patched with `sink`: `SinkLayer`s for the full-attention layers (S sinks +
    the last W − 1 keys), transformers' own layers for the others (sliding windows, linear attention). Memory stays
    at S + W − 1 keys per layer whatever the length. Pass it to `generate` (`cache=`; `past_key_values=` before
    transformers 5.24) or to forward calls.

        cache = SinkCache.for_model(model)       # the sink_size / window_size of the applied scheme
        model.generate(ids, cache=cache, max_new_tokens=4096)
    """

    def __init__(self, config, sink_size: int = 4, window_size: int | None = None, offloading: bool = False):
        if window_size is None:
            raise TypeError("SinkCache: missing `window_size` (the scheme's; SinkCache.for_model(model) reads it).")
        sink_size = check.integer("sink", "sink_size", sink_size, ge=0, le=check.WINDOW_RANGE[1])
        window_size = _check_window_size("sink", window_size)
        types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        layers = [SinkLayer(sink_size, window_size) if t == "full_attention" else DYNAMIC_LAYER_TYPE_MAPPING[t](**kw)
                  for t, kw in zip(types, kwargs, strict=True)]
        self.sink_size, self.window_size = sink_size, window_size
        super().__init__(layers=layers, offloading=offloading)

    @classmethod
    def for_model(cls, model, offloading: bool = False) -> SinkCache:
        """The cache for a model that carries `sink` (alone or in a stack such as `yarn:2+sink`): the sizes are read
        from the scheme's guard on the model's decoder."""
        base = unwrap(model)
        hooks = getattr(decoder(base), "_forward_pre_hooks", {}).values()
        guard = next((h for h in hooks if isinstance(h, SinkGuard)), None)
        if guard is None:
            raise ValueError(f"SinkCache.for_model: {type(base).__name__} carries no `sink` scheme; apply it first: "
                             "rope_patch.apply(model, 'sink:window_size=...').")
        return cls(base.config, guard.sink_size, guard.window_size, offloading=offloading)


class SinkGuard:
    """Forward pre-hook on the decoder: a `SinkCache` must have the scheme's sizes, and take unpadded rows."""

    def __init__(self, sink_size: int, window_size: int):
        self.sink_size, self.window_size = sink_size, window_size

    def __call__(self, module, args, kwargs):
        layer = next((x for x in getattr(cache_arg(kwargs), "layers", None) or () if isinstance(x, SinkLayer)), None)
        if layer is None:
            return
        sizes = (layer.sink_size, layer.window_size)
        if sizes != (self.sink_size, self.window_size):
            raise ValueError(f"sink: the SinkCache keeps sink_size={sizes[0]}, window_size={sizes[1]} but the model "
                             f"runs sink_size={self.sink_size}, window_size={self.window_size}. Build it with "
                             "SinkCache.for_model(model).")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
            raise ValueError(
                "sink: a SinkCache takes unpadded rows (its layers evict the same slots of every row, and left padding "
                "puts each row's sinks at other slots); found zeros in attention_mask. Generate rows one at a time "
                "with a SinkCache, or leave `cache` out (the default DynamicCache is exact with padding, at growing "
                "memory).")


@register_scheme
@dataclasses.dataclass(frozen=True)
class Sink(TwoRegion):
    """StreamingLLM (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453;
    reference code mit-han-lab/streaming-llm): each query sees the first `sink_size` tokens (S, the attention sinks)
    and the last `window_size` tokens (W, itself included); positions are taken inside the cache, which by RoPE's
    relative property is q at i, k at j for the window and q at min(i, S + W − 1) for the sinks (derivation in the
    module docstring of rope_patch/schemes/sink.py). With `SinkCache.for_model(model)` passed to `generate`, memory
    stays at S + W − 1 keys per layer. It does not extend the context: evicted tokens are gone."""

    name = "sink"
    aliases = ("streaming_llm", "streamingllm", "attention_sink", "attention_sinks")
    bare_param = "window_size"
    window_size: int | None = None
    sink_size: int = 4

    @classmethod
    def search_space(cls, window, target):
        return {"sink_size": [4], "window_size": [window // 4, window // 2, window - 4]}

    @classmethod
    def suggestion(cls, n, window):
        """4 sinks (Xiao et al. 2024 §3.2: four initial tokens restore window attention's perplexity) and a cache the
        size of the pre-training window (the authors' README: "the maximum cache size … remains 4096" for Llama-2):
        W = L − 4, so every position stays below L. It bounds memory and keeps generation fluent past L; it does not
        let the model use what leaves the window."""
        if n <= window or window <= 5:
            return None
        w = window - 4
        return Suggestion.of(cls.name, {"sink_size": 4, "window_size": w},
                             f"4 sinks + a window of L − 4 = {w}: the cache is the pre-training window L = {window} "
                             "(Xiao et al. 2024); constant memory past L, but tokens older than the window are dropped")

    def __post_init__(self):
        n = self.name
        self._set("window_size", _check_window_size(n, self.window_size))
        self._set("sink_size", check.integer(n, "sink_size", self.sink_size, ge=0, le=check.WINDOW_RANGE[1],
                                             hint="The number of initial tokens kept (4 in the paper; 0 is plain "
                                                  "window attention, the paper's failing baseline)."))

    def far_positions(self):
        return Clamp(self.sink_size + self.window_size - 1), attention.Identity()

    def served_length(self, window):
        # the largest relative position is a sink's, S + W − 1, whatever the length: below L once S + W ≤ L (a token
        # evicted from the window is gone, but generation goes on at fixed cost, which is what the scheme serves)
        return UNBOUNDED if self.sink_size + self.window_size <= window else None

    def geometry(self):
        """The window at true positions; beyond it only the first `sink_size` keys, the query at min(i, S + W − 1)."""
        w = self.window_size
        return attention.Geometry((attention.Region(hi=w), attention.Region(query=1, lo=w, first=self.sink_size)))

    def build(self, target):
        guard = SinkGuard(self.sink_size, self.window_size)
        return SinkScores(self.geometry()), lambda log: log.add_hook(decoder(target.model), guard, with_kwargs=True)
