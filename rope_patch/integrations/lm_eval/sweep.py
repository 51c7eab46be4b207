"""lm-eval tasks x position-encoding schemes on one model, one lm-eval run per scheme (`rope-patch sweep`).

    rope-patch sweep --model tiny --schemes default yarn:4 dynamic:4 \
        --tasks rope_passkey rope_ppl --lengths 256 1024 --out results/sweep

    from rope_patch.integrations.lm_eval.sweep import SweepOptions, sweep
    state = sweep(SweepOptions(model="tiny", schemes=["default", "yarn:4"], lengths=[256, 1024], out="results/sweep"))

Each scheme runs `rope-patch-lm-eval --model rope_patch --model_args pretrained=MODEL,scheme=...` (in a fresh
process, or under `--launcher "torchrun --nproc_per_node 2"` / `"accelerate launch"`), with

- its own response cache (`--use_cache <out>/schemes/<scheme>/cache`): lm-eval's cache key is the request, not
  the model, so a shared cache would hand one scheme's answers to the next. Within a scheme the cache also
  resumes an interrupted lm-eval run request by request;
- the same task list in the same order for every scheme (RULER draws its samples from the global `random`
  seeded once per run, so the list and its order decide the samples);
- `--log_samples`, for the per-depth passkey / niah grid and the per-sample summary;
- `--output_path <out>/schemes/<scheme>/lm_eval/results.json`: lm-eval's files land in that folder, not in one it
  would name after the model path (outputs.py);
- lm-eval's `--apply_chat_template` when `--chat-template` resolves to on (auto: when the tokenizer has a template,
  as `rope-patch compare` decides): every task's prompt is then the tokenizer's chat turn (RULER's too), and
  `--metadata chat_template=true` builds the rope_passkey / rope_niah prompts as compare's chat prompts, exactly the
  length in the task's name with the template's tokens counted (without it lm-eval adds them on top: 1,053 tokens at
  1024 on SmolLM2).

`rope_passkey`, `rope_ppl`, `rope_niah` expand to one task per `--lengths` entry (`rope_passkey_256`, ...); other
names (lm-eval's own tasks, `niah_single_1`, ...) run as they are, with `--metadata max_seq_lengths=[lengths]` and
`max_length` = the longest length + TEXT_HEADROOM for every scheme (unless `--model-args max_length=` says otherwise):
HFLM cuts longer prompts from the left, and its default, each scheme's own window, would cut vanilla's and not YaRN's.
Perplexity reads `--windows` x max(L, 2048) tokens at a length L, as `rope-patch compare` does (the tasks' own
default), so the numbers equal compare's and do not depend on the other `--lengths`.

lm-eval runs offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE = 1 unless the environment sets them): RULER's tasks
whose haystack is the Hub's essays are refused at plan time unless the dataset is cached (`check_offline_data`).

Resume: a (scheme, task) cell whose result is in `<out>/schemes/<scheme>/cells/` is skipped; one of lm-eval's own tasks
(RULER), which runs every length of `max_seq_lengths` in one cell, only where it ran the lengths asked now (its
`max_seq_lengths`), else it is measured again; a rope_* cell of an earlier version of its task (`outdated`) is
measured again too. A scheme with
missing cells runs only those when every task is a self-seeded `rope_*` task, and its whole task list when any
other task is present (RULER's samples depend on what ran before them in the run).

Output (`<out>/`): per scheme, `schemes/<scheme>/cells/<task>.json` (one finished cell each), `samples.json` (one line
per sample: prompt hash, target, answer, scores; outputs.py) and lm-eval's own files in `lm_eval/` (regenerable and big:
the repository ignores them under eval/results); `sweep.json` (format "rope_patch.sweep/1": settings, schemes, one row
per cell with all of lm-eval's metrics (per length, for RULER run at several), `elapsed_s`: each scheme's lm-eval runs
as recorded in its cells, each run once (`time_spent`), so a resumed sweep keeps them, their `total`, and this call's
`wall`; `machine`: threads and load of the newest run that made a cell), `sweep.md` (scheme x task table of each task's
main metric), and, when the suite has `rope_ppl` / `rope_passkey` cells, the compare-format files
`compare.json/.csv/.md`, `perplexity.png`, `passkey.png` (redraw with `rope-patch plot results`). Paths inside the home
directory are written `~/...` (files.portable). Each cell records the rope_patch commit that measured it (`commit`, as
compare's `schemes[].commit`), and each scheme of `sweep.json` the commit of its newest cell.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers  # a lazy module: AutoTokenizer is imported on first use, not when the CLI starts

from ... import plots as figures
from ... import schema
from ... import zoo as models
from ...api import as_scheme
from ...evaluation.common import source_commit
from ...evaluation.compare import AS_LOADED, parse_schemes
from ...evaluation.compare import FORMAT as COMPARE_FORMAT
from ...evaluation.loading import patch_label
from ...evaluation.passkey import prompt_form, use_chat_template
from ...evaluation.results import json_safe, patch_note, write_results
from ...evaluation.retrieval import wilson_interval
from ...files import portable
from ...fingerprint import model_fingerprint
from ...persistence import MANIFEST, read_manifest
from ...plots.tasks import SWEEP_FORMAT
from ...registry import did_you_mean
from ...specs import scheme_label
from .options import SweepOptions  # noqa: F401  (defined apart: the CLI reads it without torch)
from .outputs import OUTPUT, latest_results, read_cells, write_samples
from .tasks import chat_layout_error, tasks_dir

FORMAT = SWEEP_FORMAT  # defined with its figure (rope_patch.plots.tasks), which the CLI imports without torch
FAMILIES = ("rope_passkey", "rope_ppl", "rope_niah")
MAIN_METRIC = {"rope_passkey": "acc", "rope_niah": "acc", "rope_ppl": "token_perplexity"}


# ---- planning -------------------------------------------------------------------------------------------------
# Tokens of max_length above the longest --lengths for lm-eval's own tasks. HFLM keeps max_length - max_gen_toks
# prompt tokens; RULER builds prompts of length - max_gen_toks tokens, to which a chat template adds its own (~30 on
# SmolLM2): 256 covers a template of up to 256 tokens.
TEXT_HEADROOM = 256


def expand_tasks(tasks, lengths) -> list[str]:
    out = []
    for t in tasks:
        for name in ([f"{t}_{n}" for n in lengths] if t in FAMILIES else [t]):
            if name not in out:
                out.append(name)
    return out


def slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec.replace(":", "-"))


def family(task: str) -> tuple[str | None, int | None]:
    m = re.fullmatch(r"(rope_passkey|rope_ppl|rope_niah)_(\d+)", task)
    return (m.group(1), int(m.group(2))) if m else (None, None)


def _kv(items) -> dict:
    from lm_eval._cli.utils import key_val_to_dict  # lm_eval: optional (the `lm-eval` extra), imported when used

    out = {}
    for item in items:
        out.update(key_val_to_dict(item))
    return out


def scheme_args(spec: str) -> dict:
    """`yarn:4` -> {"scheme": "yarn", "factor": 4} (validated: same errors as apply()); `loaded` -> {} (no scheme=:
    the model as saved, with the patch of its rope_patch.json)."""
    ((_, scheme),) = parse_schemes([spec])
    if scheme is None:
        return {}
    return {"scheme": scheme.name, **{k: list(v) if isinstance(v, tuple) else v for k, v in scheme.params().items()}}


def saved_patch(path: str) -> dict | None:
    """{"scheme", "label", "file"} of the patch a model folder's rope_patch.json records (None: none), as
    evaluation.loading.loaded_patch describes a loaded one; the file is checked (schema.MANIFEST)."""
    manifest = read_manifest(path)
    if manifest is None or manifest["scheme"] is None:
        return None
    scheme = as_scheme(manifest["scheme"], **manifest["params"])
    return {"scheme": scheme.name, "label": patch_label(scheme), "file": str(Path(path) / MANIFEST)}


def _label(spec: str, patch: dict | None) -> str:
    return f"as loaded ({patch['label'] if patch else 'RoPE'})" if spec == AS_LOADED else scheme_label(spec)


def plan(args) -> dict:
    """Settings and schemes of a sweep (`args`: SweepOptions or the CLI's Namespace), everything checked: scheme
    specs, lengths, task names (before anything is created or run)."""
    parse_schemes(args.schemes)  # bad specs fail before anything runs
    if any(L < 8 for L in args.lengths):
        raise ValueError(f"--lengths must be at least 8 tokens each, got {args.lengths}.")
    lengths = sorted(set(args.lengths))
    tasks = expand_tasks(args.tasks, lengths)
    path = str(models.resolve_model_path(args.model))
    # A folder saved with its patch: every lm-eval run loads it with that patch (RopePatchLM), which each scheme
    # replaces; the model as saved is the `loaded` row, first, as `rope-patch compare` puts it.
    patch = saved_patch(path)
    schemes = list(args.schemes)
    if patch and AS_LOADED not in schemes:
        schemes.insert(0, AS_LOADED)
    metadata = {"tokenizer": path, "depths": [float(d) for d in args.depths], "samples": args.passkey_samples,
                "seed": args.seed, "windows": args.windows, "max_seq_lengths": lengths}
    if args.heldout:
        metadata["heldout"] = str(Path(args.heldout).resolve())
    metadata.update(_kv(args.metadata))
    model_args = {"pretrained": path, **_kv(args.model_args)}
    if "max_length" not in model_args and any(not family(t)[0] for t in tasks):
        # lm-eval's own tasks (RULER, ...) go through HFLM's text path, which cuts a prompt longer than max_length
        # from the left, and max_length defaults to each scheme's own window: vanilla would lose the start of a 16k
        # RULER prompt (its needle) where YaRN x2 keeps it. One length for every scheme, long enough for the longest
        # prompt plus the chat template and the answer. (The rope_* tasks are evaluated in full regardless.)
        model_args["max_length"] = lengths[-1] + TEXT_HEADROOM
    include = args.include_path
    if include is None:
        found = tasks_dir()
        include = str(found) if found else None
    if include:
        absent = [t for t in tasks if family(t)[0] and not any(Path(include).rglob(f"{t}.yaml"))]
        if absent:
            raise ValueError(f"No task YAML for {', '.join(absent)} in {include}: the rope_* tasks exist for lengths "
                             "64, 128, ..., 131072 (powers of two); add others to LADDER in "
                             "rope_patch/data/tasks/rope/rope_tasks_utils.py and run "
                             "rope_patch/data/tasks/rope/make_tasks.py.")
    check_ruler_limit(tasks, lengths, args.limit)
    check_task_names([t for t in tasks if not family(t)[0]], include)
    check_offline_data([t for t in tasks if not family(t)[0]], in_process=getattr(args, "in_process", False))
    chat = chat_template_for(model_args.get("tokenizer") or metadata["tokenizer"], args.chat_template)
    given = metadata.pop("chat_template", None)
    error = chat_layout_error(given, chat, f"--chat-template {args.chat_template}")
    if error:
        raise ValueError(error)
    settings = {"model": args.model, "name": models.model_name(args.model), "model_path": path, "tasks": tasks,
                "lengths": lengths, "metadata": metadata,
                "model_args": model_args, "limit": args.limit, "batch_size": str(args.batch_size),
                "apply_chat_template": chat, "include_path": include}
    if chat:  # rope_passkey / rope_niah 2.0 open the assistant turn with the answer's lead-in (`layout_mismatch`)
        settings["rope_prompt"] = prompt_form(True)
        # ... and are built with the template's tokens counted in their length (rope_tasks_utils, `layout_mismatch`)
        metadata["chat_template"] = True
    if patch:  # (absent without one: an unpatched folder's settings, hence its resume fingerprint, stay as they were)
        settings["patch"] = patch
    return {"settings": settings, "schemes": [{"spec": s, "slug": slug(s), "args": scheme_args(s)} for s in schemes]}


def chat_template_for(tokenizer_path: str, mode: str) -> bool:
    """`--chat-template auto|on|off` resolved as `rope-patch compare` resolves it (auto: on when the tokenizer has a
    template), so that a sweep's prompts are framed as compare's are; "on" without a template fails here."""
    if str(mode).lower() == "off":
        return False  # no tokenizer to load
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError) as err:
        raise ValueError(f"--chat-template {mode} reads the tokenizer's template, but no tokenizer loads from "
                         f"{tokenizer_path} ({str(err).splitlines()[0][:200]}). Save the tokenizer with the model, "
                         "or pass --chat-template off.") from None
    return use_chat_template(tokenizer, mode)


def _own_tasks(include) -> list[str]:
    """The rope_* task and group names in the task folder (file stems, as the YAMLs are generated)."""
    names = set(FAMILIES)
    if include:
        names |= {p.stem for p in Path(include).rglob("rope_*.yaml")}
    return sorted(names)


@functools.lru_cache(maxsize=4)
def lm_eval_task_names(include) -> frozenset[str]:
    """Every task, group and tag lm-eval knows, with the task folder included (lm-eval's own index: it reads all
    of lm-eval's task YAMLs, ~10-20 s, so it is only built when a non-rope task is asked for)."""
    from lm_eval.tasks import TaskManager  # lm_eval: optional (the `lm-eval` extra), imported when used

    return frozenset(TaskManager(include_path=include).all_tasks)


def check_task_names(tasks, include) -> None:
    """Unknown task names fail before any scheme runs (lm-eval would fail in every scheme's run), with a "Did you
    mean"; rope_* names are checked against the task folder alone, others against lm-eval's index."""
    own = _own_tasks(include)
    for task in tasks:
        if task in own:
            continue
        if task.startswith("rope_"):
            raise ValueError(f"Unknown task {task!r}: no {task}.yaml in {include or 'the task folder'}."
                             f"{did_you_mean(task, own)} rope-patch's tasks: {', '.join(FAMILIES)} (one per "
                             "--lengths entry) and their _<length> forms.")
        known = lm_eval_task_names(include)
        if task not in known:
            raise ValueError(f"Unknown task {task!r}: neither a rope_* task nor one lm-eval knows."
                             f"{did_you_mean(task, [*own, *known])} rope-patch's tasks: {', '.join(FAMILIES)}; "
                             "`rope-patch-lm-eval ls tasks` lists lm-eval's.")


# lm-eval's RULER tasks that read their haystack from the Hub (Paul Graham's essays), and its group: the sweep runs
# lm-eval offline (`hub_env`), so these fail after the model has loaded unless the dataset is in the local cache.
# (ruler_qa_squad / ruler_qa_hotpot fetch their documents from the web on every run, offline settings or not.)
ESSAYS = "baber/paul_graham_essays"
HUB_DATA = {t: ESSAYS for t in ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multiquery",
                                "niah_multivalue")}
GROUPS = {"ruler": ("niah_single_1", *HUB_DATA, "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe",
                    "ruler_fwe", "ruler_qa_squad", "ruler_qa_hotpot")}
RULER_OFFLINE = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")


def check_ruler_limit(tasks, lengths, limit) -> None:
    """RULER lists its documents length by length (all of `max_seq_lengths`' first length, then the next), and lm-eval's
    --limit keeps the first of them: with several lengths only the shortest would run, and the others would be missing
    from the results without a word. Refused here, before anything runs."""
    ruler = [t for t in tasks if t in GROUPS or any(t in members for members in GROUPS.values())]
    if limit is not None and len(lengths) > 1 and ruler:
        raise ValueError(f"--limit {limit:g} with several --lengths ({', '.join(map(str, lengths))}): RULER's "
                         f"{', '.join(ruler)} list their documents length by length and --limit keeps the first, so "
                         f"only length {min(lengths)} would run. Sweep one length per call (each with its own --out), "
                         "or drop --limit.")


def hub_env(environ=None) -> dict:
    """The environment of a sweep's lm-eval runs: offline unless the caller's environment says otherwise (a run
    must not depend on what the Hub serves today, and on a machine without it the Hub calls only time out)."""
    environ = os.environ if environ is None else environ
    return {**environ, "HF_DATASETS_OFFLINE": environ.get("HF_DATASETS_OFFLINE", "1"),
            "HF_HUB_OFFLINE": environ.get("HF_HUB_OFFLINE", "1")}


def _cached(dataset: str) -> bool:
    """Whether `datasets` finds `dataset` offline: a snapshot in the Hub cache, or a prepared copy in its own."""
    import datasets.config
    import huggingface_hub.constants

    hub = Path(huggingface_hub.constants.HF_HUB_CACHE) / f"datasets--{dataset.replace('/', '--')}"
    own = Path(datasets.config.HF_DATASETS_CACHE) / dataset.replace("/", "___")
    return hub.is_dir() or own.is_dir()


def check_offline_data(tasks, in_process: bool = False, environ=None) -> None:
    """A task that needs a Hub dataset the sweep cannot reach fails here, with the tasks that do run, instead of in
    lm-eval after the model has loaded (and again in every scheme's run)."""
    environ = os.environ if environ is None else environ
    env = environ if in_process else hub_env(environ)  # in this process, the caller's own settings apply
    if not any(str(env.get(k, "")).lower() in ("1", "true", "yes", "on") for k in ("HF_DATASETS_OFFLINE",
                                                                                   "HF_HUB_OFFLINE")):
        return
    for task in tasks:
        needs = sorted({HUB_DATA[t] for t in GROUPS.get(task, (task,)) if t in HUB_DATA})
        missing = [d for d in needs if not _cached(d)]
        if missing:
            what = (f"The group {task!r} includes {', '.join(t for t in GROUPS[task] if t in HUB_DATA)}, which read"
                    if task in GROUPS else f"Task {task!r} reads")
            raise ValueError(f"{what} a haystack from the Hub dataset {', '.join(missing)}, and the sweep runs lm-eval "
                             "offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE) with no copy of it in the local cache. "
                             f"RULER's tasks that run offline: {' '.join(RULER_OFFLINE)}. To run this one, set "
                             "HF_DATASETS_OFFLINE=0 and HF_HUB_OFFLINE=0 on a machine that reaches the Hub.")


def layout_mismatch(old: dict, settings: dict) -> str | None:
    """Why a sweep directory stamped with `old` settings cannot take today's templated rope_passkey / rope_niah cells:
    its own were measured with the 1.0 prompts (no `rope_prompt`), whose lead-in closed the user turn, or with the
    template's tokens on top of the task's length (no metadata `chat_template`). Other tasks' cells, and untemplated
    ones, are the same in all."""
    own = [t for t in old.get("tasks", ()) if family(t)[0] in ("rope_passkey", "rope_niah")]
    if settings.get("rope_prompt") and not old.get("rope_prompt") and own:
        return (f"its {', '.join(own)} cells were measured with the templated prompts of rope_passkey / rope_niah "
                "1.0, whose answer lead-in closed the user turn (2.0 opens the assistant turn with it)")
    if (settings["metadata"].get("chat_template") and not (old.get("metadata") or {}).get("chat_template")
            and old.get("apply_chat_template") and own):
        return (f"its templated {', '.join(own)} cells were measured with prompts longer than their length (the chat "
                "template's tokens added to it; now they are counted in it, as rope-patch compare counts them)")
    return None


def task_version(include, task: str) -> float | None:
    """The `metadata.version` of a rope_* task's YAML in the task folder (None: not found)."""
    for path in Path(include).rglob(f"{task}.yaml") if include else ():
        found = re.search(r"^\s*version:\s*([0-9.]+)\s*$", path.read_text(encoding="utf-8"), re.MULTILINE)
        return float(found.group(1)) if found else None
    return None


def outdated(cell: dict, task: str, include) -> bool:
    """Whether a finished rope_* cell was measured by another version of its task than the folder's (then it is
    measured again, not mixed into this sweep's table). A cell from before cells recorded the version
    (`task_version`) is outdated only for rope_ppl: its word / byte counts were 1.0's (the whole window's text, one
    token more than its log-likelihood covers); the passkey / niah prompts such a cell read are today's plain ones
    (templated ones are `layout_mismatch`'s)."""
    if not family(task)[0]:
        return False
    recorded = cell.get("task_version")
    if recorded is None:
        return family(task)[0] == "rope_ppl"
    current = task_version(include, task)
    return current is not None and float(recorded) != current


def fingerprint(settings: dict) -> str:
    """What makes two runs of a cell comparable (the task list itself may grow between resumed runs)."""
    keep = {k: v for k, v in settings.items() if k not in ("tasks", "lengths", "rope_prompt")}
    # chat_template follows apply_chat_template (kept above); an older stamp without it is `layout_mismatch`'s
    keep["metadata"] = {k: v for k, v in settings["metadata"].items() if k not in ("max_seq_lengths", "chat_template")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---- running one scheme ---------------------------------------------------------------------------------------
def lm_eval_argv(settings: dict, scheme: dict, tasks: list[str], out_dir: Path) -> list[str]:
    argv = ["run", "--model", "rope_patch",
            "--model_args", json.dumps({**settings["model_args"], **scheme["args"]}),
            "--tasks", ",".join(tasks), "--batch_size", settings["batch_size"],
            "--output_path", str(out_dir / OUTPUT), "--log_samples",
            "--use_cache", str(out_dir / "cache" / "responses"),
            "--metadata", json.dumps(settings["metadata"])]
    if settings["include_path"]:
        argv += ["--include_path", settings["include_path"]]
    if settings["limit"] is not None:
        argv += ["--limit", str(settings["limit"])]
    if settings.get("apply_chat_template"):
        argv.append("--apply_chat_template")
    return argv


def run_subprocess(argv: list[str], launcher: str | None, log) -> None:
    base = shlex.split(launcher) if launcher else [sys.executable]
    cmd = [*base, "-m", "rope_patch.integrations.lm_eval.cli", *argv]
    log("$ " + shlex.join(cmd))
    env = hub_env()
    if launcher:
        if not torch.cuda.is_available():  # data parallel on CPU processes (HFLM's accelerator needs to be told)
            env.setdefault("ACCELERATE_USE_CPU", "true")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"lm-eval exited with status {proc.returncode}: {shlex.join(cmd)}")


def run_in_process(settings: dict, scheme: dict, tasks: list[str], out_dir: Path, log) -> None:
    """The same as the subprocess, in this process (tests, quick sweeps): simple_evaluate + lm-eval's writer."""
    # lm_eval: optional (the `lm-eval` extra), imported when used; importing .model registers `rope_patch` with it.
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    from . import model  # noqa: F401

    own = settings["include_path"] and all(
        any(Path(settings["include_path"]).rglob(f"{t}.yaml")) for t in tasks)
    tm = TaskManager(include_path=settings["include_path"], include_defaults=not own,
                     metadata={**settings["model_args"], **scheme["args"], **settings["metadata"]})
    tracker = EvaluationTracker(output_path=str(out_dir / OUTPUT))
    log(f"in-process lm-eval: {scheme['spec']} on {len(tasks)} tasks")
    res = lm_eval.simple_evaluate(model="rope_patch", model_args={**settings["model_args"], **scheme["args"]},
                                  tasks=tasks, task_manager=tm, log_samples=True, limit=settings["limit"],
                                  batch_size=settings["batch_size"], evaluation_tracker=tracker,
                                  apply_chat_template=bool(settings.get("apply_chat_template")),
                                  use_cache=str(out_dir / "cache" / "responses"))
    samples = res.pop("samples")
    tracker.save_results_aggregated(results=res, samples=samples)
    for name in res["configs"]:
        tracker.save_results_samples(task_name=name, samples=samples[name])


# ---- aggregation ------------------------------------------------------------------------------------------------
def main_metric(task: str, metrics: dict, lengths=()):
    fam, _ = family(task)
    if fam:
        return MAIN_METRIC[fam], metrics.get(MAIN_METRIC[fam])
    # RULER names its score by the length (max_seq_lengths), and reports -1 for its default lengths that did not run
    ran = [str(L) for L in lengths if metrics.get(str(L), -1) != -1]
    for key in (*ran, "acc", "exact_match", "word_perplexity", *(k for k in metrics if metrics[k] != -1)):
        if key in metrics and isinstance(metrics[key], (int, float)):
            return key, metrics[key]
    return None, None


def length_scores(task: str, metrics: dict, lengths) -> list[tuple[int, float]]:
    """[(length, score)] of a task that scores each length it ran under the length's name (RULER, run at several
    `max_seq_lengths` in one cell; -1: a length that did not run); [] for the rope_* tasks, whose name is the length."""
    if family(task)[0]:
        return []
    return [(int(L), metrics[str(L)]) for L in lengths
            if isinstance(metrics.get(str(L)), (int, float)) and metrics[str(L)] != -1]


def aggregate(state: dict) -> dict:
    """sweep.json: settings, schemes, rows (scheme x task with every metric; a task that ran several lengths in one
    cell, RULER's, one row per length, its `n_samples` the cell's shared out equally: RULER makes as many documents
    at each length)."""
    rows = []
    for sch in state["schemes"]:
        for task in state["settings"]["tasks"]:
            cell = sch["cells"].get(task)
            if cell is None:
                continue
            scores = length_scores(task, cell["metrics"], state["settings"]["lengths"])
            if len(scores) > 1:
                n = cell.get("n_samples")
                rows += [{"scheme": sch["spec"], "task": task, "family": None, "length": L, "metric": str(L),
                          "value": v, "metrics": cell["metrics"], "n_samples": None if n is None else n // len(scores)}
                         for L, v in scores]
                continue
            fam, length = family(task)
            metric, value = main_metric(task, cell["metrics"], state["settings"]["lengths"])
            if length is None and metric is not None and metric.isdigit():
                length = int(metric)  # a RULER score, named by its length
            rows.append({"scheme": sch["spec"], "task": task, "family": fam, "length": length, "metric": metric,
                         "value": value, "metrics": cell["metrics"], "n_samples": cell.get("n_samples"),
                         **({"by_depth": cell["by_depth"]} if "by_depth" in cell else {})})
    return {"format": FORMAT, "settings": state["settings"],
            "schemes": [{k: v for k, v in s.items() if k != "cells"} for s in state["schemes"]],
            "rows": rows, "elapsed_s": state.get("elapsed_s", {}), "machine": _runs_machine(state)}


def _runs_machine(state: dict) -> dict:
    """The machine of the newest lm-eval run that made a cell (so a re-run that runs nothing leaves it as it was);
    this call's when no cell records one."""
    runs = [c for s in state["schemes"] for c in s["cells"].values() if c.get("run_machine") and c.get("run_id")]
    return max(runs, key=lambda c: c["run_id"])["run_machine"] if runs else _machine()


def _machine() -> dict:
    """Threads, cores and load average when the results were written (the machine is shared: read timings with it)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    return {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "loadavg": load}


def markdown(result: dict) -> str:
    tasks = result["settings"]["tasks"]
    at: dict[str, set] = {}  # the lengths of each task's rows: a column per length where a task ran several
    for r in result["rows"]:
        at.setdefault(r["task"], set()).add(r.get("length"))
    split = {t for t, ls in at.items() if len(ls) > 1}
    columns = [(t, L) for t in tasks
               for L in (sorted(at[t], key=lambda x: (x is None, x or 0)) if t in split else [None])]
    by = {(r["scheme"], r["task"], r.get("length") if r["task"] in split else None): r for r in result["rows"]}
    patch = result["settings"].get("patch")
    lines = [f"Model `{result['settings'].get('name', result['settings']['model'])}`{patch_note({'patch': patch})}; "
             "lm-eval tasks x schemes (main metric of each task).", "",
             "| scheme | " + " | ".join(t if L is None else f"{t} ({L})" for t, L in columns) + " |",
             "| --- | " + " | ".join("---:" for _ in columns) + " |"]
    for sch in result["schemes"]:
        cells = []
        for t, L in columns:
            r = by.get((sch["spec"], t, L))
            v = None if r is None else r["value"]
            cells.append("-" if v is None else (f"{100 * v:.0f}%" if r["metric"] == "acc" else f"{v:.4g}"))
        lines.append(f"| {_label(sch['spec'], patch)} | " + " | ".join(cells) + " |")
    metrics = sorted({f"{r['task']}: {r['metric']}" for r in result["rows"] if not r["family"] and r["metric"]})
    if metrics:
        lines += ["", "Other tasks' metrics: " + "; ".join(metrics) + "."]
    return "\n".join(lines) + "\n"


def compare_format(result: dict) -> dict | None:
    """The rope_ppl / rope_passkey cells as a `rope-patch compare` result (its table, CSV and plots)."""
    rows = [r for r in result["rows"] if r["family"] in ("rope_ppl", "rope_passkey")]
    if not rows:
        return None
    s = result["settings"]
    meta = s["metadata"]
    records, passkey = [], []
    names = {x["spec"]: x["args"].get("scheme", AS_LOADED) for x in result["schemes"]}  # `loaded`: no scheme=
    for sch in result["schemes"]:
        spec, label = sch["spec"], _label(sch["spec"], s.get("patch"))
        lengths = sorted({r["length"] for r in rows if r["scheme"] == spec})
        for L in lengths:
            ppl = next((r for r in rows if r["scheme"] == spec and r["family"] == "rope_ppl"
                        and r["length"] == L), None)
            pk = next((r for r in rows if r["scheme"] == spec and r["family"] == "rope_passkey"
                       and r["length"] == L), None)
            cells = list((pk or {}).get("by_depth", {}).values()) if pk is not None else []
            k, n = sum(c["correct"] for c in cells), sum(c["n"] for c in cells)
            low, high = wilson_interval(k, n) if n else (None, None)
            records.append({"scheme": spec, "label": label, "name": names[spec], "length": L,
                            "perplexity": None if ppl is None else ppl["metrics"].get("token_perplexity"),
                            "nll": None if ppl is None else ppl["metrics"].get("nll"),
                            "n_windows": 0 if ppl is None else ppl["n_samples"], "n_tokens": None,
                            "passkey_accuracy": None if pk is None else pk["value"],
                            "passkey_n": 0 if pk is None else pk["n_samples"],
                            "passkey_correct": k if n else None, "passkey_ci_low": low, "passkey_ci_high": high})
            if pk is not None:
                for d, c in (pk.get("by_depth") or {}).items():
                    low_d, high_d = wilson_interval(c["correct"], c["n"])
                    passkey.append({"scheme": spec, "label": label, "length": L, "depth": float(d), "n": c["n"],
                                    "correct": c["correct"], "accuracy": c["accuracy"], "ci_low": low_d,
                                    "ci_high": high_d, "answers": [], "outputs": []})
    return {"format": COMPARE_FORMAT,
            "model": {"spec": s["model"], "name": s.get("name", s["model"]), "path": s["model_path"],
                      "model_type": None,
                      "window": _saved_window(s["model_path"]), "n_params": None, "dtype": None,
                      "patch": s.get("patch")},
            "settings": {"lengths": s["lengths"], "passkey_lengths": s["lengths"], "depths": meta.get("depths", []),
                         "passkey_samples": meta.get("samples"), "seed": meta.get("seed"),
                         "ppl_tokens": meta.get("ppl_tokens"), "windows_at_longest": None,
                         "heldout": {"path": meta.get("heldout")}, "haystack": meta.get("haystack", "prose"),
                         "machine": {"threads": (result.get("machine") or {}).get("threads"),
                                     "cpu_count": (result.get("machine") or {}).get("cpu_count"), "loadavg_start": None,
                                     "loadavg_end": (result.get("machine") or {}).get("loadavg")}},
            "versions": {}, "schemes": [{"spec": x["spec"], "label": _label(x["spec"], s.get("patch")),
                                         "name": names[x["spec"]],
                                         "params": {k: v for k, v in x["args"].items() if k != "scheme"}}
                                        for x in result["schemes"]],
            "records": records, "passkey": passkey, "buckets": [], "elapsed_s": result.get("elapsed_s", {})}


def _saved_window(path) -> int | None:
    """The model's window as loaded before any patch: a saved patch's recorded original, else config.json's."""
    try:
        manifest = read_manifest(path)
        if manifest is not None:
            return int(manifest["original"]["max_position_embeddings"])
        return int(json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings"))
    except (OSError, ValueError, TypeError):
        return None


def write_outputs(state: dict, out: Path, plots: bool = True) -> dict[str, Path]:
    result = aggregate(state)
    paths = {"json": out / "sweep.json", "markdown": out / "sweep.md"}
    paths["json"].write_text(json.dumps(json_safe(portable(result)), indent=1) + "\n")
    paths["markdown"].write_text(markdown(result))
    if plots and (tasks_png := figures.write_tasks_figure(result, out)) is not None:
        paths["tasks_figure"] = tasks_png
    cmp = compare_format(result)
    if cmp is not None:
        written = write_results(cmp, out)
        if plots:
            written.update(figures.write_figures(cmp, out))
        for kind, p in written.items():
            paths[f"compare_{kind}"] = p
    return paths


def time_spent(cells: dict) -> float | None:
    """The seconds of lm-eval runs that made a scheme's cells: each run counted once, however many cells it wrote
    (cells written before run ids existed share their run's elapsed time, which then stands for the run)."""
    runs = {c.get("run_id", c["run_elapsed_s"]): c["run_elapsed_s"] for c in cells.values()
            if c.get("run_elapsed_s") is not None}
    return round(sum(runs.values()), 2) if runs else None


# ---- the sweep --------------------------------------------------------------------------------------------------
def sweep(args, log: Callable[[str], object] = print, on_start: Callable[[Path], object] | None = None) -> dict:
    """Run (or resume) a sweep: `args` is a SweepOptions (or the CLI's Namespace); `log` gets progress lines;
    `on_start(out)` is called once the settings are checked and recorded in `out`, before the first scheme runs.
    Returns the state: settings, schemes with their cells, elapsed_s, and "paths" of the files written."""
    out = Path(args.out)
    p = plan(args)  # specs, lengths, task names: checked before anything is created or run
    out.mkdir(parents=True, exist_ok=True)
    settings = p["settings"]
    fp = fingerprint(portable(settings))  # as the stamp records them: the same sweep from another checkout matches
    weights = model_fingerprint(settings["model_path"])
    stamp = out / "sweep_settings.json"
    earlier_lengths = None  # the lengths the cells of an earlier run without a record of their own were measured at
    if stamp.exists():
        old = schema.read(stamp, schema.SWEEP_STAMP)
        earlier_lengths = ((old.get("settings") or {}).get("metadata") or {}).get("max_seq_lengths")
        if old.get("weights") and old["weights"] != weights:  # stamps from before fingerprints: matched on the rest
            raise ValueError(f"{out} holds a sweep of other model files: the weights, config, tokenizer or saved patch "
                             f"in {settings['model_path']} changed since its cells were measured (fingerprint "
                             f"{old['weights'][:19]}... -> {str(weights)[:19]}...). Use another --out, "
                             f"or delete {out}.")
        # the settings the stamp records (its own fingerprint was of the raw ones, which named its checkout's folders)
        if (fingerprint(old["settings"]) if old.get("settings") else old["fingerprint"]) != fp:
            raise ValueError(f"{out} holds a sweep with other settings (model, metadata, model_args, limit, batch "
                             f"size or task folder differ). Use another --out, or delete {out}.")
        why = layout_mismatch(old.get("settings") or {}, settings)
        if why:
            raise ValueError(f"{out} holds a sweep that cannot be resumed: {why}. Use another --out, or delete {out}.")
    stamp.write_text(json.dumps({"fingerprint": fp, "weights": weights, "settings": portable(settings)}, indent=1,
                                default=str) + "\n")
    if on_start is not None:
        on_start(out)
    tasks = settings["tasks"]
    lengths_read = settings["metadata"].get("max_seq_lengths")  # what lm-eval's own tasks (RULER) run at
    commit = source_commit()  # the code that measures this call's cells (git, once per call, not per cell)
    state = {"settings": settings, "schemes": [], "elapsed_s": {}}
    t_all = time.perf_counter()
    for sch in p["schemes"]:
        sdir = out / "schemes" / sch["slug"]
        cdir = sdir / "cells"
        cdir.mkdir(parents=True, exist_ok=True)
        done = {t: schema.read(cdir / f"{t}.json", schema.SWEEP_CELL) for t in tasks if (cdir / f"{t}.json").exists()}
        stale = [t for t, cell in done.items() if not family(t)[0]
                 and cell.get("max_seq_lengths", earlier_lengths) != lengths_read]
        if stale:
            # lm-eval's own tasks (RULER) run at every length of max_seq_lengths in one cell: a cell of other
            # lengths would stand for lengths it never ran, and a new run's cell of these lengths was thrown away
            log(f"[{sch['spec']}] {', '.join(stale)}: measured at other lengths than {lengths_read}; measured again")
            done = {t: cell for t, cell in done.items() if t not in stale}
        old_version = [t for t, cell in done.items() if outdated(cell, t, settings["include_path"])]
        if old_version:
            log(f"[{sch['spec']}] {', '.join(old_version)}: measured by an earlier version of the task; measured again")
            done = {t: cell for t, cell in done.items() if t not in old_version}
        missing = [t for t in tasks if t not in done]
        if missing:
            # rope_* tasks seed themselves; anything else (RULER) depends on the whole list: keep it whole then.
            todo = missing if all(family(t)[0] for t in tasks) else tasks
            log(f"[{sch['spec']}] running {len(todo)} task(s); {len(done)} cell(s) already done")
            t0, run_id = time.perf_counter(), datetime.now(timezone.utc).isoformat(timespec="microseconds")
            if args.in_process:
                run_in_process(settings, sch, todo, sdir, log)
            else:
                run_subprocess(lm_eval_argv(settings, sch, todo, sdir), args.launcher, log)
            elapsed = round(time.perf_counter() - t0, 2)
            new = read_cells(sdir, todo)
            lost = [t for t in todo if t not in new]
            if lost:
                raise RuntimeError(f"lm-eval's results for {sch['spec']} lack {lost}")
            for t, cell in new.items():
                if t in missing:
                    # the run's wall time travels with its cells, so a resumed sweep still reports what it cost
                    cell = {**cell, "scheme": sch["spec"], "fingerprint": fp, "run_id": run_id,
                            "run_elapsed_s": elapsed, "run_machine": _machine(), "commit": commit,
                            "max_seq_lengths": lengths_read}
                    tmp = cdir / f".{t}.json.tmp"
                    tmp.write_text(json.dumps(cell, indent=1, default=str) + "\n")
                    os.replace(tmp, cdir / f"{t}.json")
                    done[t] = cell
            write_samples(sdir, sch["spec"], latest_results(sdir / "lm_eval"), [t for t in todo if t in missing])
        else:
            log(f"[{sch['spec']}] all {len(tasks)} cells done: skipped")
        if (spent := time_spent(done)) is not None:
            state["elapsed_s"][sch["spec"]] = spent
        # the rope_patch commit that measured the scheme's newest cell (None: before cells recorded it, or a wheel)
        newest = max(done.values(), key=lambda c: str(c.get("run_id", "")), default={})
        state["schemes"].append({**sch, "commit": newest.get("commit"), "cells": done})
    state["elapsed_s"]["wall"] = round(time.perf_counter() - t_all, 2)  # this call's, resumed cells cost nothing here
    state["elapsed_s"]["total"] = round(sum(v for k, v in state["elapsed_s"].items() if k != "wall"), 2)
    state["paths"] = write_outputs(state, out, plots=not args.no_plots)
    return state

