"""Two references for LM-Infinite (Han et al., NAACL 2024, arXiv:2308.16137), independent of rope_patch and of each
other. G = global_size (the paper's n_global, the code's `global_branch`), L = local_size (n_local, `local_branch`),
D = max_distance (the distance limit L_pretrain, the code's `limit_distance`).

`paper_forward`: the paper's Λ-shaped attention written per pair (i, j) of true positions: key j is seen by query i
through the local branch (0 <= i − j < L, relative position i − j) or the global branch (j < G and i − j >= L,
relative position min(i − j, D)); every other key is masked. As helpers.reference does, each pair is "q_i rotated by
its relative position against the un-rotated key" (one angle per pair), materialised (b, H, n, n) scores.

`lambda_forward` / `lambda_generate_logits`: the authors' efficient ("lambda mask") path re-written in plain torch from
Glaciohound/LM-Infinite at a0ce64c: `models/llama.py`'s `attn_forward_factory` with `use_lambda_mask=True` and
`models/lambda_attention.py`'s `Lambda_Attention_Matrix`:

- rotations (`attn_forward_factory`): the cache stores the raw (un-rotated) keys (`past_key_value.update` comes before
  any rotation); every call rotates all kv_seq_len keys at `arange(kv_seq_len)` (rot_key), the queries at their
  position_ids (rot_query, true positions); the stationary keys are the raw keys (position 0) and the stationary
  queries are rotated at min(limit_distance, kv_seq_len − 1) (the cos/sin table has kv_seq_len rows);
- `Lambda_Attention_Matrix`: the first min(G, kv_seq_len) key columns are stationary scores, kept where
  i − j >= L (`triu(−L + 1 + kv_len − q_len)` masks the rest), concatenated with rotated scores of the local band,
  one softmax over both, and the values taken to match (the first G values, then the band's). Its modes:
  `short_seq` (prefill of n <= L: full causal rotated scores, the first G columns replaced by the stationary ones
  where those are kept, i.e. never: plain RoPE), `long_seq` (prefill of n > L: queries in blocks of L, each against
  the previous and its own key block, kept where 1 <= c − r <= L, i.e. 0 <= i − j < L; the first block's "previous"
  is the last block rolled round and masked; the padded tail masked), `single_query` (one query: the last L keys
  rotated) and `cached` (a chunk on a cache: only when q_len + L + G = kv_len, the key blocks taken from key G on).

Where the authors' code differs from the paper, or has quirks (none of which the tests reach, except as noted):
- the stationary query sits at D, not at min(i − j, D) as the paper's "distance limit" reads: the same for every
  visible global pair when D <= L (they all have i − j >= L >= D), different when D > L, which rope_patch refuses.
  The code's min(limit_distance, kv_seq_len − 1) is also per call, not per query (a prefill of n > D puts every
  query's stationary rotation at D, a decoding step at min(D, i)): again only D > L can see it;
- masked scores are `torch.finfo(dtype).min` (clamped after the 1/sqrt(d) division), not −inf: exp underflows to 0
  exactly in float32 since every row keeps its diagonal; the lambda path's softmax runs in the input dtype;
- `long_seq` splits the concatenated scores at `global_branch`, not at min(G, kv_len): with G > n > L it fails (shape
  error) instead of attending every key through the band; transcribed with min(G, kv_len), which is the intent;
- `cached` asserts q_len + L + G == kv_len: a multi-token chunk on a cache works only after exactly G + L tokens (the
  full cache of the repo's own callers keeps every key, so chunked prefill otherwise fails); `lambda_chunked_logits`
  refuses the other chunks the same way. Decoding one token at a time (`single_query`) has no such limit;
- the lambda path drops the attention mask (`_prepare_decoder_attention_mask` returns None) and puts the keys at
  arange(kv_seq_len): no padding support (padded rows are compared against their unpadded reference);
- q/k/v are all viewed with `num_heads` (no GQA; Llama-2 7B/13B): transcribed with the key/value heads repeated per
  group, as transformers' repeat_kv does;
- the `top_k_attention` variant (a retrieval that only the last query row gets, and only in layers
  [top_k_from_layer, top_k_to_layer): the top-k of the masked-out middle keys by a query rotated at top_k_insert_at)
  and `triangle_offset` (a log-count penalty of the non-lambda path) are not part of this scheme and not transcribed;
- the non-lambda path (`use_lambda_mask=False`, `detailed_lambda_attention`) is another model: without top_k it adds
  the stationary score to every key with i − j >= D (`tril(−limit_distance + ...)`: no restriction to j < G, the
  middle is not masked) on top of the rotated band's (`triu(−L + 1 + ...)`, zeros outside it), so with D < L a pair
  with D <= i − j < L gets both; only the lambda path (transcribed here) is the Λ-shaped scheme.

Checked once outside the suite (the authors' repository is no dependency): their `attn_forward_factory` and
`Lambda_Attention_Matrix`, run unmodified on an MHA tiny llama (batch 1, a DynamicCache), give logits identical (0.0)
to `lambda_chunked_logits` for prefills, token-by-token decoding and the `cached` chunk, D < L and D = L; and
`lambda_attention` equals `Lambda_Attention_Matrix` on random tensors in all four modes (369 shapes, <= 6e-7).

Both run the llama-layout tiny models (pre-norm, GQA, SwiGLU; qwen2's q/k/v biases come with its projections).
"""

