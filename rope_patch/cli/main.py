"""`rope-patch` command line. Subcommands live in their own modules (SUBCOMMANDS) and register here; `main` turns
every error into one line on stderr (exit status 2; 130 when interrupted), or re-raises it under `--debug`.

Parsing imports neither torch nor transformers: the subcommand modules import the library inside their `run`, and
scheme names come from the generated name table (rope_patch.scheme_names), so `--help`, `rope-patch list` and every
argument error answer in a fraction of a bare `import torch` (bench/cli_startup.py measures it)."""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import select
import sys
import textwrap
import warnings

from .. import scheme_names
from .._version import __version__
from ..registry import did_you_mean
from . import compare, explain, export, models, plot, sweep, tune

DESCRIPTION = (
    "Swap the position encoding of a loaded Hugging Face LLaMA-family model at runtime (RoPE scaling: linear/PI, "
    "NTK, dynamic NTK, YaRN, llama3, LongRoPE; attention schemes: ALiBi, NoPE, Self-Extend, ReRoPE, ...) and "
    "measure what each swap does to perplexity and passkey retrieval at long context.")
EPILOG = """\
examples:
  rope-patch list                                       schemes, their parameters and aliases
  rope-patch compare --schemes default yarn:8 ntk:8 --lengths 256 1024 --out results/
  rope-patch sweep --schemes default yarn:4 --tasks rope_passkey rope_ppl --lengths 256 1024
  rope-patch plot decay --schemes default yarn:8 linear:8 --out decay.png
  rope-patch tune --scheme longrope --target 1024 --out tune/   LongRoPE's evolutionary search of rescale factors
  rope-patch export saved_model/                        native rope_parameters and the vLLM argument
  rope-patch export merged/ --engine sglang             the SGLang (or vLLM) command line that serves it as patched

A scheme spec is `name`, `name:VALUE` (yarn:8 sets factor) or `name:key=value,...` (yarn:factor=8,beta_fast=16).
`rope-patch COMMAND --help` describes each command. Errors are one line (exit status 2); `rope-patch --debug
COMMAND ...` shows the traceback instead."""

