"""The fine-tuning recipe's config (recipes/finetune_lora.py): one dataclass per YAML section, each parsed by
transformers' `HfArgumentParser`.

    cfg = load_config("recipes/configs/tiny_yarn_4x.yaml", {"train.steps": 20})   # --set train.steps=20
    cfg.validate(num_processes=2)    # the checks that span sections: {"accumulation_steps", "target_length"}
    args = cfg.training_arguments(accumulation_steps)                             # transformers.TrainingArguments

Sections: the top level -> `RunArgs`; `rope_patch:` {scheme, **params} -> `PatchArgs` (null: no patch); `lora:` ->
`peft.LoraConfig` unchanged (peft's dataclass checks it); `data:` -> `DataArgs`; `pose:` -> `PoseArgs` (null or
absent: no PoSE); `train:` -> `TrainArgs` + any other `TrainingArguments` field, passed on; `eval:` -> `EvalArgs`
(null or absent: no evaluation); `output:` -> `OutputArgs`. Each field carries its `help` (as transformers' `HfArg`)
and its check, a `rope_patch.schema` spec in `Annotated[type, spec]`.

Why HfArgumentParser and not OmegaConf: no new dependency (transformers is one already; omegaconf is not installed
and brings antlr4); it is the mechanism of what the config feeds (`TrainingArguments` is an HfArgumentParser
dataclass, and `train:` passes its fields on); and what OmegaConf adds is what a recipe config should not have:
`${...}` interpolation (a value containing `${` would change meaning) and config merging, with multi-line errors
that the project's one-line rule would rewrap anyway. What HfArgumentParser lacks takes a few lines here: nested
sections (its dataclasses are flat: one per section), unknown keys with a did-you-mean, dotted overrides, the checks
that span sections (`RecipeConfig.validate`) and the resume fingerprint. Every error is one `ConfigError` line naming
the file, the field and the fix, raised before a model is loaded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import glob
import hashlib
import itertools
import json
import math
import os
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from .. import schema
from ..schema import Bool, Check, Fraction, Int, List, Num, Opt, Str

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
CHECKPOINTS = "checkpoints"  # output_dir/checkpoints/checkpoint-N: Trainer's own checkpoint folders


class ConfigError(ValueError):
    """A config value that cannot work; raised before the model is loaded or any step runs (one line)."""


def arg(default: Any = dataclasses.MISSING, *, help: str, factory=None):
    """A config field with its `help` (the metadata HfArgumentParser shows, as transformers' `HfArg` writes it). Its
    check is the `rope_patch.schema` spec in the field's `Annotated[type, spec]` (read by `Section.__post_init__`;
    HfArgumentParser sees the plain type)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


class Section:
    """A YAML section's dataclass: each field's value must pass its schema spec; errors name `section.field`."""

    section: ClassVar[str] = ""

    def __post_init__(self):
        for name, spec in _specs(type(self)).items():
            value = getattr(self, name)
            if schema.problem(spec, value):
                raise ConfigError(f"`{self.key(name)}` must be {spec.expected}, got {value!r}.")

    @classmethod
    def key(cls, name: str) -> str:
        return f"{cls.section}.{name}" if cls.section else name


@functools.cache
def _specs(cls) -> dict[str, schema.Spec]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: spec for f in dataclasses.fields(cls)
            for spec in getattr(hints[f.name], "__metadata__", ()) if isinstance(spec, schema.Spec)}


