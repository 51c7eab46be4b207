"""Long-context LoRA fine-tuning of a rope_patch-patched LLaMA-family model on transformers' Trainer (+ peft, accelerate).

One self-contained recipe (torchtune style): read a YAML config, patch the model's position encoding with
`rope_patch.apply(model, **cfg["rope_patch"])`, wrap it with `peft.LoraConfig(**cfg["lora"])`, and train it with
`transformers.Trainer` on packed rows (`rope_patch.training.PackedDataset`), optionally with synthetic passkey rows
(`PasskeyMixer`, answer tokens weighted by `data.answer_loss_weight`) and PoSE position ids (`PoSECollator`).
Evaluate before/after (`rope_patch.evaluation`: perplexity and passkey), save the adapter with its `rope_patch.json`,
and with --merge a merged model (rope_patch.save_pretrained: config.json carries the native `rope_parameters` where the
whole patch has them, else the unpatched RoPE with a logged warning; rope_patch.from_pretrained reads its rope_patch.json).

    # one process (CPU or one GPU)
    python recipes/finetune_lora.py --config recipes/configs/tiny_yarn_4x.yaml [--merge]
    # check a config without loading the model (every shipped config passes)
    python recipes/finetune_lora.py --config recipes/configs/llama2_7b_yarn_32k.yaml --check
    # override values: --set section.key=value (YAML values; repeatable; unknown keys are errors)
    python recipes/finetune_lora.py --config ... --set train.steps=20 --set lora.r=8
    # two processes on CPU (DDP over gloo): the same global batch, the same loss curve as one process
    torchrun --standalone --nproc_per_node 2 recipes/finetune_lora.py --config recipes/configs/tiny_yarn_4x.yaml
    # GPUs: DDP / FSDP / DeepSpeed ZeRO-3 (config files in recipes/accelerate/)
    accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes 8 recipes/finetune_lora.py --config ...
    # continue an interrupted run (kill -9 included) from its last complete checkpoint
    python recipes/finetune_lora.py --config ... --resume

Papers: Position Interpolation (Chen et al. 2023, arXiv:2306.15595) and YaRN (Peng et al. 2023,
arXiv:2309.00071) fine-tune briefly at the target length; LongLoRA (Chen et al. 2024, arXiv:2309.12307) shows
that LoRA alone is not enough at long context unless embeddings and norms train too (PG19 perplexity at 32k:
11.4-12.0 LoRA-only vs 8.1 with embed+norm) - put `modules_to_save: [embed_tokens, norm]` in the `lora:` block
(peft matches module names by suffix, so `norm` covers every RMSNorm); PoSE (Zhu et al. 2024, arXiv:2309.10400)
trains short rows with skipped position ids (rope_patch/training/pose.py, including the transformers mask trap).

Config: flat dataclasses, one per YAML section (`RunArgs` for the top-level keys, `PatchArgs` <- `rope_patch:`,
`peft.LoraConfig` <- `lora:`, `DataArgs` <- `data:`, `PoseArgs` <- `pose:`, `TrainArgs` <- `train:`, `EvalArgs` <-
`eval:`); `train:` may also hold any other `transformers.TrainingArguments` field (e.g. `optim`, `report_to`,
`dataloader_num_workers`), passed on unchanged. `training_arguments()` derives the rest: per-device batch and
gradient accumulation from the global batch and the process count, the `cosine_with_min_lr` schedule with warm-up,
checkpoints every `save_every` steps under `output_dir/checkpoints/checkpoint-N` (Trainer's format, one path for
one and many processes; `RopePatchCallback` adds the patch to each).

Determinism and resume: rows are packed once (no draw), Trainer's seeded sampler shuffles them, and every draw of
the collators is a pure function of (seed, sample index) (rope_patch/training/seeding.py), because Trainer resumes
by skipping the batches already seen without calling the collator and restores only the global RNG states. A
checkpoint counts as complete once `recipe_state.json` (written last, after every process has saved) exists;
`--resume` continues from the newest complete one and removes newer incomplete ones. The dataset is cut to a
multiple of the global batch, so one process with accumulation and N processes see the same rows per step.

Distributed, as run here (CPU only): `torchrun --nproc_per_node 2` gives DDP over gloo, equal to 1 process (tests/
recipes/test_distributed.py: losses and adapter weights identical, 0.0 difference measured). `accelerate launch
--config_file recipes/accelerate/ddp_cpu.yaml` starts ONE process unless MPI is installed and the config names an
mpirun hostfile (accelerate's multi-CPU launch goes through mpirun; there is none here): use torchrun. FSDP does not
run on CPU with this accelerate (1.15): it enables FSDP only for GPU-like devices and would silently train with DDP;
the recipe raises instead (see FSDP_ON_CPU). The GPU configs (ddp_gpu.yaml, fsdp.yaml, deepspeed_zero3.yaml) are
parsed by the tests but were never run here (no GPU).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import glob
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECKPOINTS = "checkpoints"  # output_dir/checkpoints/checkpoint-N: Trainer's own checkpoint folders
COMPLETE = "recipe_state.json"  # written last into a checkpoint: its presence marks the checkpoint complete
# accelerate 1.15 AcceleratorState.__init__ (state.py) turns a run into FSDP only when its distributed type is one
# of MULTI_GPU / MLU / SDAA / MUSA / NPU / XPU / HPU / NEURON: a CPU run (MULTI_CPU over gloo, or one process) stays
# DDP and ignores ACCELERATE_USE_FSDP and TrainingArguments(fsdp=...) without a word, and `accelerate launch` with an
# FSDP config plus --cpu falls back to its simple launcher (one process). So FSDP cannot run on CPU through
# Trainer + accelerate here; the recipe refuses such a request instead of silently training with DDP.
FSDP_ON_CPU = ("FSDP was requested (ACCELERATE_USE_FSDP / train.fsdp), but accelerate runs FSDP only on GPUs and other "
               "accelerators: on CPU it would silently train with plain DDP ({kind}). Use torchrun without the FSDP "
               "settings for DDP on CPU, or run the FSDP config on GPUs.")


class ConfigError(ValueError):
    """A config value that cannot work; raised before the model is loaded or any step runs."""


# ---------------------------------------------------------------------------------------------------------------
# Config: one flat dataclass per YAML section; per-field checks in __post_init__, cross-field checks in validate().
# ---------------------------------------------------------------------------------------------------------------
def _check(name: str, value, spec) -> None:
    """`value` of the config key `name` against a spec of rope_patch's one file schema (rope_patch/schema.py)."""
    from rope_patch import schema  # the package is imported where it is used, as everywhere in this recipe

    expected = schema.problem(spec, value)
    if expected:
        raise ConfigError(f"`{name}` must be {expected}, got {value!r}.")


