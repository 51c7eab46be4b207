"""The search log: every evaluation of a search, in order, rewritten atomically after each one.

A search is a deterministic function of its settings, its seed and the objective values it has seen. Resuming
therefore replays the search from the start: the k-th evaluation it asks for is answered from the log's k-th record
(after checking that it asks for the same parameters), and evaluation starts for real where the log ends. A resumed
run thus writes exactly the log an uninterrupted run with the same seed writes (`seconds` aside).

Log JSON (format "rope_patch.tune/1"):

    {"format": "rope_patch.tune/1",
     "model": {...}, "settings": {...}, "split": {...}, "versions": {...},
     "evaluations": [{"index", "generation", "origin", "spec", "params", "objective", "perplexity",
                      "needle_perplexity", "passkey_accuracy", "error", "seconds"}, ...],
     "status": "running" | "done" | "stopped",  "stopped": null | "max_evals" | "budget",
     "best": {"index", "spec", "params", "objective", "perplexity"} | null,
     "acceptance": {...} | absent}

`objective` is null for a candidate the scheme refused (its `error` says why); such a record ranks last.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

from .. import schema
from ..evaluation.passkey import PROMPT_FORMS
from ..evaluation.results import json_safe
from ..files import portable, write_text_atomic

FORMAT = schema.SEARCH_LOG_FORMAT
# Keys of the log's "model" that logs written before them lack (check_resumable skips them there).
OPTIONAL_MODEL_KEYS = ("fingerprint", "patch", "dtype")
# Settings a resumed run may change: the stopping rules (a resume usually exists to extend them).
RESUMABLE = ("max_evals", "budget_minutes")


class StopSearch(Exception):  # noqa: N818 - a signal, not an error
    """Raised by `SearchLog.evaluate` when the evaluation budget is spent (`reason`: "max_evals" or "budget")."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def rank(record: dict) -> float:
    """Sort key: the objective, refused candidates (null, NaN) last."""
    value = record.get("objective")
    return value if isinstance(value, (int, float)) and not math.isnan(value) else math.inf


def _plain(obj):
    """The JSON form of `obj` (tuples become lists), as a replayed record holds it."""
    return json.loads(json.dumps(json_safe(obj)))


def load_log(path: str | Path) -> dict:
    """Read a search_log.json back, checked against its schema (`schema.SEARCH_LOG`: a damaged or foreign file raises
    a ValueError naming the file, the field and what to do)."""
    return parse_log(schema.parse_text(path, schema.SEARCH_LOG), path)


def parse_log(data, path: str | Path = "the log") -> dict:
    """A search log from its parsed JSON `data` (checked, "inf"/"nan" objectives made floats again)."""
    schema.check(data, schema.SEARCH_LOG, path)
    for rec in [*data["evaluations"], *([data["best"]] if data["best"] else [])]:
        for key in ("objective", "perplexity", "needle_perplexity"):
            if isinstance(rec.get(key), str):  # "inf" / "nan" as json_safe wrote them
                rec[key] = float(rec[key])
    return data


def load_best(path: str | Path) -> dict:
    """Read a best.json that `rope-patch tune` wrote (checked against `schema.BEST`): {"scheme", "spec", "params",
    "objective", "target", ...}; `spec` is ready for `rope_patch.apply`."""
    data = schema.read(path, schema.BEST)
    if isinstance(data["objective"], str):
        data["objective"] = float(data["objective"])
    return data


def _comparable(settings: dict) -> dict:
    """The settings that must match for a resume. A passkey term's prompts are what count: a log written before
    its haystack / chat-template settings existed hid the key in the tuning text without the template, one written
    before `passkey_prompt` existed put a templated prompt's lead-in in the user turn, and the template mode (auto,
    on) matters only through whether it was used."""
    out = {k: v for k, v in settings.items() if k not in RESUMABLE}
    if out.get("passkey_weight") or out.get("objective") == "needle":
        out.setdefault("haystack", "prose")
        out["chat_template"] = bool((out.get("chat_template") or {}).get("used", False))
        out.setdefault("passkey_prompt", PROMPT_FORMS[2] if out["chat_template"] else PROMPT_FORMS[0])
    return out


