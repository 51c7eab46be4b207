"""`rope-patch` command line: `list`, the help text, and errors as one line (exit 2; 130 when interrupted); parsing
(--help, `list`, every argument error) imports neither torch nor transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rope_patch.cli import main
from rope_patch.specs import parse_scheme_spec


def test_list_command(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "yarn" in out and "beta_fast" in out and "frequency" in out and "pi" in out


def test_a_stack_is_not_listed_as_a_scheme(capsys):
    """`stack` is registered (a saved stack resolves) but it is several schemes joined with '+', not one to pick."""
    import rope_patch

    assert main(["list"]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.split()[0] == "stack"]
    assert "stack" not in rope_patch.list_schemes() and rope_patch.registry.get_scheme_class("stack").name == "stack"
    with pytest.raises(ValueError, match="Available: ") as info:
        rope_patch.as_scheme("stak")
    available = str(info.value).split("Available: ")[1]
    assert "stack," not in available and "Did you mean 'stack'" not in str(info.value)
    assert "yarn" in available and "'+' stacks them (yarn:4+logn)" in available


def test_spec_parsing_lives_in_the_library():
    import rope_patch.cli

    assert parse_scheme_spec("pi:4").name == "linear"
    assert not hasattr(rope_patch.cli, "parse_scheme_spec") and not hasattr(rope_patch.cli, "scheme_label")


def test_help_is_for_users(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Swap the position encoding" in out and "examples:" in out and "--debug" in out
    assert "Subcommands live in" not in out and "register here" not in out


def error_line(capsys) -> str:
    """stderr holds exactly one line and no traceback; stdout nothing."""
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and out == "", err
    return lines[0]


BAD_ARGS = [
    (["compare", "--threads", "-3"], "rope-patch compare: error: argument --threads: must be an integer >= 1, got -3"),
    (["compare", "--threads", "2.5"], "argument --threads: expected a whole number, got '2.5'"),
    (["compare", "--passkey-samples", "0"], "argument --passkey-samples: must be an integer >= 1, got 0"),
    (["compare", "--lengths", "256", "0"], "argument --lengths: must be an integer >= 8, got 0"),
    (["compare", "--passkey-lengths", "-5"], "argument --passkey-lengths: must be an integer >= 8"),
    (["compare", "--windows", "two"], "argument --windows: expected a number, got 'two'"),
    (["compare", "--depths", "1.5"], "argument --depths: must be a number in [0, 1], got 1.5"),
    (["compare", "--depths", "nan"], "expected a finite number"),
    (["compare", "--bogus"], "unrecognized arguments: --bogus"),
    (["sweep", "--lengths", "-1"], "rope-patch sweep: error: argument --lengths: must be an integer >= 8"),
    (["sweep", "--passkey-samples", "0"], "argument --passkey-samples: must be an integer >= 1"),
    (["sweep", "--limit", "0"], "argument --limit: must be a number > 0"),
    (["plot", "decay", "--max-distance", "0"], "rope-patch plot: error: argument --max-distance: "
                                               "must be an integer >= 1"),
    (["plot", "decay", "--head-dim", "1"], "argument --head-dim: must be an integer >= 2"),
    (["plot", "decay", "--rope-theta", "1"], "argument --rope-theta: must be a number > 1"),
    (["plot", "decay", "--partial-rotary-factor", "1.5"], "argument --partial-rotary-factor: must be a number <= 1"),
    (["plot", "decay", "--dpi", "1e9"], "argument --dpi: must be an integer between 1 and 2,400"),
    (["plot", "nothing"], "argument kind: invalid choice: 'nothing'"),
    ([], "rope-patch: error: the following arguments are required: COMMAND"),
    # a misspelt option: the subcommand's own error (its prog, its --help) with "Did you mean", from its options
    (["compare", "--model", "tiny", "--lenghts", "256"],
     "rope-patch compare: error: unrecognized arguments: --lenghts 256. Did you mean '--lengths'? "
     "(see `rope-patch compare --help`)"),
    (["explain", "yarn:8", "--confg", "tiny"], "rope-patch explain: error: unrecognized arguments: --confg tiny. "
                                                "Did you mean '--config'?"),
    (["compare", "--lenghts=256", "--passky-samples", "3"], "Did you mean '--lengths' (for --lenghts=256), "
                                                             "'--passkey-samples' (for --passky-samples)?"),
    (["tune", "--scheme", "yarn", "--target", "64", "--grid", "factr=2,4"],
     "rope-patch tune: error: unrecognized arguments: --grid factr=2,4. Did you mean '--method grid'?"),
    (["models", "list", "--bogus"], "rope-patch models list: error: unrecognized arguments: --bogus (see `rope-patch "
                                    "models list --help`)"),
    # an invalid choice: "Did you mean", from the choices
    (["plot", "decy"], "rope-patch plot: error: argument kind: invalid choice: 'decy' (choose from 'decay', "),
    (["plot", "decy"], "'results'). Did you mean 'decay'?"),
    (["tune", "--scheme", "yarn", "--target", "64", "--method", "gird"], "Did you mean 'grid'?"),
    (["compre"], "rope-patch: error: argument COMMAND: invalid choice: 'compre'"),
    (["compre"], "Did you mean 'compare'?"),
    (["models", "fetch", "smolm2"], "rope-patch models fetch: error: argument name: invalid choice: 'smolm2' "
                                    "(choose from 'smollm2', 'gemma3'). Did you mean 'smollm2'?"),
    # checked while parsing, before the model loads (the startup probe: nothing heavy imported)
    (["compare", "--dtype", "flaot16"], "rope-patch compare: error: argument --dtype: Unknown dtype 'flaot16': "
                                        "expected one of bf16, bfloat16, float16, float32, fp16, fp32. "
                                        "Did you mean 'float16'?"),
    (["tune", "--scheme", "yarn", "--target", "64", "--dtype", "bf61"], "Did you mean 'bf16'?"),
    (["compare", "--heldout", "/nonexist.txt"], "rope-patch compare: error: argument --heldout: /nonexist.txt does "
                                                "not exist: expected a UTF-8 text file"),
    (["tune", "--scheme", "yarn", "--target", "64", "--heldout", "/"], "argument --heldout: / is a folder"),
    (["sweep", "--heldout", "/nonexist.txt"], "rope-patch sweep: error: argument --heldout: /nonexist.txt does"),
    # spec strings: what was meant
    (["explain", "dpe:group_sizes=4,4,window_size=64"], "sets 'group_sizes' twice: commas separate parameters, "
     "so '4' after group_sizes=... is read as a value of its own. A list value is joined with '/': "
     "'dpe:group_sizes=4/4,window_size=64'"),
    (["explain", "yarn:4+"], "Scheme spec 'yarn:4+' has an empty part after '+'"),
    (["explain", "self_extend:group_size=4;window_size=1024"], "parameters are separated by ',', e.g. "
                                                              "'self_extend:group_size=4,window_size=1024'"),
]


@pytest.mark.parametrize("argv,message", BAD_ARGS, ids=[" ".join(a) or "<none>" for a, _ in BAD_ARGS])
def test_bad_arguments_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    line = error_line(capsys)
    assert message in line and line.endswith("--help`)")


# Errors found once the arguments parsed, before the model loads (one line: no "Loading ..." before it)
RUN_ERRORS = [
    (["tune", "--scheme", "longrope", "--target", "64", "--space", "factor=2,4"],
     "rope-patch tune: error: --space is the grid or random search's (KEY=V1,V2,...); the evolutionary search of "
     "longrope searches its long factors"),
    (["tune", "--scheme", "yarn", "--target", "64", "--space", "factr=2,4"],
     "rope-patch tune: error: yarn has no parameter 'factr' to search. Did you mean 'factor'? Parameters of 'yarn': "),
    (["tune", "--scheme", "pi", "--target", "64", "--space", "factor=2,4", "fctor=3"], "linear has no parameter "
                                                                                     "'fctor'"),
    (["compare", "--model", "/nonexistent"], "rope-patch compare: error: The model folder /nonexistent does not exist"),
    (["compare", "--model", "./no/such/model"], "The model folder no/such/model does not exist"),
    (["tune", "--scheme", "yarn", "--target", "64", "--model", "~/no_such_model"], "no_such_model does not exist"),
    (["compare", "--model", "smolm2"], "Unknown model 'smolm2': expected one of 'tiny', 'smollm2', 'gemma3', or a "
                                       "local model folder. Did you mean 'smollm2'?"),
]


@pytest.mark.parametrize("argv,message", RUN_ERRORS, ids=[" ".join(a) for a, _ in RUN_ERRORS])
def test_errors_before_the_model_loads(tmp_path, capsys, argv, message):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert message in error_line(capsys)


def test_models_without_a_subcommand_lists_them(monkeypatch, tmp_path, capsys):
    """`rope-patch models` is `rope-patch models list` (it said "required: models_command", an internal name)."""
    monkeypatch.setenv("ROPE_PATCH_CACHE", str(tmp_path))
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert main(["models", "list"]) == 0
    assert out == capsys.readouterr().out and "rope-patch models fetch smollm2" in out


def test_version(capsys):
    from rope_patch import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"rope-patch {__version__}\n"


def test_every_model_option_names_the_zoo_s_models(monkeypatch):
    """--model / --config help is read from rope_patch.zoo.MODELS in every subcommand (compare's lacked gemma3)."""
    from rope_patch import zoo
    from rope_patch.cli import build_parser

    monkeypatch.setitem(zoo.MODELS, "newmodel", zoo.ModelInfo("newmodel", "a model added to the zoo", 1024))
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    helps = {(name, a.dest): a.help for name, p in sub.choices.items() for a in p._actions
             if a.dest in ("model", "config")}
    assert {name for name, _ in helps} >= {"compare", "tune", "sweep", "plot", "explain"}
    for where, text in helps.items():
        assert all(name in text for name in zoo.MODELS) and "local model folder" in text, (where, text)
    fetch = next(a for a in sub.choices["models"]._actions if a.dest == "models_command").choices["fetch"]
    assert next(a for a in fetch._actions if a.dest == "name").choices == tuple(zoo.FETCHED)


def test_plot_refuses_a_figure_that_would_not_fit_before_allocating(monkeypatch, capsys):
    import rope_patch.plots

    monkeypatch.setattr(rope_patch.plots, "make", lambda *a, **k: pytest.fail("the figure was computed"))
    assert main(["plot", "decay", "--max-distance", "1e8"]) == 2
    line = error_line(capsys)
    assert "--max-distance 100,000,000 needs about" in line and "GiB" in line and "over the 1 GiB limit" in line
    limit = int(line.split("pass --max-distance ")[1].split()[0])
    assert 100_000 < limit < 1_000_000
    assert main(["plot", "score", "--window", "1000000"]) == 2  # the default range of a huge window, too
    assert "the default distance range (8,000,000)" in error_line(capsys)


class Boom(Exception):
    pass


@pytest.mark.parametrize("exc,code,message", [
    (ValueError("bad\nvalue"), 2, "rope-patch list: error: bad value"),
    (FileNotFoundError(2, "No such file or directory", "x.json"), 2, "No such file or directory: x.json"),
    (PermissionError(13, "Permission denied", "/out"), 2, "Permission denied: /out"),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), 2, "out of memory (CUDA out of memory."),
    (RuntimeError("lm-eval exited with status 1"), 2, "lm-eval exited with status 1 (rerun with --debug"),
    (Boom("unexpected"), 2, "Boom: unexpected (an unexpected error; rerun with --debug"),
    (KeyboardInterrupt(), 130, "rope-patch list: interrupted."),
])
def test_errors_are_one_line(monkeypatch, capsys, exc, code, message):
    import rope_patch.scheme_names

    def fail():
        raise exc

    monkeypatch.setattr(rope_patch.scheme_names, "list_schemes", fail)
    assert main(["list"]) == code
    assert message in error_line(capsys)