def _int(name: str, value, minimum: int = 1) -> None:
    from rope_patch import schema

    _check(name, value, schema.Int(ge=minimum))


def _number(name: str, value, low: float, high: float = math.inf, low_open: bool = False) -> None:
    from rope_patch import schema

    le = high if high < math.inf else None
    _check(name, value, schema.Num(gt=low, le=le) if low_open else schema.Num(ge=low, le=le))


def _choice(name: str, value, options) -> None:
    from rope_patch import schema

    _check(name, value, schema.Str(choices=tuple(options)))


@dataclass
class RunArgs:
    """The top-level keys."""

    model: str  # `tiny`, `smollm2`, a local save_pretrained folder, or a hub id (where a hub is reachable)
    output_dir: str
    tokenizer: str | None = None  # default: the model's folder
    seed: int = 0

    def __post_init__(self):
        _int("seed", self.seed, 0)


@dataclass
class PatchArgs:
    """`rope_patch:` {scheme, **params} -> rope_patch.apply(model, scheme, **params); `rope_patch: null`: no patch."""

    scheme: str
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        import rope_patch

        try:
            self.resolved = rope_patch.as_scheme(self.scheme, **self.params)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"`rope_patch`: {err}") from None


@dataclass
class DataArgs:
    files: list = field(default_factory=list)  # local .txt (one document per file) / .jsonl (one per line); globs
    dataset: str | None = None  # a `datasets` name, e.g. "emozilla/pg19" (needs a reachable hub)
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"  # the field of .jsonl lines and dataset rows that holds the text
    max_documents: int | None = None  # cap on documents read (datasets can be huge)
    cache_dir: str = "out/token_cache"  # tokenised streams, keyed by content + tokenizer hash
    sampling: str = "windows"  # "windows": steps x global batch windows at random offsets (TextWindows), every sample
    #                            new; "rows": the packed rows (PackedDataset), epochs repeat rows and their draws
    passkey_fraction: float = 0.0  # share of rows that hold a synthetic passkey sample (PasskeyMixer)
    passkey_min_tokens: int = 64  # passkey prompts span passkey_min_tokens .. seq_len - 8 tokens
    answer_loss_weight: float = 1.0  # loss weight of the passkey answer tokens relative to all others

    def __post_init__(self):
        if not self.files and not self.dataset:
            raise ConfigError("`data.files` is empty and `data.dataset` is not set: give local .txt/.jsonl files or a "
                              "dataset name.")
        if self.files and self.dataset:
            raise ConfigError("Set either `data.files` or `data.dataset`, not both.")
        _number("data.passkey_fraction", self.passkey_fraction, 0.0, 1.0)
        _number("data.answer_loss_weight", self.answer_loss_weight, 0.0, low_open=True)
        _int("data.passkey_min_tokens", self.passkey_min_tokens, 16)
        if self.sampling not in ("windows", "rows"):
            raise ConfigError(f"`data.sampling` must be 'windows' or 'rows', got {self.sampling!r}.")
        if self.max_documents is not None:
            _int("data.max_documents", self.max_documents)
        # The files themselves are checked by validate() (still before the model loads): a config stays loadable,
        # and its structure checkable, on a machine that has not prepared the data yet.

    def paths(self) -> list[Path]:
        """The data files, globs expanded, in sorted order; errors for missing files and unknown suffixes."""
        out = []
        for pattern in self.files:
            matches = sorted(glob.glob(os.path.expanduser(str(pattern))))
            if not matches:
                raise ConfigError(f"`data.files`: {str(pattern)!r} matches no file (cwd {os.getcwd()}). Fix the path or "
                                  "run the data preparation step in the config's header.")
            for m in matches:
                if Path(m).suffix not in (".txt", ".jsonl"):
                    raise ConfigError(f"`data.files`: {m!r} is neither .txt nor .jsonl.")
                out.append(Path(m))
        return out


@dataclass
class PoseArgs:
    """`pose:` PoSE rows of train.seq_len tokens whose position ids reach target_length (PoSECollator)."""

    target_length: int
    n_chunks: int = 2


