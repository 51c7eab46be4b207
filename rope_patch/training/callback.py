"""rope_patch inside transformers' Trainer: the patch saved with every checkpoint and restored on resume.

Trainer checkpoints hold the model's weights (or peft's adapter), optimizer, scheduler and RNG states, but nothing
of a position-encoding patch: config.json keeps no attention-side scheme, and an adapter carries no
position-encoding information at all. `RopePatchCallback` adds, on every checkpoint save, what
`rope_patch.save_pretrained` adds to a save (`rope_patch.json`, and `rope_patch.safetensors` for learned tables,
through `rope_patch.persistence.save_patch`), so that each `checkpoint-N` loads with `rope_patch.from_pretrained` and a
resumed run gets its patch back:

    model = AutoModelForCausalLM.from_pretrained(path)
    if resume:                                    # before get_peft_model: learned tables must exist to be wrapped
        restore_patch(model, checkpoint)          # re-applies the checkpoint's patch and loads its tables
    else:
        rope_patch.apply(model, "relative_bias")
    model = get_peft_model(model, LoraConfig(..., modules_to_save=learned_modules_to_save(model)))
    trainer = Trainer(model, args, ..., callbacks=[RopePatchCallback()])
    trainer.train(resume_from_checkpoint=checkpoint if resume else None)

On `on_train_begin` of a resumed run the callback finds the checkpoint (its `resume_from_checkpoint=`, else
`args.resume_from_checkpoint`, else `output_dir/checkpoint-{global_step}`) and checks the model against its
`rope_patch.json`: an unpatched model gets the patch re-applied when the scheme has no learned parameters (frequency
and parameter-free attention schemes); a patched one must carry the same scheme and parameters (ValueError
otherwise). A scheme with learned tables cannot be re-applied there: Trainer has built the optimizer (and peft its
`modules_to_save` copies) before `on_train_begin`, so new tables would not train; the callback raises and names
`restore_patch`, which does it before the model is wrapped. On every start, resumed or not, it warns when a learned
table of the patch is frozen (a LoRA built without `modules_to_save=learned_modules_to_save(model)`: peft freezes
the table, which would then keep its initial values; `frozen_tables`).

Two more callbacks for a run that must survive a kill -9 and say how it went (the fine-tuning recipe uses both):
`CompleteCheckpointCallback` marks a checkpoint complete (`recipe_state.json`, written last, after every process has
saved its part), so that a resume takes `last_checkpoint(output_dir)`, never a half-written folder;
`JsonLogCallback` appends one JSON line per logging step (exact loss, learning rate, tokens/s). Resuming:
`resume_checkpoint` (the newest complete checkpoint, refused when written under another config's fingerprint),
and `discard_checkpoints_after` (a killed run's incomplete ones).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from torch import nn
from transformers import TrainerCallback

from .. import schema
from ..api import current, original_config, patch_modules
from ..discovery import unwrap
from ..files import write_text_atomic
from ..persistence import MANIFEST, load_patch_weights, read_manifest, reapply_manifest, save_patch
from ..schemes.base import Scheme
from .config import ConfigError

logger = logging.getLogger(__name__)
CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
COMPLETE = "recipe_state.json"  # written last into a checkpoint: its presence marks the checkpoint complete
RECIPE_STATE = schema.Kind(
    COMPLETE, fix="Delete that checkpoint folder (a resume then takes the one before it) or start in a new output_dir.",
    spec=schema.Obj({"step": schema.Int(ge=0)}, {"config": schema.Opt(schema.Str())}, name="a checkpoint's marker"))


def learned_modules_to_save(model: nn.Module) -> list[str]:
    """Names to put in `peft.LoraConfig(modules_to_save=...)` so that the applied patch's learned tables
    (`relative_bias`, `learned_absolute`) train and are saved with the adapter; [] for schemes without any.

    Call it on the patched model before `get_peft_model` (peft wraps only modules that exist then). Without these
    names peft freezes the tables at their initial values (peft freezes every base-model parameter);
    `RopePatchCallback` warns when training begins with such a frozen table (`frozen_tables`)."""
    return sorted(patch_modules(_unwrap(model)))


def frozen_tables(model: nn.Module) -> list[str]:
    """The names (as `learned_modules_to_save` gives them) of the applied patch's learned tables that will not train:
    every parameter of the table in effect has `requires_grad=False` (peft froze it: the name was not in
    `LoraConfig(modules_to_save=...)`). A table whose parameters the module does not hold (FSDP's flat parameters) is
    not reported."""
    base = _unwrap(model)
    if current(base) is None:
        return []
    found = []
    for name, module in patch_modules(base).items():
        params = list(module.parameters())
        if params and not any(p.requires_grad for p in params):
            found.append(name)
    return sorted(found)


def warn_frozen_tables(model: nn.Module, where: str = "RopePatchCallback") -> list[str]:
    """Log a warning naming the applied patch's frozen learned tables (`frozen_tables`) and the fix; returns them."""
    frozen = frozen_tables(model)
    base = _unwrap(model)
    loaded = [n for n in frozen if _peft_copy(base, n)]
    if loaded:
        logger.warning(
            "%s: the learned table(s) %s of the %s patch are in peft's modules_to_save but frozen "
            "(requires_grad=False): the adapter was loaded for inference, which freezes all of it. Load it with "
            "rope_patch.from_pretrained(dir, is_trainable=True) (or PeftModel.from_pretrained(..., is_trainable=True)) "
            "to train it further.", where, ", ".join(loaded), current(base).name)
    elif frozen:
        logger.warning(
            "%s: the learned table(s) %s of the %s patch are frozen (requires_grad=False) and will not train: peft "
            "freezes every base-model parameter that LoraConfig(modules_to_save=...) does not name, so they keep "
            "their initial values. Build the peft model with peft.LoraConfig(..., modules_to_save="
            "rope_patch.training.learned_modules_to_save(model)) on the patched model, before get_peft_model "
            "(or unfreeze them yourself).", where, ", ".join(frozen), current(base).name)
    return frozen


def restore_patch(model: nn.Module, checkpoint: str | os.PathLike | None) -> Scheme | None:
    """Give `model` the patch recorded in `checkpoint` (a Trainer `checkpoint-N` folder written with
    `RopePatchCallback`, or any folder written by `rope_patch.save_pretrained`); returns the scheme now applied.

    Unpatched model: the recorded scheme is applied. Patched model: it must be the recorded scheme with the
    recorded parameters (ValueError naming both otherwise). In both cases the learned tables are loaded from
    `rope_patch.safetensors` (checked against the manifest's keys and sha256). Call it before `get_peft_model` and
    before building the Trainer. `checkpoint=None` (a fresh start) changes nothing."""
    if checkpoint is None:
        return current(_unwrap(model))
    path = Path(checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"restore_patch: {str(path)!r} is not a checkpoint folder.")
    manifest = read_manifest(path)
    if manifest is None:
        raise FileNotFoundError(f"{path / MANIFEST} is missing: the checkpoint was written without RopePatchCallback "
                                "(or by an older run), so it does not say which patch the model was "
                                "trained with. Apply the scheme yourself with rope_patch.apply, as in the run that "
                                "wrote the checkpoint.")
    if current(_unwrap(model)) is None:
        if (manifest.get("weights") or {}).get("keys") and _unwrap(model) is not model:
            # applied now, the tables would not be peft's modules_to_save (nor the adapter's keys, which the resumed
            # Trainer then fails to load)
            raise ValueError(
                f"restore_patch: {path / MANIFEST} records {manifest['scheme']} with learned tables "
                f"({', '.join(manifest['weights']['keys'])}), but the model is already wrapped "
                f"({type(model).__name__}) and unpatched: call restore_patch(model, {str(path)!r}) on the base model, "
                "before wrapping it (get_peft_model, ...), so that the wrapper holds the restored tables.")
        if manifest["scheme"] is not None:
            reapply_manifest(model, manifest, path / MANIFEST)
    else:
        check_patch(model, manifest, path / MANIFEST)
    if manifest["scheme"] is not None:
        load_patch_weights(model, manifest, path)
    return current(_unwrap(model))


def check_patch(model: nn.Module, manifest: dict, file: str | os.PathLike = MANIFEST) -> None:
    """ValueError when `model`'s patch (scheme, parameters, pre-patch RoPE config) is not the one `manifest`
    (a `read_manifest` result, from `file`) records."""
    base = _unwrap(model)
    scheme = current(base)
    have = {"scheme": None if scheme is None else scheme.name, "params": {} if scheme is None else scheme.params()}
    want = {"scheme": manifest["scheme"], "params": manifest["params"]}
    if _normal(have) != _normal(want):
        raise ValueError(f"{file} records the patch {_label(want)}, but the model carries {_label(have)}: resuming "
                         "would continue training under another position encoding. Build the model as the run that "
                         "wrote the checkpoint did (or leave it unpatched: the recorded patch is then re-applied).")
    if _normal(original_config(base)) != _normal(manifest["original"]):
        raise ValueError(f"{file} was written for a model whose unpatched RoPE config is {manifest['original']}, but "
                         f"this model's is {original_config(base)}: it is another base model.")


def refuse_fsdp_tables(args, model: nn.Module) -> None:
    """ValueError when FSDP shards the run (`args.fsdp`, accelerate's ACCELERATE_USE_FSDP, or FSDP modules or
    DTensor tables in the model) and the applied patch owns learned tables: each process holds a shard of them, and
    the checkpoints' `rope_patch.safetensors` would hold the saving process's shard, not the tables (a reload fails
    on their shapes, after training)."""
    base = _unwrap(model)
    tables = patch_modules(base) if current(base) is not None else {}
    if not tables:
        return
    names = sorted(tables)
    fsdp = (bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
            # FSDP1's wrapper, FSDP2's fully_shard (a subclass of FSDPModule), their DTensor parameters
            or any(c.__name__ in ("FullyShardedDataParallel", "FSDPModule") for m in base.modules()
                   for c in type(m).__mro__)
            or any(type(p).__name__ == "DTensor" for t in tables.values() for p in t.parameters()))
    if fsdp:
        raise ValueError(
            f"RopePatchCallback: the {current(base).name} patch owns learned tables ({', '.join(names)}), which "
            "rope_patch cannot gather under FSDP: every checkpoint's rope_patch.safetensors would hold one process's "
            "shard of them, not the trained tables. Train it with DDP or DeepSpeed ZeRO-3 "
            "(recipes/accelerate/deepspeed_zero3.yaml), or use a scheme without learned tables under FSDP.")


class RopePatchCallback(TrainerCallback):
    """Writes the patch into every Trainer checkpoint (`on_save`) and restores / checks it on resume
    (`on_train_begin`); see the module docstring.

    Args:
        resume_from_checkpoint: the checkpoint a resumed run starts from, when it is not
            `output_dir/checkpoint-{global_step}` (Trainer does not tell callbacks which folder it resumed from).

    Distributed runs: every process calls the callback; only the process that saves (`args.should_save`) writes.
    Under DeepSpeed ZeRO-3 the learned tables are gathered for the write (a collective, on every process); under FSDP
    they are not, so a patch with learned tables is refused when training begins (`refuse_fsdp_tables`; frequency and
    parameter-free schemes, which own no tables, are unaffected).
    """

    def __init__(self, resume_from_checkpoint: str | os.PathLike | None = None):
        self.resume_from_checkpoint = resume_from_checkpoint

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        refuse_fsdp_tables(args, model)
        self._restore_or_check(args, state, model)
        if getattr(state, "is_world_process_zero", True):  # once per run: every process holds the same model
            warn_frozen_tables(model)

    def _restore_or_check(self, args, state, model) -> None:
        checkpoint = self._resumed_checkpoint(args, state)
        if checkpoint is None:
            return
        manifest = read_manifest(checkpoint)
        if manifest is None:
            logger.warning("%s has no %s (written without RopePatchCallback?): the model's position encoding is not "
                           "checked against the run that wrote it.", checkpoint, MANIFEST)
            return
        base = _unwrap(model)
        if current(base) is not None:
            check_patch(base, manifest, checkpoint / MANIFEST)
            return
        if manifest["scheme"] is None:
            return
        if (manifest.get("weights") or {}).get("keys"):
            raise ValueError(
                f"{checkpoint / MANIFEST} records {manifest['scheme']} with learned tables "
                f"({', '.join(manifest['weights']['keys'])}), but the model is not patched. Trainer has already built "
                "the optimizer, so tables added now would not train: call rope_patch.training.restore_patch(model, "
                f"{str(checkpoint)!r}) before get_peft_model and before building the Trainer.")
        reapply_manifest(model, manifest, checkpoint / MANIFEST)
        logger.info("re-applied %s from %s", manifest["scheme"], checkpoint / MANIFEST)

    def on_save(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        folder = Path(args.output_dir) / f"{CHECKPOINT_PREFIX}-{state.global_step}"
        with gathered_tables(model):  # every process: the ZeRO-3 gather is a collective
            if not args.should_save:
                return
            if not folder.is_dir():
                logger.warning("RopePatchCallback: no checkpoint folder %s to write %s into (a hyperparameter-search "
                               "run folder?): this checkpoint carries no patch.", folder, MANIFEST)
                return
            save_patch(model, folder)

    def _resumed_checkpoint(self, args, state) -> Path | None:
        if self.resume_from_checkpoint is not None:
            return Path(self.resume_from_checkpoint)
        if not state.global_step:
            return None
        given = getattr(args, "resume_from_checkpoint", None)
        if isinstance(given, (str, os.PathLike)) and Path(given).is_dir():
            return Path(given)
        folder = Path(args.output_dir) / f"{CHECKPOINT_PREFIX}-{state.global_step}"
        if folder.is_dir():
            return folder
        logger.warning("RopePatchCallback: resumed at step %d but found no %s; pass RopePatchCallback("
                       "resume_from_checkpoint=...) to check the patch.", state.global_step, folder)
        return None


class CompleteCheckpointCallback(TrainerCallback):
    """After every process has written its part of `checkpoint-N`, the saving process writes `recipe_state.json`
    ({"step": N, "config": fingerprint}) into it: `complete_checkpoints` / `last_checkpoint` only trust checkpoints
    that have it (a run killed inside a save leaves a folder without it).

    `keep`: how many complete checkpoints to keep (None or 0: all); the older ones are removed once the new one is
    marked. Use it instead of `TrainingArguments(save_total_limit=...)`: Trainer removes old checkpoints before the
    callbacks' `on_save`, so a run killed between the two is left with no complete checkpoint at all where the limit
    is 1 (every step is then trained again)."""

    def __init__(self, fingerprint: str | None = None, keep: int | None = None):
        self.fingerprint, self.keep = fingerprint, keep

    def on_save(self, args, state, control, **kwargs):
        from accelerate import PartialState

        PartialState().wait_for_everyone()
        folder = Path(args.output_dir) / f"{CHECKPOINT_PREFIX}-{state.global_step}"
        if args.should_save and folder.is_dir():
            write_text_atomic(folder / COMPLETE,
                              json.dumps({"step": state.global_step, "config": self.fingerprint}) + "\n")
            if self.keep:
                # Trainer's own rotation keeps its best checkpoint (load_best_model_at_end reads it at the end)
                best = getattr(state, "best_model_checkpoint", None)
                for old in complete_checkpoints(args.output_dir)[:-self.keep]:
                    if best is None or Path(best).resolve() != old.resolve():
                        _remove_checkpoint(old)


def _remove_checkpoint(folder: Path) -> None:
    """Its completion mark first: a kill during the removal leaves an incomplete folder (skipped on resume, cleared by
    `discard_checkpoints_after`), never a 'complete' one whose weights are gone."""
    (folder / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete checkpoints (with recipe_state.json) under a Trainer `output_dir`, oldest first."""
    found = [p for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}-*") if checkpoint_step(p) is not None
             and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0)


def last_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under a Trainer `output_dir`, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def resume_checkpoint(output_dir: str | os.PathLike, fingerprint: str | None) -> Path | None:
    """The checkpoint to resume from: the newest complete one under a Trainer `output_dir` (None when there is none),
    refused with a ConfigError when it was written under another training config (the fingerprint its
    recipe_state.json holds differs from `fingerprint`)."""
    checkpoint = last_checkpoint(output_dir)
    if checkpoint is not None:
        written = schema.read(checkpoint / COMPLETE, RECIPE_STATE).get("config")
        if written != fingerprint:
            raise ConfigError(f"Cannot resume from {checkpoint}: it was written with a different training config "
                              f"(fingerprint {written} vs {fingerprint}); use a new output_dir or the same config.")
    return checkpoint


def discard_checkpoints_after(output_dir: str | os.PathLike, step: int) -> None:
    """Remove the `checkpoint-N` folders with N > `step` (the incomplete ones a killed run left behind: the resumed
    run saves those steps again, and a half-written folder must not be taken for its new save)."""
    for folder in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}-*"):
        if (checkpoint_step(folder) or 0) > step:
            shutil.rmtree(folder, ignore_errors=True)


def checkpoint_step(folder: str | os.PathLike) -> int | None:
    """N of a `checkpoint-N` folder, None for any other name."""
    tail = Path(folder).name.rsplit("-", 1)[-1]
    return int(tail) if Path(folder).name.startswith(f"{CHECKPOINT_PREFIX}-") and tail.isdigit() else None


class JsonLogCallback(TrainerCallback):
    """Appends one line to `path` per logging step with the exact loss (Trainer's log, gathered over processes):
    {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"}; the main process only. With
    `args.disable_tqdm` it also prints the line as text. A resumed run passes the step it resumes from and the
    elapsed seconds of the lines it kept."""

    def __init__(self, path: str | os.PathLike, tokens_per_step: int, *, elapsed_before: float = 0.0,
                 last_step: int = 0):
        self.path, self.tokens_per_step, self.elapsed_before = Path(path), tokens_per_step, elapsed_before
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



def _peft_copy(base: nn.Module, name: str) -> bool:
    """Whether the table `name` of `base` is wrapped by peft (`modules_to_save`)."""
    try:
        return hasattr(base.get_submodule(name), "modules_to_save")
    except AttributeError:
        return False


def _unwrap(model: nn.Module) -> nn.Module:
    """`target.unwrap` plus the FSDP wrapper Trainer hands callbacks under FSDP."""
    while type(model).__name__ == "FullyShardedDataParallel" and hasattr(model, "module"):
        model = model.module  # type: ignore[assignment]
    return unwrap(model)


@contextlib.contextmanager
def gathered_tables(model: nn.Module):
    """Full learned tables inside the block under DeepSpeed ZeRO-3 (partitioned parameters carry `ds_id`), for a
    `save_patch` of them; a collective there, so every process enters it (only the saving one need write)."""
    base = _unwrap(model)
    params = [p for m in patch_modules(base).values() for p in m.parameters()] if current(base) is not None else []
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed  # only under ZeRO-3, where it is installed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
    else:
        yield


def _normal(value):
    """JSON round trip (tuples -> lists, as the manifest stores them) for comparing recorded and live values."""
    return json.loads(json.dumps(value, sort_keys=True, default=list))


def _label(patch: dict) -> str:
    if patch["scheme"] is None:
        return "no patch"
    params = ", ".join(f"{k}={v!r}" for k, v in sorted(patch["params"].items()))
    return f"{patch['scheme']}({params})"
