"""`rope-patch compare`: perplexity and passkey retrieval of several schemes on one model.

    rope-patch compare --model tiny --schemes default linear:4 ntk:8 dynamic:4 yarn:8 llama3:8 \
        --lengths 256 512 1024 2048 --out results/
"""

from __future__ import annotations

from ..evaluation.defaults import (
    DEFAULT_DEPTHS,
    DEFAULT_LENGTHS,
    DEFAULT_SCHEMES,
    PASSKEY_SAMPLES,
    PPL_SHARED_LENGTH,
    SEED,
    WINDOWS_AT_LONGEST,
)
from ..evaluation.passkey import CHAT_TEMPLATE_MODES, HAYSTACKS
from .args import DTYPE_HELP, count, dtype, fraction, load_model, model_help, positive, real, scheme_spec, text_file


def add_parser(subparsers) -> None:
    length = count(8)
    p = subparsers.add_parser(
        "compare", help="perplexity and passkey accuracy of several schemes x lengths on one model",
        description="Evaluate several position-encoding schemes on one model (loaded once; each scheme applied "
        "with rope_patch.patched). Every scheme is checked against the model and --out is checked to be writable "
        "before the first evaluation; compare.json is rewritten after each finished scheme, so an interrupted run "
        "keeps what finished and --resume completes it. Writes compare.json/.csv/.md and "
        "perplexity.png/passkey.png to --out.")
    p.add_argument("--model", default="tiny", help=model_help())
    p.add_argument("--schemes", nargs="+", type=scheme_spec(loaded=True), default=None, metavar="SPEC",
                   help="scheme specs: name, name:factor, or name:key=value,... (default: "
                   f"{' '.join(DEFAULT_SCHEMES)}; with --target: default + rope_patch.suggest's schemes)")
    p.add_argument("--target", type=length, default=None, metavar="N",
                   help="target length: without --schemes, compare default with every scheme rope_patch.suggest "
                   "recommends for N on this model (its paper's parameters); with --schemes, bare names (and bare "
                   "parts of a stack: yarn+logn) get the suggested parameters and specs with parameters stay as given")
    p.add_argument("--lengths", nargs="+", type=length, default=None, metavar="N",
                   help="context lengths in tokens, each >= 8 (default: "
                   f"{' '.join(map(str, DEFAULT_LENGTHS))}; with --target N: those below N, the window and N)")
    p.add_argument("--passkey-lengths", nargs="*", type=length, default=None, metavar="N",
                   help="lengths for passkey retrieval (default: --lengths; give none to skip passkey)")
    p.add_argument("--depths", nargs="+", type=fraction, default=list(DEFAULT_DEPTHS), metavar="D",
                   help="needle depths in [0, 1] (default: %(default)s)")
    p.add_argument("--passkey-samples", type=positive, default=PASSKEY_SAMPLES, metavar="N",
                   help="passkey prompts per (length, depth) cell, >= 1 (default: %(default)s)")
    p.add_argument("--windows", type=positive, default=WINDOWS_AT_LONGEST, metavar="N",
                   help=f"perplexity windows: every length up to {PPL_SHARED_LENGTH} reads the same first N x "
                   f"{PPL_SHARED_LENGTH} held-out tokens, a longer length N windows of its own, so a length's figure "
                   "does not depend on the other --lengths (default: %(default)s)")
    p.add_argument("--chat-template", choices=CHAT_TEMPLATE_MODES, default="auto",
                   help="frame every passkey prompt with the tokenizer's chat template (haystack + question as the "
                   "user turn, the lead-in 'The pass key is' opening the assistant turn; the template's tokens count "
                   "in the length); auto: on when the tokenizer has one (default: %(default)s)")
    p.add_argument("--haystack", choices=HAYSTACKS, default="prose",
                   help="where the passkey hides: prose (a stretch of the held-out text) or noise (the passkey "
                   "paper's repeated \"The grass is green. ...\" lines, which small models can search; perplexity "
                   "always reads the held-out text) (default: %(default)s)")
    p.add_argument("--shared-haystack", action="store_true",
                   help="one haystack per (length, depth) cell, so the prompts share everything before the needle: "
                   "that prefix is prefilled once and its KV cache reused (same answers, less compute; the samples "
                   "of a cell then differ only in the key, so they are not independent: a speed option, not for "
                   "accuracy claims)")
    p.add_argument("--bucket-size", type=count(1), default=None, metavar="N",
                   help="perplexity by position in buckets of N tokens inside the longest length (default: [0, W), "
                   "[W, 2W), [2W, 4W), ... for the training window W); no extra forward pass")
    p.add_argument("--budget-minutes", type=real(above=0), default=None, metavar="M",
                   help="fit the run into M minutes: from a timed probe forward, trim passkey samples per cell "
                   "first, then perplexity windows, and say so (recorded in compare.json)")
    p.add_argument("--seed", type=int, default=SEED, help="passkey seed (default: %(default)s)")
    p.add_argument("--heldout", type=text_file, default=None,
                   help="held-out text (default: rope_patch/data/heldout.txt)")
    p.add_argument("--dtype", type=dtype, default="float32", help=DTYPE_HELP)
    p.add_argument("--threads", type=positive, default=None, metavar="N",
                   help="torch threads, >= 1 (default: the cores not busy with other work, from the load average; "
                   "on a busy machine extra threads wait for cores and slow small models down several-fold)")
    p.add_argument("--out", default="results", help="output folder (default: %(default)s)")
    again = p.add_mutually_exclusive_group()  # an earlier run in OUT: go on from it, or replace it
    again.add_argument("--resume", action="store_true",
                       help="reuse the scheme x length cells already in OUT/compare.json (same model and settings; "
                       "schemes and lengths may be added) and evaluate only the missing ones")
    again.add_argument("--overwrite", action="store_true",
                       help="replace the results of an earlier run in OUT (without it, or --resume, such a folder is "
                       "refused before anything runs)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=run)


def run(args) -> int:
    # The library, imported only now: parsing the arguments (and --help, and their errors) needs none of it.
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .. import plots
    from .. import zoo as models
    from ..evaluation.common import read_tokens
    from ..evaluation.compare import (
        check_specs,
        parse_schemes,
        resumed_units,
        run_compare,
        schemes_for_target,
        work_units,
    )
    from ..evaluation.results import RESULT_FILES, check_fresh, check_writable, load_results, rich_table, write_results
    from ..suggest import pretraining_window

    console = Console(stderr=True)
    given = args.schemes
    if given is not None:  # bad specs fail here, before the model loads; with --target, bare names are sized later
        check_specs(given, sized_by_target=args.target is not None)
    args.schemes = given or list(DEFAULT_SCHEMES)
    # and an unwritable --out, or any one file of those it writes, too
    out = check_writable(args.out, RESULT_FILES + (() if args.no_plots else plots.FIGURE_FILES))
    previous = None
    if not args.resume and not args.overwrite:
        check_fresh(out / "compare.json", "add to it (schemes and lengths may be added)")
    if args.resume:
        if (out / "compare.json").is_file():
            try:
                previous = load_results(out / "compare.json")
            except ValueError as err:  # names the file, the field and what to do (schema.COMPARE)
                raise ValueError(f"cannot resume: {err}") from None
            console.print(f"Resuming: {len(previous['schemes'])} finished scheme(s) in {out / 'compare.json'}")
            if not previous["model"].get("fingerprint"):
                console.print(f"{out / 'compare.json'} predates the model fingerprint: its cells are matched on the "
                              "model's path, type, window, size and dtype only; the rewritten file records the "
                              "fingerprint, so later resumes compare the files' contents.")
        else:
            console.print(f"Nothing to resume in {out} (no compare.json): starting from the beginning.")
    path, model, tokenizer = load_model(console, args.model, args.threads, args.dtype)
    if args.target is not None:  # the papers' parameters for this model and target (rope_patch/suggest.py)
        args.schemes = schemes_for_target(model, args.target, given)  # bare names and bare parts of stacks
        parse_schemes(args.schemes)
        console.print(f"--target {args.target}: " + " ".join(args.schemes))
    if args.lengths is None:
        args.lengths = list(DEFAULT_LENGTHS) if args.target is None else sorted(
            {n for n in DEFAULT_LENGTHS if n < args.target} | {pretraining_window(model), args.target})
    token_ids, _ = read_tokens(tokenizer, args.heldout)
    passkey_lengths = args.lengths if args.passkey_lengths is None else args.passkey_lengths
    sizes = (len(token_ids), args.lengths, passkey_lengths, args.depths, args.passkey_samples, args.windows)
    total = work_units(len(args.schemes), *sizes) - resumed_units(previous, args.schemes, *sizes)
    args.kept = (f"No scheme finished in this run; {out / 'compare.json'} is unchanged."
                 if (out / "compare.json").exists() else "No scheme had finished; nothing was written.")

    def save(partial: dict) -> None:
        write_results(partial, out)
        pending = partial["pending"]
        finished = [s for s in partial["schemes"] if s["spec"] not in pending]
        args.kept = (f"Kept {len(finished)} finished scheme(s) in {out / 'compare.json'}"
                     + (f"; rerun with --resume to evaluate only the rest ({', '.join(pending)})." if pending else "."))

    with Progress(TextColumn("{task.description:<14}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("compare", total=max(total, 1))

        def plan(p: dict) -> None:  # the estimate (and what the budget trimmed), before the first evaluation
            console.print(p["line"])
            trimmed = (len(token_ids), args.lengths, passkey_lengths, args.depths, p["passkey_samples"],
                       p["windows_at_longest"])
            bar.update(task, total=max(work_units(len(args.schemes), *trimmed)
                                       - resumed_units(previous, args.schemes, *trimmed), 1))

        result = run_compare(
            model, tokenizer, args.schemes, args.lengths, passkey_lengths=passkey_lengths, depths=args.depths,
            passkey_samples=args.passkey_samples, windows_at_longest=args.windows, seed=args.seed,
            heldout=args.heldout, model_spec=models.model_name(args.model), model_path=str(path),
            progress=lambda n, label: bar.update(task, advance=n, description=label),
            resume=previous, on_scheme=save, chat_template=args.chat_template, haystack=args.haystack,
            shared_haystack=args.shared_haystack, bucket_size=args.bucket_size, budget_minutes=args.budget_minutes,
            on_plan=plan)
    Console().print(rich_table(result))
    paths = write_results(result, out)
    if not args.no_plots:
        paths.update(plots.write_figures(result, out))
    args.kept = None
    console.print(f"{result['elapsed_s']['total']:.0f} s. Wrote " + ", ".join(str(p) for p in paths.values()))
    return 0

