"""The one schema of every file rope_patch writes and reads back, and its one reader.

    data = read(path, COMPARE)          # parsed, checked; FileFormatError (a ValueError) otherwise
    check(data, SEARCH_LOG, path)       # the same checks on data parsed elsewhere

| kind          | file                                  | written by                                  |
| ---           | ---                                   | ---                                         |
| MANIFEST      | rope_patch.json                       | rope_patch.save_pretrained / save_patch      |
| COMPARE       | compare.json                          | rope-patch compare (and sweep's rope_* cells) |
| SWEEP         | sweep.json                            | rope-patch sweep                            |
| SWEEP_STAMP   | sweep_settings.json                   | rope-patch sweep (what a resume must match)  |
| SWEEP_CELL    | schemes/<scheme>/cells/<task>.json    | rope-patch sweep (one finished cell)         |
| SWEEP_SAMPLES | schemes/<scheme>/samples.json         | rope-patch sweep (its samples, compact)      |
| SEARCH_LOG    | search_log.json                       | rope-patch tune                             |
| BEST          | best.json                             | rope-patch tune                             |
| TABLES        | a study's tables.json (eval/*/)       | people (rope_patch.evaluation.tables reads it) |
| RECIPE_CONFIG | recipes/configs/*.yaml (fine-tuning)  | people (recipes/finetune_lora.py reads it)   |
| PRETRAIN_CONFIG | recipes/configs/pretrain_tiny.yaml  | people (recipes/pretrain_tiny.py reads it)   |
| FINGERPRINTS  | $ROPE_PATCH_CACHE/fingerprints.json   | fingerprint.py (a cache of file digests)     |

Every failure is one `FileFormatError` whose message names the file, the field (`records[3].perplexity`), what was
expected, what was found and what to do, on one line (the command line prints a ValueError's message as its one
line): a missing, empty, binary (not UTF-8), truncated or unparsable file, the wrong kind of file, a format newer than
this rope_patch reads, a missing key, a value of the wrong type or range, and references that do not resolve (a
record of a scheme the file does not list). Keys a kind does not know are allowed (a newer writer may add some);
the keys its readers use are required.

The schema is data (`Obj`, `List`, `Num`, ...), so a reader cannot check less than its writer promises without it
showing here. This module is in the foundation layer: every layer reads through it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


class FileFormatError(ValueError):
    """A file rope_patch wrote (or a copy of one) that is not what its reader expects. `file`, `field` (None: the
    whole file), `expected`, `found` and `fix` are kept as attributes; the message says all of them in one line."""

    def __init__(self, file, field: str | None, expected: str, found: str, fix: str, *, message: str | None = None):
        self.file, self.field, self.expected, self.found, self.fix = str(file), field, expected, found, fix
        where = f"{file}: {field!r}" if field else f"{file}:"
        super().__init__(" ".join((message or f"{where} must be {expected}, found {found}. {fix}").split()))


class _Bad(Exception):
    """One problem inside a value: raised by the checkers, turned into a FileFormatError that names the file."""

    def __init__(self, field: str, expected: str, value: Any = None, *, missing: list[str] | None = None):
        super().__init__(field)
        self.field, self.expected, self.value, self.missing = field, expected, value, missing


def describe(value: Any, n: int = 80) -> str:
    """`found` as a reader of the JSON file sees it: its JSON type and (short) value."""
    kind = ("null" if value is None else "a boolean" if isinstance(value, bool)
            else "an integer" if isinstance(value, int)
            else "a number" if isinstance(value, float) else "a string" if isinstance(value, str)
            else "a list" if isinstance(value, list) else "an object" if isinstance(value, dict)
            else type(value).__name__)
    if value is None:
        return kind
    text = json.dumps(value, default=str) if isinstance(value, (dict, list, str)) else repr(value)
    return f"{kind} {text if len(text) <= n else text[: n - 1] + '…'}"


def _at(field: str, key) -> str:
    return f"{field}[{key}]" if isinstance(key, int) else (f"{field}.{key}" if field else str(key))


# ---- the checkers: each is called as spec(value, field) and raises _Bad ----------------------------------------
class Spec:
    expected = "a value"

    def __call__(self, value, field: str) -> None:  # pragma: no cover - every spec overrides it
        raise NotImplementedError


class Any_(Spec):
    def __call__(self, value, field):
        return None


@dataclasses.dataclass
class Str(Spec):
    choices: tuple | None = None
    nonempty: bool = False
    what: str | None = None  # what the string names, for messages ("a scheme name (str)")

    @property
    def expected(self):
        return self.what or (f"one of {', '.join(map(repr, self.choices))}" if self.choices else
                             "a non-empty string" if self.nonempty else "a string")

    def __call__(self, value, field):
        if not isinstance(value, str) or (self.choices and value not in self.choices) or (self.nonempty and not value):
            raise _Bad(field, self.expected, value)


@dataclasses.dataclass
class Bool(Spec):
    expected = "true or false"

    def __call__(self, value, field):
        if not isinstance(value, bool):
            raise _Bad(field, self.expected, value)


@dataclasses.dataclass
class Num(Spec):
    """A number (an integer with `integer`), within the bounds; `special`: also the strings "inf", "-inf", "nan"
    that json_safe writes for values JSON cannot hold (an overflowing perplexity)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    integer: bool = False
    special: bool = False

    @property
    def expected(self):
        bounds = [f">= {self.ge:g}" if self.ge is not None else "", f"> {self.gt:g}" if self.gt is not None else "",
                  f"<= {self.le:g}" if self.le is not None else ""]
        text = ("an integer" if self.integer else "a number") + (" " + " and ".join(b for b in bounds if b)
                                                                  if any(bounds) else "")
        return text + (' (or "inf" / "nan")' if self.special else "")

    def __call__(self, value, field):
        if self.special and value in ("inf", "-inf", "nan"):
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            not self.integer or isinstance(value, int))
        if ok and isinstance(value, float) and not math.isfinite(value):
            ok = self.special
        if ok and not (isinstance(value, float) and math.isnan(value)):
            ok = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                  and (self.le is None or value <= self.le))
        if not ok:
            raise _Bad(field, self.expected, value)


