"""Straightforward reference implementations of the attention-side schemes, independent of rope_patch.

A whole LLaMA-family forward (llama / mistral / qwen2 layout: pre-norm, GQA, SwiGLU) in plain math with
materialised (b, H, L, L) scores. Every relative scheme is written as "rotate q_i by its relative position
r(i, j) to key j" (RoPE: rot(q, m)·rot(k, n) = rot(q, m − n)·k), one angle per (i, j) pair, instead of the
two-rotation decomposition that the implementation uses. Only the norms, projections and MLP reuse the model's
modules (they are not under test).
"""

from __future__ import annotations

import math

import torch


def true_positions(mask: torch.Tensor | None, b: int, n: int) -> torch.Tensor:
    if mask is None:
        return torch.arange(n).expand(b, n)
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def inv_freq(cfg, d, layer_type=None):
    params = cfg.rope_parameters if layer_type is None else cfg.rope_parameters[layer_type]
    freq = 1.0 / params["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    if params.get("rope_type", "default") == "linear":  # position interpolation: every frequency / factor
        freq = freq / params["factor"]
    return freq


def logistic_groups(n: int, capacity: int, rate: float) -> list[int]:
    """SELF (Dang et al. 2025, arXiv:2505.17296): the group of each of n tokens when group x holds ⌊g(x)⌋ consecutive
    tokens, g(x) = C / (1 + (C − 1)·e^(−r·x)) (1 at x = 0, below C for every x: at most C − 1), the tokens counted from
    1 as the authors' kernel counts them (token 0 joins token 1 in group 0). Written by walking the groups one by
    one."""
    counted, x = [], 0
    while len(counted) < n:
        size = min(math.floor(capacity / (1 + (capacity - 1) * math.exp(-rate * x))), capacity - 1)
        counted += [x] * size
        x += 1
    return [counted[max(t - 1, 0)] for t in range(n)]


def relative(scheme: str, p: dict, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """r(i, j) as a float tensor (b, L, L) from true positions i (b, L, 1), j (b, 1, L)."""
    d = (i - j).float()
    if scheme == "rope":
        return d
    if scheme == "lm_infinite":  # Han et al. 2024 (LM-Infinite): d in the local branch, D for the global one
        return torch.where(d < p["local_size"], d, torch.full_like(d, p.get("max_distance", p["local_size"])))
    w = p["window_size"]
    if scheme == "string":  # An et al. 2024 (STRING) §4: d for d < S, d − S + W for d ≥ S
        shift = p["shift_size"]
        return torch.where(d < shift, d, d - shift + w)
    if scheme == "rerope":
        return torch.clamp(d, max=w)
    if scheme == "leaky_rerope":
        return torch.where(d < w, d, w + (d - w) / p["factor"])
    if scheme == "self_extend":
        g = p["group_size"]
        grouped = (torch.div(i, g, rounding_mode="floor") + w - w // g) - torch.div(j, g, rounding_mode="floor")
        return torch.where(d < w, d, grouped.float())
    if scheme == "self_extend_logistic":
        q, k = pair_positions(scheme, p, i, j)
        return q - k
    raise KeyError(scheme)


def pair_positions(scheme: str, p: dict, i: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q position, k position) of every pair, float tensors (b, L, L), from true positions i (b, L, 1), j (b, 1, L):
    where each paper puts the query and the key (RoPE of those positions gives `relative`'s r(i, j) as their
    difference). For architectures whose layers do more than rotate (q/k norms after RoPE, position-dependent
    scales), the absolute positions matter, not only their difference."""
    i, j = torch.broadcast_tensors(i.float(), j.float())
    d = i - j
    if scheme == "rope":
        return i, j
    if scheme == "dca":
        raise KeyError("dca: use helpers.reference_dca.pair_positions")
    if scheme == "sink":  # Xiao et al. 2024 (StreamingLLM), pos_shift: q at min(i, S + W − 1) for the sinks beyond the
        # window, keys in place; pairs that are neither near nor a sink are hidden (`sink_hidden`)
        far = d >= p["window_size"]
        return torch.where(far, i.clamp(max=p.get("sink_size", 4) + p["window_size"] - 1), i), j
    if scheme == "lm_infinite":  # Han et al. 2024 (LM-Infinite): beyond the local branch q at D, k un-rotated
        far = d >= p["local_size"]
        q_far = torch.full_like(i, p.get("max_distance", p["local_size"]))
        return torch.where(far, q_far, i), torch.where(far, torch.zeros_like(j), j)
    w = p["window_size"]
    if scheme == "string":  # An et al. 2024 (STRING): the query moved to i − S + W for d ≥ S, keys in place
        far = d >= p["shift_size"]
        return torch.where(far, i - p["shift_size"] + w, i), j
    far = d >= w
    if scheme == "rerope":  # Su 2023: q at W, k un-rotated (position 0) beyond the window
        return torch.where(far, torch.full_like(i, w), i), torch.where(far, torch.zeros_like(j), j)
    if scheme == "leaky_rerope":  # Su 2023: q at i/k + W − W/k, k at j/k
        k = p["factor"]
        return torch.where(far, i / k + w - w / k, i), torch.where(far, j / k, j)
    if scheme == "self_extend":  # Jin et al. 2024, Algorithm 1: q at ⌊i/G⌋ + W − ⌊W/G⌋, k at ⌊j/G⌋
        g = p["group_size"]
        return torch.where(far, torch.floor(i / g) + w - w // g, i), torch.where(far, torch.floor(j / g), j)
    if scheme == "self_extend_logistic":  # Dang et al. 2025 (SELF): q at W + f(i − W), k at f(j), f the logistic groups
        n = int(max(i.max().item(), j.max().item())) + 1
        f = torch.tensor(logistic_groups(n, p["group_size"], p.get("growth_rate", 0.02)), dtype=torch.float32)
        q_far = w + f[(i - w).clamp(min=0).long()]
        return torch.where(far, q_far, i), torch.where(far, f[j.clamp(min=0).long()], j)
    raise KeyError(scheme)


def hidden(scheme: str, p: dict, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor | None:
    """The pairs (i, j) of true positions a scheme hides (None: none): StreamingLLM's evicted keys, LM-Infinite's
    middle ones (beyond the local branch and not among the first `global_size` tokens)."""
    if scheme == "sink":
        return sink_hidden(p, i, j)
    if scheme == "lm_infinite":
        return (i - j >= p["local_size"]) & (j >= p.get("global_size", 100))
    return None


def sink_hidden(p: dict, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """StreamingLLM: the pairs (i, j) of true positions that are neither in the window (i − j < W) nor a sink
    (j < S)."""
    return (i - j >= p["window_size"]) & (j >= p.get("sink_size", 4))


def alibi_slopes(n, max_bias=8.0):
    """Press et al.: 2^(−8h/n) for a power of two, else the closest power's slopes + every other of twice it."""
    if math.log2(n).is_integer():
        return [2 ** (-max_bias * h / n) for h in range(1, n + 1)]
    c = 2 ** math.floor(math.log2(n))
    return alibi_slopes(c, max_bias) + alibi_slopes(2 * c, max_bias)[0::2][: n - c]


def t5_bucket(n: int, num_buckets: int, max_distance: int) -> int:
    """Scalar T5 causal bucket of distance n >= 0 (transformers' T5Attention._relative_position_bucket)."""
    exact = num_buckets // 2
    if n < exact:
        return n
    return min(num_buckets - 1,
               exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact)))


def sinusoid_table(n: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    pe = torch.zeros(n, dim)
    for pos in range(n):
        for t in range(0, dim, 2):
            pe[pos, t] = math.sin(pos / theta ** (t / dim))
            if t + 1 < dim:
                pe[pos, t + 1] = math.cos(pos / theta ** (t / dim))
    return pe


def scores(scheme, p, model, layer_idx, q, k, pos, scale=None, layer_type=None):
    """(b, H, L, L) pre-softmax logits; q (b, H, L, d), k (b, H, L, d) un-rotated, pos (b, L) true positions."""
    b, h, n, d = q.shape
    scale = d**-0.5 if scale is None else scale
    i, j = pos[:, :, None], pos[:, None, :]
    if scheme in ("rope", "rerope", "leaky_rerope", "self_extend", "self_extend_logistic", "string", "dpe",
                  "lm_infinite"):
        freq = inv_freq(model.config, d, layer_type)
        if scheme == "dpe":  # pair k in group ⌊k·G/(d/2)⌋ (fastest first) is Self-Extend with that group's size
            sizes = p["group_sizes"]
            r = torch.stack([relative("self_extend", {"group_size": sizes[k * len(sizes) // (d // 2)],
                                                      "window_size": p["window_size"]}, i, j)
                             for k in range(d // 2)], -1)  # (b, L, L, d/2): one relative position per pair
            ang = r * freq
        else:
            ang = relative(scheme, p, i, j)[..., None] * freq  # (b, L, L, d/2)
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        qi = q[:, :, :, None, :]  # (b, H, L, 1, d): q_i rotated by r(i, j) for every j
        q_rot = qi * cos[:, None] + rotate_half(qi) * sin[:, None]
        s = (q_rot * k[:, :, None, :, :]).sum(-1) * scale
        gone = hidden(scheme, p, i, j)
        return s if gone is None else s.masked_fill(gone[:, None], float("-inf"))
    s = q @ k.transpose(-1, -2) * scale
    if scheme in ("nope", "sinusoidal", "learned_absolute"):
        return s
    dist = (i - j).clamp(min=0)  # masked entries do not matter
    if scheme == "alibi":
        slopes = torch.tensor(alibi_slopes(h, p.get("max_bias", 8.0)))
        return s - slopes[None, :, None, None] * dist[:, None].float()
    if scheme == "relative_bias":
        w = model.rope_patch_relative_bias.weight[layer_idx]  # (H, buckets)
        buckets = torch.tensor([t5_bucket(t, p.get("num_buckets", 32), p.get("max_distance", 128)) for t in range(n)])
        return s + w[:, buckets[dist]].permute(1, 0, 2, 3)  # (H, b, L, L) -> (b, H, L, L)
    raise KeyError(scheme)


def decoder_forward(model, ids, scores_fn, mask=None, position_encoding=None):
    """A llama / mistral / qwen2-layout decoder written out: causal attention in true positions, with the scores of
    layer `layer_idx` from `scores_fn(layer_idx, q, k, pos)` (b, H, L, L) and, optionally, an absolute encoding
    `position_encoding(pos)` added to the embeddings. Logits (b, L, vocab); padding rows are garbage."""
    base = model.model
    b, n = ids.shape
    pos = true_positions(mask, b, n)
    x = base.embed_tokens(ids)
    if position_encoding is not None:
        x = x + position_encoding(pos)
    slot = torch.arange(n)
    allowed = (pos[:, :, None] >= pos[:, None, :]) & (slot[:, None] >= slot[None, :])  # causal in true positions
    if mask is not None:
        allowed &= mask.bool()[:, None, :]
    for layer_idx, layer in enumerate(base.layers):
        a = layer.self_attn
        hdn = layer.input_layernorm(x)
        d = a.head_dim
        q = a.q_proj(hdn).view(b, n, -1, d).transpose(1, 2)
        k = a.k_proj(hdn).view(b, n, -1, d).transpose(1, 2)
        v = a.v_proj(hdn).view(b, n, -1, d).transpose(1, 2)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        s = scores_fn(layer_idx, q, k, pos).masked_fill(~allowed[:, None], float("-inf"))
        attn = torch.softmax(s, dim=-1).nan_to_num(0.0)
        x = x + a.o_proj((attn @ v).transpose(1, 2).reshape(b, n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(base.norm(x))


@torch.no_grad()
def forward(model, ids, scheme, params, mask=None):
    """Reference logits (b, L, vocab) under `scheme`; rows that are padding are garbage (compare real tokens only)."""
    if scheme == "sink":  # per-query visible sets and cache indices: helpers/reference_sink.py
        from helpers.reference_sink import paper_forward

        return paper_forward(model, ids, params.get("sink_size", 4), params["window_size"], mask)
    encoding = None
    if scheme == "sinusoidal":
        table = sinusoid_table(ids.shape[1], model.config.hidden_size, params.get("rope_theta", 10000.0))
        encoding = table.__getitem__
    if scheme == "learned_absolute":
        encoding = model.rope_patch_position_embeddings.weight.__getitem__
    return decoder_forward(model, ids, lambda i, q, k, pos: scores(scheme, params, model, i, q, k, pos), mask, encoding)


@torch.no_grad()
def gemma3_forward(model, ids, scheme, params, mask=None):
    """Reference logits of a Gemma 3 text model (gemma3_text): scaled embeddings, q/k RMS norms before the rotation,
    scale query_pre_attn_scalar^-1/2, sandwich norms, and per layer type its own RoPE frequencies
    (`rope_parameters[layer_type]`) and, for sliding layers, the window i − j < sliding_window."""
    cfg, base = model.config, model.model
    b, n = ids.shape
    pos = true_positions(mask, b, n)
    x = base.embed_tokens(ids)
    slot = torch.arange(n)
    causal = (pos[:, :, None] >= pos[:, None, :]) & (slot[:, None] >= slot[None, :])
    if mask is not None:
        causal &= mask.bool()[:, None, :]
    for layer_idx, layer in enumerate(base.layers):
        a, layer_type = layer.self_attn, cfg.layer_types[layer_idx]
        allowed = causal
        if layer_type == "sliding_attention":
            allowed = causal & (pos[:, :, None] - pos[:, None, :] < cfg.sliding_window)
        hdn = layer.input_layernorm(x)
        d = a.head_dim
        q = a.q_norm(a.q_proj(hdn).view(b, n, -1, d).transpose(1, 2))
        k = a.k_norm(a.k_proj(hdn).view(b, n, -1, d).transpose(1, 2))
        v = a.v_proj(hdn).view(b, n, -1, d).transpose(1, 2)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        s = scores(scheme, params, model, layer_idx, q, k, pos, cfg.query_pre_attn_scalar**-0.5, layer_type)
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        attn = torch.softmax(s, dim=-1).nan_to_num(0.0)
        o = (attn @ v).transpose(1, 2).reshape(b, n, -1)
        x = x + layer.post_attention_layernorm(a.o_proj(o))
        x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
    out = model.lm_head(base.norm(x))
    if cfg.final_logit_softcapping is not None:
        out = torch.tanh(out / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return out