def test_warnings_are_one_line_once(monkeypatch, capsys):
    import warnings

    import rope_patch.scheme_names

    listed = rope_patch.scheme_names.list_schemes

    def warn_twice():
        warnings.simplefilter("always")  # as libraries that reset Python's once-per-line registry on the way
        for _ in range(2):  # as a comparison that applies a scheme at every length
            warnings.warn("rope_patch: these sizes serve nothing\nlonger", UserWarning, stacklevel=1)
        return listed()

    monkeypatch.setattr(rope_patch.scheme_names, "list_schemes", warn_twice)
    assert main(["list"]) == 0
    out, err = capsys.readouterr()
    assert err == "rope-patch list: warning: rope_patch: these sizes serve nothing longer\n"


@pytest.mark.parametrize("argv", [["--debug", "plot", "results", "nowhere.json"],
                                  ["plot", "results", "nowhere.json", "--debug"]])
def test_debug_raises_the_error(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError, match="nowhere.json"):
        main(argv)


def test_debug_prints_the_traceback_from_the_console(tmp_path):
    def run(*argv):
        return subprocess.run([sys.executable, "-m", "rope_patch.cli", *argv], capture_output=True, text=True,
                              cwd=tmp_path)

    debug = run("--debug", "plot", "decay", "--config", "no_such_model")
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr
    assert "no_such_model" in debug.stderr
    # an argument error is a usage error: one line even under --debug (there is no traceback worth showing)
    usage = run("--debug", "plot", "decay", "--schemes", "yran:8")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr and len(usage.stderr.strip().splitlines()) == 1
    assert "argument --schemes: Unknown position-encoding scheme 'yran'. Did you mean 'yarn'?" in usage.stderr


