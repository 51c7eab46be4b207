"""`rope-patch tune`: search a scheme's parameters for one model at one target length.

    rope-patch tune --model tiny --scheme longrope --target 1024 --population 24 --generations 10 --out out/tune
    rope-patch tune --model tiny --scheme self_extend --target 1024 --space group_size=2,4,8 window_size=32,64
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from ..evaluation.defaults import AS_LOADED
from ..evaluation.passkey import CHAT_TEMPLATE_MODES, HAYSTACKS
from ..schema import SEARCH_METHODS as METHODS
from .args import (
    DTYPE_HELP,
    count,
    dtype,
    load_model,
    model_help,
    positive,
    real,
    scheme_name,
    scheme_spec,
    text_file,
)

if TYPE_CHECKING:
    from rich.table import Table

LOG, BEST = "search_log.json", "best.json"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "tune", help="search a scheme's parameters (grid / random; LongRoPE's evolutionary search) at a target length",
        description="Search a scheme's parameters for one model at --target tokens, minimising perplexity there on "
        "the first half of the held-out text's tokens (optionally with a passkey term), then measure the best spec "
        "and the baselines at the window and the target on the second half, which the search never reads. Every "
        "evaluation is logged to OUT/search_log.json at once (atomically); --resume continues an interrupted search "
        "and reproduces the log of an uninterrupted one. Writes OUT/search_log.json, OUT/best.json (the best spec, "
        "ready for rope_patch.apply) and OUT/search.png.")
    p.add_argument("--model", default="tiny", help=model_help())
    p.add_argument("--scheme", type=scheme_name, required=True, help="the scheme to tune: longrope (evolutionary "
                   "search of its long factors) or a scalar scheme (self_extend, string, rerope, yarn, dynamic, ...)")
    p.add_argument("--target", type=count(8), required=True, metavar="N", help="target length in tokens")
    p.add_argument("--method", choices=METHODS, default=None,
                   help="evolution (longrope, the default there), grid (the default otherwise) or random")
    p.add_argument("--space", nargs="+", default=None, metavar="KEY=VALUES",
                   help="scalar search space: KEY=V1,V2,... (values) or KEY=LO..HI (a range, random search only); "
                   "default: a small grid around the scheme's paper recommendation")
    p.add_argument("--samples", type=positive, default=20, metavar="N",
                   help="random search: points (default: %(default)s)")
    p.add_argument("--population", type=count(2), default=24, metavar="N",
                   help="evolution: population (default: %(default)s)")
    p.add_argument("--generations", type=count(0), default=10, metavar="N", help="evolution: generations after the "
                   "initial population (default: %(default)s)")
    p.add_argument("--parents", type=count(2), default=None, metavar="N", help="evolution: parents kept per generation "
                   "(default: half the population)")
    p.add_argument("--mutations", type=count(0), default=None, metavar="N", help="evolution: mutants per generation "
                   "(default: half of population - parents)")
    p.add_argument("--crossovers", type=count(0), default=None, metavar="N", help="evolution: crossover children per "
                   "generation (default: the rest of population - parents)")
    p.add_argument("--max-factor", type=real(1.0), default=None, metavar="X", help="evolution: largest rescale factor "
                   "(default: 1.25 x target/window, the paper's search space)")
    p.add_argument("--init", nargs="+", type=scheme_spec(), default=None, metavar="SPEC",
                   help="evolution: frequency schemes whose factors (θ_i/θ′_i) seed the population (default: linear, "
                   "ntk and yarn at target/window, the paper's)")
    p.add_argument("--tokens", type=positive, default=None, metavar="N", help="tuning tokens per evaluation "
                   "(default: 4 windows of the target)")
    p.add_argument("--objective", choices=("perplexity", "needle"), default="perplexity", help="what the search "
                   "minimises: the tuning text's perplexity at the target, or needle: LongRoPE2's needle-driven "
                   "perplexity, over the answer tokens only of passkey prompts of --target tokens (--passkey-samples "
                   "per depth, --haystack, --chat-template) (default: %(default)s)")
    p.add_argument("--passkey-weight", type=real(0.0), default=0.0, metavar="W", help="objective = perplexity x "
                   "exp(-W x passkey accuracy at the target) (default: %(default)s, perplexity only)")
    p.add_argument("--passkey-samples", type=positive, default=4, metavar="N", help="passkey prompts per depth "
                   "(default: %(default)s)")
    p.add_argument("--haystack", choices=HAYSTACKS, default="prose", help="the passkey term's haystack: prose (the "
                   "tuning text) or noise (the passkey paper's repeated lines, for a model that cannot find a key in "
                   "prose inside its window) (default: %(default)s)")
    p.add_argument("--chat-template", choices=CHAT_TEMPLATE_MODES, default="auto", help="frame the passkey term's "
                   "prompts with the tokenizer's chat template; auto: when it has one (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="search seed (default: %(default)s)")
    p.add_argument("--max-evals", type=positive, default=None, metavar="N", help="stop after N evaluations in all")
    p.add_argument("--budget-minutes", type=real(above=0.0), default=None, metavar="M",
                   help="stop once the logged evaluations took M minutes in all (resumed ones count)")
    p.add_argument("--accept", nargs="*", type=scheme_spec(loaded=True), default=None, metavar="SPEC",
                   help="schemes to measure the best spec against on the acceptance text (default: default, and for "
                   "longrope linear/ntk/yarn at target/window; give none to measure only the best)")
    p.add_argument("--no-accept", action="store_true", help="skip the acceptance evaluation")
    p.add_argument("--accept-tokens", type=positive, default=None, metavar="N",
                   help="acceptance tokens per length (default: 16 windows of the target)")
    p.add_argument("--heldout", type=text_file, default=None,
                   help="held-out text (default: rope_patch/data/heldout.txt)")
    p.add_argument("--dtype", type=dtype, default="float32", help=DTYPE_HELP)
    p.add_argument("--threads", type=positive, default=None, metavar="N",
                   help="torch threads (default: the cores not busy with other work)")
    p.add_argument("--out", default="tune", help="output folder (default: %(default)s)")
    again = p.add_mutually_exclusive_group()  # an earlier run in OUT: go on from it, or replace it
    again.add_argument("--resume", action="store_true", help="continue the search logged in OUT/search_log.json (same "
                       "model, settings and text; --max-evals / --budget-minutes may change)")
    again.add_argument("--overwrite", action="store_true",
                       help="replace the search logged in OUT (without it, or --resume, such a folder is refused "
                       "before anything runs)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    p.set_defaults(func=run)


def parse_space(items) -> dict | None:
    """['group_size=2,4,8', 'factor=2..8'] -> {'group_size': [2, 4, 8], 'factor': (2, 8)}. The keys are checked
    against the scheme's parameters with the rest of the options (`tuning.search.check_options`), before loading."""
    if items is None:
        return None
    from ..specs import parse_spec

    space = {}
    for item in items:
        key, eq, text = (s.strip() for s in item.partition("="))
        if not eq or not key or not text:
            raise ValueError(f"--space {item!r}: expected KEY=V1,V2,... or KEY=LO..HI.")
        if key in space:
            raise ValueError(f"--space sets {key!r} twice.")
        value = lambda t: parse_spec(f"default:x={t}")[1]["x"]  # noqa: E731 - the spec grammar's value rules
        if ".." in text:
            lo, _, hi = text.partition("..")
            bounds = (value(lo.strip()), value(hi.strip()))
            if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds):
                raise ValueError(f"--space {item!r}: a range needs two numbers, LO..HI.")
            space[key] = bounds
        else:
            space[key] = [value(t.strip()) for t in text.split(",") if t.strip()]
            if not space[key]:
                raise ValueError(f"--space {item!r}: no values.")
    return space


