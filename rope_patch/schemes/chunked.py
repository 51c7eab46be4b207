"""Dual Chunk Attention (DCA, ChunkLlama): positions that never leave the pre-training window.

An, Huang, Zhang, Gong, Qiu, Zhou & Kong 2024, "Training-Free Long-Context Scaling of Large Language Models"
(arXiv:2402.17463, §3, Algorithm 1); reference code HKUNLP/ChunkLlama `chunkllama_attn_replace.py` (read at 2add4d7c)
and the dense part of vLLM's / Qwen2.5-1M's `dual_chunk_attention_config`, whose key names this scheme uses.

With `chunk_size` s and `local_size` l, the sequence is cut by *true position* into chunks of c = s − l tokens; token
p is in chunk n(p) = ⌊p/c⌋. Keys are rotated to j mod c. A query at i reads

    intra-chunk       n(j) = n(i)        q at i mod c                   relative position i − j (exact RoPE)
    successive-chunk  n(j) = n(i) − 1    q at min(i mod c + c, s)       min(i − j, s − j mod c)
    inter-chunk       n(j) ≤ n(i) − 2    q at min(2c − 1, s)            min(2c − 1, s) − j mod c

so every relative position lies in [0, s]: a model pre-trained on L ≥ s positions never sees a distance it was not
trained on, at any sequence length. Neighbours stay exact across a chunk boundary for the first l + 1 queries of a
chunk (their successive-chunk positions c … s are their true distances to the previous chunk). The three partial
softmaxes are one softmax over the union of their keys (the paper's §3.4 normalisation, merged by log-sum-exp).
Defaults: s = ¾·L and l = L/8 (the authors' `replace_with_chunkllama`, L = the pre-training window), or the
`chunk_size` / `local_size` of the model config's `dual_chunk_attention_config` (Qwen2.5-1M ships one; its sparse
attention keys are not read: this is the dense DCA). With s ≥ N and 2(s − l) ≥ N for every length N it runs at, DCA
is exactly RoPE (at most two chunks, no clipping); s ≥ N alone is not enough.

Realised as three regions by chunk (attention/geometry.py) over the layer's position copies (attention/copies.py):
the layer rotates its keys to j mod c and its queries to their three positions with its own rotary, and the regions
pick which query copy each pair reads. Chunks are counted in true positions (`AttentionCall.offset`), so left padding
and sliding-window caches do not move them.

Where the paper, the authors' code and rope_patch differ:
- Parameterisation. The paper's chunk size s is the modulus, its P_q^Succ = [s, …, s + w − 1, c − 1, …] and
  P_q^Inter = c − 1 with c the pre-training length (eqs. 5, 7). The code's `chunk_size` is the largest query position
  and its modulus is chunk_size − local_window; it is the paper's formula with s_paper = chunk_size − local_size,
  c_paper − 1 = chunk_size and w = local_size + 1, except that the code's inter-chunk query is at
  min(2c − 1, chunk_size) instead of c_paper − 1 (they differ only when 2(chunk_size − local_size) − 1 < chunk_size).
  rope_patch follows the code (and vLLM's dense DCA, which uses the same positions).
- The code multiplies q and k by 0.05·ln(N/L) + 1 when N > L (logits by its square; its comment: "employing yarn will
  lead to better performance but results reported in our paper did not use yarn"); rope_patch does not scale.
- The code casts its prefill merge weights to bf16 whatever the model dtype (~1e-2 logits) and detaches them (no
  gradient through the normaliser); rope_patch merges in fp32 and its gradients are those of the one softmax.
- The code recomputes its q/k scale only when a longer sequence arrives, so cached keys keep the scale of the prompt
  and decoding differs from recomputation; here cached decoding equals recomputation.
- The code chunks by slot index (no left padding support), and its cached path puts every new query in the chunk
  of the last key (written for one token per step); rope_patch chunks by true position, for any number of new
  tokens per cached call (chunked prefill).
- Both equal vanilla RoPE only when 2·(chunk_size − local_size) ≥ N as well as chunk_size ≥ N: with the defaults
  (chunk_size = ¾·L) DCA already changes the model for sequences longer than ¾·L, inside the pre-training window.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import attention
from .. import validation as check
from ..registry import register_scheme
from .base import UNBOUNDED, Suggestion
from .common import AttentionScheme
from .positions import Affine

CONFIG_KEY = "dual_chunk_attention_config"  # the config attribute (Qwen2.5-1M, vLLM); a dict with these keys
# The checked sizes (the scheme's two parameters; a config may also give the window their defaults derive from): the
# smallest value of each, and what it is (the hint of its error message)
_SIZES = {
    "chunk_size": (2, "It is the largest relative position DCA uses (¾ of the pre-training window by default; "
                      "Qwen2.5-1M: the window itself); chunks hold chunk_size − local_size tokens."),
    "local_size": (1, "It is how many neighbours across a chunk boundary keep their exact distance (⅛ of the "
                      "pre-training window by default); it must be below chunk_size."),
    "original_max_position_embeddings": (2, "It is the pre-training window the default chunk_size/local_size derive "
                                            "from."),
}


@dataclasses.dataclass(frozen=True)
class InChunk:
    """p ↦ p mod c (+ c, capped at `cap` = s, for the query of a successive-chunk pair): a position copy of the
    layer."""

    chunk: int
    cap: int | None = None

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        q = torch.remainder(p, self.chunk)
        return q if self.cap is None else (q + self.chunk).clamp(max=self.cap)


def _sizes(values: dict, where: str = "") -> dict:
    """The sizes of `_SIZES` that `values` (the scheme's parameters, or a dual_chunk_attention_config) sets, checked:
    integers in [low, POSITIONS_MAX]; `where` names a config they were read from."""
    return {key: check.integer("dca", f"{key}{where}", values[key], ge=low, le=check.POSITIONS_MAX, hint=hint)
            for key, (low, hint) in _SIZES.items() if values.get(key) is not None}


def _defaults(window: int) -> dict:
    """The authors' sizes for a pre-training window L (ChunkLlama's `replace_with_chunkllama`): ¾·L and L/8."""
    return {"chunk_size": window * 3 // 4, "local_size": max(1, window // 8)}


@register_scheme
@dataclasses.dataclass(frozen=True)
class DualChunk(AttentionScheme):
    """Dual Chunk Attention (An et al. 2024, arXiv:2402.17463; HKUNLP/ChunkLlama): chunks of chunk_size − local_size
    tokens by true position; keys at j mod c, queries at i mod c (own chunk), min(i mod c + c, chunk_size) (previous
    chunk) and min(2c − 1, chunk_size) (older chunks). The module docstring has the formula and where the paper and
    the authors' code differ. `chunk_size` (default ¾·L) and `local_size` (default L/8), L the pre-training window,
    or both from the model config's `dual_chunk_attention_config` (Qwen2.5-1M, vLLM)."""

    name = "dca"
    aliases = ("dual_chunk_attention", "dual_chunk", "chunkllama", "chunk_llama")
    chunk_size: int | None = None
    local_size: int | None = None

    @classmethod
    def suggestion(cls, n, window):
        """chunk_size = ¾·L, local_size = L/8 (An et al. 2024, arXiv:2402.17463; ChunkLlama's
        `replace_with_chunkllama` defaults)."""
        sizes = _defaults(window)
        if n <= window or sizes["chunk_size"] <= sizes["local_size"]:
            return None
        return Suggestion.of(cls.name, sizes, f"chunk_size = ¾·L = {sizes['chunk_size']}, local_size = L/8 = "
                                              f"{sizes['local_size']} (An et al. 2024, ChunkLlama defaults)")

    def __post_init__(self):
        for key, value in _sizes(self.params()).items():
            self._set(key, value)
        _check_pair(self.chunk_size, self.local_size)

    @classmethod
    def from_dual_chunk_attention_config(cls, config: dict) -> DualChunk:
        """The scheme a `dual_chunk_attention_config` dict describes (its dense keys chunk_size and local_size)."""
        sizes, _ = _config_values(config, f" (from {CONFIG_KEY})")
        missing = [k for k in ("chunk_size", "local_size") if k not in sizes]
        if missing:
            raise ValueError(f"dca: {CONFIG_KEY} {config!r} lacks {', '.join(missing)}; it needs chunk_size "
                             "and local_size.")
        return cls(**sizes)

    def served_length(self, window):
        # queries sit at most at chunk_size, keys at ≥ 0: every relative position is ≤ chunk_size, whatever the length
        return UNBOUNDED if self.chunk_size is not None and self.chunk_size < window else None

    def with_window(self, window: int) -> DualChunk:
        """The authors' defaults for a pre-training window L where a size is not given: ¾·L and L/8 (`replace` checks
        the pair)."""
        return self.replace(**{**_defaults(window), **self.params()})

    def resolve(self, target):
        raw = getattr(target.config, CONFIG_KEY, None)
        values, window = ({}, None) if raw is None else _config_values(raw, f" (from the model config's {CONFIG_KEY})")
        if window is None and None in (self.chunk_size, self.local_size):  # only the defaults need L
            window = target.pretraining_window
        # each size: given, else the config's, else the default
        sizes = {**(_defaults(window) if window is not None else {}), **values, **self.params()}
        origin = {k: "given" if getattr(self, k) is not None else f"from the model config's {CONFIG_KEY}" if k in values
                  else f"the default for a {window}-token window" for k in sizes}
        _check_pair(sizes["chunk_size"], sizes["local_size"], origin)
        return self.replace(**sizes)

    def copies(self):
        """Copy 0: queries and keys at p mod c; copy 1: queries at min(p mod c + c, s); copy 2: at min(2c − 1, s)."""
        if self.chunk_size is None:
            raise TypeError("dca: chunk_size and local_size are needed (they default to ¾·L and L/8 of a "
                            "model's window).")
        s, c = self.chunk_size, self.chunk_size - self.local_size
        return attention.Layout((InChunk(c), InChunk(c, cap=s), Affine(0, min(2 * c - 1, s))))

    def layout(self, module):
        # every layer alike: sliding windows only hide pairs, the regions are per pair
        layout = self.copies()
        # A layer with memory (DeepSeek-V4) decides inside itself, from its position ids, which memory entries a query
        # sees (and its indexer which it picks): one more copy at the tokens' own positions decides that
        # (protocol.own_rows reads the mask from it); DCA's copies are all at chunk positions.
        own = (attention.Identity(),) if attention.memory_rotaries(module) else ()
        return dataclasses.replace(layout, maps=(*layout.maps, *own))

    def geometry(self) -> attention.Geometry:
        """Three regions by chunk, every one against the keys at j mod c: the query's own chunk (copy 0), the one
        before (copy 1), the older ones (copy 2)."""
        c = self.chunk_size - self.local_size
        return attention.Geometry((attention.Region(hi=1, chunk=c), attention.Region(query=1, lo=1, hi=2, chunk=c),
                                   attention.Region(query=2, lo=2, chunk=c)))


