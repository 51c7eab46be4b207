"""`rope-patch plot`: figures of the position-encoding theory (rope_patch.analysis) and of compare results.

    rope-patch plot decay --schemes default yarn:8 linear:8 ntk:8 --head-dim 128 --window 4096 --out decay.png
    rope-patch plot wavelengths --schemes default yarn:8 llama3:8 --config path/to/model --out wl.svg
    rope-patch plot distance --schemes rerope:512 self_extend:group_size=8,window_size=512 alibi --out dist.png
    rope-patch plot results results/compare.json --out results/summary.png
    rope-patch plot results tune/search_log.json --out tune/search.png
"""

from __future__ import annotations

import json
from pathlib import Path

from .args import count, model_help, positive, real, rope_layout, scheme_spec

ANALYSIS_KINDS = ("decay", "wavelengths", "frequencies", "angles", "distance", "score")
DEFAULT_SCHEMES = {"*": ["default", "yarn:8", "linear:8", "ntk:8"],
                   "distance": ["default", "rerope:512", "leaky_rerope:window_size=512,factor=16",
                                "self_extend:group_size=8,window_size=512", "alibi"]}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plot", help="figures: decay bound, wavelengths, frequencies, angles, distance maps, scores, results",
        description="Draw the position-encoding theory for one or more schemes (numbers from rope_patch.analysis, "
        "the same that a patched model uses), or redraw a `rope-patch compare` / sweep result file or a "
        "`rope-patch tune` search log. The original training window L is marked on every figure.")
    p.add_argument("kind", choices=[*ANALYSIS_KINDS, "results"],
                   help="decay: RoFormer long-term-decay bound vs distance; wavelengths: 2π/θ′ per pair and turns "
                   "inside L; frequencies: θ′ per pair and interpolation factor; angles: largest angle per pair at a "
                   "length vs the trained range; distance: effective relative distance (rerope, self_extend) and "
                   "ALiBi bias; score: q·k vs distance; results: redraw compare/sweep JSON or a tune search log")
    p.add_argument("results_file", nargs="?", default=None, metavar="RESULTS.json",
                   help="for `results`: compare.json (or a JSON/JSONL list of records), or a tune search_log.json")
    p.add_argument("--schemes", nargs="+", type=scheme_spec(), default=None, metavar="SPEC",
                   help="scheme specs: name, name:value, name:key=value,... (default: default yarn:8 linear:8 ntk:8; "
                   "for distance: rerope, leaky_rerope, self_extend, alibi)")
    rope = p.add_argument_group("model RoPE (or --config)")
    rope.add_argument("--head-dim", type=count(2), default=128, help="per-head dimension d (default: %(default)s)")
    rope.add_argument("--rope-theta", type=real(above=1.0), default=10000.0, help="RoPE base b (default: %(default)s)")
    rope.add_argument("--window", type=positive, default=None, metavar="L",
                      help="original training window L = max_position_embeddings (default: 4096; for `results`: "
                      "the file's)")
    rope.add_argument("--partial-rotary-factor", type=real(maximum=1.0, above=0.0), default=None,
                      help="fraction of the head that rotates")
    rope.add_argument("--config", default=None, metavar="MODEL",
                      help="read head_dim, rope_theta, window, heads from a model's config.json: " + model_help(None))
    rope.add_argument("--seq-len", type=positive, default=None,
                      help="current length for dynamic NTK / LongRoPE (default: the scheme's extended window)")
    p.add_argument("--max-distance", type=positive, default=None,
                   help="largest distance (decay, score, distance) or the length N (angles); default max(4L, s·L); "
                   "refused before anything is computed when the figure would need more memory than the plots' limit "
                   "(the error says how much, and the largest distance that fits)")
    p.add_argument("--normalize", action="store_true", help="decay: divide by the value at Δ = 0")
    p.add_argument("--linear", action="store_true", help="decay: linear distance axis (like the RoFormer figure)")
    p.add_argument("--logits", action="store_true", help="score: a²·q·k/√d plus ALiBi's bias (what softmax sees)")
    p.add_argument("--num-heads", type=positive, default=None, help="heads for ALiBi slopes (default: config's or 8)")
    p.add_argument("--out", default=None, help="output file (default: <kind>.<format>)")
    p.add_argument("--format", choices=("png", "svg"), default=None,
                   help="figure format (default: from --out, else png)")
    p.add_argument("--dpi", type=count(1, 2400), default=150, help="PNG resolution (default: %(default)s)")
    p.set_defaults(func=run)


