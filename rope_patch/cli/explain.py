"""`rope-patch explain`: the numbers behind the docs' theory page (docs/theory.md), for any scheme and RoPE layout.

    rope-patch explain yarn:8                       # d = 128, b = 10 000, L = 4096 (Llama-2-7B-like)
    rope-patch explain llama3:8 --config path/to/model
"""

from __future__ import annotations

from .args import count, model_help, positive, real, rope_layout, scheme_spec


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "explain", help="pair counts, wavelengths, temperature and decay bound of schemes",
        description="Print what a scheme does to the rotary frequencies of a RoPE layout: how many pairs complete a "
        "turn inside the pre-training window, how many it keeps or fully interpolates, the longest wavelength, the "
        "cos/sin scale, and the RoFormer decay bound over distances L/16..L (numbers from rope_patch.analysis, "
        "the same that a patched model uses).")
    p.add_argument("schemes", nargs="+", type=scheme_spec(), metavar="SPEC",
                   help="scheme specs: name, name:value, name:key=value,...")
    rope = p.add_argument_group("model RoPE (or --config)")
    rope.add_argument("--head-dim", type=count(2), default=128, help="per-head dimension d (default: %(default)s)")
    rope.add_argument("--rope-theta", type=real(above=1.0), default=10000.0, help="RoPE base b (default: %(default)s)")
    rope.add_argument("--window", type=positive, default=None, metavar="L",
                      help="pre-training window L (default: 4096)")
    rope.add_argument("--partial-rotary-factor", type=real(maximum=1.0, above=0.0), default=None,
                      help="fraction of the head that rotates")
    rope.add_argument("--config", default=None, metavar="MODEL",
                      help="read the RoPE layout from a model's config.json: " + model_help(None))
    p.set_defaults(func=run, seq_len=None)


def run(args) -> int:
    from .. import analysis  # torch: only now, after the arguments parsed

    rope = {k: v for k, v in rope_layout(args).items() if not k.startswith("_")}
    # a config whose RoPE is per layer type (Gemma 3's sliding and full attention layers): each type's layout, named
    entries = getattr(rope.get("config"), "rope_parameters", None) or {}
    types = [t for t, entry in entries.items() if isinstance(entry, dict)] or [None]
    for spec in args.schemes:
        for layer_type in types:
            lines = analysis.explain(spec, **rope, **({"layer_type": layer_type} if layer_type else {})).lines()
            if layer_type:
                lines[0] += f" ({layer_type} layers)"
            print("\n".join(lines))
    return 0