def check_accept_tokens(args, window: int | None = None) -> None:
    """The acceptance reads whole windows at --target and, once the model is loaded, at its pre-training `window`:
    --accept-tokens (accept()'s default 16 × --target) must hold one window of the longer."""
    longest = max(args.target, window or 0)
    accepting = args.accept_tokens or 16 * args.target
    if args.no_accept or accepting >= longest:
        return
    given = f"--accept-tokens {accepting}" if args.accept_tokens else f"the default {accepting} (16 × --target)"
    where = (f"of --target {args.target}" if longest == args.target
             else f"at the model's pre-training window {window}")
    raise ValueError(f"{given} is less than one window {where}: the acceptance reads whole windows at --target"
                     f"{'' if window is None else ' and at the pre-training window'}; give --accept-tokens >= "
                     f"{longest} (or --no-accept).")


def run(args) -> int:
    # The library, imported only now: parsing the arguments (and --help, and their errors) needs none of it.
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .. import plots
    from .. import zoo as models
    from ..api import as_scheme
    from ..evaluation.common import read_tokens
    from ..evaluation.loading import loaded_patch
    from ..evaluation.results import check_fresh, check_writable, json_safe
    from ..files import write_text_atomic
    from ..fingerprint import model_fingerprint
    from ..tuning import (
        EvolutionSettings,
        TuneOptions,
        accept,
        baselines,
        load_log,
        planned_evaluations,
        resolve_options,
    )
    from ..tuning import tune as tune_search
    from ..tuning.search import check_options, model_info

    console = Console(stderr=True)
    evolution = EvolutionSettings(population=args.population, generations=args.generations, parents=args.parents,
                                  mutations=args.mutations, crossovers=args.crossovers, max_factor=args.max_factor)
    options = TuneOptions(scheme=args.scheme, target=args.target, method=args.method,
                          space=parse_space(args.space),
                          samples=args.samples, evolution=evolution, n_tokens=args.tokens,
                          passkey_weight=args.passkey_weight, passkey_samples=args.passkey_samples,
                          objective=args.objective, haystack=args.haystack, chat_template=args.chat_template,
                          seed=args.seed,
                          max_evals=args.max_evals, budget_minutes=args.budget_minutes, init=args.init)
    for spec in args.accept or []:
        as_scheme(spec)  # a bad acceptance spec fails now, not after the search
    check_options(options)  # an unknown scheme or bad search settings fail here, before the model loads
    check_accept_tokens(args)  # before the model loads: against --target
    out = check_writable(args.out, (LOG, BEST) + (() if args.no_plots else (plots.SEARCH_FIGURE,)))
    log_path = out / LOG
    previous = None
    if not args.resume and not args.overwrite:
        check_fresh(log_path, "continue it")
    if args.resume:
        if log_path.is_file():
            previous = load_log(log_path)
            console.print(f"Resuming: {len(previous['evaluations'])} evaluation(s) in {log_path}")
        else:
            console.print(f"Nothing to resume in {out} (no {LOG}): starting from the beginning.")
    path, model, tokenizer = load_model(console, args.model, args.threads, args.dtype)
    _, _, settings = resolve_options(model, options)  # bad options fail before the first evaluation
    check_accept_tokens(args, settings["window"])  # once loaded: against the pre-training window too
    token_ids, heldout = read_tokens(tokenizer, args.heldout)
    patch = loaded_patch(model, path)  # a folder saved with rope_patch.json: the search replaces its patch
    header = {"model": {**model_info(model, args.model), "name": models.model_name(args.model), "path": str(path),
                        "fingerprint": model_fingerprint(path), "patch": patch},
              "heldout": heldout}
    args.kept = (f"No evaluation finished in this run; {log_path} is unchanged." if log_path.exists()
                 else "No evaluation had finished; nothing was written.")
    total = planned_evaluations(settings)
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("tune", total=total)
        best = [float("inf")]

        def on_record(rec, replayed):
            if rec.get("objective") is not None:
                best[0] = min(best[0], rec["objective"])
            n = rec["index"] + 1
            args.kept = (f"Kept {n} evaluation(s) in {log_path}; rerun with --resume to continue.")
            bar.update(task, completed=min(n, total), description=f"gen {rec.get('generation', 0)} best {best[0]:.2f}")

        log = tune_search(model, tokenizer, token_ids, options, log_path=log_path, previous=previous, header=header,
                          on_record=on_record)
        if log["best"] is None and log["stopped"]:  # the space may hold accepted candidates not reached yet
            limit = (f"--max-evals {args.max_evals}" if log["stopped"] == "max_evals"
                     else f"--budget-minutes {args.budget_minutes:g}")
            raise ValueError(f"{limit} stopped the search before a candidate the scheme accepts: "
                             f"{evaluation_count(log)}; see {log_path}. Raise {limit.split()[0]}.")
        if log["best"] is None:
            raise ValueError(f"no candidate could be evaluated: {evaluation_count(log)}; see {log_path}. Choose a "
                             "--space the scheme accepts on this model.")
        write_text_atomic(out / BEST, json.dumps(json_safe({"scheme": settings["scheme"], **log["best"],
                                                            "target": args.target}), indent=1) + "\n")
        args.kept = f"The search is complete in {log_path}; the best spec is in {out / BEST}."
        if not args.no_accept:
            specs = baselines(args.scheme, args.target, settings["window"]) if args.accept is None else args.accept
            if patch and args.accept is None:  # `default` is the unpatched model; the model as saved is `loaded`
                specs = [AS_LOADED, *specs]
            acc = bar.add_task("acceptance", total=len(specs) + 1)
            accept(model, token_ids, log, specs, n_tokens=args.accept_tokens, log_path=log_path,
                   on_scheme=lambda label: bar.update(acc, advance=1, description=f"acceptance: {label}"))
    paths = [log_path, out / BEST]
    if not args.no_plots:
        paths.append(plots.write_search_figure(log, out))
    args.kept = None
    Console().print(_summary(log))
    stop = {"max_evals": " (stopped by --max-evals)",
            "budget": " (stopped by --budget-minutes)"}.get(log["stopped"], "")
    console.print(f"{evaluation_count(log)}, {sum(r.get('seconds') or 0 for r in log['evaluations']):.0f} s"
                  f"{stop}. Wrote " + ", ".join(str(p) for p in paths))
    return 0


