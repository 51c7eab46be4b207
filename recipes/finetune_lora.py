"""Long-context LoRA fine-tuning of a rope_patch-patched LLaMA-family model (PEFT + accelerate).

One self-contained recipe (torchtune style): read a YAML config, patch the model's position encoding with
`rope_patch.apply(model, **cfg["rope_patch"])`, wrap it with `peft.LoraConfig(**cfg["lora"])`, train on packed
long rows (optionally PoSE rows: short rows whose position ids skip ahead), checkpoint atomically, resume
exactly, evaluate before/after, and save an adapter (plus, with --merge, a merged model whose config.json carries
native `rope_parameters`).

    # one process (CPU or one GPU)
    python recipes/finetune_lora.py --config recipes/configs/tiny_yarn_4x.yaml
    # several processes: DDP over gloo on CPU, DDP/FSDP/DeepSpeed on GPUs (config files in recipes/accelerate/)
    accelerate launch --config_file recipes/accelerate/ddp_cpu.yaml recipes/finetune_lora.py --config ...
    # continue an interrupted run (kill -9 included) from its last complete checkpoint
    python recipes/finetune_lora.py --config ... --resume

Papers: Position Interpolation (Chen et al. 2023, arXiv:2306.15595) and YaRN (Peng et al. 2023,
arXiv:2309.00071) fine-tune briefly at the target length; LongLoRA (Chen et al. 2024, arXiv:2309.12307) shows
that LoRA alone is not enough at long context unless embeddings and norms train too (PG19 perplexity at 32k:
11.4-12.0 LoRA-only vs 8.1 with embed+norm) - put `modules_to_save: [embed_tokens, norm]` in the `lora:` block
(peft matches module names by suffix, so `norm` covers every RMSNorm); PoSE (Zhu et al. 2024, arXiv:2309.10400)
trains short rows with skipped position ids (rope_patch/training/pose.py, including the transformers mask trap).

Determinism: every training row is a pure function of (seed, step, row index), so the data position is the step
counter, a resumed run draws exactly the rows an uninterrupted one would, and N processes see the same global
batch as one process (rows are dealt out by index).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import glob
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

# ---------------------------------------------------------------------------------------------------------------
# Config: every key the recipe reads, with its default. Unknown keys are errors (a typo must not silently fall
# back to a default); `rope_patch:` and `lora:` are passed on unchanged and validated by rope_patch / peft.
# ---------------------------------------------------------------------------------------------------------------
REQUIRED = object()
SCHEMA: dict = {
    "model": REQUIRED,  # `tiny`, `smollm2`, a local save_pretrained folder, or a hub id (where a hub is reachable)
    "tokenizer": None,  # default: the model's folder
    "output_dir": REQUIRED,
    "seed": 0,
    "rope_patch": None,  # {scheme: ..., **params} -> rope_patch.apply(model, **block); null = no patch
    "lora": REQUIRED,  # -> peft.LoraConfig(**block)
    "data": {
        "files": [],  # local .txt (one document per file) / .jsonl (one document per line) files; globs allowed
        "dataset": None,  # a `datasets` name, e.g. "emozilla/pg19" (needs a reachable hub)
        "dataset_config": None,
        "split": "train",
        "text_field": "text",  # the field of .jsonl lines and dataset rows that holds the text
        "max_documents": None,  # cap on documents read (datasets can be huge)
        "cache_dir": "out/token_cache",  # tokenised streams, keyed by content + tokenizer hash
        "passkey_fraction": 0.0,  # share of rows that hold a synthetic passkey sample
        "passkey_min_tokens": 64,  # passkey prompts span passkey_min_tokens .. seq_len - 8 tokens
        "answer_loss_weight": 1.0,  # loss weight of the passkey answer tokens relative to all others
    },
    "train": {
        "seq_len": REQUIRED,  # tokens per row (with PoSE: the short training window)
        "global_batch_size": 8,  # rows per optimizer step, over all processes and accumulation steps
        "micro_batch_size": 1,  # rows per forward pass and process
        "steps": REQUIRED,
        "lr": 2.0e-4,
        "warmup_steps": 0,
        "min_lr_ratio": 0.1,  # cosine decays to lr * min_lr_ratio
        "weight_decay": 0.0,
        "betas": [0.9, 0.999],
        "grad_clip": 1.0,  # null: no clipping
        "mixed_precision": "no",  # no | bf16 | fp16 (GPU); the trainable weights stay fp32
        "model_dtype": "float32",  # dtype of the frozen base weights: float32 | bfloat16 | float16
        "gradient_checkpointing": False,
        "attn_implementation": None,  # eager | sdpa | flash_attention_2 ...; null: transformers' default
        "threads": None,  # torch threads per process on CPU; null: torch's default
        "deterministic": True,  # torch.use_deterministic_algorithms (exact resume on CPU)
        "log_every": 1,
        "save_every": 0,  # checkpoint every N steps (0: only the final save)
        "keep_checkpoints": 2,
    },
    "pose": None,  # {target_length, n_chunks}: PoSE rows of seq_len tokens whose positions reach target_length
    "eval": None,  # {heldout, perplexity_lengths, perplexity_tokens, passkey_lengths, passkey_depths, passkey_samples, before}
    "output": {"merge": False},  # also write <output_dir>/merged: a full model with native rope_parameters
}
POSE_SCHEMA = {"target_length": REQUIRED, "n_chunks": 2}
EVAL_SCHEMA = {
    "heldout": "rope_patch/data/heldout.txt",  # text never trained on (Persuasion for rope-tiny)
    "perplexity_lengths": [],
    "perplexity_tokens": 16384,  # every length scores the same first tokens of the held-out text
    "passkey_lengths": [],
    "passkey_depths": [0.1, 0.5, 0.9],
    "passkey_samples": 10,  # per (length, depth) cell
    "before": True,  # also evaluate the base model (unpatched, and patched without training)
}
MIXED_PRECISION = ("no", "bf16", "fp16")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A config value that cannot work; raised before the model is loaded or any step runs."""


