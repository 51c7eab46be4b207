"""Two independent references for Ms-PoE (Zhang et al. 2024, arXiv:2403.04797), on the llama-layout decoder of
helpers.reference (plain math, materialised scores):

- `paper_forward`: every head's queries and keys at explicit positions p/r_h, r_h from the prompt's outlier scores,
  per KV head on GQA (rope_patch's reading, rope_patch/schemes/multiscale.py), batches with left padding;
- `authors_forward`: the computation of VITA-Group/Ms-PoE `utils/modify_arch/llama.py` (a46c3d1) re-written in plain
  torch: per-ratio cos/sin tables, the head order from pre-RoPE scores with their causal mask, `cos[head_order]` for
  the queries and `cos[::num_key_value_groups]` for the keys; one row, no padding (what their code supports).
"""

from __future__ import annotations

import torch

from helpers.reference import decoder_forward, inv_freq, rotate_half, scores


def _rotate(x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """x (b, H, L, d) rotated, head h at positions[b, h, L] (float)."""
    ang = positions[..., None] * freq
    emb = torch.cat((ang, ang), dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def paper_ratios(lo: float, hi: float, n: int) -> torch.Tensor:
    return lo + (hi - lo) * torch.arange(n, dtype=torch.float32) / n


@torch.no_grad()
def paper_forward(model, ids, params: dict, mask=None, orders: dict | None = None):
    """(logits, orders): `orders[layer]` (b, Hkv) each KV head's ratio slot, computed from this input's last query
    unless given (a prompt's order, for the tokens generated after it)."""
    lo, hi, skip = params.get("min_ratio", 1.2), params.get("max_ratio", 1.8), params.get("skip_layers", 2)
    b, n = ids.shape
    real = torch.ones(b, n, dtype=torch.bool) if mask is None else mask.bool()
    found = {}

    def fn(layer, q, k, pos):
        if layer < skip:
            return scores("rope", {}, model, layer, q, k, pos)
        h, d = q.shape[1], q.shape[-1]
        hkv = model.config.num_key_value_heads
        g = h // hkv
        if orders is not None:
            order = orders[layer]
        else:  # the last query against every real key, q and k un-rotated (RoPE at position 0)
            w = torch.softmax((q[:, :, -1:] @ k.transpose(-1, -2) * d**-0.5)
                              .masked_fill(~real[:, None, None], -torch.inf), -1)
            count = real.sum(-1).float()[:, None, None]  # (b, 1, 1)
            frac = (w[:, :, 0] > 3 / count).sum(-1) / count[..., 0]  # (b, H): share of keys above 3× the mean
            order = torch.argsort(-frac.view(b, hkv, g).mean(-1), dim=-1, stable=True)
        found[layer] = order
        r = paper_ratios(lo, hi, hkv)[order].repeat_interleave(g, dim=1)  # (b, H): head h takes its KV head's ratio
        p = pos.float()[:, None, :] / r[:, :, None]  # (b, H, L): explicit per-head positions p / r_h
        freq = inv_freq(model.config, d)
        return _rotate(q, p, freq) @ _rotate(k, p, freq).transpose(-1, -2) * d**-0.5

    return decoder_forward(model, ids, fn, mask), found


@torch.no_grad()
def authors_forward(model, ids, params: dict):
    """Logits of one unpadded row (1, L) as the authors' MsPoELlamaAttention computes them (fp32)."""
    assert ids.shape[0] == 1
    lo, hi, skip = params.get("min_ratio", 1.2), params.get("max_ratio", 1.8), params.get("skip_layers", 2)
    cfg = model.config
    heads, groups = cfg.num_attention_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    n = ids.shape[1]

    def fn(layer, q, k, pos):
        d = q.shape[-1]
        if layer < skip:
            return scores("rope", {}, model, layer, q, k, pos)
        # MsPoELlamaRotaryEmbedding._set_cos_sin_cache: t / compress_ratio per head, ratios over num_heads
        t = torch.arange(n, dtype=torch.float32).repeat(heads, 1)
        ratio = lo + (hi - lo) * (torch.arange(heads, dtype=torch.float32) / heads)
        t = t / ratio.unsqueeze(-1)
        freqs = torch.einsum("ki,j->kij", t, inv_freq(cfg, d))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()  # (heads, L, d)
        # _head_wise_statistics: pre-RoPE scores, causal mask, softmax; _calculate_outlier on the last query
        key_states = k[:, ::groups]  # the un-repeated keys ...
        w = q @ key_states.repeat_interleave(groups, dim=1).transpose(2, 3) / d**0.5  # ... repeat_kv'd again
        w = w + torch.full((n, n), torch.finfo(w.dtype).min).triu(1)
        w = torch.softmax(w, dim=-1).squeeze(0)  # (heads, L, L)
        average = w.mean(-1).unsqueeze(-1)
        outlier = -(w > 3 * average).float().mean(-1)[:, -1]
        head_order = outlier.argsort(stable=True)
        cos, sin = cos[head_order], sin[head_order]
        q_rot = q * cos[None] + rotate_half(q) * sin[None]  # apply_rotary_pos_emb_single_scaling
        cos_k, sin_k = cos[::groups], sin[::groups]  # sample_rotary_emb
        k_rot = key_states * cos_k[None] + rotate_half(key_states) * sin_k[None]
        k_rot = k_rot.repeat_interleave(groups, dim=1)  # repeat_kv
        return q_rot @ k_rot.transpose(2, 3) / d**0.5

    return decoder_forward(model, ids, fn)