@dataclass
class RunArgs(Section):
    """The top-level keys."""

    model: Annotated[str, Str(nonempty=True)] = arg(
        help="'tiny', 'smollm2', 'gemma3', a local model folder, or a hub id")
    output_dir: Annotated[str, Str(nonempty=True)] = arg(help="adapter, merged model, log, checkpoints/checkpoint-N")
    tokenizer: Annotated[str | None, Opt(Str(nonempty=True))] = arg(None, help="default: the model's folder")
    seed: Annotated[int, Int(ge=0)] = arg(0, help="LoRA init, sampling, every collator draw")

    def model_path(self) -> str:
        """`tiny` / `smollm2` / `gemma3` / a local folder -> its path; a hub id (`org/name`, not a local path) passes
        through."""
        from ..zoo import MODELS, resolve_model_path

        text = str(self.model)
        if text in MODELS or Path(text).expanduser().exists():
            try:
                return str(resolve_model_path(text))
            except (FileNotFoundError, ValueError) as err:
                raise ConfigError(f"`model`: {err}") from None
        if text.count("/") == 1 and not text.startswith((".", "/", "~")):
            return text  # hub id: from_pretrained downloads it where a hub is reachable
        raise ConfigError(f"`model`: {text!r} is neither {', '.join(map(repr, MODELS))}, a local model folder nor "
                          "a hub id 'org/name'.")


@dataclass
class PatchArgs:
    """`rope_patch:` {scheme, **params} -> rope_patch.apply(model, scheme, **params); checked by `as_scheme` now."""

    scheme: str
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        from ..api import as_scheme

        try:
            self.resolved = as_scheme(self.scheme, **self.params)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"`rope_patch`: {err}") from None


@dataclass
class DataArgs(Section):
    section: ClassVar[str] = "data"

    files: Annotated[list[str], List(Str(nonempty=True))] = arg(
        help="local .txt (one document per file) / .jsonl (one per line); globs", factory=list)
    dataset: Annotated[str | None, Opt(Str(nonempty=True))] = arg(None, help="a `datasets` name (needs a hub)")
    dataset_config: Annotated[str | None, Opt(Str())] = arg(None, help="the dataset's config name")
    split: Annotated[str, Str(nonempty=True)] = arg("train", help="the dataset's split")
    text_field: Annotated[str, Str(nonempty=True)] = arg("text", help="the field of .jsonl lines / rows with the text")
    max_documents: Annotated[int | None, Opt(Int(ge=1))] = arg(None, help="cap on documents read")
    cache_dir: Annotated[str, Str(nonempty=True)] = arg("out/token_cache", help="tokenised streams, by content hash")
    sampling: Annotated[str, Str(choices=("windows", "rows"))] = arg(
        "windows", help="windows: steps x global batch windows at offsets drawn per sample (TextWindows), every "
                        "sample new; rows: the packed rows (PackedDataset), epochs repeat rows and their draws")
    passkey_fraction: Annotated[float, Fraction()] = arg(0.0, help="share of rows that hold a passkey sample")
    passkey_min_tokens: Annotated[int, Int(ge=16)] = arg(64, help="passkey prompts: min_tokens .. seq_len - 8 tokens")
    answer_loss_weight: Annotated[float, Num(gt=0)] = arg(1.0, help="loss weight of the passkey answer tokens")

    def __post_init__(self):
        super().__post_init__()
        if not self.files and not self.dataset:
            raise ConfigError("`data.files` is empty and `data.dataset` is not set: give local .txt/.jsonl files or a "
                              "dataset name.")
        if self.files and self.dataset:
            raise ConfigError("Set either `data.files` or `data.dataset`, not both.")
        # The files themselves are checked by validate() (still before the model loads): a config stays loadable,
        # and its structure checkable, on a machine that has not prepared the data yet.

    def paths(self) -> list[Path]:
        """The data files, globs expanded, in sorted order; errors for missing files and unknown suffixes."""
        out = []
        for pattern in self.files:
            matches = sorted(glob.glob(os.path.expanduser(str(pattern))))
            if not matches:
                raise ConfigError(f"`data.files`: {str(pattern)!r} matches no file (cwd {os.getcwd()}). "
                                  "Fix the path or run the data preparation step in the config's header.")
            for m in matches:
                if Path(m).suffix not in (".txt", ".jsonl"):
                    raise ConfigError(f"`data.files`: {m!r} is neither .txt nor .jsonl.")
                out.append(Path(m))
        return out

    def documents(self) -> Iterator[str]:
        """The texts: each .txt file whole, each line of a .jsonl file (its `text_field`), or each dataset row."""
        if self.dataset:
            try:
                import datasets
            except ImportError:
                raise ConfigError("`data.dataset` needs the `datasets` package: pip install datasets") from None
            rows = datasets.load_dataset(self.dataset, self.dataset_config, split=self.split)
            yield from itertools.islice((row[self.text_field] for row in rows), self.max_documents)
            return
        yield from itertools.islice(self._file_documents(), self.max_documents)

    def _file_documents(self) -> Iterator[str]:
        for path in self.paths():
            if path.suffix == ".txt":
                yield path.read_text(encoding="utf-8")
                continue
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    row = json.loads(line)
                    if self.text_field not in row:
                        raise ConfigError(f"{path}:{lineno} has no field `{self.text_field}` (data.text_field); "
                                          f"keys: {sorted(row)}.")
                    yield row[self.text_field]

    def token_stream(self, tokenizer) -> torch.Tensor:
        """The documents as one `[BOS] doc [EOS] ...` stream, tokenised once and cached in `cache_dir`
        (`data.token_stream`, keyed by the files' names and bytes, the other source keys and the tokenizer)."""
        from .data import token_stream

        return token_stream(self.documents(), tokenizer, self.cache_dir, files=self.paths() if self.files else (),
                            source=[self.dataset, self.dataset_config, self.split, self.text_field, self.max_documents])


