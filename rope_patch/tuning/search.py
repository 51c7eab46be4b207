"""`tune`: search a scheme's parameters for one model at one target length, logging every evaluation, then measure
the best one (and the baselines) on the acceptance part of the held-out text.

    model, tokenizer = rope_patch.zoo.load_model("tiny")
    ids, info = read_tokens(tokenizer)
    log = tune(model, tokenizer, ids, TuneOptions(scheme="longrope", target=1024), log_path="out/search_log.json")
    log["best"]["spec"]      # ready for rope_patch.apply

longrope: LongRoPE's evolutionary search (evolution.py) of the long factors; the result is a `longrope` spec with
short factors 1 (see evolution.py for what is and is not searched). Every other scheme: grid or random search of its
scalar parameters (scalar.py). The log format and how resuming works: log.py; the text split and the objective:
objective.py.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..api import as_scheme
from ..discovery import find_target
from ..evaluation.common import versions
from ..evaluation.passkey import CHAT_TEMPLATE_MODES, check_haystack, prompt_form, use_chat_template
from ..evaluation.results import json_safe
from ..files import write_text_atomic
from ..registry import canonical_name
from ..schema import SEARCH_METHODS as METHODS
from ..specs import scheme_label
from ..suggest import pretraining_window
from .evolution import EvolutionSettings, evolve, initial_factors
from .log import SearchLog, check_resumable
from .objective import SPLIT_FRACTION, Objective, perplexities, spec_of, split_heldout
from .scalar import Space, check_candidates, check_space, default_space, grid_points, random_points, scalar_search

# METHODS (`--method`): schema.SEARCH_METHODS, torch-free for the command line.


# what a search minimises: the tuning text's perplexity, or LongRoPE2's needle-driven perplexity (objective.py)
OBJECTIVES = ("perplexity", "needle")


@dataclasses.dataclass
class TuneOptions:
    scheme: str
    target: int
    method: str | None = None  # default: evolution for longrope, grid otherwise
    space: Space | None = None  # scalar schemes (default: scalar.default_space)
    samples: int = 20  # random search: points drawn
    evolution: EvolutionSettings = dataclasses.field(default_factory=EvolutionSettings)
    n_tokens: int | None = None  # tuning tokens per evaluation (default 4 windows of the target)
    passkey_weight: float = 0.0
    objective: str = "perplexity"  # or "needle": LongRoPE2's needle-driven perplexity (tuning/objective.py)
    passkey_samples: int = 4
    depths: Sequence[float] = (0.1, 0.5, 0.9)
    haystack: str = "prose"  # the passkey term's: the tuning text, or "noise" (passkey.NOISE)
    chat_template: str = "auto"  # the passkey term's prompts: auto | on | off, as in `rope-patch compare`
    seed: int = 0
    max_evals: int | None = None
    budget_minutes: float | None = None
    split_fraction: float = SPLIT_FRACTION
    # evolution: frequency-scheme specs seeding the population (default PI, NTK, YaRN ×s)
    init: Sequence[str] | None = None


def longrope_params(long_factor: Sequence[float], scale: float, window: int) -> dict:
    """The `longrope` parameters of a searched individual: short factors 1 (in-window behaviour kept), the searched
    long factors, factor s and the window L (transformers then applies the attention factor √(1 + ln s / ln L))."""
    return {"short_factor": [1.0] * len(long_factor), "long_factor": list(long_factor), "factor": float(scale),
            "original_max_position_embeddings": int(window)}


def model_info(model, spec: str | None = None) -> dict:
    return {"spec": spec, "model_type": model.config.model_type, "window": pretraining_window(model),
            "n_params": sum(p.numel() for p in model.parameters()),
            # the weights' precision: an objective is comparable (and a log resumable) only within one
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "rotary_dim": next(iter(find_target(model).contexts().values())).rotary_dim}


def check_options(options: TuneOptions) -> tuple[str, str]:
    """(canonical scheme, method): the checks that need no model, so a command line fails before loading one."""
    name = canonical_name(options.scheme)
    method = options.method or ("evolution" if name == "longrope" else "grid")
    if method not in METHODS:
        raise ValueError(f"unknown search method {method!r}; use one of {', '.join(METHODS)}.")
    if (method == "evolution") != (name == "longrope"):
        raise ValueError("the evolutionary search is LongRoPE's (--scheme longrope); scalar schemes use --method "
                         f"grid or random (got --scheme {name} --method {method}).")
    check_haystack(options.haystack)
    if options.objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {options.objective!r}: use one of {', '.join(OBJECTIVES)}.")
    if options.chat_template not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"unknown chat-template mode {options.chat_template!r}: use one of "
                         f"{', '.join(CHAT_TEMPLATE_MODES)}.")
    if options.target <= 1:
        raise ValueError(f"--target must be > 1 token, got {options.target}.")
    if options.n_tokens is not None and options.n_tokens < options.target:
        raise ValueError(f"--tokens {options.n_tokens} is less than one window of --target {options.target}: the "
                         f"objective reads whole windows of the target; give --tokens >= {options.target}.")
    if options.max_evals is not None and options.max_evals < 1:
        raise ValueError(f"--max-evals must be >= 1, got {options.max_evals}.")
    if options.budget_minutes is not None and not options.budget_minutes > 0:
        raise ValueError(f"--budget-minutes must be > 0, got {options.budget_minutes}.")
    if method == "evolution":
        if options.space is not None:
            raise ValueError(f"--space is the grid or random search's (KEY=V1,V2,...); the evolutionary search of "
                             f"{name} searches its long factors, shaped by --max-factor and --init. Leave --space out, "
                             "or give --method grid / random to search scalar parameters.")
        for spec in options.init or ():
            if as_scheme(spec).kind != "frequency":
                raise ValueError(f"--init {spec!r}: the initial factors come from a frequency scheme (linear, ntk, "
                                 "yarn, llama3, ...), not an attention-side one.")
        if options.init is not None and not options.init:
            raise ValueError("--init needs at least one spec.")
        options.evolution.resolved(2.0)  # population, parents, ... (the largest factor is checked with the scale)
    elif options.space is not None:
        check_space(name, options.space, method)
        check_candidates(name, options.space)
    if method == "random" and options.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {options.samples}.")
    return name, method


def resolve_options(model, options: TuneOptions) -> tuple[str, str, dict]:
    """(canonical scheme, method, settings for the log); bad options raise ValueError before anything runs."""
    name, method = check_options(options)
    window = pretraining_window(model)
    scale = options.target / window
    prompts = options.passkey_weight > 0 or options.objective == "needle"
    settings = {"scheme": name, "method": method, "target": options.target, "window": window, "scale": scale,
                "n_tokens": options.n_tokens or 4 * options.target, "passkey_weight": options.passkey_weight,
                "passkey_samples": options.passkey_samples if prompts else None,
                "depths": list(options.depths) if prompts else None, "seed": options.seed,
                "max_evals": options.max_evals, "budget_minutes": options.budget_minutes}
    if options.objective == "needle":  # (absent from a perplexity log, as before the needle objective existed)
        settings["objective"] = "needle"
    if method == "evolution":
        if scale <= 1:
            raise ValueError(f"LongRoPE's long factors serve lengths beyond the window: --target must be > {window}.")
        settings["evolution"] = dataclasses.asdict(options.evolution.resolved(scale))
        if options.init is not None:  # (absent from the log when the default PI / NTK / YaRN seed it)
            settings["init"] = list(options.init)
        settings["searched"] = ("long_factor (short_factor fixed at 1: vanilla frequencies inside the window; "
                                "initial-token count n̂ = 0: transformers' longrope cannot express it)")
    else:
        space = options.space if options.space is not None else default_space(name, window, options.target)
        check_space(name, space, method)
        settings["space"] = {k: list(v) if isinstance(v, list) else {"range": list(v)} for k, v in space.items()}
        if method == "random":
            settings["samples"] = options.samples
    return name, method, settings


def planned_evaluations(settings: dict) -> int:
    if settings["method"] == "evolution":
        e = settings["evolution"]
        n = e["population"] + e["generations"] * (e["mutations"] + e["crossovers"])
    elif settings["method"] == "grid":
        n = 1
        for values in settings["space"].values():
            n *= len(values)
    else:
        n = settings["samples"]
    return min(n, settings["max_evals"]) if settings["max_evals"] else n


def _space(settings: dict) -> Space:
    return {k: tuple(v["range"]) if isinstance(v, dict) else list(v) for k, v in settings["space"].items()}


def tune(model, tokenizer, token_ids: Sequence[int], options: TuneOptions, *, log_path: str | Path | None = None,
         previous: dict | None = None, header: dict | None = None,
         on_record: Callable[[dict, bool], None] | None = None, clock: Callable[[], float] = time.monotonic) -> dict:
    """Run (or, with `previous`, resume) the search; returns the log (also written to `log_path` after every
    evaluation). `header` adds fields to the log (the model's name and path, the held-out text's provenance)."""
    name, method, settings = resolve_options(model, options)
    chat = False
    if options.passkey_weight > 0 or options.objective == "needle":  # passkey prompts (absent from a perplexity log)
        chat = use_chat_template(tokenizer, options.chat_template)
        settings.update(haystack=options.haystack, chat_template={"mode": options.chat_template, "used": chat},
                        passkey_prompt=prompt_form(chat))
    tuning_ids, _, split = split_heldout(token_ids, options.split_fraction)
    head = {"model": model_info(model), **(header or {}), "settings": settings, "split": split}
    if previous is not None:
        check_resumable(previous, head, log_path)
    head["versions"] = versions()
    budget = options.budget_minutes * 60 if options.budget_minutes else None
    log = SearchLog(head, log_path, previous=previous, max_evals=options.max_evals, budget_s=budget, clock=clock,
                    on_record=on_record)
    objective = Objective(model, tokenizer, tuning_ids, options.target, settings["n_tokens"],
                          passkey_weight=options.passkey_weight, passkey_samples=options.passkey_samples,
                          depths=options.depths, seed=options.seed, haystack=options.haystack, chat_template=chat,
                          needle=options.objective == "needle")
    window, scale = settings["window"], settings["scale"]
    if method == "evolution":
        def params(factors):
            return longrope_params(factors, scale, window)

        seeds = initial_factors(model, scale, options.init, seq_len=options.target)
        stopped = evolve(log, lambda f: objective(name, params(f)), seeds, options.evolution, scale,
                         seed=options.seed, spec=lambda f: spec_of(name, params(f)))
        if log.data["best"] is not None:  # the log records the searched long factors; the spec is the whole scheme
            log.data["best"]["params"] = params(log.data["best"]["params"]["long_factor"])
    else:
        space = _space(settings)
        points = grid_points(space) if method == "grid" else random_points(space, options.samples,
                                                                            random.Random(options.seed))
        stopped = scalar_search(log, lambda p: objective(name, p), points, lambda p: spec_of(name, p))
    log.finish(stopped)
    return log.data


def baselines(scheme: str, target: int, window: int) -> list[str]:
    """What the searched scheme is measured against: the model as loaded, and for longrope the training-free PI,
    NTK and YaRN at the same scale (LongRoPE's comparison); for a scalar scheme its paper's parameters are not
    guessed here, so only the model as loaded."""
    s = f"{target / window:g}"
    return ["default", f"linear:{s}", f"ntk:{s}", f"yarn:{s}"] if canonical_name(scheme) == "longrope" else ["default"]


def accept(model, token_ids: Sequence[int], log: dict, specs: Sequence[str], *, n_tokens: int | None = None,
           split_fraction: float = SPLIT_FRACTION, log_path: str | Path | None = None,
           on_scheme: Callable[[str], None] | None = None) -> dict:
    """Perplexity at the window and the target on the acceptance part of the held-out text for the best spec of
    `log` and each of `specs`; stored in log["acceptance"] (rewritten after each scheme; rows already there for
    the same lengths and tokens are kept, so a resumed run measures only the missing ones)."""
    settings = log["settings"]
    lengths = sorted({settings["window"], settings["target"]})
    n_tokens = n_tokens or 16 * settings["target"]
    _, acceptance_ids, split = split_heldout(token_ids, split_fraction)
    if split != log["split"]:
        raise ValueError("the held-out text is not the one the search used (the split differs); "
                         "pass the same --heldout.")
    key = {"lengths": lengths, "n_tokens": n_tokens, "tokens": split["acceptance_tokens"]}
    old = log.get("acceptance") or {}
    rows = {r["spec"]: r for r in old.get("rows", [])} if all(old.get(k) == v for k, v in key.items()) else {}
    best = log["best"]
    todo = ([("searched", best["spec"])] if best else []) + [(spec, spec) for spec in specs]
    log["acceptance"] = {**key, "about": "perplexity on the acceptance part of the held-out text (never read by the "
                         "search), non-overlapping windows over the same first n_tokens tokens at every length",
                         "rows": []}
    for label, spec in todo:
        if spec not in rows:
            if on_scheme:
                on_scheme(label)
            ppl = perplexities(model, acceptance_ids, None if spec == "loaded" else spec, lengths, n_tokens)
            rows[spec] = {"spec": spec, "label": "searched " + settings["scheme"] if label == "searched"
                          else scheme_label(spec), "perplexity": {str(k): v for k, v in ppl.items()}}
        log["acceptance"]["rows"].append(rows[spec])
        if log_path is not None:
            _write(log, log_path)
    return log["acceptance"]


def _write(log: dict, path) -> None:
    write_text_atomic(path, json.dumps(json_safe(log), indent=1) + "\n")