def _merge(section: str, schema: dict, given: dict | None) -> dict:
    given = {} if given is None else given
    if not isinstance(given, dict):
        raise ConfigError(f"`{section}` must be a mapping, got {type(given).__name__}: {given!r}.")
    unknown = sorted(set(given) - set(schema))
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, schema, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        where = f"`{section}`" if section else "the top level"
        raise ConfigError(f"Unknown key(s) in {where} of the config: {', '.join(hints)}. Known keys: {', '.join(schema)}.")
    out = {}
    for key, default in schema.items():
        name = f"{section}.{key}" if section else key
        if key not in given and default is REQUIRED:
            raise ConfigError(f"`{name}` is required but missing from the config.")
        if isinstance(default, dict) and key in ("data", "train", "output"):
            out[key] = _merge(name, default, given.get(key))
        else:
            out[key] = copy.deepcopy(given.get(key, default))
    return out


def load_config(source, overrides: list[str] | None = None) -> dict:
    """YAML path or dict -> a complete config (defaults filled in, unknown keys rejected). `overrides` are
    `section.key=value` strings (YAML values), as given to --set."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"Config file {str(path)!r} does not exist.")
        raw = yaml.safe_load(path.read_text()) or {}
    else:
        raw = copy.deepcopy(source)
    for item in overrides or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--set expects section.key=value, got {item!r}.")
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[leaf] = yaml.safe_load(value)
    cfg = _merge("", SCHEMA, raw)
    if cfg["pose"] is not None:
        cfg["pose"] = _merge("pose", POSE_SCHEMA, cfg["pose"])
    if cfg["eval"] is not None:
        cfg["eval"] = _merge("eval", EVAL_SCHEMA, cfg["eval"])
    return cfg


def _positive_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")


def data_files(cfg: dict) -> list[Path]:
    """The data files, globs expanded, in sorted order; errors for missing files and unknown suffixes."""
    out = []
    for pattern in cfg["data"]["files"]:
        matches = sorted(glob.glob(os.path.expanduser(str(pattern))))
        if not matches:
            raise ConfigError(f"`data.files`: {str(pattern)!r} matches no file (cwd {os.getcwd()}). Fix the path or run "
                              "the data preparation step in the config's header.")
        for m in matches:
            if Path(m).suffix not in (".txt", ".jsonl"):
                raise ConfigError(f"`data.files`: {m!r} is neither .txt nor .jsonl.")
            out.append(Path(m))
    return out


def validate_config(cfg: dict, num_processes: int = 1) -> dict:
    """Everything that can be checked without the model weights. Returns derived values (accumulation steps)."""
    t, d = cfg["train"], cfg["data"]
    for key in ("seq_len", "global_batch_size", "micro_batch_size", "steps", "log_every"):
        _positive_int(f"train.{key}", t[key])
    for key in ("warmup_steps", "save_every", "keep_checkpoints"):
        _positive_int(f"train.{key}", t[key], 0)
    if not (isinstance(t["lr"], (int, float)) and t["lr"] > 0):
        raise ConfigError(f"`train.lr` must be a positive number, got {t['lr']!r}.")
    if t["mixed_precision"] not in MIXED_PRECISION:
        raise ConfigError(f"`train.mixed_precision` must be one of {MIXED_PRECISION}, got {t['mixed_precision']!r}.")
    if t["model_dtype"] not in DTYPES:
        raise ConfigError(f"`train.model_dtype` must be one of {tuple(DTYPES)}, got {t['model_dtype']!r}.")
    if t["warmup_steps"] >= t["steps"]:
        raise ConfigError(f"`train.warmup_steps`={t['warmup_steps']} must be smaller than `train.steps`={t['steps']}.")
    per_step = t["micro_batch_size"] * num_processes
    if t["global_batch_size"] % per_step:
        raise ConfigError(
            f"`train.global_batch_size`={t['global_batch_size']} is not divisible by micro_batch_size x processes = "
            f"{t['micro_batch_size']} x {num_processes} = {per_step}: pick a global batch that is a multiple of it, so "
            "that every process runs the same number of accumulation steps."
        )
    if not d["files"] and not d["dataset"]:
        raise ConfigError("`data.files` is empty and `data.dataset` is not set: give local .txt/.jsonl files or a dataset name.")
    if d["files"] and d["dataset"]:
        raise ConfigError("Set either `data.files` or `data.dataset`, not both.")
    if d["files"]:
        data_files(cfg)
    if not 0.0 <= d["passkey_fraction"] <= 1.0:
        raise ConfigError(f"`data.passkey_fraction` must be in [0, 1], got {d['passkey_fraction']!r}.")
    if d["passkey_fraction"] > 0 and not 16 <= d["passkey_min_tokens"] <= t["seq_len"] - 8:
        raise ConfigError(f"`data.passkey_min_tokens`={d['passkey_min_tokens']} must lie in [16, seq_len - 8 = {t['seq_len'] - 8}].")

    target = t["seq_len"]
    if cfg["pose"] is not None:
        from rope_patch.training.pose import validate_pose

        p = cfg["pose"]
        try:
            validate_pose(t["seq_len"], p["target_length"], p["n_chunks"])
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if p["target_length"] % t["seq_len"]:
            raise ConfigError(
                f"`pose.target_length`={p['target_length']} is not divisible by `train.seq_len`={t['seq_len']}: PoSE's "
                "extension factor target/seq_len should be a whole number (it is the factor the rope_patch scheme uses)."
            )
        target = p["target_length"]

    if cfg["rope_patch"] is not None:
        block = dict(cfg["rope_patch"])
        if "scheme" not in block:
            raise ConfigError("`rope_patch` needs a `scheme:` key (e.g. scheme: yarn), or set `rope_patch: null` for no patch.")
        import rope_patch

        try:
            scheme = rope_patch.as_scheme(block.pop("scheme"), **block)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"`rope_patch`: {err}") from None
        params = scheme.params()
        factor, window = params.get("factor"), params.get("original_max_position_embeddings")
        if isinstance(factor, (int, float)) and isinstance(window, int) and factor * window < target:
            raise ConfigError(
                f"`rope_patch`: {scheme.name} with factor={factor} x original_max_position_embeddings={window} covers "
                f"{factor * window:g} positions, fewer than the target length {target}: raise the factor to at least "
                f"{math.ceil(target / window)}."
            )
    _lora_config(cfg)
    if cfg["eval"] is not None:
        e = cfg["eval"]
        for name in ("perplexity_lengths", "passkey_lengths"):
            for n in e[name]:
                _positive_int(f"eval.{name}[]", n, 16)
        if (e["perplexity_lengths"] or e["passkey_lengths"]) and not Path(e["heldout"]).is_file():
            raise ConfigError(f"`eval.heldout`: {e['heldout']!r} does not exist.")
    return {"accumulation_steps": t["global_batch_size"] // per_step, "target_length": target}


def _lora_config(cfg: dict):
    import peft

    block = dict(cfg["lora"])
    block.setdefault("task_type", "CAUSAL_LM")
    try:
        return peft.LoraConfig(**block)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"`lora` block rejected by peft.LoraConfig: {err}") from None


def config_fingerprint(cfg: dict) -> str:
    """Hash of everything that changes the training trajectory (not steps-independent bits like eval/output)."""
    keep = {k: cfg[k] for k in ("model", "seed", "rope_patch", "lora", "data", "pose")}
    keep["train"] = {k: v for k, v in cfg["train"].items() if k not in ("log_every", "save_every", "keep_checkpoints", "threads")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# Data: tokenise once (cached), one stream of documents framed by BOS/EOS, rows drawn as a function of the step.
# ---------------------------------------------------------------------------------------------------------------
def _documents(cfg: dict):
    d = cfg["data"]
    if d["dataset"]:
        try:
            import datasets
        except ImportError:
            raise ConfigError("`data.dataset` needs the `datasets` package: pip install datasets") from None
        ds = datasets.load_dataset(d["dataset"], d["dataset_config"], split=d["split"])
        for i, row in enumerate(ds):
            if d["max_documents"] is not None and i >= d["max_documents"]:
                return
            yield row[d["text_field"]]
        return
    n = 0
    for path in data_files(cfg):
        if path.suffix == ".txt":
            docs = [path.read_text(encoding="utf-8")]
        else:
            docs = []
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    row = json.loads(line)
                    if d["text_field"] not in row:
                        raise ConfigError(f"{path}:{lineno} has no field `{d['text_field']}` (data.text_field); keys: {sorted(row)}.")
                    docs.append(row[d["text_field"]])
        for doc in docs:
            if d["max_documents"] is not None and n >= d["max_documents"]:
                return
            n += 1
            yield doc


def _source_key(cfg: dict, tokenizer) -> str:
    d = cfg["data"]
    h = hashlib.sha256()
    h.update(json.dumps({k: d[k] for k in ("dataset", "dataset_config", "split", "text_field", "max_documents")}).encode())
    for path in data_files(cfg) if d["files"] else []:
        h.update(path.name.encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))).encode())
    h.update(repr((tokenizer.bos_token_id, tokenizer.eos_token_id)).encode())
    return h.hexdigest()[:24]


def token_stream(cfg: dict, tokenizer, accelerator=None) -> torch.Tensor:
    """All documents as one int32 stream `[BOS] doc [EOS] [BOS] doc [EOS] ...`, cached on disk (main process writes)."""
    cache = Path(cfg["data"]["cache_dir"]) / f"{_source_key(cfg, tokenizer)}.pt"
    ctx = accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext()
    with ctx:
        if cache.is_file():
            return torch.load(cache)
        ids: list[int] = []
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        for doc in _documents(cfg):
            ids += bos + tokenizer.encode(doc, add_special_tokens=False) + eos
        stream = torch.tensor(ids, dtype=torch.int32)
        if accelerator is None or accelerator.is_main_process:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp{os.getpid()}")
            torch.save(stream, tmp)
            os.replace(tmp, cache)  # atomic: a concurrent reader sees the old state or the whole file
        return stream


def row_seed(seed: int, step: int, row: int) -> int:
    """A per-row seed independent of PYTHONHASHSEED, process count and order of drawing."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{step}/{row}".encode()).digest()[:8], "little")