def evaluation_count(log: dict) -> str:
    """"12 evaluations" or "12 candidates: 10 evaluated, 2 refused by the scheme (2x group_size ...: why)": a refused
    candidate (objective null: the scheme's own check rejected its parameters) is no evaluation, and says why."""
    records = log["evaluations"]
    refused = [r for r in records if r.get("objective") is None]
    if not refused:
        return f"{len(records)} evaluations"
    reasons: dict[str, int] = {}
    for r in refused:
        why = _elided(r.get("error") or "no reason recorded", r.get("params") or {})
        reasons[why] = reasons.get(why, 0) + 1
    shown = "; ".join(f"{n}x {why if len(why) <= 160 else why[:159] + '…'}" for why, n in list(reasons.items())[:3])
    more = f"; and {len(reasons) - 3} other reason(s) in {LOG}" if len(reasons) > 3 else ""
    return (f"{len(records)} candidates: {len(records) - len(refused)} evaluated, {len(refused)} refused by the scheme "
            f"({shown}{more})")


def _elided(why: str, params: dict) -> str:
    """A refusal's reason with the candidate's own values elided (`shift_size=32` -> `shift_size=…`): candidates
    refused for one reason count as one, which their values (often past the shown characters) would split."""
    for key, value in params.items():
        forms = {str(value), repr(value)} | ({"/".join(map(str, value))} if isinstance(value, list) else set())
        for form in sorted(forms, key=len, reverse=True):  # whole names and whole values only (not factor=16)
            why = re.sub(rf"(?<![\w.]){re.escape(key)}={re.escape(form)}(?!\w|\.\d)", f"{key}=…", why)
    return why


def _summary(log: dict) -> Table:
    from rich.table import Table

    from ..evaluation.results import patch_note, spec_cell

    best = log["best"]
    model = log.get("model") or {}
    table = Table(title=f"best {log['settings']['scheme']} at {log['settings']['target']} (tuning text): "
                  f"objective {best['objective']:.3f}")
    table.caption = (f"Model `{model.get('name') or model.get('spec')}` (window {log['settings']['window']})"
                     f"{patch_note(model)}")
    acc = log.get("acceptance")
    if not acc:
        table.add_column("best spec", overflow="fold")  # wrapped between the spec's parts (spec_cell)
        table.add_row(spec_cell(best["spec"]) if len(best["spec"]) < 200 else best["spec"][:200] + "...")
        return table
    table.add_column("scheme (acceptance text)", overflow="fold")
    for length in acc["lengths"]:
        table.add_column(f"ppl @{length}", justify="right")
    for row in acc["rows"]:
        table.add_row(spec_cell(row["label"]), *(f"{row['perplexity'][str(L)]:.2f}" for L in acc["lengths"]))
    return table
