"""Two references for StreamingLLM (Xiao et al. 2024, arXiv:2309.17453), independent of rope_patch and of each other.

`paper_forward`: the paper's §3.2 written per query: query i's visible set (the first S tokens and the last W, itself
included), its keys re-indexed 0 … |V| − 1 in the cache, un-rotated keys rotated at their cache index and the query
at the last index, every query separately (no relative-position shortcut).

`pos_shift_forward`: the authors' code re-written in plain torch (mit-han-lab/streaming-llm at 2e50426):
`examples/eval_long_ppl.py`'s token-by-token loop, `pos_shift/modify_llama.py`'s attention (un-rotated keys in the
cache, `key_position_ids = arange(kv_seq_len)`, the query at the past length) and `kv_cache.py`'s StartRecentKVCache
applied after every step (keep the first start_size and the last recent_size). No padding (the code has none).

Both on the llama-layout tiny models (pre-norm, GQA, SwiGLU), through helpers.reference's decoder.
"""

from __future__ import annotations

import torch

from helpers.reference import decoder_forward, inv_freq, rotate_half, true_positions


def rotate(x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """x (b, H, n, d) rotated at positions (b, n) (GPT-NeoX half split, as transformers' Llama)."""
    ang = positions.float()[..., None] * freq  # (b, n, d/2)
    ang = torch.cat((ang, ang), dim=-1)[:, None]
    return x * ang.cos() + rotate_half(x) * ang.sin()


@torch.no_grad()
def paper_forward(model, ids, sink_size: int, window_size: int, mask=None):
    """Logits (b, n, vocab); padding rows are garbage."""
    b, n = ids.shape
    pos = true_positions(mask, b, n)
    real = torch.ones(b, n, dtype=torch.bool) if mask is None else mask.bool()
    slot = torch.arange(n)

    def scores(layer_idx, q, k, _pos):
        d = q.shape[-1]
        freq = inv_freq(model.config, d)
        out = q.new_full((b, q.shape[1], n, n), float("-inf"))
        for t in range(n):
            i = pos[:, t:t + 1]
            visible = real & (slot <= t) & ((pos < sink_size) | (i - pos < window_size))  # (b, n)
            index = visible.long().cumsum(-1) - 1  # each visible key's index in the cache
            k_cached = rotate(k, index, freq)
            q_last = rotate(q[:, :, t:t + 1], index[:, t:t + 1], freq)  # the query: the last index
            s = (q_last * k_cached).sum(-1) * d**-0.5  # (b, H, n)
            out[:, :, t] = s.masked_fill(~visible[:, None], float("-inf"))
        return out

    return decoder_forward(model, ids, scores, mask)


@torch.no_grad()
def pos_shift_forward(model, ids, start_size: int, recent_size: int):
    """Logits (b, n, vocab) of feeding `ids` one token at a time through the authors' pos_shift attention and
    StartRecentKVCache(start_size, recent_size)."""
    base = model.model
    b, n = ids.shape
    layers = base.layers
    past = [None] * len(layers)  # per layer: (un-rotated keys, values) (b, Hkv, m, d)
    out = []
    for t in range(n):
        x = base.embed_tokens(ids[:, t:t + 1])
        for li, layer in enumerate(layers):
            a = layer.self_attn
            d = a.head_dim
            freq = inv_freq(model.config, d)
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(b, 1, -1, d).transpose(1, 2)
            k = a.k_proj(h).view(b, 1, -1, d).transpose(1, 2)
            v = a.v_proj(h).view(b, 1, -1, d).transpose(1, 2)
            past_len = 0 if past[li] is None else past[li][0].shape[2]
            q = rotate(q, torch.full((b, 1), past_len), freq)  # position_ids = past_key_values_length
            if past[li] is not None:
                k, v = torch.cat([past[li][0], k], dim=2), torch.cat([past[li][1], v], dim=2)
            past[li] = (k, v)
            kv_len = k.shape[2]
            k_rot = rotate(k, torch.arange(kv_len).expand(b, kv_len), freq)  # key pos = the pos in cache
            groups = q.shape[1] // k.shape[1]
            k_rot, v_rep = k_rot.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            w = torch.softmax(q @ k_rot.transpose(2, 3) / d**0.5, dim=-1)
            x = x + a.o_proj((w @ v_rep).transpose(1, 2).reshape(b, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        out.append(model.lm_head(base.norm(x)))
        for li, (k, v) in enumerate(past):  # kv_cache(past_key_values): StartRecentKVCache.__call__
            if k.shape[2] > start_size + recent_size:
                keep = lambda z: torch.cat([z[:, :, :start_size], z[:, :, z.shape[2] - recent_size:]], dim=2)  # noqa: E731
                past[li] = (keep(k), keep(v))
    return torch.cat(out, dim=1)