@dataclass
class PoseArgs(Section):
    """`pose:` PoSE rows of train.seq_len tokens whose position ids reach target_length (PoSECollator)."""

    section: ClassVar[str] = "pose"

    target_length: Annotated[int, Int(ge=1)] = arg(help="the position ids reach target_length - 1")
    n_chunks: Annotated[int, Int(ge=1)] = arg(2, help="chunks per row (the paper's default: 2)")


_BETAS = Check(lambda v: isinstance(v, list) and len(v) == 2 and all(
    isinstance(b, (int, float)) and not isinstance(b, bool) for b in v), "two numbers")


@dataclass
class TrainArgs(Section):
    section: ClassVar[str] = "train"

    seq_len: Annotated[int, Int(ge=1)] = arg(help="tokens per row (with PoSE: the short training window)")
    steps: Annotated[int, Int(ge=1)] = arg(help="optimizer steps (TrainingArguments.max_steps)")
    global_batch_size: Annotated[int, Int(ge=1)] = arg(8, help="rows per optimizer step, over processes "
                                                               "and accumulation")
    micro_batch_size: Annotated[int, Int(ge=1)] = arg(1, help="rows per forward pass and process")
    lr: Annotated[float, Num(gt=0)] = arg(2.0e-4, help="peak learning rate")
    warmup_steps: Annotated[int, Int(ge=0)] = arg(0, help="linear warm-up steps")
    min_lr_ratio: Annotated[float, Fraction()] = arg(0.1, help="cosine decays to lr * min_lr_ratio "
                                                               "(cosine_with_min_lr)")
    weight_decay: Annotated[float, Num(ge=0)] = arg(0.0, help="AdamW weight decay")
    betas: Annotated[list[float], _BETAS] = arg(help="AdamW betas", factory=lambda: [0.9, 0.999])
    grad_clip: Annotated[float | None, Opt(Num(ge=0))] = arg(1.0, help="null: no clipping")
    mixed_precision: Annotated[str, Str(choices=("no", "bf16", "fp16"))] = arg(
        "no", help="no | bf16 | fp16 (GPU); the trainable weights stay fp32")
    model_dtype: Annotated[str, Str(choices=DTYPES)] = arg("float32", help="dtype of the frozen base weights")
    gradient_checkpointing: Annotated[bool, Bool()] = arg(False, help="non-reentrant activation checkpointing")
    attn_implementation: Annotated[str | None, Opt(Str(nonempty=True))] = arg(
        None, help="eager | sdpa | flash_attention_2 ...; null: transformers' default")
    threads: Annotated[int | None, Opt(Int(ge=1))] = arg(None, help="torch threads per process on CPU; null: default")
    deterministic: Annotated[bool, Bool()] = arg(True, help="torch.use_deterministic_algorithms (exact resume on CPU)")
    log_every: Annotated[int, Int(ge=1)] = arg(1, help="a train_log.jsonl line every N steps")
    save_every: Annotated[int, Int(ge=0)] = arg(0, help="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: Annotated[int, Int(ge=0)] = arg(2, help="checkpoints kept (0: all)")
    trainer: dict = field(default_factory=dict, init=False)  # the other TrainingArguments fields given under `train:`

    def __post_init__(self):
        super().__post_init__()
        if self.warmup_steps >= self.steps:
            raise ConfigError(f"`train.warmup_steps`={self.warmup_steps} must be smaller than "
                              f"`train.steps`={self.steps}.")


# TrainingArguments fields the recipe sets from its own keys (given under `train:` they would be ignored or clash).
DERIVED = {"output_dir": "output_dir (top level)", "max_steps": "train.steps", "learning_rate": "train.lr",
           "per_device_train_batch_size": "train.micro_batch_size",
           "gradient_accumulation_steps": "train.global_batch_size",
           "warmup_steps": "train.warmup_steps", "lr_scheduler_type": "train.min_lr_ratio (cosine_with_min_lr)",
           "lr_scheduler_kwargs": "train.min_lr_ratio", "weight_decay": "train.weight_decay",
           "adam_beta1": "train.betas",
           "adam_beta2": "train.betas", "max_grad_norm": "train.grad_clip", "bf16": "train.mixed_precision",
           "fp16": "train.mixed_precision", "logging_steps": "train.log_every", "save_steps": "train.save_every",
           "save_strategy": "train.save_every", "save_total_limit": "train.keep_checkpoints",
           "seed": "seed (top level)",
           "data_seed": "seed (top level)", "remove_unused_columns": "nothing: the collators need the index column",
           "gradient_checkpointing": "train.gradient_checkpointing", "resume_from_checkpoint": "--resume"}


@dataclass
class EvalArgs(Section):
    section: ClassVar[str] = "eval"

    heldout: Annotated[str, Str(nonempty=True)] = arg("rope_patch/data/heldout.txt", help="text never trained on")
    perplexity_lengths: Annotated[list[int], List(Int(ge=16))] = arg(help="perplexity at each length", factory=list)
    perplexity_tokens: Annotated[int, Int(ge=1)] = arg(16384, help="held-out tokens scored at every length")
    passkey_lengths: Annotated[list[int], List(Int(ge=16))] = arg(help="passkey accuracy at each length", factory=list)
    passkey_depths: Annotated[list[float], List(Fraction(), min_len=1)] = arg(
        help="needle depths", factory=lambda: [0.1, 0.5, 0.9])
    passkey_samples: Annotated[int, Int(ge=1)] = arg(10, help="prompts per (length, depth) cell")
    before: Annotated[bool, Bool()] = arg(True, help="also evaluate the base model, unpatched and patched")

    def __post_init__(self):
        super().__post_init__()
        if (self.perplexity_lengths or self.passkey_lengths) and not Path(self.heldout).is_file():
            raise ConfigError(f"`eval.heldout`: {self.heldout!r} does not exist.")

    def score(self, model, tokenizer, seed: int) -> dict:
        """{"perplexity": {length: ppl}, "passkey": {length: accuracy}, "passkey_prompts": n} of `model` on the
        held-out text (rope_patch.evaluation), in eval mode; the model's training mode is restored after."""
        import torch

        from ..evaluation.common import read_tokens
        from ..evaluation.perplexity import evaluate_perplexity
        from ..evaluation.retrieval import accuracy_by_length, evaluate_passkey

        was_training = model.training
        model.eval()
        ids, _ = read_tokens(tokenizer, self.heldout)
        out: dict = {}
        with torch.no_grad():
            if self.perplexity_lengths:
                res = evaluate_perplexity(model, ids, self.perplexity_lengths, n_tokens=self.perplexity_tokens)
                out["perplexity"] = {str(r["length"]): r["perplexity"] for r in res["lengths"]}
            if self.passkey_lengths:
                recs = evaluate_passkey(model, tokenizer, ids, self.passkey_lengths, self.passkey_depths,
                                        self.passkey_samples, seed=seed)
                out["passkey"] = {str(k): v for k, v in accuracy_by_length(recs).items()}
                out["passkey_prompts"] = len(self.passkey_depths) * self.passkey_samples
        model.train(was_training)
        return out

    def table(self, rows: dict[str, dict]) -> str:
        """Markdown: one row per model ({name: score()}), a column per perplexity and passkey length."""
        cols = [f"ppl@{n}" for n in self.perplexity_lengths] + [f"passkey@{n}" for n in self.passkey_lengths]
        lines = ["| model | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        for name, r in rows.items():
            cells = [f"{r.get('perplexity', {}).get(str(n), float('nan')):.2f}" for n in self.perplexity_lengths]
            cells += [f"{r.get('passkey', {}).get(str(n), float('nan')):.0%}" for n in self.passkey_lengths]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


@dataclass
class OutputArgs(Section):
    section: ClassVar[str] = "output"

    merge: Annotated[bool, Bool()] = arg(False, help="also write a merged full model (as --merge)")


@dataclass
class RecipeConfig:
    run: RunArgs
    patch: PatchArgs | None
    lora: Any  # peft.LoraConfig
    data: DataArgs
    pose: PoseArgs | None
    train: TrainArgs
    eval: EvalArgs | None
    output: OutputArgs
    raw: dict = field(default_factory=dict, repr=False)  # the merged YAML, for the fingerprint and the record
    source: str | None = None  # the YAML file it was read from (+ its --set): config errors name it

    def validate(self, num_processes: int = 1) -> dict:
        """The checks that span sections (everything that can be checked without the model weights). Returns the
        derived values: {"accumulation_steps", "target_length"}. Errors name the config file."""
        with _named(self.source):
            return self._validate(num_processes)

    def _validate(self, num_processes: int) -> dict:
        from .pose import validate_pose

        t, d = self.train, self.data
        if d.files:
            d.paths()  # missing files and unknown suffixes, before anything is loaded
        per_step = t.micro_batch_size * num_processes
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"`train.global_batch_size`={t.global_batch_size} is not divisible by micro_batch_size x processes = "
                f"{t.micro_batch_size} x {num_processes} = {per_step}: pick a global batch that is a "
                "multiple of it, so that every process runs the same number of accumulation steps.")
        if d.passkey_fraction > 0 and not d.passkey_min_tokens <= t.seq_len - 8:
            raise ConfigError(f"`data.passkey_min_tokens`={d.passkey_min_tokens} must lie in [16, seq_len - 8 "
                              f"= {t.seq_len - 8}].")
        target = t.seq_len
        if self.pose is not None:
            try:
                validate_pose(t.seq_len, self.pose.target_length, self.pose.n_chunks)
            except ValueError as err:
                raise ConfigError(str(err)) from None
            if self.pose.target_length % t.seq_len:
                raise ConfigError(
                    f"`pose.target_length`={self.pose.target_length} is not divisible by `train.seq_len`={t.seq_len}: "
                    "PoSE's extension factor target/seq_len should be a whole number (it is the factor the rope_patch "
                    "scheme uses).")
            target = self.pose.target_length
        if self.patch is not None:
            scheme = self.patch.resolved
            params = scheme.params()
            factor, window = params.get("factor"), params.get("original_max_position_embeddings")
            if isinstance(factor, (int, float)) and isinstance(window, int) and factor * window < target:
                raise ConfigError(
                    f"`rope_patch`: {scheme.name} with factor={factor} x original_max_position_embeddings={window} "
                    f"covers {factor * window:g} positions, fewer than the target length {target}: raise the factor to "
                    f"at least {math.ceil(target / window)}.")
            # a learned position table has a row per position: a longer training row or evaluation length would fail
            # in its forward (after loading the model; for an evaluation length, after training)
            longest = scheme.longest_input()
            uses = {"the training rows (" + ("`pose.target_length`" if self.pose is not None else "`train.seq_len`")
                    + ")": target}
            if self.eval is not None:
                uses["the evaluation (`eval.perplexity_lengths` / `eval.passkey_lengths`)"] = max(
                    [*self.eval.perplexity_lengths, *self.eval.passkey_lengths], default=0)
            over = {what: n for what, n in uses.items() if longest is not None and n > longest}
            if over:
                raise ConfigError(
                    f"`rope_patch`: {scheme.name} runs at most {longest} positions (its learned table's rows), fewer "
                    f"than {' and '.join(f'{what}: {n}' for what, n in over.items())}. Raise its "
                    f"max_position_embeddings to at least {max(over.values())}.")
        self.run.model_path()  # a missing model folder is a config error too
        return {"accumulation_steps": t.global_batch_size // per_step, "target_length": target}

    def fingerprint(self) -> str:
        """Hash of everything that changes the training trajectory (not logging, checkpoint cadence, threads, eval):
        `--resume` refuses a checkpoint written under another one."""
        keep = {k: self.raw.get(k) for k in ("model", "seed", "rope_patch", "lora", "data", "pose")}
        keep["train"] = {k: v for k, v in (self.raw.get("train") or {}).items()
                         if k not in ("log_every", "save_every", "keep_checkpoints", "threads")}
        return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def training_arguments(self, accumulation_steps: int):
        """transformers.TrainingArguments from the recipe's keys (+ the other fields given under `train:`). Under
        torchrun / accelerate launch this sets up the process group."""
        import torch
        from transformers import TrainingArguments

        t = self.train
        args: dict[str, Any] = dict(
            output_dir=str(Path(self.run.output_dir) / CHECKPOINTS), max_steps=t.steps, learning_rate=t.lr,
            per_device_train_batch_size=t.micro_batch_size, gradient_accumulation_steps=accumulation_steps,
            warmup_steps=t.warmup_steps, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio}, weight_decay=t.weight_decay, adam_beta1=t.betas[0],
            adam_beta2=t.betas[1], max_grad_norm=t.grad_clip or 0.0, bf16=t.mixed_precision == "bf16",
            fp16=t.mixed_precision == "fp16", logging_steps=t.log_every,
            save_strategy="steps" if t.save_every else "no",
            # no save_total_limit: train.keep_checkpoints is CompleteCheckpointCallback's `keep` (the recipe's)
            save_steps=t.save_every or 500, seed=self.run.seed, data_seed=self.run.seed, remove_unused_columns=False,
            dataloader_num_workers=0, report_to=[],
            disable_tqdm=not sys.stderr.isatty(), use_cpu=not torch.cuda.is_available(),
            ddp_find_unused_parameters=False,
            save_only_model=False)
        args.update(t.trainer)
        try:
            return TrainingArguments(**args)
        except (TypeError, ValueError) as err:
            with _named(self.source):
                raise ConfigError(f"`train` -> transformers.TrainingArguments: {err}") from None


@contextlib.contextmanager
def _named(file: str | None):
    """A ConfigError raised inside gets `file: ` in front (when the config came from a file)."""
    try:
        yield
    except ConfigError as err:
        if file is None or str(err).startswith(file):
            raise
        raise ConfigError(f"{file}: {err}") from None


TOP_LEVEL = {"model", "tokenizer", "output_dir", "seed", "rope_patch", "lora", "data", "pose", "train", "eval",
             "output"}


def load_config(source, overrides: dict[str, Any] | None = None) -> RecipeConfig:
    """YAML path, dict or RecipeConfig -> a checked RecipeConfig. `overrides`: {"section.key": value} (the recipe's
    --set, values already parsed), applied before any check: the overridden keys go through the file's checks."""
    if isinstance(source, RecipeConfig):
        return source
    file = None
    if isinstance(source, (str, os.PathLike)):
        if not Path(source).is_file():
            raise ConfigError(f"Config file {str(source)!r} does not exist.")
        sets = " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in (overrides or {}).items())
        file = str(source) + (f" (with --set {sets})" if sets else "")
        try:  # an empty, binary or unparsable file, or one that is not a mapping: named, one line
            raw = schema.read(source, schema.RECIPE_CONFIG)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    else:
        raw = copy.deepcopy(source)
    with _named(file):
        for key, value in (overrides or {}).items():
            _set(raw, key, value)
        cfg = _parse(raw)
    cfg.source = file
    return cfg


def _set(raw: dict, key: str, value: Any) -> None:
    """raw["a"]["b"] = value for the dotted key "a.b" (missing sections created; unknown keys are caught later)."""
    *parents, leaf = key.split(".")
    node = raw
    for p in parents:
        node = node[p] if node.get(p) is not None else node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}=...: `{p}` is not a section.")
    node[leaf] = value


