"""Every reader of a file rope_patch writes goes through one schema (rope_patch/schema.py): a damaged file raises an
error that names the file, the field, what was found and what to do, and the command line prints it as one line.

Table-driven: for each kind of file a valid one, a list of damages (each a function of the valid file's text or
data), and the readers of that kind. The damages include the cases reported on main: a null manifest ("scheme: none
(unpatched)" with exit status 0), a manifest without `native` (KeyError), truncated / empty / binary files (the JSON
parser's message without the file name), `"format": 99` (reported as "has no native form"), a negative window (loaded
as max_position_embeddings = -5), a string rope_theta (a raw TypeError), and compare.json files that are valid JSON
with a broken structure (AttributeError, KeyError 'perplexity', "'NoneType' object is not iterable")."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from helpers.models import tiny_model
from helpers.scripts import ROOT, load_script

import rope_patch
from rope_patch import schema
from rope_patch.cli import main
from rope_patch.evaluation.results import load_results, read_results
from rope_patch.persistence import export_info
from rope_patch.tuning import load_best, load_log

# ---- valid files ------------------------------------------------------------------------------------------------
COMPARE = {
    "format": "rope_patch.compare/1",
    "model": {"name": "tiny", "window": 32, "spec": "tiny", "path": "/m", "n_params": 10, "dtype": "float32"},
    "settings": {"lengths": [32, 64], "passkey_lengths": [64], "depths": [0.5], "passkey_samples": 2, "seed": 0,
                 "ppl_tokens": 128},
    "schemes": [{"spec": "default", "label": "default", "name": "default", "params": {}},
                {"spec": "yarn:2", "label": "yarn×2", "name": "yarn", "params": {"factor": 2.0}}],
    "records": [{"scheme": s, "label": s, "name": s, "length": L, "perplexity": p, "nll": 1.0, "n_windows": 2,
                 "n_tokens": 128, "passkey_accuracy": None, "passkey_n": 0, "passkey_correct": None,
                 "passkey_ci_low": None, "passkey_ci_high": None}
                for s, L, p in (("default", 32, 9.0), ("default", 64, "inf"), ("yarn:2", 32, 9.5),
                                ("yarn:2", 64, 9.9))],
    "passkey": [{"scheme": "yarn:2", "label": "yarn×2", "length": 64, "depth": 0.5, "n": 2, "correct": 1,
                 "accuracy": 0.5, "ci_low": 0.1, "ci_high": 0.9}],
    "buckets": [{"scheme": "default", "label": "default", "length": 64, "start": 0, "end": 32, "perplexity": 9.0}],
    "elapsed_s": {"default": 1.0, "yarn:2": 1.0, "total": 2.0}, "pending": [],
}
SWEEP = {
    "format": "rope_patch.sweep/1",
    "settings": {"model": "tiny", "name": "tiny", "tasks": ["niah_single_1"], "lengths": [4096]},
    "schemes": [{"spec": "default", "slug": "default", "args": {"scheme": "default"}}],
    "rows": [{"scheme": "default", "task": "niah_single_1", "family": None, "length": 4096, "metric": "4096",
              "value": 0.5, "metrics": {"4096": 0.5}, "n_samples": 4}],
    "elapsed_s": {}, "machine": {},
}
SEARCH_LOG = {
    "format": "rope_patch.tune/1", "model": {"spec": "m"}, "split": {"tuning_tokens": [0, 10]},
    "settings": {"scheme": "yarn", "method": "grid", "target": 64, "window": 32, "seed": 0},
    "evaluations": [{"index": 0, "spec": "yarn:factor=2", "params": {"factor": 2}, "objective": 3.0, "seconds": 0.1},
                    {"index": 1, "spec": "yarn:factor=4", "params": {"factor": 4}, "objective": None,
                     "error": "refused"}],
    "status": "done", "stopped": None, "best": {"index": 0, "spec": "yarn:factor=2", "params": {"factor": 2},
                                                "objective": 3.0, "perplexity": 3.0},
}
BEST = {"scheme": "yarn", "index": 0, "spec": "yarn:factor=2", "params": {"factor": 2}, "objective": 3.0,
        "perplexity": 3.0, "passkey_accuracy": None, "target": 64}


def _json(data) -> str:
    return json.dumps(data)


def _edit(change):
    """A damage that edits the parsed valid file."""
    def damage(text: str) -> str:
        data = json.loads(text)
        change(data)
        return json.dumps(data)
    return damage


def _set(path: str, value):
    """`_set("records.0.perplexity", "abc")`: one field set (the last key removed where value is DELETE)."""
    def change(data):
        *parents, leaf = path.split(".")
        node = data
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is DELETE:
            del node[int(leaf) if isinstance(node, list) else leaf]
        else:
            node[int(leaf) if isinstance(node, list) else leaf] = value
    return _edit(change)


DELETE = object()
TEXT = {  # damages of any file: (damage, what the message must say)
    "empty": (lambda t: "", "is empty (0 bytes)"),
    "truncated": (lambda t: t[: len(t) // 2], "not valid JSON ("),
    "binary": (lambda t: "\x00\xff" + t, None),  # written as bytes below
    "null": (lambda t: "null", "found null"),
}

# kind -> (file name, valid text, [(case, damage, expected fragments)])
CASES = {
    "manifest": ("rope_patch.json", None, [
        ("null", TEXT["null"][0], ["expected a rope_patch.json manifest", "found null"]),
        ("no native", _set("native", DELETE), ["lacks the required key 'native'"]),
        ("empty", TEXT["empty"][0], [TEXT["empty"][1]]),
        ("truncated", TEXT["truncated"][0], [TEXT["truncated"][1], "corrupt or truncated"]),
        ("binary", None, ["not UTF-8 text"]),
        ("format 99", _set("format", 99), ["has format 99", "Upgrade rope_patch"]),
        ("negative window", _set("original.max_position_embeddings", -5),
         ["'original.max_position_embeddings' must be an integer >= 1, found an integer -5"]),
        ("string rope_theta", _set("original.rope_parameters.rope_theta", "1e4"),
         ["'original.rope_parameters.rope_theta' must be a number > 0, found a string \"1e4\""]),
        ("negative original window", _set("original.rope_parameters.original_max_position_embeddings", -5),
         ["'original.rope_parameters.original_max_position_embeddings' must be an integer >= 1"]),
        ("params a list", _set("params", [4]), ["'params' must be a JSON object, found a list [4]"]),
    ]),
    "compare": ("compare.json", _json(COMPARE), [
        ("empty", TEXT["empty"][0], [TEXT["empty"][1]]),
        ("truncated", TEXT["truncated"][0], [TEXT["truncated"][1]]),
        ("binary", None, ["not UTF-8 text"]),
        ("a list", lambda t: "[]", ["is not a rope-patch compare result", "expected 'rope_patch.compare/1'"]),
        ("newer format", _set("format", "rope_patch.compare/2"), ["newer than the 'rope_patch.compare/1'",
                                                                  "Upgrade rope_patch"]),
        ("records null", _set("records", None), ["'records' must be a list", "found null"]),
        ("schemes null", _set("schemes", None), ["'schemes' must be a list", "found null"]),
        ("model a list", _set("model", []), ["'model' must be", "found a list []"]),
        ("record without perplexity", _set("records.1.perplexity", DELETE),
         ["'records[1]' lacks the required key 'perplexity'"]),
        ("perplexity a word", _set("records.2.perplexity", "abc"),
         ["'records[2].perplexity' must be a number >= 0 (or \"inf\" / \"nan\") or null, found a string \"abc\""]),
        ("accuracy above 1", _set("passkey.0.accuracy", 2), ["'passkey[0].accuracy' must be a number >= 0 and <= 1"]),
        ("unknown scheme", _set("records.0.scheme", "ntk:8"),
         ["'records[0].scheme' must be one of the schemes' specs (default, yarn:2), found a string \"ntk:8\""]),
        ("lengths a number", _set("settings.lengths", 32), ["'settings.lengths' must be a list of integers >= 1"]),
    ]),
    "sweep": ("sweep.json", _json(SWEEP), [
        ("truncated", TEXT["truncated"][0], [TEXT["truncated"][1]]),
        ("rows null", _set("rows", None), ["'rows' must be a list", "found null"]),
        ("value a word", _set("rows.0.value", "high"), ["'rows.0.value'".replace(".0.", "[0].") + " must be a number"]),
        ("no tasks", _set("settings.tasks", DELETE), ["'settings' lacks the required key 'tasks'"]),
        ("unknown scheme", _set("rows.0.scheme", "yarn:9"), ["'rows[0].scheme' must be one of the schemes' specs"]),
    ]),
    "search_log": ("search_log.json", _json(SEARCH_LOG), [
        ("empty", TEXT["empty"][0], [TEXT["empty"][1]]),
        ("truncated", TEXT["truncated"][0], [TEXT["truncated"][1]]),
        ("evaluations null", _set("evaluations", None), ["'evaluations' must be a list", "found null"]),
        ("out of order", _set("evaluations.1.index", 5), ["'evaluations[1].index' must be 1 (evaluations in order)"]),
        ("status", _set("status", "maybe"), ["'status' must be one of 'running', 'done', 'stopped'"]),
        ("objective a word", _set("evaluations.0.objective", "low"), ["'evaluations[0].objective' must be a number"]),
        ("compare file", lambda t: _json(COMPARE), ["is not a rope-patch tune search log"]),
    ]),
    "best": ("best.json", _json(BEST), [
        ("empty", TEXT["empty"][0], [TEXT["empty"][1]]),
        ("no spec", _set("spec", DELETE), ["lacks the required key 'spec'"]),
        ("objective a word", _set("objective", "low"), ["'objective' must be a number"]),
        ("target zero", _set("target", 0), ["'target' must be an integer >= 2, found an integer 0"]),
    ]),
}
FIX = {"manifest": "re-save it with rope_patch.save_pretrained", "compare": "--overwrite (not --resume) starts over",
       "sweep": "rope-patch sweep", "search_log": "--overwrite (not --resume) starts over", "best": "rope-patch tune"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder written by rope_patch.save_pretrained (yarn x2 on a tiny model)."""
    model = tiny_model()
    rope_patch.apply(model, "yarn:2")
    return rope_patch.save_pretrained(model, tmp_path_factory.mktemp("saved"))