class Rows:
    """Training rows as a pure function of (seed, step, row index): text windows of seq_len tokens, or (with
    probability passkey_fraction) a passkey prompt + answer + EOS followed by text; PoSE position ids when set."""

    def __init__(self, cfg: dict, stream: torch.Tensor, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.stream = stream
        self.stream_list = None  # python list for the passkey generator, built on first use
        self.seq_len = cfg["train"]["seq_len"]
        if len(stream) < self.seq_len + 1:
            raise ConfigError(f"The training data has {len(stream)} tokens, fewer than one row of train.seq_len={self.seq_len}.")

    def _text(self, rng: random.Random, n: int) -> list[int]:
        start = rng.randint(0, len(self.stream) - n)
        return self.stream[start : start + n].tolist()

    def row(self, step: int, index: int) -> tuple[list[int], list[float], list[int]]:
        d, n = self.cfg["data"], self.seq_len
        rng = random.Random(row_seed(self.cfg["seed"], step, index))
        if d["passkey_fraction"] > 0 and rng.random() < d["passkey_fraction"]:
            from rope_patch.evaluation.passkey import make_passkey_sample

            if self.stream_list is None:
                self.stream_list = self.stream.tolist()
            length = rng.randint(d["passkey_min_tokens"], n - 8)  # 8: room for " 12345" and EOS
            sample = make_passkey_sample(self.tokenizer, self.stream_list, length, rng.random(), rng)
            ids = sample["prompt_ids"] + sample["answer_ids"] + [self.tokenizer.eos_token_id]
            weights = [1.0] * length + [float(d["answer_loss_weight"])] * len(sample["answer_ids"]) + [1.0]
            ids, weights = ids + self._text(rng, n - len(ids)), weights + [1.0] * (n - len(ids))
        else:
            ids, weights = self._text(rng, n), [1.0] * n
        if self.cfg["pose"] is not None:
            from rope_patch.training.pose import pose_position_ids

            p = self.cfg["pose"]
            positions = pose_position_ids(n, p["target_length"], p["n_chunks"], rng)
        else:
            positions = list(range(n))
        return ids, weights, positions

    def batch(self, step: int, indices) -> dict:
        rows = [self.row(step, i) for i in indices]
        return {"input_ids": torch.tensor([r[0] for r in rows]), "weights": torch.tensor([r[1] for r in rows]),
                "position_ids": torch.tensor([r[2] for r in rows])}


def micro_batches(step: int, cfg: dict, rank: int, world: int, accumulation: int):
    """Row indices of each accumulation step of one process: micro-step a on rank k takes rows
    [(a*world + k)*m, (a*world + k + 1)*m), so any (world, accumulation) pair with the same global batch sees the
    same set of rows per optimizer step."""
    m = cfg["train"]["micro_batch_size"]
    for a in range(accumulation):
        start = (a * world + rank) * m
        yield range(start, start + m)


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------
def resolve_model(spec: str) -> str:
    """`tiny` / `smollm2` / a local folder -> its path; a hub id (`org/name`, not a local path) is passed through."""
    from rope_patch.zoo import resolve_model_path

    text = str(spec)
    local = Path(text).expanduser()
    if text in ("tiny", "smollm2") or local.exists():
        try:
            return str(resolve_model_path(text))
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"`model`: {err}") from None
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return text  # hub id: from_pretrained downloads it where a hub is reachable
    raise ConfigError(f"`model`: {text!r} is neither 'tiny', 'smollm2', a local model folder nor a hub id 'org/name'.")