def sweep_argv(tmp_path, *tasks):
    from helpers.models import tiny_config

    tiny_config("llama").save_pretrained(tmp_path / "m")
    return ["sweep", "--model", str(tmp_path / "m"), "--tasks", *tasks, "--out", str(tmp_path / "out")]


def test_sweep_unknown_rope_task_did_you_mean(tmp_path, capsys):
    assert main(sweep_argv(tmp_path, "rope_passkey", "rope_pasky")) == 2
    line = error_line(capsys)
    assert "Unknown task 'rope_pasky'" in line and "Did you mean 'rope_passkey'?" in line
    assert not (tmp_path / "out").exists()  # nothing created, nothing run


@pytest.mark.slow
def test_sweep_unknown_lm_eval_task_did_you_mean(tmp_path, capsys):
    """Checked against lm-eval's own task index (built in ~10-20 s)."""
    import lm_eval  # noqa: F401  (a dev dependency: must be there)
    assert main(sweep_argv(tmp_path, "rope_ppl", "no_such_task")) == 2
    line = error_line(capsys)
    assert "Unknown task 'no_such_task'" in line and "Did you mean" in line and "ls tasks" in line
    assert main(sweep_argv(tmp_path, "arc_easyy")) == 2
    assert "Did you mean 'arc_easy'?" in error_line(capsys)


