"""`rope-patch compare`: perplexity and passkey retrieval for several schemes on one loaded model.

The model is loaded once; each scheme is applied with `rope_patch.patched`, so the model is back to vanilla
between schemes (and after an error). For every scheme the same text (perplexity) and the same passkey prompts
(same seed) are used, so differences between rows are differences between schemes.

Result JSON (`compare.json`, format "rope_patch.compare/1", checked on reading by schema.COMPARE; `rope-patch plot
results` redraws the plots from it):

    {
      "format": "rope_patch.compare/1",
      "model":    {"spec": "tiny", "name": "tiny", "path": ..., "model_type": "llama", "window": 256,
                   "n_params": ..., "dtype": "float32",
                   "fingerprint": "sha256:..." or null,   # the folder's files (fingerprint.py), what --resume checks
                   "patch": null or {"scheme", "label", "file"}},  # the patch it was loaded with (rope_patch.json)
      "settings": {"lengths": [256, ...], "passkey_lengths": [...], "depths": [0.1, 0.5, 0.9],
                   "passkey_samples": 4, "seed": 0,
                   "ppl_tokens": null,      # null: each length L reads the first windows_at_longest x max(L,
                   "ppl_shared_length": 2048,  # ppl_shared_length) held-out tokens (perplexity.scored_tokens); a
                                            # number N: every length reads the first N (ppl_shared_length null).
                                            # Before 2026-12-06 (no ppl_shared_length): every length read
                                            # ppl_tokens = windows_at_longest x the run's longest length
                   "windows_at_longest": 4,
                   "heldout": {"path", "sha256", "bytes", "tokens"},
                   "chat_template": {"mode": "auto", "used": false},
                   "passkey_prompt": "plain",   # or "chat" (passkey.PROMPT_FORMS; absent before 2026-12-02)
                   "haystack": "prose", "shared_haystack": false,
                   "bucket_size": null,     # null: the default buckets [0, W), [W, 2W), [2W, 4W), ...
                   "budget": null or {"minutes", "estimate_s", "estimate_untrimmed_s", "trimmed", "fits",
                              "passkey_samples", "windows_at_longest", "line", "probe": {"tokens", "s_per_token"}},
                   "machine": {"threads", "cpu_count", "loadavg_start": [1, 5, 15 min], "loadavg_end"},
                   "counts": {"passkey_per_cell", "passkey_cells", "passkey_prompts",
                              "perplexity_windows": {"<length>": n}}},
      "versions": {"rope_patch", "torch", "transformers", "python", "platform", "threads", "commit"},
      "schemes":  [{"spec": "yarn:8", "label": "yarn×8", "name": "yarn", "params": {...}, "commit": ...}, ...],
                  # params: the applied scheme with model-derived defaults filled in (rope_patch.current);
                  # commit: the rope_patch git commit that measured the scheme's newest cells (versions["commit"]
                  # of the run that did; null outside a git checkout or in a file from before 2026-12-07)
      "records":  [{"scheme": "yarn:8", "label", "name", "length", "perplexity", "nll", "n_windows", "n_tokens",
                    "passkey_accuracy" (pooled over depths, null when not run), "passkey_n", "passkey_correct",
                    "passkey_ci_low", "passkey_ci_high" (Wilson 95%)}, ...],
      "passkey":  [{"scheme", "label", "length", "depth", "n", "correct", "accuracy", "ci_low", "ci_high",
                    "shared_prefix", "answers", "outputs"}, ...],
      "buckets":  [{"scheme", "label", "length" (the longest), "start", "end", "n_tokens", "nll", "perplexity"}, ...],
      "elapsed_s": {"total": ..., "<spec>": ...},
      "pending":  ["<spec>", ...]   # schemes not finished yet ([] in a complete result); a file written
                                    # mid-resume still holds the earlier cells of these
    }

`scheme` (the spec as given) is the key that ties records, passkey cells and buckets to `schemes`; `label` is for
display. Perplexities are plain floats (inf when exp overflows, written as the JSON string "inf").

`rope-patch compare` rewrites compare.json (atomically: a temporary file, then `os.replace`) after every finished
scheme, so an interrupted or failed run leaves a valid file of the schemes that finished; `--resume` reads it back
and evaluates only the scheme x length cells that are missing (`run_compare(..., resume=)`). A perplexity cell is
reused only where it read the tokens this run reads at its length (its `n_windows`: the first n_windows x L tokens
of the same held-out text); a cell of a file written under the earlier rule (windows x the run's longest length at
every length) that read others is measured again, and a warning says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from .. import api
from ..api import original_config
from ..files import portable
from ..fingerprint import model_fingerprint
from ..specs import is_bare, parse_scheme_spec, scheme_label, stack_parts
from ..suggest import pretraining_window, specs_for_target
from .budget import fit_budget, probe_cost, run_seconds
from .common import read_tokens, versions
from .defaults import (
    AS_LOADED,
    DEFAULT_LENGTHS,
    DEFAULT_SCHEMES,
    PASSKEY_SAMPLES,
    PPL_SHARED_LENGTH,
    SEED,
    WINDOWS_AT_LONGEST,
)
from .loading import loaded_patch
from .passkey import PROMPT_FORMS, check_haystack, haystack_filler, prompt_form, use_chat_template
from .perplexity import check_lengths, evaluate_perplexity, fixed_buckets, perplexity_work, scored_tokens
from .results import FORMAT, json_safe
from .retrieval import DEFAULT_DEPTHS, accuracy_by_length, evaluate_passkey, make_cell, wilson_interval

# DEFAULT_SCHEMES, AS_LOADED (the model as loaded: the baseline row) and DEFAULT_LENGTHS live in .defaults, which
# imports nothing: the command line shows them before it imports torch. They are imported from here as before.

logger = logging.getLogger("rope_patch")


def _shipped_scaling(model) -> str | None:
    """The rope_type a checkpoint ships with when it is a scaling, else None: read from the config as loaded before
    any patch (a folder saved with a yarn patch ships plain RoPE; its yarn is the patch's)."""
    params = original_config(model)["rope_parameters"] or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):  # per layer type: the first
        params = next((params[k] for k in sorted(params) if params[k]), {})
    rope_type = params.get("rope_type", "default")
    return None if rope_type == "default" else rope_type