@dataclass
class TrainArgs:
    seq_len: int  # tokens per row (with PoSE: the short training window)
    steps: int  # optimizer steps (TrainingArguments.max_steps)
    global_batch_size: int = 8  # rows per optimizer step, over all processes and accumulation steps
    micro_batch_size: int = 1  # rows per forward pass and process (per_device_train_batch_size)
    lr: float = 2.0e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio (transformers' cosine_with_min_lr)
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float | None = 1.0  # null: no clipping
    mixed_precision: str = "no"  # no | bf16 | fp16 (GPU); the trainable weights stay fp32
    model_dtype: str = "float32"  # dtype of the frozen base weights
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None  # eager | sdpa | flash_attention_2 ...; null: transformers' default
    threads: int | None = None  # torch threads per process on CPU; null: torch's default
    deterministic: bool = True  # torch.use_deterministic_algorithms (exact resume on CPU)
    log_every: int = 1
    save_every: int = 0  # checkpoint every N steps (0: only at the end)
    keep_checkpoints: int = 2
    trainer: dict = field(default_factory=dict)  # other TrainingArguments fields, given directly under `train:`

    def __post_init__(self):
        for key in ("seq_len", "steps", "global_batch_size", "micro_batch_size", "log_every"):
            _int(f"train.{key}", getattr(self, key))
        for key in ("warmup_steps", "save_every", "keep_checkpoints"):
            _int(f"train.{key}", getattr(self, key), 0)
        _number("train.lr", self.lr, 0.0, low_open=True)
        _number("train.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _number("train.weight_decay", self.weight_decay, 0.0)
        if self.grad_clip is not None:
            _number("train.grad_clip", self.grad_clip, 0.0)
        if not (isinstance(self.betas, (list, tuple)) and len(self.betas) == 2):
            raise ConfigError(f"`train.betas` must be two numbers, got {self.betas!r}.")
        _choice("train.mixed_precision", self.mixed_precision, ("no", "bf16", "fp16"))
        _choice("train.model_dtype", self.model_dtype, DTYPES)
        if self.threads is not None:
            _int("train.threads", self.threads)
        if self.warmup_steps >= self.steps:
            raise ConfigError(f"`train.warmup_steps`={self.warmup_steps} must be smaller than `train.steps`={self.steps}.")


# TrainingArguments fields the recipe sets from its own keys (given under `train:` they would be ignored or clash).
DERIVED = {"output_dir": "output_dir (top level)", "max_steps": "train.steps", "learning_rate": "train.lr",
           "per_device_train_batch_size": "train.micro_batch_size", "gradient_accumulation_steps": "train.global_batch_size",
           "warmup_steps": "train.warmup_steps", "lr_scheduler_type": "train.min_lr_ratio (cosine_with_min_lr)",
           "lr_scheduler_kwargs": "train.min_lr_ratio", "weight_decay": "train.weight_decay", "adam_beta1": "train.betas",
           "adam_beta2": "train.betas", "max_grad_norm": "train.grad_clip", "bf16": "train.mixed_precision",
           "fp16": "train.mixed_precision", "logging_steps": "train.log_every", "save_steps": "train.save_every",
           "save_strategy": "train.save_every", "save_total_limit": "train.keep_checkpoints", "seed": "seed (top level)",
           "data_seed": "seed (top level)", "remove_unused_columns": "nothing: the collators need the index column",
           "gradient_checkpointing": "train.gradient_checkpointing", "resume_from_checkpoint": "--resume"}


@dataclass
class EvalArgs:
    heldout: str = "rope_patch/data/heldout.txt"  # text never trained on (Persuasion for rope-tiny)
    perplexity_lengths: list = field(default_factory=list)
    perplexity_tokens: int = 16384  # every length scores the same first tokens of the held-out text
    passkey_lengths: list = field(default_factory=list)
    passkey_depths: list = field(default_factory=lambda: [0.1, 0.5, 0.9])
    passkey_samples: int = 10  # per (length, depth) cell
    before: bool = True  # also evaluate the base model (unpatched, and patched without training)

    def __post_init__(self):
        for name in ("perplexity_lengths", "passkey_lengths"):
            for n in getattr(self, name):
                _int(f"eval.{name}[]", n, 16)
        _int("eval.perplexity_tokens", self.perplexity_tokens)
        _int("eval.passkey_samples", self.passkey_samples)
        if (self.perplexity_lengths or self.passkey_lengths) and not Path(self.heldout).is_file():
            raise ConfigError(f"`eval.heldout`: {self.heldout!r} does not exist.")


@dataclass
class Config:
    run: RunArgs
    patch: PatchArgs | None
    lora: Any  # peft.LoraConfig
    data: DataArgs
    pose: PoseArgs | None
    train: TrainArgs
    eval: EvalArgs | None
    merge: bool = False
    raw: dict = field(default_factory=dict, repr=False)  # the merged YAML, for the fingerprint and the record
    source: str | None = None  # the YAML file it was read from: config errors name it


SECTIONS = {"model", "tokenizer", "output_dir", "seed", "rope_patch", "lora", "data", "pose", "train", "eval", "output"}


def _unknown(where: str, given, known) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(k, known, n=1)) else "")
                 for k in unknown]
        raise ConfigError(f"Unknown key(s) in {where} of the config: {', '.join(hints)}. Known keys: {', '.join(sorted(known))}.")


def _build(cls, section: str, block, extra_known=()):
    """`cls(**block)` with unknown keys named (did you mean ...) and missing required ones reported."""
    block = {} if block is None else block
    if not isinstance(block, dict):
        raise ConfigError(f"`{section}` must be a mapping, got {type(block).__name__}: {block!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    _unknown(f"`{section}`", block, set(fields) | set(extra_known))
    for name, f in fields.items():
        if name not in block and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"`{section + '.' if section else ''}{name}` is required but missing from the config.")
    try:
        return cls(**{k: copy.deepcopy(v) for k, v in block.items() if k in fields})
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"`{section}`: {err}") from None