def check_resumable(previous: dict, header: dict, path) -> None:
    """A log resumes only a search with the same model, settings and split (the stopping rules may change)."""
    for key in ("model", "split", "heldout"):
        # as written (paths inside the home directory as `~/...`, files.portable), whichever machine wrote `previous`
        old, new = portable(_plain(previous.get(key))), portable(_plain(header.get(key)))
        if key == "model" and isinstance(old, dict) and isinstance(new, dict):
            # a log written before the fingerprint / the loaded patch were recorded is matched on the rest (the
            # search replaces a loaded patch, so its evaluations are relative to the unpatched model either way)
            new = {k: v for k, v in new.items() if k in old or k not in OPTIONAL_MODEL_KEYS}
            if old.get("fingerprint") and old.get("fingerprint") != new.get("fingerprint"):
                raise ValueError(f"cannot resume from {path}: the model's files (weights, config, tokenizer or saved "
                                 f"patch) changed since its evaluations were made (fingerprint "
                                 f"{str(old['fingerprint'])[:19]}... -> {str(new.get('fingerprint'))[:19]}...). Use "
                                 "another --out, or --overwrite (not --resume) starts over.")
        if old != new:
            what = previous.get(key)
            if isinstance(old, dict) and isinstance(new, dict):  # name what differs (e.g. the dtype, --dtype)
                what = "; ".join(f"{k}: {old.get(k)!r} in the log, {new.get(k)!r} now"
                                 for k in sorted(set(old) | set(new), key=str) if old.get(k) != new.get(k))
            raise ValueError(f"cannot resume from {path}: it was written for another {key} ({what}). "
                             "Use another --out, or --overwrite (not --resume) starts over.")
    old = _comparable(previous.get("settings") or {})
    new = _comparable(_plain(header.get("settings")))
    if old != new:
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise ValueError(f"cannot resume from {path}: its settings differ in {', '.join(changed)} "
                         f"(the log has {', '.join(f'{k}={old.get(k)!r}' for k in changed)}). Rerun with the log's "
                         "settings, use another --out, or --overwrite (not --resume) starts over.")


class SearchLog:
    """Records evaluations, answers replayed ones from a previous log and enforces `max_evals` / `budget_s`.

    `budget_s` counts the evaluation seconds recorded in the log, the replayed ones included, so a resumed search
    stops where an uninterrupted one would. `clock` is injectable for tests. `path=None` keeps the log in memory.
    """

    def __init__(self, header: dict, path: str | Path | None = None, *, previous: dict | None = None,
                 max_evals: int | None = None, budget_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_record: Callable[[dict, bool], None] | None = None):
        self.path = Path(path) if path is not None else None
        self.data = {"format": FORMAT, **_plain(header), "evaluations": [], "status": "running", "stopped": None,
                     "best": None}
        if previous is not None and "acceptance" in previous:
            self.data["acceptance"] = previous["acceptance"]
        self.replay = list(previous["evaluations"]) if previous is not None else []
        self.max_evals, self.budget_s, self.clock = max_evals, budget_s, clock
        self.on_record = on_record  # (record, replayed) after each evaluation: progress bars

    # ---- what the search calls ------------------------------------------------------------------------------
    @property
    def evaluations(self) -> list[dict]:
        return self.data["evaluations"]

    def spent_s(self) -> float:
        return sum(r.get("seconds") or 0.0 for r in self.evaluations)

    def evaluate(self, params: dict, spec: str, run: Callable[[], dict], **info) -> float:
        """The objective of one candidate: from the replayed log if it holds this evaluation, else `run()`, which
        returns {"objective", ...} (or {"objective": None, "error": ...}). Raises StopSearch when the budget is
        spent."""
        k = len(self.evaluations)
        params = _plain(params)
        if k < len(self.replay):
            rec = self.replay[k]
            if rec.get("params") != params or rec.get("spec") != spec:
                raise ValueError(f"cannot resume: evaluation {k} of the log is {rec.get('spec')!r} but the search now "
                                 f"asks for {spec!r} (the log comes from another search or version). Use another "
                                 "--out, or --overwrite (not --resume) starts over.")
            self.evaluations.append(rec)
            self._update_best(rec)
            if self.on_record:
                self.on_record(rec, True)
            return rank(rec)
        if self.max_evals is not None and k >= self.max_evals:
            raise StopSearch("max_evals")
        if self.budget_s is not None and self.spent_s() >= self.budget_s:
            raise StopSearch("budget")
        start = self.clock()
        result = run()
        seconds = self.clock() - start
        rec = _plain({"index": k, **info, "spec": spec, "params": params, "objective": None, **result,
                      "seconds": round(seconds, 3)})
        if isinstance(rec.get("objective"), str):
            rec["objective"] = float(rec["objective"])
        self.evaluations.append(rec)
        self._update_best(rec)
        self.write()
        if self.on_record:
            self.on_record(rec, False)
        return rank(rec)

    def _update_best(self, rec: dict) -> None:
        if rank(rec) < math.inf and (self.data["best"] is None or rank(rec) < self.data["best"]["objective"]):
            keys = ("index", "spec", "params", "objective", "perplexity", "needle_perplexity", "passkey_accuracy")
            self.data["best"] = {k: rec[k] for k in keys if k in rec}

    # ---- the end of a search -----------------------------------------------------------------------------------
    def finish(self, stopped: str | None) -> None:
        self.data["status"] = "stopped" if stopped else "done"
        self.data["stopped"] = stopped
        self.write()

    def write(self) -> None:
        if self.path is not None:
            # paths inside the home directory as `~/...` (files.portable): a log names no machine's home
            write_text_atomic(self.path, json.dumps(json_safe(portable(self.data)), indent=1) + "\n")