def run(args) -> int:
    print(f"Wrote {_run(args)}")
    return 0


def check_size(args, schemes, rope) -> None:
    """Refuse a figure whose arrays would not fit (e.g. `plot decay --max-distance 1e8`) with the estimate."""
    from .. import plots

    need, n = plots.figure_memory(args.kind, schemes, max_distance=args.max_distance,
                                  num_heads=args.num_heads or rope.get("_num_heads"),
                                  **{k: v for k, v in rope.items() if not k.startswith("_")})
    if need > plots.MEMORY_LIMIT:
        per = need / n
        flag = f"--max-distance {n:,}" if args.max_distance is not None else f"the default distance range ({n:,})"
        raise ValueError(f"`rope-patch plot {args.kind}` with {flag} needs about {need / 2**30:.1f} GiB of memory "
                         f"({n:,} distances x {len(schemes)} scheme(s)), over the {plots.MEMORY_LIMIT / 2**30:.0f} "
                         f"GiB limit; pass --max-distance {int(plots.MEMORY_LIMIT / per)} or less.")


def _special(path) -> tuple[str, dict] | None:
    """("search", log) for a `rope-patch tune` log, ("tasks", sweep) for a sweep of lm-eval's own tasks only (RULER,
    ...), each checked against its schema; None for anything else (read_results then reads it, or says what is
    wrong)."""
    from .. import schema
    from ..plots.tasks import SWEEP_FORMAT
    from ..tuning.log import FORMAT as SEARCH_LOG_FORMAT
    from ..tuning.log import parse_log

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if data.get("format") == SEARCH_LOG_FORMAT:
        return "search", parse_log(data, path)
    if data.get("format") == SWEEP_FORMAT:
        data = schema.check(data, schema.SWEEP, path)
        if not any(r.get("family") for r in data["rows"]):
            return "tasks", data
    return None


def _run(args):
    from .. import plots  # torch, matplotlib: only now, after the arguments parsed

    if args.kind == "results":
        if args.results_file is None:
            raise ValueError("`rope-patch plot results` needs the results file, e.g. results/compare.json.")
        if args.schemes:
            raise ValueError("`rope-patch plot results` draws the schemes in the file; drop --schemes.")
        special = _special(args.results_file)
        if special is not None:
            kind, data = special
            if args.window is not None:
                raise ValueError(f"a {'search log' if kind == 'search' else 'task sweep'}'s figure has no window "
                                 "axis; drop --window.")
            fig = plots.search(data) if kind == "search" else plots.tasks(data)
        else:
            fig = plots.results(args.results_file, window=args.window)
    else:
        if args.results_file is not None:
            raise ValueError(f"`rope-patch plot {args.kind}` takes no file argument (got {args.results_file!r}); "
                             "give schemes with --schemes.")
        schemes = args.schemes or DEFAULT_SCHEMES.get(args.kind, DEFAULT_SCHEMES["*"])
        rope = rope_layout(args)
        check_size(args, schemes, rope)
        kw = {}
        if args.kind in ("decay", "score", "distance") and args.max_distance is not None:
            kw["max_distance"] = args.max_distance
        if args.kind == "angles" and args.max_distance is not None:
            kw["length"] = args.max_distance
        if args.kind == "decay":
            kw.update(normalize=args.normalize, log_x=not args.linear)
        if args.kind == "score":
            kw["logits"] = args.logits
        if args.kind in ("score", "distance"):
            kw["num_heads"] = args.num_heads or rope.pop("_num_heads", None) or 8
        rope.pop("_num_heads", None)
        if args.kind == "distance":
            rope.pop("seq_len", None)
        fig = plots.make(args.kind, schemes, **kw, **rope)
    out = args.out or f"{args.kind}.{args.format or 'png'}"
    return plots.save(fig, out, args.format, dpi=args.dpi)