# Runs each command line in turn through the console script's entry point (as `rope-patch` does: the package's
# __init__ first, then the entry module), in one fresh interpreter, and reports per call what it printed and which
# heavy modules were imported by then: the first call that imports torch is the one to blame.
STARTUP_PROBE = """
import contextlib, io, json, sys
from importlib.metadata import entry_points

(script,) = entry_points(group="console_scripts", name="rope-patch")
main = script.load()
report = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
    heavy = [m for m in ("torch", "transformers", "torch._dynamo", "numpy", "matplotlib", "rich", "lm_eval")
             if m in sys.modules]
    report.append({"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue(), "heavy": heavy})
print(json.dumps(report))
"""


def startup_calls() -> list[list[str]]:
    """`--help` of the program and of every (sub)command, `list`, and argument errors of every kind."""
    from rope_patch.cli import build_parser

    calls = [["--help"], ["list"]]
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        calls.append([name, "--help"])
        for action in parser._actions:
            if action.dest == "models_command":
                calls += [[name, inner, "--help"] for inner in action.choices]
    calls += [argv for argv, _ in BAD_ARGS]
    return calls + [argv for argv, _ in SCHEME_ERRORS] + [["bogus"], ["export"], ["tune", "--target", "64"]]


# Scheme and parameter names are checked while parsing, from the name table (rope_patch.scheme_names)
SCHEME_ERRORS = [
    (["compare", "--model", "tiny", "--lengths", "1k"], "argument --lengths: expected a number, got '1k'"),
    (["compare", "--schemes", "default", "yran:8"], "argument --schemes: Unknown position-encoding scheme 'yran'. "
     "Did you mean 'yarn'?"),
    (["sweep", "--schemes", "yarn:fctor=2"], "argument --schemes: yarn: unknown parameter 'fctor'. "
     "Did you mean 'factor'?"),
    (["plot", "decay", "--schemes", "self_extend:4+yran"], "Did you mean 'yarn'?"),
    (["explain", "nope:3"], "nope takes no positional value"),
    (["tune", "--scheme", "longrop", "--target", "64"],
     "argument --scheme: Unknown position-encoding scheme 'longrop'. Did you mean 'longrope'?"),
    (["tune", "--scheme", "yarn", "--target", "64", "--accept", "loaded", "ymr"], "argument --accept: Unknown"),
    (["tune", "--scheme", "longrope", "--target", "64", "--init", "yarn:beta=2"], "unknown parameter 'beta'"),
    (["tune", "--scheme", "yarn", "--target", "64", "--method", "evolve"], "argument --method: invalid choice"),
    (["export", "saved", "--engine", "vlm"], "argument --engine: unknown engine 'vlm'. Did you mean 'vllm'?"),
]