def _row_label(spec: str, scheme, shipped: str | None, patch: dict | None = None) -> str:
    if scheme is None:
        return f"as loaded ({patch['label'] if patch else shipped or 'RoPE'})"
    if shipped and scheme.name == "default":
        return "unscaled RoPE" + (f" θ={scheme.rope_theta:g}" if scheme.rope_theta is not None else "")
    return scheme_label(spec)


def parse_schemes(specs: Sequence[str]) -> list[tuple[str, object]]:
    """Validate every spec before anything runs: [(spec, Scheme or None for `loaded`)]; ValueError/TypeError name
    the bad spec."""
    _once(specs)
    out = []
    for spec in specs:
        with _bad_spec(spec):
            out.append((spec, None if spec == AS_LOADED else parse_scheme_spec(spec)))
    return out


def check_specs(specs: Sequence[str], *, sized_by_target: bool = False) -> None:
    """What `parse_schemes` checks, before the model loads. `sized_by_target` (compare --target N): a bare name, or a
    bare part of a stack (`yarn`, `yarn+logn`), gets its parameters from rope_patch.suggest once the model is loaded
    (`schemes_for_target`), so only its name is checked here (the spec grammar did); every part given with parameters
    is built as `apply()` builds it, and a spec without bare parts as a whole."""
    if not sized_by_target:
        parse_schemes(specs)
        return
    _once(specs)
    for spec in specs:
        if spec == AS_LOADED:
            continue
        with _bad_spec(spec):
            parts = stack_parts(spec)
            given = [part for part in parts if not is_bare(part)]
            for part in [spec] if len(given) == len(parts) else given:
                parse_scheme_spec(part)


def schemes_for_target(model, target_length: int, specs: Sequence[str] | None = None) -> list[str]:
    """The schemes of `rope-patch compare --target N`: `rope_patch.suggest.specs_for_target` (bare names and bare
    parts of a stack sized for N, the rest as given). A bare name that needs parameters and that suggest does not size
    for N on this model (longrope, p_rope; yarn for N <= L) is a ValueError that says so and what to give."""
    if specs is None:
        return specs_for_target(model, target_length)
    out = specs_for_target(model, target_length, list(specs))
    for spec, now in zip(specs, out, strict=True):
        for part in () if now == AS_LOADED else stack_parts(now):
            if is_bare(part):  # left bare by suggest: it must build without parameters
                try:
                    parse_scheme_spec(part)
                except (ValueError, TypeError) as err:
                    raise ValueError(
                        f"Scheme {spec!r}: rope_patch.suggest has no parameters for {part!r} at a "
                        f"{target_length}-token target on this model, and it needs them: {err} Give them in the "
                        "spec, or drop it.") from None
    return out


def _once(specs: Sequence[str]) -> None:
    seen = set()
    for spec in specs:
        if spec in seen:
            raise ValueError(f"Scheme {spec!r} is listed twice.")
        seen.add(spec)


