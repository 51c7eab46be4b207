"""The built-in schemes' names, aliases, kinds, parameter names and bare-value parameters, readable without importing
torch.

The command line checks scheme specs (`--schemes yran:8` -> "Did you mean 'yarn'?") and prints `rope-patch list`
before it imports anything heavy, from this table. The scheme classes stay the one place a scheme is defined: the
table is rope_patch/data/scheme_names.json, generated from the registered classes and committed; a test checks it
against the live registry and names the command that rewrites it:

    python -m rope_patch.scheme_names           # rewrite the table from the scheme classes (imports torch)
    python -m rope_patch.scheme_names --check   # exit status 1 when the table is out of date

Only the built-in schemes are in it: a user's `register_scheme` lives in the user's process, never in the CLI's.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

from .registry import did_you_mean, normalise_name, unknown_scheme
from .resources import data_path

TABLE = "scheme_names.json"
COMMAND = "python -m rope_patch.scheme_names"


@functools.cache
def table() -> dict:
    """{"schemes": {name: {"kind", "params", "bare", "listed"}}, "aliases": {alias: name}} as committed ("bare": the
    parameter a bare value `name:VALUE` sets, null for none)."""
    return json.loads(data_path(TABLE).read_text(encoding="utf-8"))


def list_schemes() -> list[str]:
    """As registry.list_schemes(): the listed names (not `stack`), sorted."""
    return sorted(name for name, row in table()["schemes"].items() if row["listed"])


def aliases() -> dict[str, str]:
    return dict(table()["aliases"])


def canonical_name(name: str) -> str:
    """As registry.canonical_name(), with the same errors (that point to `rope-patch list`)."""
    key = normalise_name(name)
    if key in table()["schemes"]:
        return key
    if key in table()["aliases"]:
        return table()["aliases"][key]
    raise unknown_scheme(name, list_schemes(), table()["aliases"], see="`rope-patch list`")


def param_names(name: str) -> list[str]:
    return list(table()["schemes"][canonical_name(name)]["params"])


def bare_param(name: str) -> str | None:
    """As registry.bare_param(): the parameter the bare VALUE of `name:VALUE` sets, None for none."""
    return table()["schemes"][canonical_name(name)]["bare"]


def kind(name: str) -> str:
    return table()["schemes"][canonical_name(name)]["kind"]


def check_spec(spec: str) -> None:
    """The names in a scheme spec (`yarn:8`, `yarn:factor=8`, `yarn:4+logn`): the scheme, its positional value and
    its parameter keys, with the errors `apply()` gives (ValueError / TypeError). The values are checked when the
    scheme is built (that needs the classes)."""
    from .specs import parse_spec

    name, params = parse_spec(spec, names=sys.modules[__name__])
    parts = params["schemes"] if name == "stack" else [spec]
    for part in parts:
        name, params = parse_spec(part, names=sys.modules[__name__])
        known = param_names(name)
        for key in params:
            if key not in known:  # the message of Scheme.from_params
                raise TypeError(f"{name}: unknown parameter {key!r}.{did_you_mean(key, known)} "
                                f"Parameters of {name!r}: {', '.join(known) or '(none)'}.")


def build() -> dict:
    """The table from the registered scheme classes (imports them: torch)."""
    from . import registry

    # the built-in classes only: a scheme a test or a user registered in this process is not the CLI's
    builtin = {name: cls for name, cls in registry.registered().items()
               if cls.__module__.startswith(f"{__package__}.schemes.")}
    schemes = {name: {"kind": cls.kind, "params": cls.param_names(), "bare": registry.bare_param(name),
                      "listed": cls.listed} for name, cls in sorted(builtin.items())}
    aliases = {alias: name for alias, name in sorted(registry.aliases().items()) if name in builtin}
    return {"generated_by": COMMAND, "schemes": schemes, "aliases": aliases}


def render(data: dict) -> str:
    """JSON with one line per scheme and per alias, so that adding a scheme is a one-line diff."""
    def block(rows: dict) -> str:
        return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in rows.items()) + "\n }"

    return (f'{{\n "generated_by": {json.dumps(data["generated_by"])},\n "schemes": {block(data["schemes"])},\n'
            f' "aliases": {block(data["aliases"])}\n}}\n')


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Rewrite rope_patch/data/scheme_names.json from the "
                                     "registered scheme classes.")
    parser.add_argument("--check", action="store_true", help="only compare; exit status 1 when it is out of date")
    args = parser.parse_args(argv)
    path, text = data_path(TABLE), render(build())
    current = path.read_text(encoding="utf-8") if path.is_file() else None
    if args.check:
        if current != text:
            print(f"{path} is out of date with the scheme classes: run `{COMMAND}`.", file=sys.stderr)
            return 1
        return 0
    if current != text:
        path.write_text(text, encoding="utf-8")
        table.cache_clear()
    print(f"{path}: {len(json.loads(text)['schemes'])} schemes" + (" (unchanged)" if current == text else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
