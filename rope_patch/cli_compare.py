"""`rope-patch compare`: perplexity and passkey retrieval of several schemes on one model.

    rope-patch compare --model tiny --schemes default linear:4 ntk:8 dynamic:4 yarn:8 llama3:8 \
        --lengths 256 512 1024 2048 --out results/
"""

from __future__ import annotations

import os
import sys


def add_parser(subparsers) -> None:
    from .evaluation.compare import DEFAULT_LENGTHS, DEFAULT_SCHEMES
    from .evaluation.retrieval import DEFAULT_DEPTHS

    p = subparsers.add_parser(
        "compare", help="perplexity and passkey accuracy of several schemes x lengths on one model",
        description="Evaluate several position-encoding schemes on one model (loaded once; each scheme applied "
        "with rope_patch.patched). Writes compare.json/.csv/.md and perplexity.png/passkey.png to --out.")
    p.add_argument("--model", default="tiny", help="tiny, smollm2, or a local model folder (default: tiny)")
    p.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES), metavar="SPEC",
                   help="scheme specs: name, name:factor, or name:key=value,... (default: %(default)s)")
    p.add_argument("--lengths", nargs="+", type=int, default=list(DEFAULT_LENGTHS), metavar="N",
                   help="context lengths in tokens (default: %(default)s)")
    p.add_argument("--passkey-lengths", nargs="*", type=int, default=None, metavar="N",
                   help="lengths for passkey retrieval (default: --lengths; give none to skip passkey)")
    p.add_argument("--depths", nargs="+", type=float, default=list(DEFAULT_DEPTHS), metavar="D",
                   help="needle depths in [0, 1] (default: %(default)s)")
    p.add_argument("--passkey-samples", type=int, default=4, metavar="N",
                   help="passkey prompts per (length, depth) cell (default: %(default)s)")
    p.add_argument("--windows", type=int, default=2, metavar="N",
                   help="perplexity windows at the longest length; every length reads the same N x longest tokens "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="passkey seed (default: %(default)s)")
    p.add_argument("--heldout", default=None, help="held-out text (default: eval/data/heldout.txt)")
    p.add_argument("--dtype", default="float32", help="model dtype (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the cores not busy with other work, from the load average; on a "
                   "busy machine extra threads wait for cores and slow small models down several-fold)")
    p.add_argument("--out", default="results", help="output folder (default: %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=run)


def auto_threads() -> int:
    """torch's thread count, reduced to the cores that the 1-minute load average leaves free (at least 1)."""
    import torch

    n = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return n
    free = (os.cpu_count() or n) - load
    return max(1, min(n, int(free + 0.5)))


def run(args) -> int:
    try:
        return _run(args)
    except FileNotFoundError as err:  # a missing model / held-out file: a message, not a traceback
        print(f"rope-patch compare: error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .evaluation.common import read_tokens
    from .evaluation.compare import parse_schemes, rich_table, run_compare, work_units, write_results
    from .models import load_model, model_name, resolve_model_path

    console = Console(stderr=True)
    parse_schemes(args.schemes)  # bad specs fail here, before the model loads
    if any(L < 8 for L in args.lengths):
        raise ValueError(f"--lengths must be at least 8 tokens each, got {args.lengths}.")
    if any(not 0.0 <= d <= 1.0 for d in args.depths):
        raise ValueError(f"--depths must lie in [0, 1], got {args.depths}.")
    torch.set_num_threads(args.threads or auto_threads())
    path = resolve_model_path(args.model)
    console.print(f"Loading {args.model} from {path} ({torch.get_num_threads()} threads) ...")
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    token_ids, _ = read_tokens(tokenizer, args.heldout)
    passkey_lengths = args.lengths if args.passkey_lengths is None else args.passkey_lengths
    total = work_units(len(args.schemes), len(token_ids), args.lengths, passkey_lengths, args.depths,
                       args.passkey_samples, args.windows)
    with Progress(TextColumn("{task.description:<14}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("compare", total=total)
        result = run_compare(
            model, tokenizer, args.schemes, args.lengths, passkey_lengths=passkey_lengths, depths=args.depths,
            passkey_samples=args.passkey_samples, windows_at_longest=args.windows, seed=args.seed,
            heldout=args.heldout, model_spec=model_name(args.model), model_path=str(path),
            progress=lambda n, label: bar.update(task, advance=n, description=label))
    Console().print(rich_table(result))
    paths = write_results(result, args.out, plots=not args.no_plots)
    console.print(f"{result['elapsed_s']['total']:.0f} s. Wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    from .cli import main

    sys.exit(main(["compare", *sys.argv[1:]]))