@contextlib.contextmanager
def _bad_spec(spec: str) -> Iterator[None]:
    """A ValueError/TypeError raised inside names `spec` and the forms a spec takes."""
    try:
        yield
    except (ValueError, TypeError) as err:
        raise type(err)(f"Bad scheme spec {spec!r}: {err} Specs look like `yarn`, `yarn:8` or "
                        "`yarn:factor=8,beta_fast=16`.") from None


PASSKEY_ANSWER = 32  # positions past a passkey prompt that its decoding may reach (check_schemes)


def check_schemes(model, parsed: Sequence[tuple[str, object]], longest: int | None = None) -> None:
    """Apply and remove each scheme once, so that a scheme this model refuses (a LongRoPE list of the wrong
    length, a frequency scheme on a model whose config forbids it, ...), or one that cannot run `longest` positions
    (a learned table's rows), fails before the first evaluation instead of after the schemes before it ran. The model
    is unpatched afterwards, also on error."""
    kind = getattr(model.config, "model_type", None) or type(model).__name__
    for spec, scheme in parsed:
        if scheme is None:  # the model as loaded
            continue
        try:
            with api.patched(model, scheme):
                limit = api.current(model).longest_input()
        except (ValueError, TypeError) as err:
            raise type(err)(f"Scheme {spec!r} cannot be applied to this model ({kind}): {err} "
                            "Fix it or drop it from the schemes.") from None
        if limit is not None and longest is not None and longest > limit:
            raise ValueError(f"Scheme {spec!r} runs at most {limit} positions on this model (its table's rows), and "
                             f"this run's inputs reach {longest} (the longest length; a passkey prompt followed by "
                             f"its answer): give it a larger table (e.g. max_position_embeddings={longest}), shorter "
                             "lengths, or drop it from the schemes.")


def check_passkey_prompts(tokenizer, token_ids, lengths, depths, seed, chat_template: bool = False,
                          haystack: str = "prose") -> None:
    """Build one passkey prompt per (length, depth): a length too short for the prompt fails now, not mid-run."""
    for L in lengths:
        filler = haystack_filler(tokenizer, haystack, token_ids, L)  # tokenized once per length
        for d in depths:
            make_cell(tokenizer, filler, L, d, 1, seed, chat_template=chat_template)


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not on every platform
        return None


