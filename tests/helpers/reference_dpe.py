"""The authors' DPE computation (LuLuLuyi/DPE, `dpe_for_llama.py` at 46b85de: `dpe_flash_forward`,
`atten_merge_forward`, `concat_tensors`) written again in plain torch, independent of rope_patch: flash-attention
calls become materialised softmaxes that also return their log-sum-exp, and the model's own modules do the
projections, norms and MLP. Batch size 1, no padding (as the code: "Only support batch size = 1").

Prefill (q_len = kv_len): q and k at true positions in a band of distances 0 … W − 1; the queries i ≥ W against the
keys j ≤ i − W at grouped positions (query ⌊i/s⌋ + W − W/s, key ⌊j/s⌋, each dimension group with its own s,
spliced by `concat_tensors` over the two halves of a rotate-half head); the two partial softmaxes merged by
log-sum-exp as the code does (sigmoid of the lse gap).
Decode (q_len = 1): the un-rotated query against cached un-rotated keys rotated by minus their relative position:
the last W keys by the true distance, the others by ⌊i/s⌋ − ⌊j/s⌋ + W − ⌊W/s⌋ (key positions = slots 0 … n − 1).
"""

from __future__ import annotations

import torch

from helpers.reference import rotate_half


def _splice(parts: list[torch.Tensor], ranges: list[int], half: int) -> torch.Tensor:
    """concat_tensors: group g's columns [r_g, r_g+1) of each half from parts[g]."""
    first = [parts[g][..., ranges[g]:ranges[g + 1]] for g in range(len(parts))]
    second = [parts[g][..., half + ranges[g]:half + ranges[g + 1]] for g in range(len(parts))]
    return torch.cat(first + second, dim=-1)


def _grouped(rotary, x, positions: list[torch.Tensor], ranges, half):
    """cos, sin with group g's columns at positions[g] (each (1, n))."""
    made = [rotary(x, p) for p in positions]
    return (_splice([c for c, _ in made], ranges, half), _splice([s for _, s in made], ranges, half))


def _rot(x, cos, sin):
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def _softmax_lse(q, k, v, allowed, scale):
    """flash_attn_func: output and log-sum-exp per query (rows with no key: output 0, lse −inf)."""
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (1, H, q)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse


def prefill_attention(rotary, q, k, v, sizes, window, scale, floor_shift=False):
    """q (1, H, n, d), k, v (1, H, n, d) un-rotated (kv repeated); the attention output (1, H, n, d). The grouped
    queries are shifted by W − W/s as the code's prefill does (`floor_shift`: by W − ⌊W/s⌋, as its decode)."""
    n, d = q.shape[2], q.shape[3]
    half = d // 2
    ranges = [g * half // len(sizes) for g in range(len(sizes) + 1)]
    pos = torch.arange(n)[None]
    cos, sin = rotary(v, pos)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    if pos.max() < window:
        return _softmax_lse(_rot(q, cos, sin), _rot(k, cos, sin), v, j <= i, scale)[0]
    out_n, lse_n = _softmax_lse(_rot(q, cos, sin), _rot(k, cos, sin), v, (j <= i) & (i - j <= window - 1), scale)
    shifts = [window - (window // s if floor_shift else window / s) for s in sizes]
    q_cos, q_sin = _grouped(rotary, v, [pos // s + t for s, t in zip(sizes, shifts, strict=True)], ranges, half)
    k_cos, k_sin = _grouped(rotary, v, [pos // s for s in sizes], ranges, half)
    m = n - window  # scale_q = queries [W, n), scale_k = keys [0, n − W), causal (query t sees keys ≤ t)
    qs, ks = _rot(q, q_cos, q_sin)[:, :, -m:], _rot(k, k_cos, k_sin)[:, :, :m]
    t = torch.arange(m)
    out_s, lse_s = _softmax_lse(qs, ks, v[:, :, :m], t[None, :] <= t[:, None], scale)
    gap = lse_s - lse_n[..., -m:]
    w_n = torch.ones_like(lse_n)
    w_n[..., -m:] = 1 / (1 + torch.exp(gap))
    out = out_n * w_n[..., None]
    out[:, :, -m:] += out_s * (1 / (1 + torch.exp(-gap)))[..., None]
    return out


def decode_attention(rotary, q, k, v, sizes, window, scale):
    """The last query (position n − 1) against all n cached keys, by the code's decode path."""
    n, d = k.shape[2], k.shape[3]
    half = d // 2
    ranges = [g * half // len(sizes) for g in range(len(sizes) + 1)]
    qpos, keys = torch.tensor([[n - 1]]), torch.arange(n)[None]
    normal = qpos - keys
    re = 0 if n - 1 < window else window
    rel = []
    for s in sizes:
        scaled = qpos // s - keys // s + (re - re // s)
        rel.append(torch.cat([scaled[:, :-window], normal[:, -window:]], dim=1))
    cos, sin = _grouped(rotary, v, rel, ranges, half)
    return _softmax_lse(q[:, :, -1:], _rot(k, cos, -sin), v, torch.ones(1, n, dtype=torch.bool), scale)[0]


@torch.no_grad()
def forward(model, ids, sizes, window, decode: bool = False, floor_shift: bool = False):
    """Logits (1, n, vocab) of the authors' prefill; with `decode`, the last token's logits (1, 1, vocab) by their
    decode path after a prefill of the others (only the keys and values reach the decode step: the cache)."""
    base = model.model
    x = base.embed_tokens(ids)
    n = ids.shape[1]
    for layer in base.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        d = a.head_dim
        q = a.q_proj(h).view(1, n, -1, d).transpose(1, 2)
        k = a.k_proj(h).view(1, n, -1, d).transpose(1, 2)
        v = a.v_proj(h).view(1, n, -1, d).transpose(1, 2)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if decode:  # rows 0 … n − 2 as the prefill computed them, the last row by the decode path
            first = prefill_attention(base.rotary_emb, q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], sizes, window,
                                      a.scaling)
            last = decode_attention(base.rotary_emb, q, k, v, sizes, window, a.scaling)
            att = torch.cat([first, last], dim=2)
        else:
            att = prefill_attention(base.rotary_emb, q, k, v, sizes, window, a.scaling, floor_shift)
        x = x + a.o_proj(att.transpose(1, 2).reshape(1, n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    out = model.lm_head(base.norm(x))
    return out[:, -1:] if decode else out
