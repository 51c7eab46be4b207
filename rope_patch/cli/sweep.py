"""`rope-patch sweep`: lm-eval tasks x position-encoding schemes on one model, one lm-eval run per scheme.

    rope-patch sweep --model tiny --schemes default yarn:4 dynamic:4 \
        --tasks rope_passkey rope_ppl --lengths 256 1024 --out results/sweep

The sweep itself (planning, one lm-eval run per scheme, resume by cell, aggregation, sweep.json) is
rope_patch.integrations.lm_eval.sweep; its docstring describes the run and the output.
"""

from __future__ import annotations

import sys

from ..evaluation.passkey import CHAT_TEMPLATE_MODES
from ..integrations.lm_eval.options import SweepOptions
from .args import count, fraction, model_help, positive, real, scheme_spec, text_file


def add_parser(subparsers) -> None:
    d = SweepOptions()

    p = subparsers.add_parser(
        "sweep", help="lm-eval tasks x schemes on one model (one lm-eval run per scheme; resumable)",
        description="`rope-patch sweep`: lm-eval tasks x position-encoding schemes on one model, one lm-eval run "
        "per scheme. Writes sweep.json/.md (+ compare-format files and plots) to --out.")
    p.add_argument("--model", default=d.model, help=model_help(d.model))
    p.add_argument("--schemes", nargs="+", type=scheme_spec(loaded=True), default=d.schemes, metavar="SPEC",
                   help="scheme specs as in compare: name, name:factor, name:key=value,... (default: %(default)s)")
    p.add_argument("--tasks", nargs="+", default=d.tasks, metavar="TASK",
                   help="rope_passkey / rope_ppl / rope_niah (expanded per length) and any lm-eval task "
                   "(default: %(default)s)")
    p.add_argument("--lengths", nargs="+", type=count(8), default=d.lengths, metavar="N",
                   help="context lengths in tokens, each >= 8 (default: %(default)s)")
    p.add_argument("--depths", nargs="+", type=fraction, default=d.depths, metavar="D",
                   help="needle depths in [0, 1] (default: %(default)s)")
    p.add_argument("--passkey-samples", type=positive, default=d.passkey_samples, metavar="N",
                   help="prompts per (length, depth) cell, >= 1 (default: %(default)s)")
    p.add_argument("--windows", type=positive, default=d.windows, metavar="N",
                   help="perplexity reads N x max(L, 2048) tokens at a length L, as compare (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="passkey / niah seed (default: %(default)s)")
    p.add_argument("--heldout", type=text_file, default=d.heldout,
                   help="held-out text (default: rope_patch/data/heldout.txt)")
    p.add_argument("--model-args", nargs="*", default=d.model_args, metavar="KEY=VALUE",
                   help="extra --model_args for every scheme (dtype=..., max_length=..., adapter=...)")
    p.add_argument("--metadata", nargs="*", default=d.metadata, metavar="KEY=VALUE", help="extra lm-eval --metadata")
    p.add_argument("--limit", type=real(above=0.0), default=d.limit,
                   help="lm-eval --limit (per task): a count, or a fraction of the task when below 1")
    p.add_argument("--batch-size", default=d.batch_size, help="lm-eval --batch_size (default: %(default)s)")
    p.add_argument("--chat-template", choices=CHAT_TEMPLATE_MODES, default=d.chat_template,
                   help="lm-eval's --apply_chat_template for every task: on, off, or auto (default: on when the "
                   "tokenizer has a chat template, as in compare)")
    p.add_argument("--include-path", default=d.include_path,
                   help="task folder (default: the repository's rope_patch/data/tasks)")
    p.add_argument("--launcher", default=d.launcher, metavar="CMD",
                   help='run each scheme under a launcher, e.g. "torchrun --nproc_per_node 2" (CPU: also set '
                   "ACCELERATE_USE_CPU=true) or \"accelerate launch\"")
    p.add_argument("--in-process", action="store_true",
                   help="run lm-eval in this process (faster start; no launcher; one scheme's global state may "
                   "outlive its run)")
    p.add_argument("--out", default=d.out, help="output folder (default: %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..integrations.lm_eval.sweep import aggregate, markdown, sweep  # torch: only now, after the arguments parsed

    def started(out) -> None:  # what an error or Ctrl-C from here on leaves behind (cli.main prints it)
        args.kept = (f"Finished (scheme, task) cells stay in {out / 'schemes'}; rerun the same command to run only "
                     "the missing ones.")

    state = sweep(args, log=lambda msg: print(msg, file=sys.stderr, flush=True), on_start=started)
    args.kept = None
    print(markdown(aggregate(state)))
    print("Wrote " + ", ".join(str(p) for p in state["paths"].values()), file=sys.stderr)
    return 0