def _train_args(block) -> TrainArgs:
    from transformers import TrainingArguments

    block = dict(block or {})
    own = {f.name for f in dataclasses.fields(TrainArgs)} - {"trainer"}
    hf = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    clash = sorted(k for k in block if k in DERIVED and k not in own)
    if clash:
        raise ConfigError(f"`train.{clash[0]}` is set by the recipe from {DERIVED[clash[0]]}; set that instead.")
    extra = {k: block.pop(k) for k in list(block) if k not in own and k in hf}
    args = _build(TrainArgs, "train", block)
    args.trainer = extra
    return args


def load_config(source, overrides: list[str] | None = None) -> Config:
    """YAML path, dict or Config -> a checked Config. `overrides` are `section.key=value` strings (YAML values), as
    given to --set; the overridden keys go through the same checks as the file's."""
    if isinstance(source, Config):
        return source
    file = None
    if isinstance(source, (str, os.PathLike)):
        from rope_patch import schema

        if not Path(source).is_file():
            raise ConfigError(f"Config file {str(source)!r} does not exist.")
        file = str(source) + (f" (with --set {' '.join(overrides)})" if overrides else "")
        try:  # an empty, binary or unparsable file, or one that is not a mapping: named, one line
            raw = schema.read(source, schema.RECIPE_CONFIG)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    else:
        raw = copy.deepcopy(source)
    try:
        cfg = _overridden(raw, overrides)
    except ConfigError as err:
        if file is None:
            raise
        raise ConfigError(f"{file}: {err}") from None
    cfg.source = file
    return cfg


def _overridden(raw: dict, overrides: list[str] | None) -> Config:
    """The Config of the parsed YAML `raw` with the --set `overrides` applied (the same checks for both)."""
    for item in overrides or []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set expects section.key=value, got {item!r}.")
        *parents, leaf = key.split(".")
        node = raw
        for p in parents:
            node = node[p] if node.get(p) is not None else node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: `{p}` is not a section.")
        node[leaf] = yaml.safe_load(value)  # unknown keys are caught below, like the file's own
    return _from_raw(raw)


def _from_raw(raw: dict) -> Config:
    import peft

    if not isinstance(raw, dict):
        raise ConfigError(f"The config must be a mapping of sections, got {type(raw).__name__}.")
    _unknown("the top level", raw, SECTIONS)
    run = _build(RunArgs, "", {k: raw[k] for k in ("model", "output_dir", "tokenizer", "seed") if k in raw})
    patch = None
    if raw.get("rope_patch") is not None:
        block = dict(raw["rope_patch"]) if isinstance(raw["rope_patch"], dict) else raw["rope_patch"]
        if not isinstance(block, dict) or "scheme" not in block:
            raise ConfigError("`rope_patch` needs a `scheme:` key (e.g. scheme: yarn), or set `rope_patch: null` for no patch.")
        patch = PatchArgs(block.pop("scheme"), block)
    if "lora" not in raw:
        raise ConfigError("`lora` is required but missing from the config (it is passed to peft.LoraConfig).")
    lora = _build(peft.LoraConfig, "lora", {"task_type": "CAUSAL_LM", **(raw["lora"] or {})})
    output = raw.get("output") or {}
    _unknown("`output`", output, {"merge"})
    return Config(run=run, patch=patch, lora=lora, data=_build(DataArgs, "data", raw.get("data")),
                  pose=None if raw.get("pose") is None else _build(PoseArgs, "pose", raw["pose"]),
                  train=_train_args(raw.get("train")),
                  eval=None if raw.get("eval") is None else _build(EvalArgs, "eval", raw["eval"]),
                  merge=bool(output.get("merge", False)), raw=raw)


def validate(cfg: Config, num_processes: int = 1) -> dict:
    """The checks that span sections (everything that can be checked without the model weights). Returns the
    derived values: accumulation steps and the target length. Errors name the config file it came from."""
    try:
        return _validate(cfg, num_processes)
    except ConfigError as err:
        if cfg.source is None:
            raise
        raise ConfigError(f"{cfg.source}: {err}") from None