def build_model(cfg: dict, path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rope_patch

    t = cfg["train"]
    kwargs = {"dtype": DTYPES[t["model_dtype"]]}
    if t["attn_implementation"]:
        kwargs["attn_implementation"] = t["attn_implementation"]
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(cfg["tokenizer"] or path)
    if cfg["rope_patch"] is not None:
        block = dict(cfg["rope_patch"])
        rope_patch.apply(model, block.pop("scheme"), **block)
    if t["gradient_checkpointing"]:
        # Non-reentrant checkpointing works with frozen inputs (LoRA): no enable_input_require_grads hack needed.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # no KV cache in training (and with a cache transformers skips mask checks)
    import peft

    model = peft.get_peft_model(model, _lora_config(cfg))
    return model, tokenizer


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The trained weights (LoRA, modules_to_save) by name in the unwrapped peft model, detached fp32 copies."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints: written to a temporary folder and renamed into place, so a kill at any moment leaves either the
# previous checkpoint or the new one complete; `latest` names the newest complete one.
# ---------------------------------------------------------------------------------------------------------------
def _crash_point(where: str, step: int) -> None:
    """Test hook: ROPE_PATCH_FINETUNE_CRASH=after_step:N|during_save:N kills this process with SIGKILL there
    (ROPE_PATCH_FINETUNE_CRASH_MODE=raise raises instead, for in-process tests)."""
    spec = os.environ.get("ROPE_PATCH_FINETUNE_CRASH")
    if spec and spec == f"{where}:{step}":
        if os.environ.get("ROPE_PATCH_FINETUNE_CRASH_MODE") == "raise":
            raise KeyboardInterrupt(f"injected crash at {spec}")
        os.kill(os.getpid(), signal.SIGKILL)


def _rng_state() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sharded(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def save_checkpoint(out: Path, step: int, accelerator, model, optimizer, scheduler, meta: dict, keep: int) -> Path:
    ckpts = out / "checkpoints"
    final = ckpts / f"step-{step:07d}"
    tmp = ckpts / f".tmp-step-{step:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if _sharded(accelerator):
        accelerator.save_state(str(tmp / "accelerate"))  # FSDP / ZeRO-3 shards: accelerate knows their layout
    elif accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        torch.save(trainable_state(unwrapped), tmp / "trainable.pt")  # exact fp32 weights, what --resume loads
        import rope_patch

        rope_patch.save_pretrained(unwrapped, tmp / "adapter")  # a loadable adapter, to evaluate a checkpoint
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(_rng_state(), tmp / f"rng-rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        _crash_point("during_save", step)
        (tmp / "state.json").write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the checkpoint appears complete or not at all
        _write_atomic(ckpts / "latest", final.name + "\n")
        for old in sorted(p for p in ckpts.glob("step-*") if p != final)[: max(0, len(list(ckpts.glob("step-*"))) - keep)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def latest_checkpoint(out: Path) -> Path | None:
    ckpts = out / "checkpoints"
    pointer = ckpts / "latest"
    if pointer.is_file():
        path = ckpts / pointer.read_text().strip()
        if (path / "state.json").is_file():
            return path
    done = sorted(p for p in ckpts.glob("step-*") if (p / "state.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, accelerator, model, optimizer, scheduler) -> dict:
    if _sharded(accelerator):
        accelerator.load_state(str(path / "accelerate"))
    else:
        unwrapped = accelerator.unwrap_model(model)
        saved = torch.load(path / "trainable.pt")
        params = dict(unwrapped.named_parameters())
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng = path / f"rng-rank{accelerator.process_index}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    return json.loads((path / "state.json").read_text())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation (rope_patch.evaluation): perplexity at each length, passkey accuracy at each length.
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, tokenizer, cfg: dict) -> dict:
    from rope_patch.evaluation.perplexity import evaluate_perplexity
    from rope_patch.evaluation.retrieval import accuracy_by_length, evaluate_passkey

    e = cfg["eval"]
    was_training = model.training
    model.eval()
    ids = tokenizer.encode(Path(e["heldout"]).read_text(encoding="utf-8"), add_special_tokens=False)
    out: dict = {}
    if e["perplexity_lengths"]:
        res = evaluate_perplexity(model, ids, e["perplexity_lengths"], n_tokens=e["perplexity_tokens"])
        out["perplexity"] = {str(r["length"]): r["perplexity"] for r in res["lengths"]}
    if e["passkey_lengths"]:
        recs = evaluate_passkey(model, tokenizer, ids, e["passkey_lengths"], e["passkey_depths"], e["passkey_samples"], seed=cfg["seed"])
        out["passkey"] = {str(k): v for k, v in accuracy_by_length(recs).items()}
    model.train(was_training)
    return out


def results_table(rows: dict[str, dict], cfg: dict) -> str:
    e = cfg["eval"]
    cols = [f"ppl@{n}" for n in e["perplexity_lengths"]] + [f"passkey@{n}" for n in e["passkey_lengths"]]
    lines = ["| model | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, r in rows.items():
        cells = [f"{r.get('perplexity', {}).get(str(n), float('nan')):.2f}" for n in e["perplexity_lengths"]]
        cells += [f"{r.get('passkey', {}).get(str(n), float('nan')):.0%}" for n in e["passkey_lengths"]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
def cosine_with_warmup(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up over `warmup` steps, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def weighted_loss(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over rows of each row's weighted next-token NLL (rows weigh equally, whatever their weights sum to)."""
    # logits [b, s, V] -> predictions for positions 1..s-1: [b, V, s-1] for cross_entropy's class dim.
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")  # [b, s-1]
    w = weights[:, 1:].to(nll.dtype)
    return ((nll * w).sum(1) / w.sum(1)).mean()


def main(cfg, *, resume: bool = False) -> dict:
    """Train as configured; returns {"steps", "final_loss", "adapter", "merged", "eval", "log"}.

    `cfg` is a YAML path or a dict (see SCHEMA). With `resume`, continue from the newest complete checkpoint in
    `output_dir` (or start fresh when there is none).
    """
    from accelerate import Accelerator

    cfg = load_config(cfg)  # idempotent on a loaded config; fills defaults and rejects unknown keys
    t = cfg["train"]
    # Every config error surfaces here, before a model is loaded or a process group does any work.
    # WORLD_SIZE is set by accelerate launch / torchrun; reading it avoids starting the process group for a bad config.
    derived = validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    resolve_model(cfg["model"])  # a missing model folder is a config error too
    accelerator = Accelerator(mixed_precision=t["mixed_precision"], gradient_accumulation_steps=derived["accumulation_steps"])

    # Process-wide torch settings for this run, restored on return (main() is also called in-process by tests).
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        if t["threads"]:
            torch.set_num_threads(t["threads"])
        if t["deterministic"]:
            torch.use_deterministic_algorithms(True, warn_only=accelerator.device.type != "cpu")
        return _train(cfg, accelerator, derived, resume)
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])


def _train(cfg: dict, accelerator, derived: dict, resume: bool) -> dict:
    from accelerate.utils import set_seed

    import rope_patch
    from rope_patch.training.pose import pose_inputs

    t = cfg["train"]
    path = resolve_model(cfg["model"])
    out = Path(cfg["output_dir"])
    main_proc = accelerator.is_main_process
    log = (lambda *a: print(*a, flush=True)) if main_proc else (lambda *a: None)
    set_seed(cfg["seed"])  # model init of LoRA weights: the same on every process

    model, tokenizer = build_model(cfg, path)
    stream = token_stream(cfg, tokenizer, accelerator)
    rows = Rows(cfg, stream, tokenizer)
    accumulation = derived["accumulation_steps"]
    log(f"model {path}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable; scheme "
        f"{rope_patch.current(model).name if rope_patch.current(model) else 'none'}; data {len(stream):,} tokens; "
        f"{accelerator.num_processes} process(es) x {accumulation} accumulation step(s) x {t['micro_batch_size']} rows")

    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    before_path = out / "eval_before.json"
    if resume and before_path.is_file():
        results = json.loads(before_path.read_text())
    elif cfg["eval"] is not None and cfg["eval"]["before"] and main_proc:
        base = model.get_base_model()
        scheme = rope_patch.current(base)
        with model.disable_adapter():  # the base weights: before any training
            if scheme is not None:
                rope_patch.remove(base)
            results["base (unpatched)"] = evaluate(base, tokenizer, cfg)
            if scheme is not None:
                rope_patch.apply(base, scheme)
                results[f"{scheme.name}, no fine-tuning"] = evaluate(base, tokenizer, cfg)
        log(results_table(results, cfg))
        before_path.write_text(json.dumps(results, indent=2) + "\n")
    accelerator.wait_for_everyone()

    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": t["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=t["lr"], betas=tuple(t["betas"]))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, t["warmup_steps"], t["steps"], t["min_lr_ratio"]))
    # The scheduler is not prepared: accelerate would step it once per process; it steps once per optimizer step.
    model, optimizer = accelerator.prepare(model, optimizer)

    start_step, tokens_seen, elapsed_before = 0, 0, 0.0
    log_path = out / "train_log.jsonl"
    if resume:
        ckpt = latest_checkpoint(out)
        if ckpt is None:
            log(f"--resume: no complete checkpoint in {out / 'checkpoints'}; starting from step 0")
        else:
            meta = load_checkpoint(ckpt, accelerator, model, optimizer, scheduler)
            if meta["config"] != config_fingerprint(cfg):
                raise ConfigError(f"--resume: {ckpt} was written with a different training config (fingerprint "
                                  f"{meta['config']} vs {config_fingerprint(cfg)}); use a new output_dir or the same config.")
            start_step, tokens_seen, elapsed_before = meta["step"], meta["tokens"], meta["elapsed_s"]
            log(f"resumed from {ckpt} (step {start_step})")
    if main_proc:
        # The log keeps the lines of the steps that are still valid: a crashed run's later lines are dropped.
        kept = []
        if start_step and log_path.is_file():
            kept = [ln for ln in log_path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= start_step]
        _write_atomic(log_path, "".join(ln + "\n" for ln in kept))
        for tmp in (out / "checkpoints").glob(".tmp-step-*"):
            shutil.rmtree(tmp, ignore_errors=True)  # half-written checkpoints of a killed run

    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(total=t["steps"], initial=start_step, disable=not main_proc or tqdm is None or not sys.stderr.isatty(),
               dynamic_ncols=True) if tqdm else None
    model.train()
    tokens_per_step = t["global_batch_size"] * t["seq_len"]
    t0 = time.perf_counter()
    loss_value = float("nan")
    for step in range(start_step, t["steps"]):
        step_start = time.perf_counter()
        losses = []
        for indices in micro_batches(step, cfg, accelerator.process_index, accelerator.num_processes, accumulation):
            batch = rows.batch(step, indices)
            with accelerator.accumulate(model):
                # pose_inputs adds the all-ones attention mask: with skipped position ids (PoSE) transformers would
                # otherwise build a block-diagonal "packed sequences" mask (rope_patch/training/pose.py).
                inputs = pose_inputs(batch["input_ids"].to(accelerator.device), batch["position_ids"].to(accelerator.device))
                logits = model(**inputs, use_cache=False).logits
                loss = weighted_loss(logits, inputs["input_ids"], batch["weights"].to(accelerator.device))
                accelerator.backward(loss)  # divided by the accumulation steps inside accumulate()
                grad_norm = None
                if accelerator.sync_gradients and t["grad_clip"]:
                    # All parameters (frozen ones have no grad): FSDP only uses its sharded clip for exactly this list.
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), t["grad_clip"])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        scheduler.step()
        loss_value = accelerator.reduce(torch.stack(losses).mean(), reduction="mean").item()
        tokens_seen += tokens_per_step
        now = time.perf_counter()
        rate = tokens_per_step / (now - step_start)
        done = step + 1
        if main_proc:
            record = {"step": done, "loss": round(loss_value, 6), "lr": scheduler.get_last_lr()[0], "tokens": tokens_seen,
                      "tokens_per_s": round(rate, 1), "elapsed_s": round(elapsed_before + now - t0, 2)}
            if grad_norm is not None:
                record["grad_norm"] = round(float(grad_norm), 6)
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if bar is not None and not bar.disable:
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{rate:,.0f}")
                bar.update(1)
            elif done % t["log_every"] == 0 or done == t["steps"]:
                log(f"step {done:6d}/{t['steps']}  loss {loss_value:.4f}  lr {record['lr']:.2e}  {rate:,.0f} tok/s  "
                    f"elapsed {record['elapsed_s'] / 60:.1f} min")
        if t["save_every"] and done % t["save_every"] == 0 and done < t["steps"]:
            meta = {"step": done, "tokens": tokens_seen, "elapsed_s": elapsed_before + now - t0,
                    "data_position": {"next_step": done, "rows_per_step": t["global_batch_size"]},
                    "config": config_fingerprint(cfg), "loss": loss_value}
            save_checkpoint(out, done, accelerator, model, optimizer, scheduler, meta, t["keep_checkpoints"])
        _crash_point("after_step", done)
    if bar is not None:
        bar.close()

    # ---- final artefacts --------------------------------------------------------------------------------------
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    summary = {"steps": t["steps"], "final_loss": loss_value, "adapter": str(out / "adapter"), "merged": None,
               "log": str(log_path)}
    sharded = _sharded(accelerator)
    if sharded:
        state = accelerator.get_state_dict(model)  # gathers FSDP / ZeRO-3 shards on the main process (all ranks call it)
        if main_proc:
            unwrapped.save_pretrained(out / "adapter", state_dict=state)
            _write_manifest_only(unwrapped, out / "adapter")
            names = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
            torch.save({k: v.float().cpu() for k, v in state.items() if k in names}, out / "adapter" / "trainable.pt")
    elif main_proc:
        rope_patch.save_pretrained(unwrapped, out / "adapter")
        torch.save(trainable_state(unwrapped), out / "adapter" / "trainable.pt")
    if main_proc:
        tokenizer.save_pretrained(out / "adapter")
        # Sharded parameters cannot be used by one process alone: evaluate and merge a copy rebuilt from the saved
        # adapter (which also exercises the save/reload round trip); otherwise use the trained model itself.
        final = (rope_patch.from_pretrained(out / "adapter", base_model=path, dtype=DTYPES[t["model_dtype"]]).to(accelerator.device)
                 if sharded else unwrapped)
        if cfg["output"]["merge"]:
            merged = (final if sharded else copy.deepcopy(final)).merge_and_unload()  # merge_and_unload keeps the patch
            rope_patch.save_pretrained(merged, out / "merged")  # config.json gets native rope_parameters where they exist
            tokenizer.save_pretrained(out / "merged")
            summary["merged"] = str(out / "merged")
            final = merged if sharded else final
        if cfg["eval"] is not None:
            scheme = rope_patch.current(final)
            results[f"{scheme.name if scheme else 'unpatched'} + LoRA fine-tuned"] = evaluate(final, tokenizer, cfg)
            table = results_table(results, cfg)
            log(table)
            (out / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
            (out / "eval.md").write_text(table + "\n")
        summary["eval"] = results
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    accelerator.wait_for_everyone()
    return summary


def _write_manifest_only(model, directory: Path) -> None:
    """Under FSDP/DeepSpeed the adapter weights are saved from the gathered state dict; add rope_patch.json."""
    import rope_patch
    from rope_patch.persistence import MANIFEST

    tmp = directory / ".manifest"
    rope_patch.save_pretrained(model, tmp)
    os.replace(tmp / MANIFEST, directory / MANIFEST)
    shutil.rmtree(tmp, ignore_errors=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see recipes/configs/)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in output_dir")
    parser.add_argument("--merge", action="store_true", help="also write a merged full model (output.merge)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.steps=10 (repeatable)")
    parser.add_argument("--check", action="store_true", help="validate the config and exit (no model is loaded)")
    return parser.parse_args(argv)


def cli(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        if args.merge:
            cfg["output"]["merge"] = True
        if args.check:
            validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
            print(f"{args.config}: OK")
            return 0
        main(cfg, resume=args.resume)
    except ConfigError as err:
        print(f"finetune_lora: config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
