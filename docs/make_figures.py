"""Draw the theory page's figures (docs/theory.md) into docs/figures/ (numbers from rope_patch.analysis).

    python docs/make_figures.py [--out-dir docs/figures] [--format png|svg]

The model is a Llama-2-7B-like RoPE: head_dim 128, base b = 10000, original window L = 4096, 32 heads. Every
figure can be redrawn for another model with `rope-patch plot KIND --schemes ... --config path/to/model`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rope_patch import plots

ROPE = dict(head_dim=128, rope_theta=10000.0, max_position_embeddings=4096)
SCALED = ["default", "linear:8", "ntk:8", "yarn:8", "llama3:8", "dynamic:8"]

FIGURES = {
    # name: (kind, schemes, extra keywords)
    "frequencies": ("frequencies", ["default", "default:500000", "linear:8", "ntk:8", "yarn:8", "llama3:8",
                                    "p_rope:0.75"], {}),
    "wavelengths": ("wavelengths", SCALED, {}),
    "decay": ("decay", ["default", "default:500000", "linear:8", "ntk:8", "yarn:8", "llama3:8"], {}),
    "decay_roformer": ("decay", ["default"], {"max_distance": 256, "log_x": False}),
    "angles": ("angles", SCALED, {"length": 32768}),
    "distance": ("distance", ["default", "rerope:512", "leaky_rerope:window_size=512,factor=16",
                              "self_extend:group_size=8,window_size=512", "alibi", "nope"],
                 {"max_distance": 16384, "num_heads": 32}),
    "score": ("score", ["default", "linear:8", "ntk:8", "yarn:8", "rerope:512"], {"max_distance": 32768}),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "figures"))
    parser.add_argument("--format", choices=("png", "svg"), default="png")
    parser.add_argument("--only", nargs="*", default=None, help="figure names to draw (default: all)")
    args = parser.parse_args(argv)
    for name, (kind, schemes, kw) in FIGURES.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        fig = plots.make(kind, schemes, **kw, **ROPE)
        path = plots.save(fig, Path(args.out_dir) / f"{name}.{args.format}", args.format, dpi=110)
        print(f"{path}  ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