def Int(ge: int | None = None, le: int | None = None) -> Num:  # noqa: N802 - reads as the type it checks
    return Num(ge=ge, le=le, integer=True)


def Fraction() -> Num:  # noqa: N802
    return Num(ge=0.0, le=1.0)


@dataclasses.dataclass
class Opt(Spec):
    """`spec` or null."""

    spec: Spec

    @property
    def expected(self):
        inner = self.spec.expected
        return inner if inner.startswith("null or ") else f"{inner} or null"

    def __call__(self, value, field):
        if value is not None:
            try:
                self.spec(value, field)
            except _Bad as bad:
                if bad.field == field and bad.missing is None:  # this value itself: say that null is fine too
                    raise _Bad(field, self.expected, value) from None
                raise


@dataclasses.dataclass
class Const(Spec):
    value: Any

    @property
    def expected(self):
        return json.dumps(self.value)

    def __call__(self, value, field):
        if value != self.value:
            raise _Bad(field, self.expected, value)


@dataclasses.dataclass
class List(Spec):
    item: Spec = dataclasses.field(default_factory=Any_)
    min_len: int = 0

    @property
    def expected(self):
        return "a list" + (f" of at least {self.min_len} items" if self.min_len else "") + \
            (f" of {_plural(self.item.expected)}" if not isinstance(self.item, Any_) else "")

    def __call__(self, value, field):
        if not isinstance(value, list) or len(value) < self.min_len:
            raise _Bad(field, self.expected, value)
        for i, item in enumerate(value):
            self.item(item, _at(field, i))


