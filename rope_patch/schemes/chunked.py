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

Realised as deferred RoPE: the model's rotary is the identity (the cache holds un-rotated keys); per call the keys are
rotated once to j mod c with the model's own rotary forward and `apply_rotary_pos_emb`, queries to their three
positions per block. Chunks are counted in true positions (`AttentionCall.offset`), so left padding and sliding-window
caches do not move them.

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
from torch.nn.attention.flex_attention import BlockMask

from .. import attention
from .. import validation as check
from ..registry import register_scheme
from .base import UNBOUNDED, Suggestion
from .common import AttentionScheme

INTRA, SUCC, INTER = 0, 1, 2
CONFIG_KEY = "dual_chunk_attention_config"  # the config attribute (Qwen2.5-1M, vLLM); a dict with these keys
_HINT = {
    "chunk_size": "It is the largest relative position DCA uses (¾ of the pre-training window by default; Qwen2.5-1M: "
                  "the window itself); chunks hold chunk_size − local_size tokens.",
    "local_size": "It is how many neighbours across a chunk boundary keep their exact distance (⅛ of the pre-training "
                  "window by default); it must be below chunk_size.",
}


def _merge_lse(parts: list[attention.Partial]) -> attention.Partial:
    """Partials over disjoint keys → one Partial (out, lse) over their union (log-sum-exp weights, fp32)."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    out = sum(torch.exp(p_lse - lse)[..., None] * out for out, p_lse in parts)
    return out, lse


@dataclasses.dataclass(frozen=True)
class InChunk:
    """p ↦ p mod c (+ c, capped at s, for the query of a successive-chunk pair): a position copy of the layer."""

    chunk: int
    successive: bool = False
    cap: int = 0

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        q = torch.remainder(p, self.chunk)
        return (q + self.chunk).clamp(max=self.cap) if self.successive else q


@dataclasses.dataclass(frozen=True)
class Fixed:
    """p ↦ a constant position (DCA's inter-chunk query at min(2c − 1, s))."""

    position: int

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        return torch.full_like(p, self.position)


class DualChunkScores(attention.AttentionRule):
    """The three DCA regions of every (query, key) pair, by the chunks of their true positions.

    The layer hands over its queries at the three positions and its keys at j mod c, computed by its own code
    (attention/copies.py): `queries[INTRA]`, `queries[SUCC]`, `queries[INTER]`, `key`. Held across blocks: the batch's
    position offsets on the host (the chunk boundaries in key slots, one device→host read per call)."""

    flex_lse = True  # the flex form merges three flex calls by log-sum-exp

    def __init__(self, chunk_size: int, local_size: int):
        self.chunk_size, self.local_size = chunk_size, local_size
        self.chunk = chunk_size - local_size  # c: tokens per chunk, the key positions' modulus
        self.inter_position = min(2 * self.chunk - 1, chunk_size)

    def layout(self) -> attention.Layout:
        """Copy INTRA: queries and keys at p mod c; SUCC: queries at min(p mod c + c, s); INTER: at min(2c − 1, s)."""
        return attention.Layout((InChunk(self.chunk), InChunk(self.chunk, True, self.chunk_size),
                                 Fixed(self.inter_position)), key_copies=(0,))

    def probe(self, length):
        return DualChunkScores(length // 4 + 2, 2)  # four chunks: the intra, successive and inter regions all occur

    def fused_rows(self, heads):
        # nothing is materialised on the fused path; chunk boundaries split a block further, so a long block keeps
        # whole chunks together (few kernel calls, each over many rows: the kernel's larger tiles)
        return 2048

    # ---- positions -------------------------------------------------------------------------------------------------
    def begin(self, call):
        call.scratch["offsets"] = call.offset.reshape(-1).tolist()
        call.scratch["k_rot"] = call.key
        call.scratch["plain"] = len(call.queries) == 1  # a layer without positions: attention as the model has it

    def _q(self, call, rows: slice, region: int) -> torch.Tensor:
        """The queries of `rows` (b, Hkv, G, r, d) at their `region` position."""
        return call.queries[region][:, :, :, rows]

    def _chunk_of(self, call, slots: torch.Tensor) -> torch.Tensor:
        """(b|1, n) chunk index of key slots; padding (negative true positions) counts as chunk 0 (it is masked)."""
        return torch.div((slots + call.offset).clamp(min=0), self.chunk, rounding_mode="floor")

    def _first_slot(self, n: int, offset: int) -> int:
        """First key slot of chunk n in a row whose true positions are slot + offset (pads belong to chunk 0)."""
        return 0 if n <= 0 else max(0, n * self.chunk - offset)

    def _ranges(self, call, rows: slice, end: int) -> list[tuple[int, int]]:
        """Per region, a key-slot range [lo, hi) holding every key of that region for every row of the block and
        every sequence of the batch (host integers: the union over the batch's offsets)."""
        first, last = call.first_slot(rows), call.first_slot(rows) + (rows.stop - rows.start) - 1
        spans = {INTRA: [], SUCC: [], INTER: []}
        for off in call.scratch["offsets"]:
            n0, n1 = max(first + off, 0) // self.chunk, max(last + off, 0) // self.chunk
            spans[INTRA].append((self._first_slot(n0, off), end))
            if n1 >= 1:
                spans[SUCC].append((self._first_slot(n0 - 1, off), self._first_slot(n1, off)))
            if n1 >= 2:
                spans[INTER].append((0, self._first_slot(n1 - 1, off)))
        return [(min(lo for lo, _ in s), max(hi for _, hi in s)) if s else (0, 0) for s in spans.values()]

    # ---- materialised (eager, training, padding) -----------------------------------------------------------------
    def logits(self, call, rows, start, end):
        """Each region's logits over only its key range, combined element by element by the pair's region."""
        if call.scratch["plain"]:
            return attention.PLAIN.logits(call, rows, start, end)
        if call.gapped:  # chunks by position id, per element (the three regions over every key)
            q_ids = (call.ids[:, -call.query.shape[3]:] if call.q_ids is None else call.q_ids)[:, rows]
            dn = (torch.div(q_ids.clamp(min=0), self.chunk, rounding_mode="floor")[:, :, None]
                  - torch.div(call.ids[:, None, start:end].clamp(min=0), self.chunk, rounding_mode="floor"))
            region = ((dn >= 1).long() + (dn >= 2).long())[:, None, None]  # (b, 1, 1, r, w)
            parts = [call.qk(self._q(call, rows, r), call.key[:, :, start:end]) for r in (INTRA, SUCC, INTER)]
            return torch.where(region == INTRA, parts[0], torch.where(region == SUCC, parts[1], parts[2]))
        ranges = [(r, max(lo, start), min(hi, end)) for r, (lo, hi) in enumerate(self._ranges(call, rows, end))]
        ranges = [(r, lo, hi) for r, lo, hi in ranges if lo < hi]
        k_rot = call.scratch["k_rot"]
        if len(ranges) == 1:  # one region (the whole call inside one chunk, or a block of one region)
            return call.qk(self._q(call, rows, ranges[0][0]), k_rot[:, :, start:end])
        slots = torch.arange(start, end, device=call.key.device)
        dn = self._chunk_of(call, call.q_slot[rows])[:, :, None] - self._chunk_of(call, slots)[:, None, :]
        region = ((dn >= 1).to(torch.int8) + (dn >= 2).to(torch.int8))[:, None, None]  # (b|1, 1, 1, r, w); future: 0
        s = None
        for r, lo, hi in ranges:
            part = call.qk(self._q(call, rows, r), k_rot[:, :, lo:hi])
            if s is None:
                s = part.new_zeros(*part.shape[:-1], end - start)
            a, z = lo - start, hi - start
            s[..., a:z] = torch.where(region[..., a:z] == r, part, s[..., a:z])
        return s

    def regions(self, call, rows, start, end):
        """Each score's region is its query copy (INTRA, SUCC, INTER); every region reads key set 0 (j mod c)."""
        if call.scratch["plain"]:
            return [(0, 0, None)]
        if call.gapped:
            q_ids = (call.ids[:, -call.query.shape[3]:] if call.q_ids is None else call.q_ids)[:, rows]
            dn = (torch.div(q_ids.clamp(min=0), self.chunk, rounding_mode="floor")[:, :, None]
                  - torch.div(call.ids[:, None, start:end].clamp(min=0), self.chunk,
                              rounding_mode="floor"))[:, None, None]
        else:
            slots = torch.arange(start, end, device=call.key.device)
            dn = (self._chunk_of(call, call.q_slot[rows])[:, :, None]
                  - self._chunk_of(call, slots)[:, None, :])[:, None, None]
        region = (dn >= 1).long() + (dn >= 2).long()
        return [(r, 0, region == r) for r in (INTRA, SUCC, INTER)]

    # ---- fused (inference on CPU without mask) ---------------------------------------------------------------------
    def fused(self, call, rows, end):
        """Rows are split at chunk boundaries; a group of rows in chunk n reads, each through one fused kernel with
        its own rotated queries over a contiguous key range:
            [first slot of n, group)        intra, full          [group]   intra, causal (the diagonal)
            [first slot of n − 1, of n)     successive, full     [0, first slot of n − 1)   inter, full
        merged by log-sum-exp. Needs one offset for the whole batch (else: the materialised path)."""
        if call.scratch["plain"]:
            return attention.PLAIN.fused(call, rows, end)
        offsets = call.scratch["offsets"]
        if len(set(offsets)) != 1 or offsets[0] < 0:
            return None
        off, k_rot, v = offsets[0], call.scratch["k_rot"], call.value
        first, stop = call.first_slot(rows), call.first_slot(rows) + (rows.stop - rows.start)
        outs, lses = [], []
        a = first
        while a < stop:
            n = (a + off) // self.chunk
            z = min(stop, (n + 1) * self.chunk - off)  # the group: slots [a, z), all in chunk n
            sub = slice(rows.start + a - first, rows.start + z - first)
            q = self._q(call, sub, INTRA)
            parts = [attention.flash_causal_partial(call, q, k_rot[:, :, a:z], v[:, :, a:z])]
            lo = self._first_slot(n, off)
            if lo < a:
                parts.append(attention.flash_partial(call, q, k_rot[:, :, lo:a], v[:, :, lo:a]))
            prev = self._first_slot(n - 1, off)
            if n >= 1 and prev < lo:
                parts.append(attention.flash_partial(call, self._q(call, sub, SUCC), k_rot[:, :, prev:lo],
                                                     v[:, :, prev:lo]))
            if n >= 2 and prev > 0:
                parts.append(attention.flash_partial(call, self._q(call, sub, INTER), k_rot[:, :, :prev],
                                                     v[:, :, :prev]))
            out, lse = _merge_lse(parts)
            outs.append(out)
            lses.append(lse)
            a = z
        return [(torch.cat(outs, dim=2), torch.cat(lses, dim=2))]

    # ---- flex_attention ----------------------------------------------------------------------------------------------
    def flex(self, call, block_mask):
        """Three flex_attention calls under transformers' BlockMask, one per region (its own rotated queries against
        the keys at j mod c; the region is part of the mask_mod and blocks holding none of it are dropped), merged by
        log-sum-exp. Inside one chunk (every position < c) it is one call: plain RoPE."""
        if call.scratch["plain"]:
            return attention.PLAIN.flex(call, block_mask)
        all_rows = slice(0, call.query.shape[3])
        k_rot = call.scratch["k_rot"]
        k_len = call.key.shape[2]
        if max(k_len - 1 + off for off in call.scratch["offsets"]) < self.chunk:
            return attention.flex_call(call, self._q(call, all_rows, INTRA).flatten(1, 2), k_rot, call.value,
                                       block_mask)
        parts = []
        for region in (INTRA, SUCC, INTER):
            mask = self._region_block_mask(block_mask, call, region)
            if mask is not None:
                q = self._q(call, all_rows, region).flatten(1, 2)
                parts.append(attention.flex_call(call, q, k_rot, call.value, mask, lse=True))
        return attention.merge(parts)

    def _region_block_mask(self, block_mask, call, region: int):
        """`block_mask` ∧ (pair in `region`), keeping only the blocks that can hold such a pair (judged from each
        block's smallest and largest chunk difference); None when no block does."""
        q_len, k_len = call.query.shape[3], call.key.shape[2]
        dev, c = call.key.device, self.chunk
        b = call.query.shape[0]
        offsets = call.offset.reshape(-1).expand(b) if call.offset.numel() == 1 else call.offset.reshape(-1)
        first = torch.tensor(k_len - q_len, device=dev)
        base = block_mask.mask_mod

        def in_region(dn):
            return dn <= 0 if region == INTRA else (dn == 1 if region == SUCC else dn >= 2)

        def mask_mod(bi, h, qi, kv):
            off = offsets[bi]
            dn = (qi + first + off).clamp(min=0) // c - (kv + off).clamp(min=0) // c
            return base(bi, h, qi, kv) & in_region(dn)

        qb, kb = block_mask.BLOCK_SIZE
        dense = block_mask.to_dense().bool()  # (B, H, q blocks, kv blocks)
        off = offsets.view(-1, 1, 1, 1)
        q0 = torch.arange(dense.shape[-2], device=dev).view(1, 1, -1, 1) * qb + (k_len - q_len)
        k0 = torch.arange(dense.shape[-1], device=dev).view(1, 1, 1, -1) * kb

        def chunk(p):
            return torch.div((p + off).clamp(min=0), c, rounding_mode="floor")

        dn_min = chunk(q0) - chunk(k0 + kb - 1)
        dn_max = chunk(q0 + qb - 1) - chunk(k0)
        if region == INTRA:
            holds = dn_min <= 0
        elif region == SUCC:
            holds = (dn_min <= 1) & (dn_max >= 1)
        else:
            holds = dn_max >= 2
        dense = dense & holds  # (max(B, b), H, q blocks, kv blocks)
        if not bool(dense.any()):
            return None
        num = dense.sum(-1, dtype=torch.int32)
        order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return BlockMask.from_kv_blocks(num, order, BLOCK_SIZE=block_mask.BLOCK_SIZE, mask_mod=mask_mod,
                                        seq_lengths=(q_len, k_len))


def _size(key: str, value, where: str = "", low: int = 1) -> int:
    """chunk_size / local_size: an integer in [low, POSITIONS_MAX]; `where` names a config it was read from."""
    return check.integer("dca", f"{key}{where}", value, ge=low, le=check.POSITIONS_MAX, hint=_HINT[key])


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
        chunk, local = window * 3 // 4, max(1, window // 8)
        if n <= window or chunk <= local:
            return None
        return Suggestion.of(cls.name, {"chunk_size": chunk, "local_size": local},
                             f"chunk_size = ¾·L = {chunk}, local_size = L/8 = {local} (An et al. 2024, ChunkLlama "
                             "defaults)")

    def __post_init__(self):
        if self.chunk_size is not None:
            self._set("chunk_size", _size("chunk_size", self.chunk_size, low=2))
        if self.local_size is not None:
            self._set("local_size", _size("local_size", self.local_size))
        if self.chunk_size is not None and self.local_size is not None:
            _check_pair(self.chunk_size, self.local_size)

    @classmethod
    def from_dual_chunk_attention_config(cls, config: dict) -> DualChunk:
        """The scheme a `dual_chunk_attention_config` dict describes (its dense keys chunk_size and local_size)."""
        values = _config_values(config, f" (from {CONFIG_KEY})")
        missing = [k for k in ("chunk_size", "local_size") if k not in values]
        if missing:
            raise ValueError(f"dca: {CONFIG_KEY} {config!r} lacks {', '.join(missing)}; it needs chunk_size "
                             "and local_size.")
        return cls(chunk_size=values["chunk_size"], local_size=values["local_size"])

    def relative_position(self, i, j):
        """The table in the module docstring: keys at j mod c; the query at i mod c (same chunk), at
        min(i mod c + c, s) (previous chunk) or at min(2c − 1, s) (earlier chunks)."""
        s, c = self.chunk_size, self.chunk_size - self.local_size
        if s is None:
            raise TypeError("dca: chunk_size and local_size are needed (they default to ¾·L and L/8 of a "
                            "model's window).")
        gap = torch.floor(i / c) - torch.floor(j / c)
        q = torch.where(gap == 0, i % c, torch.where(gap == 1, torch.clamp(i % c + c, max=s),
                                                     torch.full_like(i * 1.0, min(2 * c - 1, s))))
        return q - j % c

    def served_length(self, window):
        # queries sit at most at chunk_size, keys at ≥ 0: every relative position is ≤ chunk_size, whatever the length
        if self.chunk_size is None:
            return None
        return UNBOUNDED if self.chunk_size < window else None

    def with_window(self, window: int) -> DualChunk:
        """The authors' defaults for a pre-training window L where a size is not given: ¾·L and L/8."""
        chunk = self.chunk_size if self.chunk_size is not None else window * 3 // 4
        local = self.local_size if self.local_size is not None else max(1, window // 8)
        _check_pair(chunk, local)
        return self.replace(chunk_size=chunk, local_size=local)

    def resolve(self, target):
        raw = getattr(target.config, CONFIG_KEY, None)
        values = {} if raw is None else _config_values(raw, f" (from the model config's {CONFIG_KEY})")
        window = values.pop("original_max_position_embeddings", None)
        if window is None and (self.chunk_size is None or self.local_size is None):  # only the defaults need L
            window = target.pretraining_window
        chunk = self.chunk_size if self.chunk_size is not None else values.get("chunk_size") or window * 3 // 4
        local = self.local_size if self.local_size is not None else values.get("local_size") or max(1, window // 8)
        origin = {k: "given" if getattr(self, k) is not None
                  else ("from the model config's " + CONFIG_KEY if k in values
                        else f"the default for a {window}-token window")
                  for k in ("chunk_size", "local_size")}
        _check_pair(chunk, local, origin)
        return self.replace(chunk_size=chunk, local_size=local)

    def repositions(self) -> bool:
        return True

    def layout(self, module):
        # every layer alike: sliding windows only hide pairs, the regions are per pair
        layout = DualChunkScores(self.chunk_size, self.local_size).layout()
        if attention.memory_rotaries(module):
            # A layer with memory (DeepSeek-V4) decides inside itself, from its position ids, which memory entries a
            # query sees (and its indexer which it picks): one more copy at the tokens' own positions decides that
            # (protocol.own_rows reads the mask from it); DCA's copies are all at chunk positions.
            return attention.Layout((*layout.maps, attention.Identity()), layout.key_copies)
        return layout

    def build(self, target):
        return DualChunkScores(self.chunk_size, self.local_size), None


def _config_values(raw, where: str) -> dict:
    """The dense DCA keys of a dual_chunk_attention_config (a dict; sparse-attention keys are ignored), checked."""
    if not isinstance(raw, dict):
        raise TypeError(f"dca: {CONFIG_KEY} must be a dict such as {{'chunk_size': 24576, 'local_size': 4096}}, got "
                        f"{type(raw).__name__} {raw!r}{where}.")
    out = {}
    for key, low in (("chunk_size", 2), ("local_size", 1)):
        if raw.get(key) is not None:
            out[key] = _size(key, raw[key], f"{where}", low)
    if raw.get("original_max_position_embeddings") is not None:
        out["original_max_position_embeddings"] = check.integer(
            "dca", f"original_max_position_embeddings{where}", raw["original_max_position_embeddings"], ge=2,
            le=check.POSITIONS_MAX, hint="It is the pre-training window the default chunk_size/local_size derive from.")
    return out


def _check_pair(chunk: int, local: int, origin: dict | None = None) -> None:
    if chunk > local:
        return
    said = "" if origin is None else f" (chunk_size {origin['chunk_size']}, local_size {origin['local_size']})"
    raise ValueError(
        f"dca: parameter `chunk_size` must be larger than `local_size` (chunks hold chunk_size − local_size ≥ 1 "
        f"tokens), got chunk_size={chunk}, local_size={local}{said}. Pass e.g. chunk_size=¾·L and local_size=L/8 for "
        "a pre-training window L (the authors' defaults)."
    )