from __future__ import annotations

import torch

from helpers.reference import decoder_forward, inv_freq, rotate_half, true_positions


def rotate(x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """x (b, H, n, d) rotated at positions (b, n) (GPT-NeoX half split, as transformers' Llama)."""
    ang = positions.float()[..., None] * freq  # (b, n, d/2)
    ang = torch.cat((ang, ang), dim=-1)[:, None]
    return x * ang.cos() + rotate_half(x) * ang.sin()


# ---- the paper ------------------------------------------------------------------------------------------------------
def paper_relative(i: torch.Tensor, j: torch.Tensor, global_size: int, local_size: int, max_distance: int):
    """(relative position as float, visible) of the pairs of true positions i, j (broadcast)."""
    d = i - j
    local = (d >= 0) & (d < local_size)
    glob = (j < global_size) & (d >= local_size)
    rel = torch.where(local, d, torch.clamp(d, max=max_distance)).float()
    return rel, local | glob


@torch.no_grad()
def paper_forward(model, ids, global_size: int, local_size: int, max_distance: int | None = None, mask=None):
    """Logits (b, n, vocab) under the paper's Λ-shaped attention; padding rows are garbage."""
    max_distance = local_size if max_distance is None else max_distance
    b, n = ids.shape
    pos = true_positions(mask, b, n)
    rel, visible = paper_relative(pos[:, :, None], pos[:, None, :], global_size, local_size, max_distance)

    def scores(layer_idx, q, k, _pos):
        d = q.shape[-1]
        ang = rel[..., None] * inv_freq(model.config, d)  # (b, n, n, d/2)
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        qi = q[:, :, :, None, :]  # (b, H, n, 1, d): q_i rotated by r(i, j) for every j
        q_rot = qi * cos[:, None] + rotate_half(qi) * sin[:, None]
        s = (q_rot * k[:, :, None, :, :]).sum(-1) * d**-0.5
        return s.masked_fill(~visible[:, None], float("-inf"))  # decoder_forward adds causality and padding

    return decoder_forward(model, ids, scores, mask)


# ---- the authors' code ----------------------------------------------------------------------------------------------
def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """`blockwise_sequence`: (..., n, d) zero-padded to a multiple of `size`, viewed (..., n_blocks, size, d)."""
    n = x.shape[-2]
    padded = -(-n // size) * size
    x = torch.cat((x, x.new_zeros(*x.shape[:-2], padded - n, x.shape[-1])), dim=-2)
    return x.view(*x.shape[:-2], padded // size, size, x.shape[-1])


def _pairs(blocks: torch.Tensor) -> torch.Tensor:
    """`shift_and_pair`: each block after the one before it (the first after the last, rolled round):
    (..., nb, 2s, d)."""
    previous = torch.cat((blocks[..., -1:, :, :], blocks[..., :-1, :, :]), dim=-3)
    return torch.cat((previous, blocks), dim=-2)


def lambda_attention(k_rot, k_stat, q_rot, q_stat, v, local_size: int, global_size: int):
    """`Lambda_Attention_Matrix(...) / sqrt(d)`, `.softmax()`, `.matmul(v)`: (b, H, q_len, d). All (b, H, ·, d), keys
    and values already repeated to the query heads."""
    ql, kl, d = q_rot.shape[-2], k_rot.shape[-2], q_rot.shape[-1]
    L, G = local_size, global_size
    neg = torch.finfo(q_rot.dtype).min
    scale = d**-0.5
    if ql == 1:
        mode = "single_query"
    elif ql < kl:
        if ql + L + G != kl:
            raise AssertionError(f"the authors' cached mode needs q_len + L + G == kv_len, got {ql} + {L} + {G} "
                                 f"!= {kl}")
        mode = "cached"
    elif ql <= L:
        mode = "short_seq"
    else:
        mode = "long_seq"
    g = min(G, kl)  # key_stationary[..., :global_branch, :]

    stat = (q_stat @ k_stat[..., :g, :].transpose(-1, -2) * scale).clamp(min=neg)  # (b, H, ql, g)
    stat_hidden = torch.ones(ql, g, dtype=torch.bool).triu(-L + 1 + kl - ql)  # i − j < L: the local branch's
    stat = stat.masked_fill(stat_hidden, neg)

    def band(q_blocks, key_pairs):
        """Rotated scores of query blocks (…, nb, L, d) against key block pairs (…, nb, 2L, d), kept where
        1 <= c − r <= L (`triu(1).tril(L)`)."""
        s = (q_blocks @ key_pairs.transpose(-1, -2) * scale).clamp(min=neg)
        kept = torch.ones(L, 2 * L, dtype=torch.bool).triu(1).tril(L)
        return s.masked_fill(~kept, neg)

    if mode == "short_seq":
        rot = (q_rot @ k_rot.transpose(-1, -2) * scale).clamp(min=neg)
        rot = rot.masked_fill(torch.ones(ql, kl, dtype=torch.bool).triu(1), neg)
        rot[..., :g] = torch.where(stat > neg / 2, stat, rot[..., :g])
        return rot.softmax(-1) @ v

    if mode == "single_query":
        start = max(0, kl - L)
        rot = (q_rot @ k_rot[..., start:, :].transpose(-1, -2) * scale).clamp(min=neg)
        attn = torch.cat((stat, rot), dim=-1).softmax(-1)
        return attn @ torch.cat((v[..., :g, :], v[..., start:, :]), dim=-2)

    nb = -(-ql // L)
    padded = nb * L
    patch = padded - ql
    q_blocks = _blocks(q_rot, L)
    if mode == "long_seq":
        k_pairs, v_pairs = _pairs(_blocks(k_rot, L)), _pairs(_blocks(v, L))
    else:  # cached: the keys after the first G; block pairs (b − 1, b) from the second block on
        k_pairs = _pairs(_blocks(k_rot[..., G:, :], L))[..., 1:, :, :]
        v_pairs = _pairs(_blocks(v[..., G:, :], L))[..., 1:, :, :]
    rot = band(q_blocks, k_pairs)  # (b, H, nb, L, 2L)
    if mode == "long_seq":
        rot[..., 0, :, :L] = neg  # the first block has no previous block (that slot holds the last, rolled round)
    if patch:
        rot[..., -1, L - patch:, :] = neg  # padded query rows
        rot[..., -1, :, 2 * L - patch:] = neg  # padded key columns
    rot = rot.reshape(*rot.shape[:-3], padded, 2 * L)
    # `pad_sequence_to_length(attn_stationary, pad_to_length, min_value)` ignores its value and pads zeros (the
    # padded rows are dropped after the matmul)
    stat = torch.cat((stat, stat.new_zeros(*stat.shape[:-2], patch, g)), dim=-2)
    attn = torch.cat((stat, rot), dim=-1).softmax(-1)  # one softmax over both branches
    out_stat = attn[..., :ql, :g] @ v[..., :g, :]
    out_rot = (attn[..., g:].reshape(*attn.shape[:-2], nb, L, 2 * L) @ v_pairs).reshape(*attn.shape[:-2], padded, d)
    return out_stat + out_rot[..., :ql, :]


def _chunk(model, ids_chunk, past, global_size, local_size, max_distance):
    """One call of the patched model on `ids_chunk` (b, q) with `past` (per layer: raw keys, values) updated in
    place."""
    base = model.model
    b, ql = ids_chunk.shape
    start = 0 if past[0] is None else past[0][0].shape[2]
    position_ids = torch.arange(start, start + ql).expand(b, ql)  # true positions (no padding: the code has none)
    x = base.embed_tokens(ids_chunk)
    for li, layer in enumerate(base.layers):
        a = layer.self_attn
        d = a.head_dim
        freq = inv_freq(model.config, d)
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(b, ql, -1, d).transpose(1, 2)
        k = a.k_proj(h).view(b, ql, -1, d).transpose(1, 2)
        v = a.v_proj(h).view(b, ql, -1, d).transpose(1, 2)
        if past[li] is not None:  # past_key_value.update(key_states, ...) before any rotation: raw keys cached
            k, v = torch.cat((past[li][0], k), dim=2), torch.cat((past[li][1], v), dim=2)
        past[li] = (k, v)
        kl = k.shape[2]
        key_position_ids = torch.arange(kl).expand(b, kl)
        q_rot = rotate(q, position_ids, freq)
        k_rot = rotate(k, key_position_ids, freq)
        k_stat = k
        q_stat = rotate(q, torch.full((b, ql), min(max_distance, kl - 1)), freq)
        groups = q.shape[1] // k.shape[1]
        k_rot, k_stat, v = (z.repeat_interleave(groups, dim=1) for z in (k_rot, k_stat, v))
        o = lambda_attention(k_rot, k_stat, q_rot, q_stat, v, local_size, global_size)
        x = x + a.o_proj(o.transpose(1, 2).reshape(b, ql, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(base.norm(x))


@torch.no_grad()
def lambda_chunked_logits(model, ids, chunks, global_size: int, local_size: int, max_distance: int | None = None):
    """Logits (b, n, vocab) of feeding `ids` in chunks of the given sizes (summing to n) through the authors' lambda
    path with a cache of raw keys: the first chunk is a prefill (short_seq / long_seq, or single_query for one
    token), each later one a step on the cache (single_query for one token, cached for more)."""
    max_distance = local_size if max_distance is None else max_distance
    if sum(chunks) != ids.shape[1]:
        raise ValueError(f"chunks {chunks} do not sum to {ids.shape[1]}")
    past = [None] * len(model.model.layers)
    out, start = [], 0
    for size in chunks:
        out.append(_chunk(model, ids[:, start:start + size], past, global_size, local_size, max_distance))
        start += size
    return torch.cat(out, dim=1)


def lambda_forward(model, ids, global_size: int, local_size: int, max_distance: int | None = None):
    """Logits (b, n, vocab) of one forward (a prefill) through the authors' lambda path."""
    return lambda_chunked_logits(model, ids, [ids.shape[1]], global_size, local_size, max_distance)


def lambda_generate_logits(model, ids, n_prompt: int, global_size: int, local_size: int,
                           max_distance: int | None = None):
    """Logits (b, n, vocab) of the authors' cached loop: the first n_prompt tokens as one forward, then one token at a
    time (single_query) on the cache of raw keys."""
    n = ids.shape[1]
    return lambda_chunked_logits(model, ids, [n_prompt] + [1] * (n - n_prompt), global_size, local_size, max_distance)
