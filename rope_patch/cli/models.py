"""`rope-patch models list` and `rope-patch models fetch smollm2|gemma3`."""

from __future__ import annotations

# The models `fetch` downloads and converts (zoo.FETCHED; spelled here so that --help and argument errors answer
# without importing torch; tests/evaluation/test_models.py checks the two agree).
FETCHABLE = ("smollm2", "gemma3")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("models", help="list the named models; fetch SmolLM2 or Gemma 3 270M into the cache")
    sub = p.add_subparsers(dest="models_command", required=True)
    lst = sub.add_parser("list", help="the named models (tiny, smollm2, gemma3) and where they are")
    lst.set_defaults(func=_list)
    fetch = sub.add_parser("fetch", help="download and convert a model into the cache (smollm2, gemma3)")
    fetch.add_argument("name", choices=FETCHABLE)
    fetch.add_argument("--cache", default=None, help="cache directory (default $ROPE_PATCH_CACHE or "
                                                     "~/.cache/rope_patch)")
    fetch.add_argument("--force", action="store_true", help="download and convert again even if cached")
    fetch.set_defaults(func=_fetch)


def _list(args) -> int:
    from .. import zoo as models  # torch: only now, after the arguments parsed

    for name, info in models.MODELS.items():
        try:
            where = str(models.resolve_model_path(name))
        except (FileNotFoundError, ValueError):
            where = "not available" + (f" (rope-patch models fetch {name})" if name in models.FETCHED else "")
        print(f"{name:<8} window {info.window:<5} {info.description}\n         {where}")
    print("Any local model folder (save_pretrained layout) is accepted as well.")
    return 0


def _fetch(args) -> int:
    from .. import zoo as models

    print(models.fetch(args.name, cache=args.cache, force=args.force))  # errors: one line from cli.main
    return 0
