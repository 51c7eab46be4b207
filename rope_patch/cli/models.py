"""`rope-patch models [list]` and `rope-patch models fetch NAME` (the names: rope_patch.zoo)."""

from __future__ import annotations

from .. import zoo  # torch-free at import: the names and help below answer without loading anything

FETCHABLE = tuple(zoo.FETCHED)  # the models `fetch` downloads and converts


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("models", help=f"list the named models; fetch {' or '.join(FETCHABLE)} into the cache",
                              description=f"`rope-patch models` (= `rope-patch models list`): the named models "
                              f"({', '.join(zoo.MODELS)}) and where they are; `rope-patch models fetch NAME` "
                              "downloads and converts one into the cache.")
    p.set_defaults(func=_list)  # no subcommand: list
    sub = p.add_subparsers(dest="models_command", metavar="{list,fetch}")
    lst = sub.add_parser("list", help=f"the named models ({', '.join(zoo.MODELS)}) and where they are (the default)")
    lst.set_defaults(func=_list)
    fetch = sub.add_parser("fetch", help=f"download and convert a model into the cache ({', '.join(FETCHABLE)})")
    fetch.add_argument("name", choices=FETCHABLE)
    fetch.add_argument("--cache", default=None, help="cache directory (default $ROPE_PATCH_CACHE or "
                                                     "~/.cache/rope_patch)")
    fetch.add_argument("--force", action="store_true", help="download and convert again even if cached")
    fetch.set_defaults(func=_fetch)


def _list(args) -> int:
    for name, info in zoo.MODELS.items():
        try:
            where = str(zoo.resolve_model_path(name))
        except (FileNotFoundError, ValueError):
            where = "not available" + (f" (rope-patch models fetch {name})" if name in zoo.FETCHED else "")
        print(f"{name:<8} window {info.window:<5} {info.description}\n         {where}")
    print("Any local model folder (save_pretrained layout) is accepted as well.")
    return 0


def _fetch(args) -> int:
    print(zoo.fetch(args.name, cache=args.cache, force=args.force))  # errors: one line from cli.main
    return 0