def _json_params(params: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


# What must be equal for a cell of an earlier run to stand in a new one (the lengths and schemes may differ). The
# fingerprint (fingerprint.py: the weights, config, tokenizer and saved patch) is compared where both runs have one;
# results written before it existed are matched on the rest (cli/compare.py says so). A loaded patch (rope_patch.json)
# shows in the `loaded` row's params, which _reusable compares per scheme; the tokens a perplexity cell read, its
# n_windows (with the held-out text, compared here), per cell too: no setting decides them alone.
_SAME_MODEL = ("path", "model_type", "window", "n_params", "dtype", "fingerprint")
_SAME_SETTINGS = ("depths", "passkey_samples", "seed", "chat_template_used", "passkey_prompt",
                  "haystack", "shared_haystack", "bucket_size")
# What a result written before a setting existed ran with.
_SETTING_DEFAULTS = {"chat_template_used": False, "haystack": "prose", "shared_haystack": False, "bucket_size": None}


def _setting(settings: dict, key: str):
    if key == "chat_template_used":
        return (settings.get("chat_template") or {}).get("used", False)
    if key == "passkey_prompt" and key not in settings:  # written before the lead-in moved to the assistant turn
        return PROMPT_FORMS[2] if _setting(settings, "chat_template_used") else PROMPT_FORMS[0]
    return settings.get(key, _SETTING_DEFAULTS.get(key))


def resume_mismatch(previous: dict, result: dict) -> str | None:
    """Why the cells of `previous` (a compare result) cannot be reused in `result` (same shape), or None."""
    if previous.get("format") != FORMAT:
        return f"it is not a {FORMAT} result"
    # as written (paths inside the home directory as `~/...`, files.portable), whichever machine wrote `previous`
    old_model, new_model = portable(previous.get("model", {})), portable(result["model"])
    diffs = [_model_change(k, old_model.get(k), new_model.get(k)) for k in _SAME_MODEL
             if old_model.get(k) != new_model.get(k) and (k != "fingerprint" or old_model.get(k) is not None)]
    old_settings = previous.get("settings", {})
    # where the lead-in sat matters only to passkey cells (a perplexity-only run has none to mix)
    both_passkey = bool(old_settings.get("passkey_lengths")) and bool(result["settings"].get("passkey_lengths"))
    diffs += [f"{k} {_setting(old_settings, k)!r} -> {_setting(result['settings'], k)!r}" for k in _SAME_SETTINGS
              if _setting(old_settings, k) != _setting(result["settings"], k)
              and (k != "passkey_prompt" or both_passkey)]
    old_text = {k: v for k, v in (previous.get("settings", {}).get("heldout") or {}).items() if k != "path"}
    new_text = {k: v for k, v in result["settings"]["heldout"].items() if k != "path"}
    if old_text != new_text:
        diffs.append("held-out text")
    return "; ".join(diffs) or None


def _model_change(key: str, old, new) -> str:
    if key == "fingerprint":
        return ("the model's files (weights, config, tokenizer or saved patch) changed since those cells were measured "
                f"(fingerprint {str(old)[:19]}... -> {str(new)[:19]}...)")
    return f"model {key} {old!r} -> {new!r}"


def _cells_left(previous: dict | None, spec: str, lengths, passkey_lengths,
                windows: dict[int, int]) -> tuple[list[int], list[int]]:
    """(perplexity lengths, passkey lengths) that `spec` has no cell for in `previous`, for the time estimate (before
    the scheme is applied, so matched on the spec alone)."""
    done = _reusable(previous, spec, windows=windows)
    return ([L for L in lengths if L not in done["ppl"]], [L for L in passkey_lengths if L not in done["passkey"]])


def _windows(token_count: int, lengths, windows_at_longest: int, ppl_tokens: int | None) -> dict[int, int]:
    """The perplexity windows this run reads at each length (`perplexity.scored_tokens`)."""
    return {L: scored_tokens(L, token_count, windows_at_longest, ppl_tokens) // L for L in lengths}


def _reusable(previous: dict | None, spec: str, params: dict | None = None,
              windows: dict[int, int] | None = None) -> dict:
    """The finished cells of `spec` in `previous`: {"ppl": {L: record}, "passkey": {L: [rows]}, "buckets": {L: rows},
    "elapsed": s, "other_tokens": {L: n_windows}, "commit": the commit that measured them}; empty when the spec was
    not run or (given `params`) resolved to other parameters. Given `windows` ({L: n}), a perplexity cell counts only
    where it read n windows at L, the tokens this run reads there; the others are listed in "other_tokens"."""
    cells = {"ppl": {}, "passkey": {}, "buckets": {}, "elapsed": 0.0, "other_tokens": {}, "commit": None}
    if not previous:
        return cells
    old = next((s for s in previous.get("schemes", []) if s["spec"] == spec), None)
    if old is None or (params is not None and old.get("params") != json.loads(json.dumps(json_safe(params)))):
        return cells
    cells["commit"] = old.get("commit")
    for r in previous.get("records", []):
        if r["scheme"] == spec and r.get("n_windows"):
            if windows is not None and r["length"] in windows and r["n_windows"] != windows[r["length"]]:
                cells["other_tokens"][r["length"]] = r["n_windows"]
                continue
            cells["ppl"][r["length"]] = r
    for r in previous.get("passkey", []):
        if r["scheme"] == spec:
            cells["passkey"].setdefault(r["length"], []).append(r)
    for b in previous.get("buckets", []):
        if b["scheme"] == spec and b["length"] not in cells["other_tokens"]:  # a length's buckets come from its cell
            cells["buckets"].setdefault(b["length"], []).append(b)
    cells["elapsed"] = float(previous.get("elapsed_s", {}).get(spec, 0.0))
    return cells


@torch.no_grad()
def run_compare(model, tokenizer, schemes: Sequence[str] = DEFAULT_SCHEMES, lengths: Sequence[int] = DEFAULT_LENGTHS, *,
                passkey_lengths: Sequence[int] | None = None, depths: Sequence[float] = DEFAULT_DEPTHS,
                passkey_samples: int = PASSKEY_SAMPLES, windows_at_longest: int = WINDOWS_AT_LONGEST,
                ppl_tokens: int | None = None, seed: int = SEED,
                heldout: str | Path | None = None, token_ids: Sequence[int] | None = None, model_spec: str = "",
                model_path: str = "", progress: Callable[[int, str], None] | None = None,
                resume: dict | None = None, on_scheme: Callable[[dict], None] | None = None,
                chat_template: str | bool = "auto", haystack: str = "prose", shared_haystack: bool = False,
                bucket_size: int | None = None,
                budget_minutes: float | None = None, on_plan: Callable[[dict], None] | None = None,
                ) -> dict:
    """Run perplexity and passkey for each scheme; returns the result dict described in the module docstring.

    `passkey_lengths` defaults to `lengths` (pass [] to skip passkey). `token_ids` overrides the held-out file.
    `progress(tokens_done, description)` is called as work completes; `work_units(...)` gives the total.

    Everything that can be checked is checked before the first evaluation: the specs, each scheme applied to this
    model, the held-out size and one passkey prompt per length. `on_scheme(result)` is called after each finished
    scheme with the result so far (a complete, valid result of the schemes done; `pending` lists the rest): the
    command line writes it to disk, so an interruption or a late error keeps what finished. `resume`: an earlier
    result of the same model and settings (`resume_mismatch` says otherwise: ValueError); its scheme x length cells
    are reused and only the missing ones are evaluated (`resumed_units` is the work they save).

    `chat_template` ("auto" | "on" | "off"; auto: on when the tokenizer has one) frames every passkey prompt with
    the tokenizer's chat template; `haystack` "prose" hides the key in the held-out text, "noise" in the passkey
    paper's repeated lines (`passkey.NOISE`; perplexity still reads the held-out text); `shared_haystack` gives the
    prompts of a cell one haystack so that the part before the needle is prefilled once (`retrieval`); `bucket_size` N:
    perplexity buckets of N positions. With `budget_minutes` or `on_plan`, one timed probe forward estimates the run
    (`budget`); `budget_minutes` trims passkey samples per cell, then perplexity windows, to fit, and `on_plan(plan)`
    gets the plan (its "line" says it in one sentence) before the first evaluation. The plan is recorded in
    settings.budget.
    """
    chat = use_chat_template(tokenizer, chat_template)  # ValueError for an unknown mode or "on" without a template
    if budget_minutes is not None and not budget_minutes > 0:
        raise ValueError(f"budget_minutes must be a positive number of minutes, got {budget_minutes!r}.")
    parsed = parse_schemes(schemes)
    shipped = _shipped_scaling(model)
    patch = loaded_patch(model, model_path)  # a folder saved with its patch: what `loaded` measures
    if (shipped or patch) and AS_LOADED not in [spec for spec, _ in parsed]:
        parsed.insert(0, (AS_LOADED, None))
    lengths = sorted(set(int(x) for x in lengths))
    passkey_lengths = lengths if passkey_lengths is None else sorted(set(int(x) for x in passkey_lengths))
    left_out = _left_out(resume, [spec for spec, _ in parsed], lengths, passkey_lengths)
    if left_out:
        raise ValueError(f"The earlier results hold {left_out} that this run leaves out, and the results it writes "
                         "would hold this run's alone: list them again (schemes and lengths may be added, not "
                         "dropped), or write to another --out. Nothing has been evaluated yet.")
    if token_ids is None:
        token_ids, held = read_tokens(tokenizer, heldout)
    else:
        held = {"path": None, "tokens": len(token_ids)}
    if bucket_size is not None:
        fixed_buckets(lengths[-1], bucket_size)  # a size outside [1, longest] fails now
    if ppl_tokens is not None and ppl_tokens > len(token_ids):
        raise ValueError(f"The held-out text has {len(token_ids)} tokens; {ppl_tokens} requested for perplexity.")
    if ppl_tokens is None and windows_at_longest * lengths[-1] > len(token_ids):
        raise ValueError(f"The held-out text has {len(token_ids)} tokens; {windows_at_longest} perplexity windows at "
                         f"length {lengths[-1]} need {windows_at_longest * lengths[-1]}. Pass fewer windows or a "
                         "longer held-out text.")
    check_lengths(len(token_ids), lengths, windows_at_longest, ppl_tokens)  # ppl_tokens below the longest length
    # the window the model was trained on (a shipped-scaling checkpoint's pre-training window, also under a loaded
    # patch): buckets, stars
    window = pretraining_window(model)
    # a passkey prompt of L tokens is followed by its generated answer: a 5-digit key, 1 more, and with a chat
    # template the lead-in, fewer than PASSKEY_ANSWER tokens with any tokenizer
    check_schemes(model, parsed, max([*lengths, *(L + PASSKEY_ANSWER for L in passkey_lengths)]))
    check_haystack(haystack)
    check_passkey_prompts(tokenizer, token_ids, passkey_lengths, depths, seed, chat, haystack)
    load_start = _loadavg()
    plan = None
    if budget_minutes is not None or on_plan is not None:
        # a resumed run that its budget trimmed goes on with what it ran: re-fitted to the cells left alone, the budget
        # would give back samples (then the earlier cells are refused as other settings) or windows (measured again)
        kept = _trimmed_before(resume, passkey_samples, windows_at_longest) if budget_minutes is not None else None
        if kept is not None:
            passkey_samples, windows_at_longest = kept
        cost = probe_cost(model, token_ids, [*lengths, *passkey_lengths])
        planned = _windows(len(token_ids), lengths, windows_at_longest, ppl_tokens)
        left = [_cells_left(resume, spec, lengths, passkey_lengths, planned) for spec, _ in parsed]

        def estimate(samples: int, windows: int) -> float:
            return sum(run_seconds(cost, len(token_ids), ppl, pk, len(depths), samples, windows, n_tokens=ppl_tokens)
                       for ppl, pk in left)

        plan = fit_budget(estimate, None if budget_minutes is None else 60.0 * budget_minutes, passkey_samples,
                          windows_at_longest, has_passkey=bool(passkey_lengths))
        plan["minutes"] = budget_minutes
        if kept is not None:  # still below what was asked: a further resume keeps them too
            plan["trimmed"] = True
            plan["line"] += (f" Resumed with the earlier run's trimmed settings (passkey samples per cell {kept[0]}, "
                             f"perplexity windows {kept[1]}).")
        first = cost.probed[0] if cost.probed else (None, cost.a)
        plan["probe"] = {"tokens": first[0], "s_per_token": first[1], "a": cost.a, "b": cost.b,
                         "probes": [list(p) for p in cost.probed]}
        passkey_samples, windows_at_longest = plan["passkey_samples"], plan["windows_at_longest"]
        if on_plan is not None:
            on_plan(plan)

    windows = _windows(len(token_ids), lengths, windows_at_longest, ppl_tokens)
    result = {
        "format": FORMAT,
        "model": {"spec": model_spec, "name": model_spec or type(model).__name__, "path": model_path,
                  "model_type": getattr(model.config, "model_type", None), "window": window,
                  "n_params": sum(p.numel() for p in model.parameters()),
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                  "fingerprint": model_fingerprint(model_path) if model_path else None, "patch": patch},
        "settings": {"lengths": lengths, "passkey_lengths": passkey_lengths, "depths": [float(d) for d in depths],
                     "passkey_samples": passkey_samples, "seed": seed, "ppl_tokens": ppl_tokens,
                     "ppl_shared_length": PPL_SHARED_LENGTH if ppl_tokens is None else None,
                     "windows_at_longest": windows_at_longest, "heldout": held,
                     "chat_template": {"mode": str(chat_template) if not isinstance(chat_template, bool)
                                       else ("on" if chat_template else "off"), "used": chat},
                     "passkey_prompt": prompt_form(chat), "haystack": haystack,
                     "shared_haystack": bool(shared_haystack), "bucket_size": bucket_size, "budget": plan,
                     "machine": {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                                 "loadavg_start": load_start, "loadavg_end": None},
                     "counts": {"passkey_per_cell": passkey_samples if passkey_lengths else 0,
                                "passkey_cells": len(passkey_lengths) * len(depths),
                                "passkey_prompts": len(passkey_lengths) * len(depths) * passkey_samples,
                                "perplexity_windows": {str(L): n for L, n in windows.items()}}},
        "versions": versions(),
        "schemes": [], "records": [], "passkey": [], "buckets": [], "elapsed_s": {},
        "pending": [spec for spec, _ in parsed],
    }
    if resume is not None:
        why = resume_mismatch(resume, result)
        if why:
            raise ValueError(f"The earlier results differ from this run ({why}), so their cells cannot be reused. "
                             "Rerun with the same model and settings, or --overwrite (not --resume) to start over.")
    order = [s for s, _ in parsed]
    depth_order = {float(d): i for i, d in enumerate(depths)}
    t_all = time.perf_counter()
    for spec, scheme in parsed:
        t0 = time.perf_counter()
        label = _row_label(spec, scheme, shipped, patch)

        def tick(n, _label=label):
            if progress is not None:
                progress(n, _label)

        with api.patched(model, scheme) if scheme is not None else contextlib.nullcontext():
            applied = api.current(model)
            if applied is None:
                name, params = AS_LOADED, _json_params(original_config(model)["rope_parameters"] or {})
            else:
                name, params = applied.name, _json_params(applied.params())
            done = _reusable(resume, spec, params, windows)
            if done["other_tokens"]:
                _warn_other_tokens(spec, done["other_tokens"], windows)
            todo_ppl = [L for L in lengths if L not in done["ppl"]]
            if lengths[-1] not in todo_ppl and lengths[-1] not in done["buckets"]:
                todo_ppl.append(lengths[-1])  # the position buckets of the longest length were not kept
            todo_pk = [L for L in passkey_lengths if L not in done["passkey"]]
            ppl = evaluate_scheme_perplexity(model, token_ids, todo_ppl, ppl_tokens, window, tick, bucket_size,
                                             windows_at_longest)
            pk = _passkey(model, tokenizer, token_ids, todo_pk, depths, passkey_samples, seed, tick, haystack,
                          chat_template=chat, shared_haystack=shared_haystack)
        ppl_rows = {**{L: r for L, r in done["ppl"].items() if L in lengths},
                    **{r["length"]: r for r in ppl["lengths"]}}
        pk += [r for L in passkey_lengths if L not in todo_pk for r in done["passkey"][L]]
        buckets = ppl["buckets"] if lengths[-1] in todo_ppl else done["buckets"][lengths[-1]]
        ran = bool(todo_ppl or todo_pk)  # a scheme whose cells were all reused keeps the commit that measured them
        result["schemes"].append({"spec": spec, "label": label, "name": name, "params": params,
                                  "commit": result["versions"]["commit"] if ran else done["commit"]})
        acc = accuracy_by_length(pk)
        n_by_len, k_by_len = {}, {}
        for r in pk:
            n_by_len[r["length"]] = n_by_len.get(r["length"], 0) + r["n"]
            k_by_len[r["length"]] = k_by_len.get(r["length"], 0) + r["correct"]
            if "ci_low" not in r:  # a cell of an earlier result, from before the intervals
                r["ci_low"], r["ci_high"] = wilson_interval(r["correct"], r["n"])
        keys = ("length", "n_windows", "n_tokens", "nll", "perplexity")
        for L in lengths:
            row = {k: ppl_rows[L][k] for k in keys}
            result["records"].append({"scheme": spec, "label": label, "name": name, **row,
                                      "passkey_accuracy": acc.get(L), "passkey_n": n_by_len.get(L, 0),
                                      **_pooled(L, k_by_len, n_by_len)})
        for L in passkey_lengths:  # passkey-only lengths still get a record
            if L not in lengths:
                result["records"].append({"scheme": spec, "label": label, "name": name, "length": L,
                                          "perplexity": None, "nll": None, "n_windows": 0, "n_tokens": 0,
                                          "passkey_accuracy": acc.get(L), "passkey_n": n_by_len.get(L, 0),
                                          **_pooled(L, k_by_len, n_by_len)})
        pk.sort(key=lambda r: (r["length"], depth_order.get(r["depth"], 0)))
        result["passkey"] += [{"scheme": spec, "label": label, **{k: v for k, v in r.items() if k not in
                                                                  ("scheme", "label")}} for r in pk]
        result["buckets"] += [{"scheme": spec, "label": label, "length": lengths[-1],
                               **{k: v for k, v in b.items() if k not in ("scheme", "label", "length")}}
                              for b in buckets]
        result["elapsed_s"][spec] = round(done["elapsed"] + time.perf_counter() - t0, 2)
        result["records"].sort(key=lambda r: (order.index(r["scheme"]), r["length"]))
        result["pending"].remove(spec)
        result["elapsed_s"]["total"] = round(time.perf_counter() - t_all, 2)
        result["settings"]["machine"]["loadavg_end"] = _loadavg()
        if on_scheme is not None:
            on_scheme(_with_earlier(result, resume, order))
    result["elapsed_s"]["total"] = round(time.perf_counter() - t_all, 2)
    result["settings"]["machine"]["loadavg_end"] = _loadavg()
    return result


def _left_out(resume: dict | None, specs: Sequence[str], lengths: Sequence[int],
              passkey_lengths: Sequence[int]) -> str | None:
    """The schemes, perplexity lengths and passkey lengths of an earlier result that a resumed run leaves out, in
    words (None: none): the result of the resumed run holds its own schemes and lengths only."""
    if not resume:
        return None
    settings = resume.get("settings") or {}
    parts = []
    for what, old, new in (("scheme(s)", [s["spec"] for s in resume.get("schemes", [])], specs),
                           ("perplexity length(s)", settings.get("lengths") or [], lengths),
                           ("passkey length(s)", settings.get("passkey_lengths") or [], passkey_lengths)):
        gone = [x for x in old if x not in new]
        if gone:
            parts.append(f"{what} {', '.join(map(str, gone))}")
    return "; ".join(parts) or None


def _trimmed_before(resume: dict | None, passkey_samples: int, windows_at_longest: int) -> tuple[int, int] | None:
    """(passkey samples, windows) of an earlier result whose budget trimmed them below these, else None."""
    settings = (resume or {}).get("settings") or {}
    if not (settings.get("budget") or {}).get("trimmed"):
        return None
    samples = min(passkey_samples, settings.get("passkey_samples", passkey_samples))
    windows = min(windows_at_longest, settings.get("windows_at_longest", windows_at_longest))
    return None if (samples, windows) == (passkey_samples, windows_at_longest) else (samples, windows)


def _warn_other_tokens(spec: str, earlier: dict[int, int], windows: dict[int, int]) -> None:
    cells = ", ".join(f"{L} ({n} windows there, {windows[L]} here)" for L, n in sorted(earlier.items()))
    logger.warning(f"rope_patch: the earlier result's perplexity of {spec} at {cells} read other held-out tokens than "
                   "this run reads at those lengths (written when every length read windows x the run's longest "
                   "length); measured again, not mixed in.")


def _pooled(length: int, correct: dict, n: dict) -> dict:
    """The pooled passkey count of one length over its depths, with its Wilson 95% interval."""
    if length not in n:
        return {"passkey_correct": None, "passkey_ci_low": None, "passkey_ci_high": None}
    low, high = wilson_interval(correct[length], n[length])
    return {"passkey_correct": correct[length], "passkey_ci_low": low, "passkey_ci_high": high}


def _with_earlier(result: dict, resume: dict | None, order: list[str]) -> dict:
    """`result` plus the earlier run's rows of the schemes still pending, so that a file written mid-resume loses
    none of the cells it was resumed from."""
    carried = [s for s in (resume or {}).get("schemes", []) if s["spec"] in result["pending"]]
    if not carried:
        return result
    keep = {s["spec"] for s in carried}
    out = dict(result)
    rank = {s: i for i, s in enumerate(order)}
    out["schemes"] = sorted([*result["schemes"], *carried], key=lambda s: rank[s["spec"]])
    for key in ("records", "passkey", "buckets"):
        rows = [*result[key], *(r for r in resume.get(key, []) if r["scheme"] in keep)]
        out[key] = sorted(rows, key=lambda r: rank[r["scheme"]]) if key != "records" else \
            sorted(rows, key=lambda r: (rank[r["scheme"]], r["length"]))
    return out


def evaluate_scheme_perplexity(model, token_ids, lengths, n_tokens, window, tick, bucket_size=None,
                               windows_at_longest: int = WINDOWS_AT_LONGEST) -> dict:
    """Perplexity of the applied scheme at `lengths` (none: nothing to do); buckets of the longest of them. Each
    length reads `perplexity.scored_tokens` of its own (`n_tokens`: the first n_tokens at every length)."""
    if not lengths:
        return {"lengths": [], "buckets": []}
    return evaluate_perplexity(model, token_ids, lengths, n_tokens=n_tokens, window=window, progress=tick,
                               bucket_size=bucket_size, windows_at_longest=windows_at_longest)


def _passkey(model, tokenizer, token_ids, lengths, depths, n_samples, seed, tick, haystack="prose", **kw):
    """evaluate_passkey per length, reporting progress in prompt tokens. A noise filler is built per length (its
    size sets where a cell's stretches start), as the rope_passkey_{L} lm-eval task builds it."""
    out = []
    for L in lengths:
        filler = haystack_filler(tokenizer, haystack, token_ids, L)
        out += evaluate_passkey(model, tokenizer, filler, [L], depths, n_samples, seed,
                                progress=lambda n, L=L: tick(n * L), **kw)
    return out


def work_units(n_schemes: int, token_count: int, lengths: Sequence[int], passkey_lengths: Sequence[int] | None = None,
               depths: Sequence[float] = DEFAULT_DEPTHS, passkey_samples: int = 4, windows_at_longest: int = 2,
               ppl_tokens: int | None = None) -> int:
    """Total of the `progress` increments of `run_compare` (tokens processed)."""
    passkey_lengths = lengths if passkey_lengths is None else passkey_lengths
    ppl = perplexity_work(token_count, lengths, ppl_tokens, windows_at_longest)
    pk = sum(L * len(depths) * passkey_samples for L in set(passkey_lengths))
    return n_schemes * (ppl + pk)


def resumed_units(resume: dict | None, specs: Sequence[str], token_count: int, lengths: Sequence[int],
                  passkey_lengths: Sequence[int] | None = None, depths: Sequence[float] = DEFAULT_DEPTHS,
                  passkey_samples: int = 4, windows_at_longest: int = 2, ppl_tokens: int | None = None) -> int:
    """The part of `work_units` that `run_compare(..., resume=resume)` skips (cells already in `resume`)."""
    if not resume:
        return 0
    passkey_lengths = lengths if passkey_lengths is None else passkey_lengths
    windows = _windows(token_count, set(lengths), windows_at_longest, ppl_tokens)
    # the cells that read the tokens this run reads at their length (`_reusable`)
    ppl = {(r["scheme"], r["length"]) for r in resume.get("records", [])
           if r.get("n_windows") and r["n_windows"] == windows.get(r["length"])}
    pk = {(r["scheme"], r["length"]) for r in resume.get("passkey", [])}
    total = 0
    for spec in specs:
        total += sum(windows[L] * L for L in set(lengths) if (spec, L) in ppl)
        total += sum(L * len(depths) * passkey_samples for L in set(passkey_lengths) if (spec, L) in pk)
    return total