def test_parsing_imports_neither_torch_nor_transformers():
    """Issue 29: `rope-patch --help`, every command's --help, `rope-patch list` and every argument error answer
    without importing torch or transformers (nor numpy, matplotlib, rich, lm_eval): parsing is ~0.1 s, a bare
    `import torch` ~1.5-2 s (bench/cli_startup.py)."""
    calls = startup_calls()
    proc = subprocess.run([sys.executable, "-c", STARTUP_PROBE, json.dumps(calls)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert [r["argv"] for r in report] == calls
    heavy = [(r["argv"], r["heavy"]) for r in report if r["heavy"]]
    assert not heavy, f"the first call that imported a heavy module: {heavy[0]}"
    for r in report:
        if "--help" in r["argv"]:
            assert r["code"] == 0 and "usage: rope-patch" in r["out"], r
        elif r["argv"] == ["list"]:
            assert r["code"] == 0 and "yarn" in r["out"], r
        else:  # an argument error: exit status 2, one line
            assert r["code"] == 2 and len(r["err"].strip().splitlines()) == 1 and r["out"] == "", r
    errors = {json.dumps(r["argv"]): r["err"] for r in report}
    for argv, message in SCHEME_ERRORS:
        assert message in errors[json.dumps(argv)], errors[json.dumps(argv)]


def test_list_prints_the_live_registry(capsys):
    """`rope-patch list` reads the name table; it prints what the scheme classes say (name, kind, parameters,
    aliases), as it did when it read the registry."""
    from rope_patch import registry

    assert main(["list"]) == 0
    by_scheme: dict[str, list[str]] = {}
    for alias, name in registry.aliases().items():
        by_scheme.setdefault(name, []).append(alias)
    expected = []
    # a test's own scheme, registered in this process, is not listed
    names = [n for n in registry.list_schemes()
             if registry.get_scheme_class(n).__module__.startswith("rope_patch.schemes.")]
    width = max(map(len, names))  # the longest name sets the first column
    for name in names:
        cls = registry.get_scheme_class(name)
        extra = f" (aliases: {', '.join(sorted(by_scheme[name]))})" if name in by_scheme else ""
        expected.append(f"{name:<{width}} {cls.kind:<10} {', '.join(cls.param_names()) or '-'}{extra}")
    assert capsys.readouterr().out.splitlines() == expected


def test_the_command_line_starts_without_optional_or_heavy_imports():
    """`import rope_patch` never imports lm_eval (an optional extra) nor the integrations; building the `rope-patch`
    parser (every command starts with it) imports neither lm_eval nor matplotlib nor transformers' AutoConfig."""
    code = ("import sys, rope_patch; "
            "assert 'lm_eval' not in sys.modules and 'rope_patch.integrations' not in sys.modules; "
            "import rope_patch.cli; rope_patch.cli.build_parser(); "
            "heavy = [m for m in ('lm_eval', 'matplotlib', 'transformers.models.auto.configuration_auto') "
            "if m in sys.modules]; assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_list_aligns_its_columns_and_stops_quietly_when_its_reader_leaves(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len({line.index(line.split()[1], len(line.split()[0])) for line in lines}) == 1  # the kind column
    import subprocess
    import sys

    # the reader of stdout left (`rope-patch list | head -1`): the write's BrokenPipeError ends the command quietly;
    # one from another pipe (a worker's) is a failure, said in one line
    for stdout_gone, what in ((True, "print('x' * 100_000)"), (False, "raise BrokenPipeError(32, 'Broken pipe')")):
        code = ("import importlib\nm = importlib.import_module('rope_patch.cli.main')\n"
                f"def gone(args):\n    {what}\n    return 0\n"
                "m._list = gone\nraise SystemExit(m.main(['list']))")
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        if stdout_gone:
            child.stdout.close()
            err = child.stderr.read()
        else:
            err = child.communicate(timeout=120)[1]
        code = child.wait(timeout=120)
        if stdout_gone:
            assert code == 0 and err == "", err
        else:
            assert code == 2 and err.strip() == "rope-patch list: error: [Errno 32] Broken pipe", err


@pytest.mark.parametrize("command", [["compare"], ["tune", "--scheme", "yarn", "--target", "512"]])
def test_resume_and_overwrite_are_one_or_the_other(command, capsys):
    assert main([*command, "--resume", "--overwrite"]) == 2
    assert "argument --overwrite: not allowed with argument --resume" in capsys.readouterr().err
