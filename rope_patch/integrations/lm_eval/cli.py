"""`rope-patch-lm-eval`: lm-eval's own command line, with the `rope_patch` model registered.

lm-eval discovers no plugins, so `lm-eval --model rope_patch` does not know the model. This script imports the
registration and hands over to lm-eval's CLI: every lm-eval flag and subcommand works unchanged.

    rope-patch-lm-eval --model rope_patch --model_args pretrained=tiny,scheme=yarn,factor=4 \
        --tasks rope_passkey --output_path out/   # rope_* tasks ship with the package
    python -m rope_patch.integrations.lm_eval.cli ...                                   # the same
    # data parallel, CPU
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 -m rope_patch.integrations.lm_eval.cli ...
    # data parallel, GPUs
    accelerate launch -m rope_patch.integrations.lm_eval.cli ...

Three conveniences, each only when it cannot change the meaning of a plain lm-eval command line:
- `--tasks rope_passkey` / `rope_ppl` / `rope_niah` with `--metadata lengths=[256,1024]` run
  `rope_passkey_256 rope_passkey_1024` (the group YAMLs list fixed default lengths, and lm-eval cannot size a
  group from `--metadata`);
- when a `rope_*` task is asked for and no `--include_path` is given, the packaged tasks (rope_patch/data/tasks) are
  included;
- with `--model rope_patch` and `pretrained=tiny|smollm2|gemma3`, `--metadata tokenizer=<its folder>` is added unless
  a tokenizer is given, so that tokenizer-sized tasks (RULER) find the tokenizer offline;
- with `rope_passkey` / `rope_niah` tasks, `--metadata chat_template=true|false` follows `--apply_chat_template`, so
  that a templated prompt is the length in the task's name, the template's tokens included, as `rope-patch compare
  --chat-template on` builds it (plain lm-eval wraps the template around a prompt that already has that length).
  A `chat_template` given that disagrees with the flag is an error.
"""

from __future__ import annotations

import sys

from lm_eval._cli import HarnessCLI
from lm_eval.utils import setup_logging

from ...zoo import MODELS, resolve_model_path
from .model import validate_model_args  # importing .model registers the `rope_patch` model with lm-eval
from .tasks import chat_layout_error, expand_tasks, tasks_dir


def adjust(args) -> None:
    """The conveniences of the module docstring, on lm-eval's parsed `run` arguments."""
    if getattr(args, "command", None) != "run":
        return
    tasks = list(args.tasks or [])
    metadata = dict(args.metadata or {})
    if tasks:
        args.tasks = expand_tasks(tasks, metadata.get("lengths"))
    if any(t.startswith("rope_") for t in args.tasks or []) and not args.include_path:
        found = tasks_dir()
        if found is not None:
            args.include_path = str(found)
    if _retrieval_tasks(args) and "chat_template" not in metadata:
        metadata["chat_template"] = bool(getattr(args, "apply_chat_template", False))
        args.metadata = metadata
    model_args = args.model_args or {}
    if args.model in ("rope_patch", "rope-patch") and isinstance(model_args, dict):
        spec = model_args.get("pretrained", "tiny")
        if spec in MODELS and not (model_args.get("tokenizer") or metadata.get("tokenizer")):
            try:
                metadata["tokenizer"] = str(resolve_model_path(spec))
            except (FileNotFoundError, ValueError):
                pass  # the model itself will say so, clearly
            else:
                args.metadata = metadata


def main(argv: list[str] | None = None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    sys.argv[0] = "rope-patch-lm-eval"
    setup_logging()
    parser = HarnessCLI()
    parser._parser.prog = "rope-patch-lm-eval"
    args = parser.parse_args()
    adjust(args)
    error = check_chat_layout(args)
    if error:
        print(f"rope-patch-lm-eval: error: {error}", file=sys.stderr)
        sys.exit(2)
    if getattr(args, "command", None) == "run" and args.model in ("rope_patch", "rope-patch"):
        error = check_model_args(args.model_args)
        if error:
            print(f"rope-patch-lm-eval: error: {error}", file=sys.stderr)
            sys.exit(2)
    parser.execute(args)


def _retrieval_tasks(args) -> list[str]:
    return [t for t in args.tasks or [] if t.startswith(("rope_passkey", "rope_niah"))]


def check_chat_layout(args) -> str | None:
    """The error of a `--metadata chat_template` that disagrees with `--apply_chat_template` for rope_passkey /
    rope_niah: the prompts would be the template's tokens longer (or shorter) than the length in the task's name."""
    if getattr(args, "command", None) != "run" or not _retrieval_tasks(args):
        return None
    applied = bool(getattr(args, "apply_chat_template", False))
    return chat_layout_error(dict(args.metadata or {}).get("chat_template", False), applied,
                             f"--apply_chat_template {'given' if applied else 'not given'}",
                             ", ".join(_retrieval_tasks(args)))


def check_model_args(model_args) -> str | None:
    """The error `--model_args` would raise when the model is built, found before lm-eval indexes its tasks
    (which takes a while): same messages as `rope_patch.apply` / the model."""
    if not isinstance(model_args, dict):
        return None
    kw = {k: v for k, v in model_args.items() if k not in ("max_length", "exact_tokens", "dtype", "device")}
    kw.setdefault("pretrained", "tiny")
    try:
        validate_model_args(**kw)
    except (ValueError, TypeError, FileNotFoundError) as err:
        return str(err)
    return None


if __name__ == "__main__":
    main()