def _write(folder: Path, kind: str, case: str, damage, saved: Path) -> Path:
    name, text, _ = CASES[kind]
    if kind == "manifest":
        import shutil

        folder = Path(shutil.copytree(saved, folder / "model"))
        text = (folder / name).read_text()
    file = folder / name
    if damage is None:  # binary
        file.write_bytes(b"\x00\xff\xfe" + text.encode())
    else:
        file.write_text(damage(text))
    return file


def _readers(kind: str, file: Path) -> list:
    """The calls that read this kind of file (each must raise the one error). `read_results` (the figures' reader)
    also takes other tools' records (a bare list, JSON Lines): it holds a file to the compare schema when the file says
    it is one, and otherwise only names it."""
    folder = file.parent
    return {
        "manifest": [lambda: rope_patch.persistence.read_manifest(folder), lambda: rope_patch.from_pretrained(folder),
                     lambda: export_info(folder)],
        "compare": [lambda: load_results(file), _Tolerant(lambda: read_results(file))],
        "sweep": [lambda: rope_patch.plots.tasks(file)],
        "search_log": [lambda: load_log(file)],
        "best": [lambda: load_best(file)],
    }[kind]


class _Tolerant:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self):
        return self.fn()


PARAMS = [(kind, case, damage, expected) for kind, (_, _, cases) in CASES.items() for case, damage, expected in cases]