SUBCOMMANDS = (compare, models, plot, explain, export, sweep, tune)  # each exposes add_parser(subparsers)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (argparse prints the whole usage block first) that names the (sub)command
    the arguments belong to, and "Did you mean" for a misspelt option or choice. Every subcommand's parser is one
    (add_subparsers makes its parsers of the parent's class)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(self, args=None, namespace=None):
        # argparse hands a subcommand's unknown arguments up to the top parser, whose error then names `rope-patch`
        # and cannot say which options were meant: the parser that got them refuses them itself. (The command line
        # has no use for leftovers: parse_args refuses them anyway.)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._meant(extras)}")
        return namespace, extras

    def _meant(self, extras) -> str:
        """". Did you mean '--lengths'?" for `--lenghts`; "'--method grid'" for `--grid` (a choice given as an option);
        "" when nothing is close. The names are compared without their dashes (all options share those)."""
        hints = []
        options = {o.lstrip("-"): o for o in self._option_string_actions if o.startswith("--")}
        flags = [e for e in extras if e.startswith("-") and not e.lstrip("-").replace(".", "", 1).isdigit()]
        for flag in flags:
            bare = flag.split("=", 1)[0].lstrip("-")
            close = difflib.get_close_matches(bare, list(options), n=1, cutoff=0.6)
            if close:
                hints.append((flag, options[close[0]]))
                continue
            for action in self._actions:
                if action.option_strings and action.choices and bare in action.choices:
                    hints.append((flag, f"{action.option_strings[-1]} {bare}"))
                    break
        if not hints:
            return ""
        if len(hints) == 1:
            return f". Did you mean {hints[0][1]!r}?"
        return ". Did you mean " + ", ".join(f"{meant!r} (for {flag})" for flag, meant in hints) + "?"

    def _check_value(self, action, value):
        """An invalid choice (`plot decy`, `--method gird`, a misspelt subcommand) with "Did you mean"."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as err:
            hint = did_you_mean(value, action.choices) if isinstance(value, str) else ""
            if not hint:
                raise
            raise argparse.ArgumentError(action, f"{err.message}.{hint}") from None


def _add_debug(parser: argparse.ArgumentParser, default=False) -> None:
    parser.add_argument("--debug", action="store_true", default=default,
                        help="show the full traceback of an error instead of one line")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rope-patch", description=textwrap.fill(DESCRIPTION, 100), epilog=EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_debug(parser)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version of rope_patch and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    lst = sub.add_parser("list", help="list the registered schemes and their parameters")
    lst.set_defaults(func=_list)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    _tag(sub)
    return parser


def _tag(sub) -> None:
    """Every (sub)command parser records its prog for the error prefix, and takes --debug after the command too
    (SUPPRESS: it does not reset a --debug given before the command)."""
    for p in set(sub.choices.values()):
        p.set_defaults(prog=p.prog)
        _add_debug(p, default=argparse.SUPPRESS)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                _tag(action)


def _list(args) -> int:
    by_scheme: dict[str, list[str]] = {}
    for alias, name in scheme_names.aliases().items():
        by_scheme.setdefault(name, []).append(alias)
    names = scheme_names.list_schemes()  # the built-in schemes, from the table generated from their classes
    width = max(map(len, names))
    for name in names:
        extra = f" (aliases: {', '.join(sorted(by_scheme.get(name, [])))})" if name in by_scheme else ""
        print(f"{name:<{width}} {scheme_names.kind(name):<10} {', '.join(scheme_names.param_names(name)) or '-'}"
              f"{extra}")
    return 0


def describe(err: BaseException) -> str:
    """One line: the message (newlines folded), with what to do for the kinds that do not say it themselves."""
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, OSError) and err.strerror and err.filename is not None:  # "[Errno 13] ...: '/x'" -> plain
        text = f"{err.strerror}: {err.filename}"
        if isinstance(err, PermissionError):
            text += " (choose a path you can write to, or fix its permissions)"
    low = text.lower()
    if "out of memory" in low or isinstance(err, MemoryError):
        return (f"out of memory ({text}). Use shorter --lengths, fewer --passkey-samples / --windows, a smaller "
                "--dtype (bfloat16), or a machine with more memory.")
    if isinstance(err, (ValueError, TypeError, OSError)):
        return text
    if isinstance(err, RuntimeError):
        return f"{text} (rerun with --debug for the traceback)"
    return f"{type(err).__name__}: {text} (an unexpected error; rerun with --debug for the traceback and report it)"


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help (0) or a usage error, already printed as one line (2)
        return stop.code if isinstance(stop.code, int) else 0
    if args.debug:
        return args.func(args) or 0
    prog = getattr(args, "prog", parser.prog)
    try:
        with warnings.catch_warnings():  # a warning on the way is one line too (the library's name the user's line)
            warnings.showwarning = functools.partial(_warning_line, prog, set())
            return args.func(args) or 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted.{_kept(args)}", file=sys.stderr)
        return 130
    except BrokenPipeError as err:
        if _stdout_gone():  # the reader of stdout left (`rope-patch list | head`): stop quietly, as other tools do,
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # and let the exit's flush pass
            return 0
        print(f"{prog}: error: {describe(err)}{_kept(args)}", file=sys.stderr)  # another pipe: a real failure
        return 2
    except Exception as err:  # noqa: BLE001 - the whole point: one line, not a traceback
        print(f"{prog}: error: {describe(err)}{_kept(args)}", file=sys.stderr)
        return 2


def _warning_line(prog: str, said: set, message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line, once per run (a comparison applies a scheme once per length, and libraries reset
    Python's once-per-line registry as they go)."""
    text = " ".join(str(message).split("\n"))
    if text not in said:
        said.add(text)
        print(f"{prog}: warning: {text}", file=sys.stderr)


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll's POLLERR on its write end; Linux says so, elsewhere
    False: the error is then reported)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or a stdout without a file descriptor
        return False


def _kept(args) -> str:
    """What a long-running command had finished (and saved) when it stopped: it sets `args.kept` as it goes."""
    kept = getattr(args, "kept", None)
    return f" {kept}" if kept else ""