@dataclasses.dataclass
class Map(Spec):
    """An object with any keys, each value checked by `value`."""

    value: Spec = dataclasses.field(default_factory=Any_)

    @property
    def expected(self):
        return "a JSON object" + (f" of {_plural(self.value.expected)}" if not isinstance(self.value, Any_) else "")

    def __call__(self, value, field):
        if not isinstance(value, dict):
            raise _Bad(field, self.expected, value)
        for k, v in value.items():
            self.value(v, _at(field, k))


@dataclasses.dataclass
class Obj(Spec):
    """An object with `required` keys (each checked) and `optional` ones (checked where present); other keys are
    allowed. `expected` names it in messages (default: the required keys)."""

    required: dict = dataclasses.field(default_factory=dict)
    optional: dict = dataclasses.field(default_factory=dict)
    name: str | None = None

    @property
    def expected(self):
        return self.name or ("a JSON object with " + ", ".join(f'"{k}"' for k in self.required) if self.required
                             else "a JSON object")

    def __call__(self, value, field):
        if not isinstance(value, dict):
            raise _Bad(field, self.expected, value)
        missing = [k for k in self.required if k not in value]
        if missing:
            raise _Bad(field, self.expected, value, missing=missing)
        for k, spec in (*self.required.items(), *((k, s) for k, s in self.optional.items() if k in value)):
            spec(value[k], _at(field, k))


@dataclasses.dataclass
class Check(Spec):
    """A rule of its own: `test(value)` is true for a good value."""

    test: Callable[[Any], bool]
    expected: str = "a valid value"

    def __call__(self, value, field):
        if not self.test(value):
            raise _Bad(field, self.expected, value)


def _plural(expected: str) -> str:
    for article in ("an ", "a "):
        if expected.startswith(article):
            head, _, rest = expected[len(article):].partition(" ")
            return f"{head}s" + (f" {rest}" if rest else "") if not head.endswith("s") else expected[len(article):]
    return expected


