"""Peak-memory estimates of the dense figures, so `rope-patch plot` refuses a huge range before allocating."""

from __future__ import annotations

from .. import analysis as A
from . import style as S

# Memory (bytes per plotted distance) that the dense figures need, measured on this code (peak RSS, 1e6 distances)
# and rounded up: decay ~0.7 KB (d = 128, one scheme) - 1 KB (four); score ~4.6 KB (the [distances, samples]
# matrices); distance ~0.35 KB. `rope-patch plot` refuses an estimate above MEMORY_LIMIT before allocating anything.
MEMORY_LIMIT = 1 << 30


def plot_bytes(kind: str, n_distances: int, pairs: int, n_schemes: int, num_heads: int = 8,
               num_samples: int = 256) -> int:
    """Estimated peak memory of figure `kind` over `n_distances` distances (0 for the small figures)."""
    per_scheme = 64 * n_schemes + 64
    per = {"decay": 16 * pairs + per_scheme,
           "score": 8 * (pairs + 2 * num_samples) + per_scheme,
           "distance": 16 * num_heads + per_scheme}.get(kind)
    return 0 if per is None else n_distances * per


def figure_memory(kind: str, schemes, max_distance: int | None = None, num_heads: int | None = None,
                  **rope) -> tuple[int, int]:
    """(estimated peak bytes, number of distances) of `make(kind, schemes, max_distance=..., **rope)`, computed
    without drawing or allocating: the distance range defaults as in the figure itself. (0, 0) for the figures
    whose size does not grow with a distance range. `rope` as in `make`: head_dim, max_position_embeddings,
    partial_rotary_factor, or config= (its num_attention_heads is the default `num_heads`)."""
    if kind not in ("decay", "score", "distance"):
        return 0, 0
    cfg = rope.get("config")
    if cfg is not None:
        window = getattr(cfg, "max_position_embeddings", None)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        partial = getattr(cfg, "partial_rotary_factor", None) or 1.0
        num_heads = num_heads or getattr(cfg, "num_attention_heads", None)
    else:
        window, head_dim = rope["max_position_embeddings"], rope["head_dim"]
        partial = rope.get("partial_rotary_factor") or 1.0
    n = max_distance
    if n is None:
        n = (4 * window if window else 16384) if kind == "distance" else \
            S.default_max_distance(S.specs(schemes), window)
    schemes = [schemes] if isinstance(schemes, (str, A.AnalysisSpec)) else list(schemes)
    return plot_bytes(kind, n, int(head_dim * partial) // 2, len(schemes), num_heads=num_heads or 8), n