@pytest.mark.parametrize("kind,case,damage,expected", PARAMS, ids=[f"{k}-{c}" for k, c, *_ in PARAMS])
def test_a_damaged_file_names_the_file_the_field_and_the_fix(kind, case, damage, expected, saved, tmp_path):
    file = _write(tmp_path, kind, case, damage, saved)
    for read in _readers(kind, file):
        with pytest.raises(ValueError) as info:
            read()
        msg = str(info.value)
        assert str(file) in msg and "\n" not in msg, msg
        if isinstance(read, _Tolerant) and case in ("a list", "empty", "binary"):
            continue  # not the compare format: read as other tools' records, and refused naming the file
        assert all(e in msg for e in expected), msg
        assert FIX[kind] in msg or "Upgrade rope_patch" in msg, msg


@pytest.mark.parametrize("kind", list(CASES))
def test_the_valid_files_read(kind, saved, tmp_path):
    name, text, _ = CASES[kind]
    if kind == "manifest":
        assert rope_patch.persistence.read_manifest(saved)["scheme"] == "yarn"
        return
    (tmp_path / name).write_text(text)
    for read in _readers(kind, tmp_path / name):
        read()


# ---- the command line: one line, exit status 2 -------------------------------------------------------------------
def _one_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[-1]


CLI = [  # kind, case, argv (FILE / DIR replaced)
    ("manifest", "null", ["export", "DIR"]),
    ("manifest", "no native", ["export", "DIR"]),
    ("manifest", "format 99", ["export", "DIR"]),
    ("manifest", "binary", ["export", "DIR"]),
    ("manifest", "negative window", ["export", "DIR"]),
    ("compare", "records null", ["plot", "results", "FILE", "--out", "OUT.png"]),
    ("compare", "record without perplexity", ["plot", "results", "FILE", "--out", "OUT.png"]),
    ("compare", "model a list", ["compare", "--resume", "--out", "DIR", "--model", "/nowhere"]),
    ("sweep", "rows null", ["plot", "results", "FILE", "--out", "OUT.png"]),
    ("search_log", "out of order", ["plot", "results", "FILE", "--out", "OUT.png"]),
    ("search_log", "status", ["tune", "--scheme", "yarn", "--target", "64", "--resume", "--out", "DIR",
                              "--model", "/nowhere"]),
]


