"""`rope-patch` command line. Subcommands live in their own modules and register here."""

from __future__ import annotations

import argparse
import sys

from .api import as_scheme
from .schemes.base import Scheme

# Positional value of `name:VALUE` specs: the parameter a bare number sets.
_POSITIONAL = {"default": "rope_theta", "p_rope": "partial_rotary_factor", "alibi": "max_bias",
               "self_extend": "group_size", "rerope": "window_size", "leaky_rerope": "window_size"}


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if "/" in text:  # lists for longrope: short_factor=1/1.5/2
        return [_value(t) for t in text.split("/")]
    return text


def parse_scheme_spec(spec: str) -> Scheme:
    """`yarn`, `yarn:8` (factor), `yarn:factor=8,beta_fast=16`, `default:500000` (rope_theta) -> a Scheme.

    Raises ValueError/TypeError with the same messages as `apply()`.
    """
    from .registry import canonical_name

    name, _, rest = spec.partition(":")
    name = canonical_name(name)
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            params[_POSITIONAL.get(name, "factor")] = _value(key)
        else:
            params[key.strip()] = _value(val.strip())
    return as_scheme(name, **params)


def scheme_label(spec: str) -> str:
    return spec.replace(":", "×", 1) if spec.count(":") == 1 and "=" not in spec else spec


SUBCOMMANDS = ["rope_patch.cli_compare", "rope_patch.cli_models", "rope_patch.cli_plot", "rope_patch.cli_export", "rope_patch.cli_sweep"]  # (module path) each exposing add_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="rope-patch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    lst = sub.add_parser("list", help="list the registered schemes and their parameters")
    lst.set_defaults(func=_list)
    for module in SUBCOMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def _list(args) -> int:
    from .registry import aliases, get_scheme_class, list_schemes

    by_scheme: dict[str, list[str]] = {}
    for alias, name in aliases().items():
        by_scheme.setdefault(name, []).append(alias)
    for name in list_schemes():
        cls = get_scheme_class(name)
        extra = f" (aliases: {', '.join(sorted(by_scheme.get(name, [])))})" if name in by_scheme else ""
        print(f"{name:<16} {cls.kind:<10} {', '.join(cls.param_names()) or '-'}{extra}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, TypeError) as err:
        print(f"rope-patch: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