# ---- the kinds of file ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of file: its name in messages, its format tag (the "format" key; None: none), its structure, what to
    do about a broken one, and checks across fields (`rules(data)` raises _Bad)."""

    name: str
    spec: Spec
    fix: str
    format: str | None = None
    rules: Callable[[Any], None] | None = None
    parse: str = "json"  # or "yaml"
    # (data, file) -> None, before the structure: a newer format names its keys otherwise
    version: Callable[[Any, Any], None] | None = None


# rope_patch.json: the manifest of a save. 3 = a stack ("scheme": "stack", "params": {"schemes": [...]}); 2 = the
# learned parameters' record ("weights"); 1 = no "weights" (still read).
MANIFEST_FORMAT = 3
MANIFEST_SINGLE_FORMAT = 2  # what a save of one scheme (or none) writes, which rope_patch versions that read 2 load
MANIFEST_FIX = ("Restore the folder from the original save, or load the model again and re-save it with "
                "rope_patch.save_pretrained(model, dir).")
COMPARE_FORMAT = "rope_patch.compare/1"
SWEEP_FORMAT = "rope_patch.sweep/1"
SWEEP_SAMPLES_FORMAT = "rope_patch.sweep_samples/1"
TABLES_FORMAT = "rope_patch.tables/1"
SEARCH_LOG_FORMAT = "rope_patch.tune/1"
# `rope-patch tune --method` (tuning.search.METHODS): defined here, torch-free, so the command line offers them before
# it imports torch, and the search log accepts the same words.
SEARCH_METHODS = ("evolution", "grid", "random")


_FLAT_ROPE = Obj({}, {"rope_type": Str(), "rope_theta": Num(gt=0), "factor": Num(gt=0),
                     "original_max_position_embeddings": Int(ge=1)},
                 name="a transformers rope_parameters object ({\"rope_type\", \"rope_theta\", ...})")


class RopeParameters(Spec):
    """A transformers `rope_parameters` dict: flat, or one per layer type (Gemma 3; null for a layer type without
    RoPE). The keys rope_patch reads from it are checked (a string rope_theta would fail deep inside transformers)."""

    expected = _FLAT_ROPE.expected + " or one per layer type"

    def __call__(self, value, field):
        if not isinstance(value, dict):
            raise _Bad(field, self.expected, value)
        layered = bool(value) and all(isinstance(v, dict) or v is None for v in value.values())
        (Map(Opt(_FLAT_ROPE)) if layered else _FLAT_ROPE)(value, field)


ROPE_PARAMETERS = RopeParameters()


def _manifest_version(data, file) -> None:
    if not isinstance(data, dict) or "format" not in data:
        return
    fmt = data["format"]
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        raise FileFormatError(file, "format", "a positive integer", describe(fmt), MANIFEST_FIX)
    if fmt > MANIFEST_FORMAT:
        from ._version import __version__

        versions = data.get("versions")
        writer = versions.get("rope_patch") if isinstance(versions, dict) else None
        newer = f">={writer}" if isinstance(writer, str) and writer != __version__ else ""
        raise FileFormatError(file, "format", f"a format from 1 to {MANIFEST_FORMAT}", describe(fmt),
                              f"Upgrade rope_patch (pip install -U rope_patch{newer}) to load it.",
                              message=f"{file} has format {fmt}, "
                                      f"written by rope_patch {writer or '(version not recorded)'}; "
                                      f"this rope_patch {__version__} reads formats 1 to {MANIFEST_FORMAT}. Upgrade "
                                      f"rope_patch (pip install -U rope_patch{newer}) to load it.")


def _manifest_rules(data) -> None:
    if data["scheme"] == "stack":
        List(Obj({"scheme": Str(nonempty=True), "params": Map()}), min_len=2)(data["params"].get("schemes"),
                                                                             "params.schemes")
    weights = data.get("weights")
    if weights is not None:
        name = weights.get("file") if isinstance(weights, dict) else None
        if not (isinstance(name, str) and name and Path(name).name == name and name not in (".", "..")):
            raise _Bad("weights", _WEIGHTS, weights)


_WEIGHTS = 'null or {"file": "rope_patch.safetensors", "keys": [...], "sha256": "..."} (a file name inside the folder)'
MANIFEST = Kind(
    "rope_patch.json", format=None, fix=MANIFEST_FIX, version=_manifest_version, rules=_manifest_rules,
    spec=Obj(
        {"format": Int(ge=1), "scheme": Opt(Str(nonempty=True, what="a scheme name (str)")), "params": Map(),
         "original": Obj({"rope_parameters": Opt(ROPE_PARAMETERS), "max_position_embeddings": Int(ge=1)},
                         name='a JSON object {"rope_parameters": {...} (null: a model whose config has none, '
                              'GPT-J\'s table rotary), "max_position_embeddings": N}'),
         "native": Bool()},
        {"adapter": Bool(), "versions": Map(),
         "weights": Opt(Obj({"file": Str(nonempty=True), "keys": List(Str())}, {"sha256": Str()}, name=_WEIGHTS))},
        name='a rope_patch.json manifest {"format", "scheme", "params", "original", "native", ...}'),
)

_RESULTS_FIX = ("Restore the file, or run `rope-patch compare` again into this --out (with --resume: move the file "
                "away, or --overwrite (not --resume) starts over).")


def _refs(data, rows: str, key: str, known: set, what: str) -> None:
    for i, row in enumerate(data.get(rows) or []):
        if row[key] not in known:
            raise _Bad(f"{rows}[{i}].{key}", f"one of the {what} ({', '.join(sorted(map(str, known)))})", row[key])


def _compare_rules(data) -> None:
    specs = {s["spec"] for s in data["schemes"]}
    for rows in ("records", "passkey", "buckets"):
        _refs(data, rows, "scheme", specs, "schemes' specs")


_PPL = Opt(Num(ge=0.0, special=True))
COMPARE = Kind(
    "compare.json", format=COMPARE_FORMAT, fix=_RESULTS_FIX, rules=_compare_rules,
    spec=Obj({
        "format": Const(COMPARE_FORMAT),
        "model": Obj({"name": Str()}, {"window": Opt(Int(ge=1)), "spec": Opt(Str()), "path": Opt(Str()),
                                       "n_params": Opt(Int(ge=0)), "dtype": Opt(Str()), "fingerprint": Opt(Str()),
                                       "patch": Opt(Obj({"scheme": Str(), "label": Str()}))}),
        "settings": Obj({"lengths": List(Int(ge=1)), "depths": List(Fraction()), "passkey_samples": Opt(Int(ge=0)),
                         "seed": Opt(Int()), "ppl_tokens": Opt(Int(ge=0))},
                        {"passkey_lengths": List(Int(ge=1)), "heldout": Opt(Map()), "machine": Opt(Map()),
                         "chat_template": Opt(Map()), "budget": Opt(Map()), "counts": Opt(Map()),
                         # the perplexity text rule since 2026-12-06 (evaluation/perplexity.py scored_tokens);
                         # absent: every length read ppl_tokens, windows_at_longest x the run's longest length
                         "ppl_shared_length": Opt(Int(ge=1))}),
        "schemes": List(Obj({"spec": Str(nonempty=True), "label": Str()},
                            {"name": Str(), "params": Map(), "commit": Opt(Str())})),
        "records": List(Obj({"scheme": Str(), "length": Int(ge=1), "perplexity": _PPL, "passkey_accuracy":
                             Opt(Fraction())},
                            {"nll": Opt(Num(special=True)), "n_windows": Opt(Int(ge=0)), "n_tokens": Opt(Int(ge=0)),
                             "passkey_n": Opt(Int(ge=0)), "passkey_correct": Opt(Int(ge=0)),
                             "passkey_ci_low": Opt(Fraction()), "passkey_ci_high": Opt(Fraction())})),
    }, {
        "passkey": List(Obj({"scheme": Str(), "length": Int(ge=1), "depth": Fraction(), "n": Int(ge=0),
                             "correct": Int(ge=0)},
                            {"accuracy": Opt(Fraction()), "ci_low": Opt(Fraction()), "ci_high": Opt(Fraction())})),
        "buckets": List(Obj({"scheme": Str(), "start": Num(ge=0), "end": Num(ge=0), "perplexity": _PPL},
                            {"length": Opt(Int(ge=1))})),
        "elapsed_s": Map(Opt(Num(ge=0))), "pending": List(Str()), "versions": Map(),
    }, name="a rope-patch compare result"),
)

_SWEEP_FIX = ("Run the same `rope-patch sweep` command again: it keeps the finished cells (OUT/schemes/*/cells/) and "
              "writes sweep.json anew; or use another --out.")


def _sweep_rules(data) -> None:
    _refs(data, "rows", "scheme", {s["spec"] for s in data["schemes"]}, "schemes' specs")


SWEEP = Kind(
    "sweep.json", format=SWEEP_FORMAT, fix=_SWEEP_FIX, rules=_sweep_rules,
    spec=Obj({
        "format": Const(SWEEP_FORMAT),
        "settings": Obj({"model": Str(), "tasks": List(Str()), "lengths": List(Int(ge=1))}),
        "schemes": List(Obj({"spec": Str(nonempty=True)}, {"args": Map(), "slug": Str()})),
        "rows": List(Obj({"scheme": Str(), "task": Str(), "metric": Opt(Str()), "value": Opt(Num(special=True)),
                          "metrics": Map()},
                         {"family": Opt(Str()), "length": Opt(Int(ge=1)), "n_samples": Opt(Int(ge=0)),
                          "by_depth": Map()})),
    }, {"elapsed_s": Map(Opt(Num(ge=0))), "machine": Map()}, name="a rope-patch sweep result"),
)
SWEEP_STAMP = Kind(
    "sweep_settings.json", fix="Delete it (or the whole --out) to start the sweep over, or use another --out.",
    spec=Obj({"fingerprint": Str(nonempty=True)}, {"settings": Map(), "weights": Opt(Str())},
             name="a sweep's settings stamp"),
)
SWEEP_CELL = Kind(
    "a sweep cell", fix="Delete the file: the next run of the same `rope-patch sweep` command evaluates "
                        "that cell again.",
    spec=Obj({"task": Str(), "metrics": Map()}, {"n_samples": Opt(Int(ge=0)), "by_depth": Map(), "run_elapsed_s":
                                                  Opt(Num(ge=0)), "run_id": Str(), "fingerprint": Str(),
                                                  "commit": Opt(Str())},
             name="a sweep cell"),
)

SWEEP_SAMPLES = Kind(
    "samples.json", format=SWEEP_SAMPLES_FORMAT,
    fix="Delete it and the scheme's cells/: the next run of the same `rope-patch sweep` command measures them again.",
    spec=Obj({
        "format": Const(SWEEP_SAMPLES_FORMAT),
        "scheme": Str(),
        "tasks": Map(Obj({"samples": List(Obj({"doc_id": Int(ge=0), "metrics": Map()},
                                               {"prompt": Str(), "in_prompt": Bool(), "depth": Num(ge=0, le=1)}))},
                         {"results_file": Str(), "versions": Map()})),
    }, name="a sweep's per-sample summary"),
)

TABLES = Kind(
    "tables.json", format=TABLES_FORMAT,
    fix="Fix the study file (rope_patch/evaluation/tables.py says what it holds).",
    spec=Obj({
        "format": Const(TABLES_FORMAT),
        "document": Str(nonempty=True),
        "results": Str(nonempty=True),
        "tables": List(Obj({"mark": Str(nonempty=True), "kind": Str(choices=("perplexity", "tune", "passkey", "ruler")),
                            "runs": List(Str(nonempty=True), min_len=1)},
                           {"haystack": Str(choices=("prose", "noise"))})),
    }, name="a study's table list"),
)

_LOG_FIX = ("Move it away (or use another --out) and run `rope-patch tune` again; --overwrite (not --resume) "
            "starts over.")


def _log_rules(data) -> None:
    for i, rec in enumerate(data["evaluations"]):
        if rec["index"] != i:  # a resume replays the log by position
            raise _Bad(f"evaluations[{i}].index", f"{i} (evaluations in order)", rec["index"])


_OBJECTIVE = Opt(Num(special=True))
SEARCH_LOG = Kind(
    "search_log.json", format=SEARCH_LOG_FORMAT, fix=_LOG_FIX, rules=_log_rules,
    spec=Obj({
        "format": Const(SEARCH_LOG_FORMAT),
        "evaluations": List(Obj({"index": Int(ge=0), "spec": Str(), "params": Map(), "objective": _OBJECTIVE},
                                {"error": Opt(Str()), "seconds": Opt(Num(ge=0)), "perplexity": _OBJECTIVE,
                                 "needle_perplexity": _OBJECTIVE, "passkey_accuracy": Opt(Fraction())})),
        "status": Str(choices=("running", "done", "stopped")),
        "best": Opt(Obj({"spec": Str(), "params": Map(), "objective": Num(special=True)}, {"index": Int(ge=0)})),
    }, {
        # what a resume compares (tune writes all three; the readers take what is there)
        "model": Map(), "split": Map(),
        "settings": Obj({}, {"scheme": Str(nonempty=True), "method": Str(choices=SEARCH_METHODS),
                             "target": Int(ge=2), "window": Int(ge=1)}),
        "stopped": Opt(Str()), "versions": Map(), "heldout": Opt(Map()),
        "acceptance": Obj({"lengths": List(Int(ge=1)), "n_tokens": Int(ge=1),
                           "rows": List(Obj({"spec": Str(), "label": Str(), "perplexity": Map(_OBJECTIVE)}))})},
        name="a rope-patch tune search log"),
)
BEST = Kind(
    "best.json", fix="Run the same `rope-patch tune ... --resume` again: it rewrites best.json from search_log.json.",
    spec=Obj({"scheme": Str(nonempty=True), "spec": Str(nonempty=True), "params": Map(),
              "objective": Num(special=True), "target": Int(ge=2)},
             {"index": Int(ge=0), "perplexity": _OBJECTIVE, "needle_perplexity": _OBJECTIVE,
              "passkey_accuracy": Opt(Fraction())},
             name="a rope-patch tune best.json"),
)
RECIPE_CONFIG = Kind(
    "recipe config", parse="yaml",
    fix="Fix the YAML file (recipes/configs/*.yaml show every key, with the launch command in their header).",
    spec=Obj({}, name="a mapping of sections (model, output_dir, lora, data, train, ...)"),
)
PRETRAIN_CONFIG = Kind(
    "pretrain config", parse="yaml",
    fix="Fix the YAML file (recipes/configs/pretrain_tiny.yaml shows every key).",
    spec=Obj({
        "seed": Int(ge=0), "output_dir": Str(nonempty=True), "heldout_path": Str(nonempty=True),
        "heldout_max_bytes": Int(ge=1),
        "model": Obj({"hidden_size": Int(ge=1), "num_hidden_layers": Int(ge=1), "num_attention_heads": Int(ge=1),
                      "num_key_value_heads": Int(ge=1), "intermediate_size": Int(ge=1),
                      "max_position_embeddings": Int(ge=1), "rope_theta": Num(gt=0), "tie_word_embeddings": Bool()}),
        "tokenizer": Obj({"vocab_size": Int(ge=8)}),
        "train": Obj({"seq_len": Int(ge=8), "batch_size": Int(ge=1), "steps": Int(ge=1), "lr": Num(gt=0),
                      "min_lr_ratio": Fraction(), "warmup_steps": Int(ge=0), "weight_decay": Num(ge=0),
                      "betas": List(Fraction(), min_len=2), "grad_clip": Num(gt=0), "answer_loss_weight": Num(gt=0),
                      "log_every": Int(ge=1), "eval_every": Int(ge=1), "threads": Int(ge=1),
                      "passkey_curriculum": List(Obj({"until_step": Int(ge=1), "fraction": Fraction(),
                                                      "min_tokens": Int(ge=1), "max_tokens": Int(ge=1)}))}),
        "eval": Obj({"passkey_samples": Int(ge=1), "heldout_tokens": Int(ge=1)}),
    }, {"init_from": Str(nonempty=True)}, name="a pretrain_tiny config"),
)


FINGERPRINTS = Kind(
    "fingerprint cache", fix="It is a cache: delete it, and the digests are computed again (fingerprint.py).",
    spec=Map(Obj({"size": Int(ge=0), "mtime_ns": Int(ge=0), "sha256": Str(nonempty=True)})),
)


# ---- reading ------------------------------------------------------------------------------------------------------
def parse_text(path: str | os.PathLike, kind: Kind) -> Any:
    """The parsed content of `path` (JSON, or YAML for the recipe configs), or a FileFormatError for a missing,
    empty, binary, truncated or unparsable file."""
    file = Path(path)
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} does not exist (expected {kind.name}). {kind.fix}") from None
    except IsADirectoryError:
        raise FileFormatError(file, None, f"a {kind.name} file", "a directory", kind.fix) from None
    if not raw.strip():
        raise FileFormatError(file, None, f"{kind.name}", f"an empty file ({len(raw)} bytes)", kind.fix,
                              message=f"{file} is empty ({len(raw)} bytes), not {_article(kind.name)}: an interrupted "
                                      f"write or copy? {kind.fix}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileFormatError(file, None, "UTF-8 text", f"binary data ({err.reason} at byte {err.start})", kind.fix,
                              message=f"{file}: not UTF-8 text ({err.reason} at byte {err.start}): the file is corrupt "
                                      f"or is not {_article(kind.name)}. {kind.fix}") from None
    if kind.parse == "yaml":
        import yaml  # the recipes' configs only (the package reads no YAML of its own)

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or type(err).__name__
            raise FileFormatError(file, None, "YAML", f"{problem}{where}", kind.fix,
                                  message=f"{file}: not valid YAML ({problem}{where}). {kind.fix}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise FileFormatError(file, None, "JSON", err.msg, kind.fix,
                              message=f"{file}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}, "
                                      f"char {err.pos}): the file is corrupt or truncated (an interrupted write or "
                                      f"copy?), or is not {_article(kind.name)}. {kind.fix}") from None


def check(data: Any, kind: Kind, path: str | os.PathLike = "") -> Any:
    """`data` (parsed from `path`) checked against `kind`; returns it unchanged."""
    file = str(path) or f"the {kind.name}"
    if kind.version is not None:
        kind.version(data, file)
    if kind.format is not None:
        got = data.get("format") if isinstance(data, dict) else None
        if got != kind.format:
            family = kind.format.rsplit("/", 1)[0] + "/"
            if isinstance(got, str) and got.startswith(family):
                from ._version import __version__

                raise FileFormatError(file, "format", json.dumps(kind.format), describe(got),
                                      "Upgrade rope_patch (pip install -U rope_patch) to read it.",
                                      message=f"{file} has format {got!r}, newer than the {kind.format!r} this "
                                              f"rope_patch {__version__} reads. Upgrade rope_patch (pip install -U "
                                              "rope_patch) to read it.")
            raise FileFormatError(file, "format", json.dumps(kind.format), describe(got) if isinstance(data, dict)
                                  else describe(data), kind.fix,
                                  message=f"{file} is not {_article(kind.spec.expected)} (format "
                                          f"{got if isinstance(data, dict) else describe(data)!r}, expected "
                                          f"{kind.format!r}). {kind.fix}")
    try:
        kind.spec(data, "")
        if kind.rules is not None:
            kind.rules(data)
    except _Bad as bad:
        raise _error(file, kind, bad) from None
    return data


def problem(spec: Spec, value: Any) -> str | None:
    """None when `value` fits `spec`, else what was expected ("an integer >= 1"): for checks of values that come from
    elsewhere than a file (a recipe config given as a dict)."""
    try:
        spec(value, "")
    except _Bad as bad:
        return bad.expected
    return None


def read(path: str | os.PathLike, kind: Kind) -> Any:
    """Read and check one file of `kind`: the one reader of every file rope_patch writes."""
    return check(parse_text(path, kind), kind, path)


def _error(file: str, kind: Kind, bad: _Bad) -> FileFormatError:
    if bad.missing:
        keys = ", ".join(map(repr, bad.missing))
        where = f"{file}: {bad.field!r}" if bad.field else file
        s = "s" * (len(bad.missing) > 1)
        return FileFormatError(file, _at(bad.field, bad.missing[0]), bad.expected, "nothing", kind.fix,
                               message=f"{where} lacks the required key{s} {keys} ({_article(bad.expected)} holds "
                                       f"them): it was not written by rope_patch or was edited. {kind.fix}")
    if not bad.field:
        return FileFormatError(file, None, bad.expected, describe(bad.value), kind.fix,
                               message=f"{file}: expected {bad.expected}, found {describe(bad.value)}. {kind.fix}")
    return FileFormatError(file, bad.field, bad.expected, describe(bad.value), kind.fix)


def _article(text: str) -> str:
    return text if text.split(" ", 1)[0] in ("a", "an", "the", "one") else \
        f"{'an' if text[:1].lower() in 'aeiou' else 'a'} {text}"