@pytest.mark.parametrize("kind,case,argv", CLI, ids=[f"{a[0]}-{k}-{c}" for k, c, a in CLI])
def test_the_command_line_says_it_in_one_line(kind, case, argv, saved, tmp_path, capsys):
    damage = next(d for c, d, _ in CASES[kind][2] if c == case)
    file = _write(tmp_path, kind, case, damage, saved)
    argv = [str(file) if a == "FILE" else str(file.parent) if a == "DIR" else str(tmp_path / "out.png")
            if a == "OUT.png" else a for a in argv]
    assert main(argv) == 2
    line = _one_line(capsys)
    assert str(file) in line, line
    assert not (tmp_path / "out.png").exists()


# ---- the recipes' configs ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finetune():
    from helpers.recipes import load_recipe

    return load_recipe()


CONFIG = yaml.safe_load((ROOT / "recipes" / "configs" / "tiny_yarn_4x.yaml").read_text())
RECIPE = [  # case, the file's text, fragments of the one line
    ("empty", "", ["is empty (0 bytes)"]),
    ("not yaml", "train: [steps: 3\n", ["not valid YAML"]),
    ("a list", "- 1\n- 2\n", ["expected a mapping of sections", "found a list [1, 2]"]),
    ("bad value", yaml.safe_dump({**CONFIG, "train": {**CONFIG["train"], "steps": -1}}),
     ["`train.steps` must be an integer >= 1, got -1"]),
    ("unknown key", yaml.safe_dump({**CONFIG, "trian": {}}), ["'trian' (did you mean 'train'?)"]),
]


@pytest.mark.parametrize("case,text,expected", RECIPE, ids=[c for c, *_ in RECIPE])
def test_a_broken_recipe_config_names_the_file(case, text, expected, finetune, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert finetune.cli(["--config", str(path), "--check"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"finetune_lora: config error: {path}") and all(e in line for e in expected), line


def test_binary_recipe_config(finetune, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xff\xfe\x00model: tiny")
    with pytest.raises(finetune.ConfigError, match=f"{path}: not UTF-8 text"):
        finetune.load_config(path)


PRETRAIN = yaml.safe_load((ROOT / "recipes" / "configs" / "pretrain_tiny.yaml").read_text())


@pytest.mark.parametrize("change,expected", [
    (lambda c: c["train"].pop("steps"), "'train' lacks the required key 'steps'"),
    (lambda c: c["model"].update(rope_theta="ten thousand"), "'model.rope_theta' must be a number > 0"),
    (lambda c: c["train"]["passkey_curriculum"][1].update(fraction=1.5),
     "'train.passkey_curriculum[1].fraction' must be a number >= 0 and <= 1"),
], ids=["missing", "wrong type", "out of range"])
def test_pretrain_config_is_checked_before_training(change, expected, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))  # the script imports its sibling check_tiny / corpus modules
    pretrain = load_script("recipes/pretrain_tiny.py")
    cfg = copy.deepcopy(PRETRAIN)
    pretrain.read_config(ROOT / "recipes" / "configs" / "pretrain_tiny.yaml")  # the shipped one is valid
    change(cfg)
    path = tmp_path / "pretrain.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as info:
        pretrain.read_config(path)
    assert str(path) in str(info.value) and expected in str(info.value), info.value


def test_schema_is_the_one_reader():
    """No module of the package parses a file this project writes with a bare json.loads / yaml.safe_load: the
    readers go through rope_patch.schema (lm-eval's own output files and transformers' config.json are not ours)."""
    allowed = {  # module: why its json.loads is not a reader of one of our files
        "rope_patch/evaluation/compare.py": "json.loads(json.dumps(...)): a value's JSON form",
        "rope_patch/tuning/log.py": "json.loads(json.dumps(...)): a value's JSON form",
        "rope_patch/training/callback.py": "json.loads(json.dumps(...)): a value's JSON form",
        "rope_patch/training/config.py": "the users' .jsonl training data (data.files), not a file rope_patch writes",
        "rope_patch/cli/plot.py": "peeks at the format; the file is then read through its schema",
        "rope_patch/evaluation/results.py": "JSON Lines of other tools' records (the tolerant figure reader)",
        "rope_patch/integrations/lm_eval/sweep.py": "transformers' config.json",
        "rope_patch/integrations/lm_eval/outputs.py": "lm-eval's results and samples files (its own formats)",
        "rope_patch/persistence.py": "transformers' config.json and peft's adapter_config.json",
        "rope_patch/serving.py": "transformers' config.json, tokenizer_config.json and peft's adapter_config.json",
        "rope_patch/schema.py": "the one reader",
        "rope_patch/scheme_names.py": "the committed name table (package data generated from the scheme classes "
                                      "and checked equal to them by tests/test_scheme_names.py), read before the "
                                      "CLI parses",
    }
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "rope_patch").rglob("*.py")
                   if ("json.loads(" in p.read_text() or "yaml.safe_load(" in p.read_text()) and "data" not in p.parts)
    assert set(found) <= set(allowed), sorted(set(found) - set(allowed))
    assert "schema" in schema.__name__