def _validate(cfg: Config, num_processes: int = 1) -> dict:
    from rope_patch.training.pose import validate_pose

    t, d = cfg.train, cfg.data
    if d.files:
        d.paths()  # missing files and unknown suffixes, before anything is loaded
    per_step = t.micro_batch_size * num_processes
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"`train.global_batch_size`={t.global_batch_size} is not divisible by micro_batch_size x processes = "
            f"{t.micro_batch_size} x {num_processes} = {per_step}: pick a global batch that is a multiple of it, so "
            "that every process runs the same number of accumulation steps.")
    if d.passkey_fraction > 0 and not d.passkey_min_tokens <= t.seq_len - 8:
        raise ConfigError(f"`data.passkey_min_tokens`={d.passkey_min_tokens} must lie in [16, seq_len - 8 = {t.seq_len - 8}].")
    target = t.seq_len
    if cfg.pose is not None:
        try:
            validate_pose(t.seq_len, cfg.pose.target_length, cfg.pose.n_chunks)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if cfg.pose.target_length % t.seq_len:
            raise ConfigError(
                f"`pose.target_length`={cfg.pose.target_length} is not divisible by `train.seq_len`={t.seq_len}: PoSE's "
                "extension factor target/seq_len should be a whole number (it is the factor the rope_patch scheme uses).")
        target = cfg.pose.target_length
    if cfg.patch is not None:
        scheme = cfg.patch.resolved
        params = scheme.params()
        factor, window = params.get("factor"), params.get("original_max_position_embeddings")
        if isinstance(factor, (int, float)) and isinstance(window, int) and factor * window < target:
            raise ConfigError(
                f"`rope_patch`: {scheme.name} with factor={factor} x original_max_position_embeddings={window} covers "
                f"{factor * window:g} positions, fewer than the target length {target}: raise the factor to at least "
                f"{math.ceil(target / window)}.")
    resolve_model(cfg.run.model)  # a missing model folder is a config error too
    return {"accumulation_steps": t.global_batch_size // per_step, "target_length": target}


def fingerprint(cfg: Config) -> str:
    """Hash of everything that changes the training trajectory (not logging, checkpoint cadence, threads, eval)."""
    keep = {k: cfg.raw.get(k) for k in ("model", "seed", "rope_patch", "lora", "data", "pose")}
    keep["train"] = {k: v for k, v in (cfg.raw.get("train") or {}).items()
                     if k not in ("log_every", "save_every", "keep_checkpoints", "threads")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# Data: tokenise once (cached), one stream `[BOS] doc [EOS] ...`, packed into rows (PackedDataset), collated with
# passkey rows and PoSE position ids whose draws depend only on (seed, sample index).
# ---------------------------------------------------------------------------------------------------------------
def _documents(d: DataArgs):
    if d.dataset:
        try:
            import datasets
        except ImportError:
            raise ConfigError("`data.dataset` needs the `datasets` package: pip install datasets") from None
        ds = datasets.load_dataset(d.dataset, d.dataset_config, split=d.split)
        for i, row in enumerate(ds):
            if d.max_documents is not None and i >= d.max_documents:
                return
            yield row[d.text_field]
        return
    n = 0
    for path in d.paths():
        if path.suffix == ".txt":
            docs = [path.read_text(encoding="utf-8")]
        else:
            docs = []
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    row = json.loads(line)
                    if d.text_field not in row:
                        raise ConfigError(f"{path}:{lineno} has no field `{d.text_field}` (data.text_field); keys: {sorted(row)}.")
                    docs.append(row[d.text_field])
        for doc in docs:
            if d.max_documents is not None and n >= d.max_documents:
                return
            n += 1
            yield doc


def _source_key(d: DataArgs, tokenizer) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([d.dataset, d.dataset_config, d.split, d.text_field, d.max_documents]).encode())
    for path in d.paths() if d.files else []:
        h.update(path.name.encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))).encode())
    h.update(repr((tokenizer.bos_token_id, tokenizer.eos_token_id)).encode())
    return h.hexdigest()[:24]


def token_stream(d: DataArgs, tokenizer) -> torch.Tensor:
    """All documents as one stream `[BOS] doc [EOS] [BOS] doc [EOS] ...` (int64), cached on disk. Call it on the
    main process first (`TrainingArguments.main_process_first`): the others then read the cache."""
    from rope_patch.training import PackedDataset

    cache = Path(d.cache_dir) / f"{_source_key(d, tokenizer)}.pt"
    if cache.is_file():
        return torch.load(cache).long()
    docs = (tokenizer.encode(text, add_special_tokens=False) for text in _documents(d))
    stream = PackedDataset(docs, 1, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).stream
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    torch.save(stream.to(torch.int32), tmp)
    os.replace(tmp, cache)  # atomic: a concurrent reader sees no file or the whole file
    return stream


def train_dataset(cfg: Config, stream: torch.Tensor):
    """The training samples, each with its "index" (what the collators seed from), a whole number of global
    batches, so one process with accumulation and N processes see the same samples at every step.

    data.sampling "windows" (default, as the recipe's first loop): train.steps x global batch windows at offsets
    drawn from (seed, index) (`TextWindows`), one epoch in which every passkey row and PoSE draw is new. "rows": the
    packed rows (`PackedDataset`) cut to whole global batches; a run longer than one epoch replays them, draws
    included (on rope-tiny's 0.9M-token corpus yarn x4 at 1024 is 1.7 epochs: 84% passkey@1024 on rows, README)."""
    from torch.utils.data import Subset

    from rope_patch.training import PackedDataset, TextWindows

    t = cfg.train
    if len(stream) < t.seq_len:
        raise ConfigError(f"The training data has {len(stream):,} tokens, fewer than one sample of "
                          f"train.seq_len={t.seq_len}.")
    if cfg.data.sampling == "windows":
        return TextWindows(stream, t.seq_len, t.steps * t.global_batch_size, seed=cfg.run.seed)
    packed = PackedDataset([stream.tolist()], t.seq_len)  # the stream is framed already: no BOS/EOS added
    n = len(packed) // t.global_batch_size * t.global_batch_size
    if n == 0:
        raise ConfigError(f"The training data has {len(stream):,} tokens: {len(packed)} rows of train.seq_len={t.seq_len}, "
                          f"fewer than one global batch of {t.global_batch_size}.")
    return packed if n == len(packed) else Subset(packed, range(n))


class WeightedCollator:
    """The rope_patch.training collators plus per-token loss weights: `PasskeyMixer` (when passkey_fraction > 0)
    then `PoSECollator` or `CausalLMCollator`; "loss_weights" [b, s] is answer_loss_weight on each passkey answer
    (`answer_start:answer_end` of the mixer's record) and 1 elsewhere."""

    def __init__(self, cfg: Config, tokenizer, stream: torch.Tensor):
        from rope_patch.training import CausalLMCollator, PasskeyMixer, PoSECollator

        d, seed = cfg.data, cfg.run.seed
        self.inner = (PoSECollator(cfg.pose.target_length, cfg.pose.n_chunks, seed=seed) if cfg.pose is not None
                      else CausalLMCollator())
        self.mixer = None
        if d.passkey_fraction > 0:
            try:
                self.mixer = PasskeyMixer(tokenizer, stream, d.passkey_fraction, d.passkey_min_tokens, seed=seed,
                                          collator=self.inner)
            except ValueError as err:
                raise ConfigError(f"`data`: {err}") from None
        self.answer_loss_weight = float(d.answer_loss_weight)

    def __call__(self, examples) -> dict[str, torch.Tensor]:
        rows = [self.mixer.mix(ex) for ex in examples] if self.mixer is not None else list(examples)
        batch = self.inner(rows)
        batch.pop("labels", None)  # the loss is computed from input_ids and the weights (WeightedLossTrainer)
        weights = torch.ones(batch["input_ids"].shape, dtype=torch.float32)
        for i, row in enumerate(rows):
            if "passkey" in row:
                weights[i, row["passkey"]["answer_start"] : row["passkey"]["answer_end"]] = self.answer_loss_weight
        batch["loss_weights"] = weights
        return batch


