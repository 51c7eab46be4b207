"""A straightforward reference of Dual Chunk Attention written from the paper, independent of rope_patch.

An et al. 2024 (arXiv:2402.17463) §3, eqs. 2, 5, 7, 8, in the paper's own notation: chunk size s (the modulus), the
largest query position c − 1, the local window w. The relative position of query i and key j is

    M[i][j] = P_q^Intra[i] − P_k[j]   if ⌊i/s⌋ − ⌊j/s⌋ = 0
              P_q^Succ[i]  − P_k[j]   if ⌊i/s⌋ − ⌊j/s⌋ = 1
              P_q^Inter[i] − P_k[j]   if ⌊i/s⌋ − ⌊j/s⌋ > 1

    P_k = P_q^Intra = [0, 1, …, l − 1] mod s
    P_q^Succ = [s, s + 1, …, s + w − 1, c − 1, …, c − 1] per chunk
    P_q^Inter = [q_inter, …]  (the paper: c − 1)

built here as explicit lists per position. The authors' code (and rope_patch's `chunk_size` / `local_size`) maps onto
it as s = chunk_size − local_size, c − 1 = chunk_size, w = local_size + 1 and q_inter = min(2s − 1, chunk_size).
The logits are then the reference's "rotate q_i by M[i][j] against the un-rotated key" (one angle per pair), with
materialised (b, H, L, L) scores; i and j are true positions (left padding skipped).
"""

from __future__ import annotations

import torch

from helpers.reference import decoder_forward, inv_freq, rotate_half


def paper_parameters(chunk_size: int, local_size: int) -> dict:
    s = chunk_size - local_size
    return dict(s=s, c=chunk_size + 1, w=local_size + 1, q_inter=min(2 * s - 1, chunk_size))


def position_lists(n: int, s: int, c: int, w: int, q_inter: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """P_k, P_q^Intra, P_q^Succ, P_q^Inter for absolute positions 0 … n − 1 (eqs. 2, 5, 7)."""
    p_k = [p % s for p in range(n)]
    succ_chunk = [s + t if t < w else c - 1 for t in range(s)]  # "the same for all chunks"
    p_succ = [succ_chunk[p % s] for p in range(n)]
    return p_k, list(p_k), p_succ, [q_inter] * n


def pair_positions(n: int, chunk_size: int, local_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, n) float (q position, k position) of every pair by eqs. 2, 5, 7, 8: the query at P_q^Intra / P_q^Succ /
    P_q^Inter by the chunk gap, the key at P_k (entries j > i are unused: masked)."""
    p = paper_parameters(chunk_size, local_size)
    s = p["s"]
    p_k, p_intra, p_succ, p_inter = position_lists(n, **p)
    pq, pk = torch.zeros(n, n), torch.zeros(n, n)
    for i in range(n):
        for j in range(i + 1):
            gap = i // s - j // s
            pq[i, j] = p_intra[i] if gap == 0 else p_succ[i] if gap == 1 else p_inter[i]
            pk[i, j] = p_k[j]
    return pq, pk


def relative_matrix(n: int, chunk_size: int, local_size: int) -> torch.Tensor:
    """(n, n) float M[i][j] by eq. 8 (entries j > i are unused: masked)."""
    p = paper_parameters(chunk_size, local_size)
    s = p["s"]
    p_k, p_intra, p_succ, p_inter = position_lists(n, **p)
    m = torch.zeros(n, n)
    for i in range(n):
        for j in range(i + 1):
            gap = i // s - j // s
            q = p_intra[i] if gap == 0 else p_succ[i] if gap == 1 else p_inter[i]
            m[i, j] = q - p_k[j]
    return m


def scores(model, q, k, pos, chunk_size, local_size, scale=None):
    """(b, H, L, L) pre-softmax logits; q, k (b, H, L, d) un-rotated, pos (b, L) true positions."""
    b, h, n, d = q.shape
    scale = d**-0.5 if scale is None else scale
    table = relative_matrix(int(pos.max()) + 1, chunk_size, local_size)
    r = table[pos[:, :, None], pos[:, None, :]]  # (b, L, L)
    ang = r[..., None] * inv_freq(model.config, d)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    qi = q[:, :, :, None, :]
    q_rot = qi * cos[:, None] + rotate_half(qi) * sin[:, None]
    return (q_rot * k[:, :, None, :, :]).sum(-1) * scale


@torch.no_grad()
def forward(model, ids, chunk_size, local_size, mask=None):
    """Reference logits (b, L, vocab) of a llama / mistral / qwen2-layout model under DCA; padding rows are garbage."""
    return decoder_forward(model, ids, lambda i, q, k, pos: scores(model, q, k, pos, chunk_size, local_size), mask)