def _parse(raw: dict) -> RecipeConfig:
    import peft
    from transformers import TrainingArguments

    if not isinstance(raw, dict):
        raise ConfigError(f"The config must be a mapping of sections, got {type(raw).__name__}.")
    _unknown("the top level", raw, TOP_LEVEL)
    run = _section(RunArgs, {k: raw[k] for k in ("model", "output_dir", "tokenizer", "seed") if k in raw})
    patch = None
    if raw.get("rope_patch") is not None:
        block = dict(raw["rope_patch"]) if isinstance(raw["rope_patch"], dict) else raw["rope_patch"]
        if not isinstance(block, dict) or "scheme" not in block:
            raise ConfigError("`rope_patch` needs a `scheme:` key (e.g. scheme: yarn), "
                              "or set `rope_patch: null` for no patch.")
        patch = PatchArgs(block.pop("scheme"), block)
    if "lora" not in raw:
        raise ConfigError("`lora` is required but missing from the config (it is passed to peft.LoraConfig).")
    lora = _section(peft.LoraConfig, {"task_type": "CAUSAL_LM", **(raw["lora"] or {})}, "lora")
    data = _section(DataArgs, raw.get("data"))
    pose = None if raw.get("pose") is None else _section(PoseArgs, raw["pose"])
    # `train:` = TrainArgs + other TrainingArguments fields, passed on (those the recipe derives are refused)
    block = dict(raw.get("train") or {})
    own = {f.name for f in dataclasses.fields(TrainArgs) if f.init}
    clash = sorted(k for k in block if k in DERIVED and k not in own)
    if clash:
        raise ConfigError(f"`train.{clash[0]}` is set by the recipe from {DERIVED[clash[0]]}; set that instead.")
    hf = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    extra = {k: block.pop(k) for k in list(block) if k not in own and k in hf}
    train = _section(TrainArgs, block)
    train.trainer = extra
    evaluation = None if raw.get("eval") is None else _section(EvalArgs, raw["eval"])
    return RecipeConfig(run=run, patch=patch, lora=lora, data=data, pose=pose, train=train, eval=evaluation,
                        output=_section(OutputArgs, raw.get("output")), raw=raw)


def _section(cls, block, name: str | None = None):
    """`block` (a YAML mapping) -> `cls`, through HfArgumentParser.parse_dict; unknown keys named (did you mean),
    missing required keys named. `peft.LoraConfig` (`lora:`) is built by peft directly: HfArgumentParser does not
    take its Union-typed fields."""
    from transformers import HfArgumentParser

    name = cls.section if name is None else name
    block = {} if block is None else block
    if not isinstance(block, dict):
        raise ConfigError(f"`{name}` must be a mapping, got {type(block).__name__}: {block!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    _unknown(f"`{name}`" if name else "the top level", block, fields)
    for key, f in fields.items():
        if key not in block and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"`{name + '.' if name else ''}{key}` is required but missing from the config.")
    block = copy.deepcopy(block)
    try:
        if issubclass(cls, Section):
            (args,) = HfArgumentParser(cls).parse_dict(block)
            return args
        return cls(**block)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"`{name}`: {err}") from None


def _unknown(where: str, given, known) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(k, known, n=1)) else "")
                 for k in unknown]
        raise ConfigError(f"Unknown key(s) in {where} of the config: {', '.join(hints)}. Known keys: "
                          f"{', '.join(sorted(known))}.")