def weighted_loss(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over rows of each row's weighted next-token NLL (rows weigh equally, whatever their weights sum to)."""
    # logits [b, s, V] -> predictions for positions 1..s-1: [b, V, s-1] for cross_entropy's class dim.
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")  # [b, s-1]
    w = weights[:, 1:].to(nll.dtype)
    return ((nll * w).sum(1) / w.sum(1)).mean()


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------
def resolve_model(spec: str) -> str:
    """`tiny` / `smollm2` / a local folder -> its path; a hub id (`org/name`, not a local path) is passed through."""
    from rope_patch.zoo import resolve_model_path

    text = str(spec)
    if text in ("tiny", "smollm2") or Path(text).expanduser().exists():
        try:
            return str(resolve_model_path(text))
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"`model`: {err}") from None
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return text  # hub id: from_pretrained downloads it where a hub is reachable
    raise ConfigError(f"`model`: {text!r} is neither 'tiny', 'smollm2', a local model folder nor a hub id 'org/name'.")


def build_model(cfg: Config, path: str, checkpoint: Path | None = None):
    """The patched base model wrapped by peft (learned tables of the patch added to modules_to_save) + tokenizer.
    Resuming, `restore_patch` checks the checkpoint's patch and loads its learned tables before peft wraps them."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rope_patch
    from rope_patch.training import learned_modules_to_save, restore_patch

    t = cfg.train
    kwargs = {"dtype": DTYPES[t.model_dtype]}
    if t.attn_implementation:
        kwargs["attn_implementation"] = t.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(cfg.run.tokenizer or path)
    if cfg.patch is not None:
        rope_patch.apply(model, cfg.patch.resolved)
    if checkpoint is not None:
        restore_patch(model, checkpoint)
    if t.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA): no enable_input_require_grads hack needed.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # no KV cache in training (and with a cache transformers skips mask checks)
    lora = cfg.lora
    learned = learned_modules_to_save(model)
    if learned:  # relative_bias / learned_absolute tables: without this, peft would freeze them
        lora = dataclasses.replace(lora, modules_to_save=sorted(set(lora.modules_to_save or []) | set(learned)))
    return peft.get_peft_model(model, lora), tokenizer


# ---------------------------------------------------------------------------------------------------------------
# Trainer: the weighted loss, the arguments, the callbacks (log, checkpoint completeness)
# ---------------------------------------------------------------------------------------------------------------
def _trainer_class():
    from transformers import Trainer

    class WeightedLossTrainer(Trainer):
        """Trainer whose loss is `weighted_loss` (per-row weighted mean NLL, then the mean over rows)."""

        loss_is_scaled_for_ga = False  # a per-micro-batch mean: Trainer divides it by the accumulation steps

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = dict(inputs)
            weights = inputs.pop("loss_weights")
            outputs = model(**inputs, use_cache=False)
            loss = weighted_loss(outputs.logits, inputs["input_ids"], weights)
            return (loss, outputs) if return_outputs else loss

    return WeightedLossTrainer


def training_arguments(cfg: Config, accumulation: int):
    from transformers import TrainingArguments

    t = cfg.train
    args = dict(
        output_dir=str(Path(cfg.run.output_dir) / CHECKPOINTS), max_steps=t.steps, learning_rate=t.lr,
        per_device_train_batch_size=t.micro_batch_size, gradient_accumulation_steps=accumulation,
        warmup_steps=t.warmup_steps, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio}, weight_decay=t.weight_decay, adam_beta1=t.betas[0],
        adam_beta2=t.betas[1], max_grad_norm=t.grad_clip or 0.0, bf16=t.mixed_precision == "bf16",
        fp16=t.mixed_precision == "fp16", logging_steps=t.log_every, save_strategy="steps" if t.save_every else "no",
        save_steps=t.save_every or 500, save_total_limit=t.keep_checkpoints or None, seed=cfg.run.seed,
        data_seed=cfg.run.seed, remove_unused_columns=False, dataloader_num_workers=0, report_to=[],
        disable_tqdm=not sys.stderr.isatty(), use_cpu=not torch.cuda.is_available(), ddp_find_unused_parameters=False,
        save_only_model=False)
    args.update(t.trainer)
    try:
        return TrainingArguments(**args)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"`train` -> transformers.TrainingArguments: {err}") from None


def _callbacks():
    from transformers import TrainerCallback

    class CompleteCheckpoint(TrainerCallback):
        """After every process has written its part of checkpoint-N, the main process writes recipe_state.json:
        `--resume` only trusts checkpoints that have it."""

        def __init__(self, fingerprint: str):
            self.fingerprint = fingerprint

        def on_save(self, args, state, control, **kwargs):
            from accelerate import PartialState

            PartialState().wait_for_everyone()
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if args.should_save and folder.is_dir():
                _write_atomic(folder / COMPLETE, json.dumps({"step": state.global_step, "config": self.fingerprint}) + "\n")

    class JsonLog(TrainerCallback):
        """train_log.jsonl: one line per logging step with the exact loss (Trainer's log, gathered over processes)."""

        def __init__(self, path: Path, tokens_per_step: int, elapsed_before: float, last_step: int):
            self.path, self.tokens_per_step, self.elapsed_before = path, tokens_per_step, elapsed_before
            self.t0 = self.last_time = time.perf_counter()
            self.last_step = last_step

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs or "loss" not in logs:
                return
            now = time.perf_counter()
            steps = max(state.global_step - self.last_step, 1)
            record = {"step": state.global_step, "loss": logs["loss"], "lr": logs.get("learning_rate"),
                      "grad_norm": logs.get("grad_norm"), "tokens": state.global_step * self.tokens_per_step,
                      "tokens_per_s": round(steps * self.tokens_per_step / max(now - self.last_time, 1e-9), 1),
                      "elapsed_s": round(self.elapsed_before + now - self.t0, 2)}
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if args.disable_tqdm:
                print(f"step {state.global_step:6d}/{state.max_steps}  loss {logs['loss']:.4f}  lr {record['lr']:.2e}  "
                      f"{record['tokens_per_s']:,.0f} tok/s  elapsed {record['elapsed_s'] / 60:.1f} min", flush=True)
            self.last_step, self.last_time = state.global_step, now

    return CompleteCheckpoint, JsonLog


def complete_checkpoints(out: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (with recipe_state.json) under output_dir/checkpoints, oldest first."""
    folder = Path(out) / CHECKPOINTS
    found = [p for p in folder.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def last_checkpoint(out: str | os.PathLike) -> Path | None:
    done = complete_checkpoints(out)
    return done[-1] if done else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation (rope_patch.evaluation): perplexity at each length, passkey accuracy at each length.
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, tokenizer, e: EvalArgs, seed: int) -> dict:
    from rope_patch.evaluation.common import read_tokens
    from rope_patch.evaluation.perplexity import evaluate_perplexity
    from rope_patch.evaluation.retrieval import accuracy_by_length, evaluate_passkey

    was_training = model.training
    model.eval()
    ids, _ = read_tokens(tokenizer, e.heldout)
    out: dict = {}
    if e.perplexity_lengths:
        res = evaluate_perplexity(model, ids, e.perplexity_lengths, n_tokens=e.perplexity_tokens)
        out["perplexity"] = {str(r["length"]): r["perplexity"] for r in res["lengths"]}
    if e.passkey_lengths:
        recs = evaluate_passkey(model, tokenizer, ids, e.passkey_lengths, e.passkey_depths, e.passkey_samples, seed=seed)
        out["passkey"] = {str(k): v for k, v in accuracy_by_length(recs).items()}
        out["passkey_prompts"] = len(e.passkey_depths) * e.passkey_samples
    model.train(was_training)
    return out


def results_table(rows: dict[str, dict], e: EvalArgs) -> str:
    cols = [f"ppl@{n}" for n in e.perplexity_lengths] + [f"passkey@{n}" for n in e.passkey_lengths]
    lines = ["| model | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, r in rows.items():
        cells = [f"{r.get('perplexity', {}).get(str(n), float('nan')):.2f}" for n in e.perplexity_lengths]
        cells += [f"{r.get('passkey', {}).get(str(n), float('nan')):.0%}" for n in e.passkey_lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------
def main(cfg, *, resume: bool = False, callbacks=()) -> dict:
    """Train as configured; returns {"steps", "final_loss", "adapter", "merged", "eval", "log", "resumed_from"}.

    `cfg` is a YAML path, a dict or a Config. With `resume`, continue from the newest complete checkpoint in
    `output_dir/checkpoints` (or start fresh when there is none). `callbacks`: extra TrainerCallbacks, called
    before the recipe's own (the tests inject crashes with them).
    """
    cfg = load_config(cfg)
    # Every config error surfaces here, before a model is loaded or a process group does any work. WORLD_SIZE is
    # set by torchrun / accelerate launch.
    derived = validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    t = cfg.train
    # Process-wide torch settings for this run, restored on return (main() is also called in-process by tests).
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        if t.threads:
            torch.set_num_threads(t.threads)
        if t.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())
        return _run(cfg, derived, resume, list(callbacks))
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])


def _run(cfg: Config, derived: dict, resume: bool, extra_callbacks: list) -> dict:
    import rope_patch
    from rope_patch.training import RopePatchCallback

    t, out = cfg.train, Path(cfg.run.output_dir)
    args = training_arguments(cfg, derived["accumulation_steps"])  # sets up the process group under torchrun
    main_proc = args.process_index == 0
    log = (lambda *a: print(*a, flush=True)) if main_proc else (lambda *a: None)
    path = resolve_model(cfg.run.model)
    fp = fingerprint(cfg)

    checkpoint = last_checkpoint(out) if resume else None
    if checkpoint is not None:
        state = json.loads((checkpoint / COMPLETE).read_text())
        if state["config"] != fp:
            raise ConfigError(f"--resume: {checkpoint} was written with a different training config (fingerprint "
                              f"{state['config']} vs {fp}); use a new output_dir or the same config.")
    elif resume:
        log(f"--resume: no complete checkpoint in {out / CHECKPOINTS}; starting from step 0")
    resumed_step = int(checkpoint.name.split("-")[-1]) if checkpoint is not None else 0

    from transformers import set_seed

    set_seed(cfg.run.seed)  # LoRA weight init: the same on every process
    model, tokenizer = build_model(cfg, path, checkpoint)
    with args.main_process_first(desc="tokenize"):
        stream = token_stream(cfg.data, tokenizer)
    dataset = train_dataset(cfg, stream)
    collator = WeightedCollator(cfg, tokenizer, stream)
    scheme = rope_patch.current(model)
    log(f"model {path}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable; scheme "
        f"{scheme.name if scheme else 'none'}; data {len(stream):,} tokens, {len(dataset):,} rows of {t.seq_len}; "
        f"{args.world_size} process(es) x {derived['accumulation_steps']} accumulation step(s) x {t.micro_batch_size} rows")

    from accelerate import PartialState

    results: dict = {}
    before_path = out / "eval_before.json"
    if main_proc:
        out.mkdir(parents=True, exist_ok=True)
        if checkpoint is not None:  # a killed run's newer, incomplete checkpoints would be taken for complete ones
            for p in (out / CHECKPOINTS).glob("checkpoint-*"):
                if p.name.split("-")[-1].isdigit() and int(p.name.split("-")[-1]) > resumed_step:
                    shutil.rmtree(p, ignore_errors=True)
        if resume and before_path.is_file():
            results = json.loads(before_path.read_text())
        elif cfg.eval is not None and cfg.eval.before:
            base = model.get_base_model()
            with model.disable_adapter():  # the base weights: before any training
                if scheme is not None:
                    rope_patch.remove(base)
                results["base (unpatched)"] = evaluate(base, tokenizer, cfg.eval, cfg.run.seed)
                if scheme is not None:
                    rope_patch.apply(base, scheme)
                    results[f"{scheme.name}, no fine-tuning"] = evaluate(base, tokenizer, cfg.eval, cfg.run.seed)
            log(results_table(results, cfg.eval))
            before_path.write_text(json.dumps(results, indent=2) + "\n")
    log_path = out / "train_log.jsonl"
    elapsed_before = 0.0
    if main_proc:
        # The log keeps the lines of the steps that are still valid: a crashed run's later lines are dropped.
        kept = []
        if checkpoint is not None and log_path.is_file():
            kept = [ln for ln in log_path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resumed_step]
            elapsed_before = json.loads(kept[-1])["elapsed_s"] if kept else 0.0
        _write_atomic(log_path, "".join(ln + "\n" for ln in kept))
    PartialState().wait_for_everyone()

    CompleteCheckpoint, JsonLog = _callbacks()
    trainer = _trainer_class()(
        model=model, args=args, train_dataset=dataset, data_collator=collator,
        callbacks=[*extra_callbacks, RopePatchCallback(resume_from_checkpoint=checkpoint), CompleteCheckpoint(fp),
                   JsonLog(log_path, t.global_batch_size * t.seq_len, elapsed_before, resumed_step)])
    if args.disable_tqdm:  # JsonLog prints one line per log; Trainer's printer would repeat it as a dict
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
    kind = trainer.accelerator.distributed_type.value
    if (os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or args.fsdp) and not trainer.is_fsdp_enabled:
        raise ConfigError(FSDP_ON_CPU.format(kind=kind))
    log(f"distributed: {kind}, {args.world_size} process(es) on {args.device.type}")
    if checkpoint is not None:
        log(f"resumed from {checkpoint} (step {resumed_step})")
    result = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r] or [result.training_loss]

    # ---- final artefacts --------------------------------------------------------------------------------------
    from rope_patch.persistence import save_patch

    adapter = out / "adapter"
    trainer.save_model(str(adapter))  # every process: gathers FSDP / ZeRO-3 shards; the main process writes
    summary = {"steps": trainer.state.global_step, "final_loss": losses[-1],  # the last logged loss
               "adapter": str(adapter), "merged": None, "log": str(log_path), "eval": results,
               "resumed_from": str(checkpoint) if checkpoint is not None else None}
    if main_proc:
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled
        save_patch(model, adapter)  # rope_patch.json (+ learned tables): the adapter reloads with its patch
        tokenizer.save_pretrained(adapter)
        # Sharded parameters cannot be used by one process alone: evaluate and merge a copy rebuilt from the saved
        # adapter (which also exercises the save/reload round trip); otherwise use the trained model itself.
        final = (rope_patch.from_pretrained(adapter, base_model=path, dtype=DTYPES[t.model_dtype]).to(args.device)
                 if sharded else unwrapped)
        if cfg.merge:
            merged = (final if sharded else copy.deepcopy(final)).merge_and_unload()  # merge_and_unload keeps the patch
            rope_patch.save_pretrained(merged, out / "merged")  # the one save rule: native config.json or a warning
            tokenizer.save_pretrained(out / "merged")
            summary["merged"] = str(out / "merged")
        if cfg.eval is not None:
            scheme = rope_patch.current(final)
            results[f"{scheme.name if scheme else 'unpatched'} + LoRA fine-tuned"] = evaluate(final, tokenizer, cfg.eval, cfg.run.seed)
            table = results_table(results, cfg.eval)
            log(table)
            (out / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
            (out / "eval.md").write_text(table + "\n")
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    PartialState().wait_for_everyone()
    return summary


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see recipes/configs/)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in output_dir")
    parser.add_argument("--merge", action="store_true", help="also write a merged full model (output.merge)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.steps=10 (repeatable)")
    parser.add_argument("--check", "--dry-run", action="store_true",
                        help="validate the config and exit (no model is loaded, nothing is written)")
    return parser.parse_args(argv)


def cli(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        cfg.merge = cfg.merge or args.merge
        if args.check:
            validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
            print(f"{args.config}: OK")
            return 0
        main(cfg, resume=args.resume)
    except ConfigError as err:
        print(f"finetune_lora: config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