def _config_values(raw, where: str) -> tuple[dict, int | None]:
    """The dense DCA sizes of a dual_chunk_attention_config (a dict; sparse-attention keys are ignored), checked, and
    the pre-training window it gives for their defaults (None where it gives none)."""
    if not isinstance(raw, dict):
        raise TypeError(f"dca: {CONFIG_KEY} must be a dict such as {{'chunk_size': 24576, 'local_size': 4096}}, got "
                        f"{type(raw).__name__} {raw!r}{where}.")
    sizes = _sizes(raw, where)
    return sizes, sizes.pop("original_max_position_embeddings", None)


def _check_pair(chunk: int | None, local: int | None, origin: dict | None = None) -> None:
    """chunk_size > local_size, where both are known (`origin`: where each came from, for the message)."""
    if chunk is None or local is None or chunk > local:
        return
    said = "" if origin is None else f" (chunk_size {origin['chunk_size']}, local_size {origin['local_size']})"
    raise ValueError(
        f"dca: parameter `chunk_size` must be larger than `local_size` (chunks hold chunk_size − local_size ≥ 1 "
        f"tokens), got chunk_size={chunk}, local_size={local}{said}. Pass e.g. chunk_size=¾·L and local_size=L/8 for "
        "a pre-training window L (the authors' defaults)."
    )
