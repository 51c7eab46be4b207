"""Long-context LoRA fine-tuning of a rope_patch-patched LLaMA-family model on transformers' Trainer (+ peft,
accelerate).

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

One recipe class in torchtune's shape, `LoRAFinetuneRecipe`: setup() patches the model (`rope_patch.apply(model,
**cfg["rope_patch"])`), wraps it with `peft.LoraConfig(**cfg["lora"])` and builds the rows (windows or packed rows,
passkey rows whose answer tokens weigh `data.answer_loss_weight`, PoSE position ids); evaluate() scores perplexity
and passkey before and after; train() runs `rope_patch.training.WeightedLossTrainer`; save() writes the adapter with
its rope_patch.json and, with --merge, a merged model through `rope_patch.save_pretrained` (the project's one save
rule: config.json carries the native `rope_parameters` where the whole patch has them, else a logged warning).

Config: one dataclass per YAML section, read by transformers' `HfArgumentParser` (rope_patch/training/config.py says
why that and not OmegaConf); so is this command line (`Command`). `train:` also takes any other `TrainingArguments`
field; the recipe derives the rest: per-device batch and accumulation from the global batch and the process count,
`cosine_with_min_lr` with warm-up, Trainer checkpoints `output_dir/checkpoints/checkpoint-N` (+ rope_patch.json).

Papers: Position Interpolation (arXiv:2306.15595) and YaRN (arXiv:2309.00071) fine-tune briefly at the target
length; LongLoRA (arXiv:2309.12307): LoRA alone lags at long context unless embeddings and norms train too (PG19 ppl
at 32k: 11.4-12.0 vs 8.1) - put `modules_to_save: [embed_tokens, norm]` in `lora:`; PoSE (arXiv:2309.10400) trains
short rows with skipped position ids (rope_patch/training/pose.py, including the transformers mask trap).

Determinism and resume: every draw of the collators is a pure function of (seed, sample index)
(rope_patch/training/seeding.py), because Trainer resumes by skipping the batches already seen without calling the
collator. A checkpoint is complete once recipe_state.json (written last, after every process saved, with the config's
fingerprint) exists; --resume continues from the newest complete one, refuses one of another training config and removes
newer incomplete ones; a run without --resume refuses an output_dir that holds checkpoints. The dataset is cut to whole
global batches, so one process with accumulation and N processes see the same rows per step
(tests/recipes/test_distributed.py: identical losses and weights). On CPU use torchrun: `accelerate launch` with
ddp_cpu.yaml needs MPI, else it starts ONE process; FSDP runs only on GPUs (accelerate would silently fall back to DDP
on CPU: the recipe refuses). The GPU configs in recipes/accelerate/ are parsed by the tests but were never run here.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import peft
import torch
import yaml
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, set_seed
from transformers.trainer_callback import PrinterCallback

import rope_patch
from rope_patch.files import write_text_atomic
from rope_patch.persistence import save_patch
from rope_patch.training import (
    CausalLMCollator,
    CompleteCheckpointCallback,
    JsonLogCallback,
    PasskeyMixer,
    PoSECollator,
    RopePatchCallback,
    WeightedCollator,
    WeightedLossTrainer,
    checkpoint_step,
    discard_checkpoints_after,
    learned_modules_to_save,
    restore_patch,
    resume_checkpoint,
    training_samples,
)
from rope_patch.training.callback import gathered_tables
from rope_patch.training.config import CHECKPOINTS, ConfigError, RecipeConfig, load_config
from rope_patch.training.trainer import refuse_fsdp_on_cpu, torch_settings, weighted_loss  # noqa: F401 (bench/finetune.py)


class LoRAFinetuneRecipe:
    """setup() -> evaluate("before") -> train() -> save(), as torchtune's recipes; `run()` does all of them.

    `cfg`: a YAML path, a dict or a RecipeConfig. `resume`: continue from the newest complete checkpoint in
    `output_dir/checkpoints` (or start fresh when there is none). `callbacks`: extra TrainerCallbacks, called before
    the recipe's own (the tests inject crashes with them). Every config error is raised here, before a model is
    loaded or a process group does any work (WORLD_SIZE is set by torchrun / accelerate launch)."""

    def __init__(self, cfg, *, resume: bool = False, callbacks=()):
        self.cfg: RecipeConfig = load_config(cfg)
        self.derived = self.cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))
        self.resume, self.extra_callbacks = resume, list(callbacks)
        self.out = Path(self.cfg.run.output_dir)
        self.results: dict = {}
        self.main_process = True  # until setup() knows the process index
        self.upcast: list = []  # trainable parameters build_model put in float32

    def run(self) -> dict:
        """Train as configured; returns {"steps", "final_loss", "adapter", "merged", "eval", "log", "resumed_from"}."""
        with torch_settings(threads=self.cfg.train.threads, deterministic=self.cfg.train.deterministic):
            self.setup()
            self.results = self.evaluate("before")
            self.train()
            return self.save()

    # ---- setup -----------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        self.args = cfg.training_arguments(self.derived["accumulation_steps"])  # the process group, under torchrun
        self.main_process = self.args.process_index == 0
        self.path = cfg.run.model_path()
        self.checkpoint = resume_checkpoint(self.out / CHECKPOINTS, cfg.fingerprint()) if self.resume else None
        earlier = sorted((p for p in (self.out / CHECKPOINTS).glob("checkpoint-*") if checkpoint_step(p) is not None),
                         key=checkpoint_step)
        if not self.resume and earlier:
            # a fresh run would overwrite some of them and leave the others, and a later --resume could take one
            # of the earlier run's newer checkpoints for its own
            raise ConfigError(f"{self.out / CHECKPOINTS} holds checkpoints of an earlier run "
                              f"({', '.join(p.name for p in earlier)}): pass --resume to continue that run, or "
                              "delete them (or set another output_dir) to start over.")
        if self.resume and self.checkpoint is None:
            self.log(f"--resume: no complete checkpoint in {self.out / CHECKPOINTS}; starting from step 0")
        self.resumed_step = checkpoint_step(self.checkpoint) if self.checkpoint is not None else 0

        set_seed(cfg.run.seed)  # LoRA weight init: the same on every process
        self.model, self.tokenizer = self.build_model(self.checkpoint)
        with self.args.main_process_first(desc="tokenize"):
            self.stream = cfg.data.token_stream(self.tokenizer)  # the main process tokenises, the others read the cache
        self.dataset = self.build_dataset(self.stream)
        self.collator = self.build_collator(self.tokenizer, self.stream)
        scheme = rope_patch.current(self.model)
        params = list(self.model.parameters())
        self.log(f"model {self.path}: {sum(p.numel() for p in params):,} parameters, "
                 f"{sum(p.numel() for p in params if p.requires_grad):,} trainable; scheme "
                 f"{scheme.name if scheme else 'none'}; data {len(self.stream):,} tokens, {len(self.dataset):,} "
                 f"rows of {t.seq_len}; {self.args.world_size} process(es) x {self.derived['accumulation_steps']} "
                 f"accumulation step(s) x {t.micro_batch_size} rows")
        self.log_path, self.elapsed_before = self.out / "train_log.jsonl", 0.0
        if self.main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            if self.resume:  # a killed run's newer, incomplete checkpoints go (all of them when none is complete)
                discard_checkpoints_after(self.out / CHECKPOINTS, self.resumed_step)
            self.elapsed_before = trim_log(self.log_path, self.resumed_step)  # the log lines of lost steps go

    def build_model(self, checkpoint: Path | None = None):
        """The patched base model wrapped by peft (the patch's learned tables added to modules_to_save) + tokenizer.
        Resuming, `restore_patch` checks the checkpoint's patch and loads its learned tables before peft wraps them."""
        t, lora = self.cfg.train, self.cfg.lora
        kwargs = {"dtype": getattr(torch, t.model_dtype)}
        if t.attn_implementation:
            kwargs["attn_implementation"] = t.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(self.path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(self.cfg.run.tokenizer or self.path)
        if self.cfg.patch is not None:
            rope_patch.apply(model, self.cfg.patch.resolved)
        if checkpoint is not None:
            restore_patch(model, checkpoint)
        if t.gradient_checkpointing:
            # Non-reentrant checkpointing works with frozen inputs (LoRA): no enable_input_require_grads hack needed.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # no KV cache in training (and with a cache transformers skips mask checks)
        learned = learned_modules_to_save(model)
        if learned:  # relative_bias / learned_absolute tables: without this, peft would freeze them
            lora = dataclasses.replace(lora, modules_to_save=sorted(set(lora.modules_to_save or []) | set(learned)))
        model = peft.get_peft_model(model, lora)
        # peft keeps LoRA's weights in float32, but its modules_to_save copies (the learned tables, embed_tokens, norm)
        # in the base weights' dtype, where most of Adam's small steps are lost (bfloat16: 8 significant bits; at
        # lr 1e-4 ~90% of a relative_bias table never moved). Under autocast they train in float32, and go back to the
        # base dtype once saved (save()), for the evaluation and the merge.
        low = {n: p for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32}
        if low and t.mixed_precision != "no":
            for p in low.values():
                p.data = p.data.float()
            self.upcast = list(low.values())
        elif low:
            self.log(f"warning: {', '.join(sorted(low))} train in {t.model_dtype}, where most small updates are lost: "
                     "set `train.mixed_precision` (bf16 / fp16), which keeps the trainable weights in float32.")
        return model, tokenizer

    def build_dataset(self, stream: torch.Tensor):
        """Samples with their "index" (what the collators seed from), whole global batches (`data.sampling`)."""
        t = self.cfg.train
        try:
            return training_samples(stream, t.seq_len, t.global_batch_size, steps=t.steps,
                                    sampling=self.cfg.data.sampling, seed=self.cfg.run.seed)
        except ValueError as err:
            raise ConfigError(f"The training data is too short for `train.seq_len`={t.seq_len}: {err}") from None

    def build_collator(self, tokenizer, stream: torch.Tensor) -> WeightedCollator:
        """PoSE position ids or plain rows, passkey rows mixed in (passkey_fraction > 0), answer tokens weighted."""
        d, seed, pose = self.cfg.data, self.cfg.run.seed, self.cfg.pose
        collator = (PoSECollator(pose.target_length, pose.n_chunks, seed=seed) if pose is not None
                    else CausalLMCollator())
        if d.passkey_fraction > 0:
            try:
                collator = PasskeyMixer(tokenizer, stream, d.passkey_fraction, d.passkey_min_tokens,
                                        seed=seed, collator=collator)
            except ValueError as err:
                raise ConfigError(f"`data`: {err}") from None
        return WeightedCollator(collator, float(d.answer_loss_weight))

    # ---- train -----------------------------------------------------------------------------------------------
    def train(self) -> None:
        t = self.cfg.train
        PartialState().wait_for_everyone()  # the main process has evaluated and prepared the output folder
        self.trainer = WeightedLossTrainer(
            model=self.model, args=self.args, train_dataset=self.dataset, data_collator=self.collator,
            callbacks=[*self.extra_callbacks, RopePatchCallback(resume_from_checkpoint=self.checkpoint),
                       CompleteCheckpointCallback(self.cfg.fingerprint(), keep=t.keep_checkpoints),
                       JsonLogCallback(self.log_path, t.global_batch_size * t.seq_len,
                                       elapsed_before=self.elapsed_before, last_step=self.resumed_step)])
        if self.args.disable_tqdm:  # JsonLogCallback prints one line per log; Trainer's printer would repeat it
            self.trainer.remove_callback(PrinterCallback)
        refuse_fsdp_on_cpu(self.trainer)
        self.log(f"distributed: {self.trainer.accelerator.distributed_type.value}, {self.args.world_size} "
                 f"process(es) on {self.args.device.type}")
        if self.checkpoint is not None:
            self.log(f"resumed from {self.checkpoint} (step {self.resumed_step})")
        self.result = self.trainer.train(resume_from_checkpoint=str(self.checkpoint) if self.checkpoint is not None
                                         else None)

    # ---- evaluate --------------------------------------------------------------------------------------------
    def evaluate(self, when: str = "after", model=None) -> dict:
        """Main process. "before": the base model unpatched and patched, untrained (read back on --resume);
        "after": `model` (the fine-tuned one). Each row: perplexity and passkey accuracy at each length."""
        e, seed = self.cfg.eval, self.cfg.run.seed
        before_path = self.out / "eval_before.json"
        if not self.main_process:
            return {}
        if when == "after":
            return {f"{_label(rope_patch.current(model))} + LoRA fine-tuned": e.score(model, self.tokenizer, seed)}
        if self.resume and before_path.is_file():
            return json.loads(before_path.read_text())
        if e is None or not e.before:
            return {}
        rows, base, scheme = {}, self.model.get_base_model(), rope_patch.current(self.model)
        # peft's modules_to_save wrappers of the learned tables: remove() detaches them and apply() attaches fresh,
        # unwrapped tables, which the adapter would then neither train as its own nor save (and --resume could not
        # load its checkpoints); they go back in place of the fresh ones
        wrapped = {name: base.get_submodule(name) for name in learned_modules_to_save(base)}
        with self.model.disable_adapter():  # the base weights: before any training
            if scheme is not None:
                rope_patch.remove(base)
            rows["base (unpatched)"] = e.score(base, self.tokenizer, seed)
            if scheme is not None:
                rope_patch.apply(base, scheme)
                for name, module in wrapped.items():
                    base.set_submodule(name, module)
                rows[f"{_label(scheme)}, no fine-tuning"] = e.score(base, self.tokenizer, seed)
        self.log(e.table(rows))
        before_path.write_text(json.dumps(rows, indent=2) + "\n")
        return rows

    # ---- save ------------------------------------------------------------------------------------------------
    def save(self) -> dict:
        """The adapter (+ rope_patch.json, tokenizer), with --merge the merged model, the final evaluation."""
        trainer, cfg, adapter = self.trainer, self.cfg, self.out / "adapter"
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r] or [self.result.training_loss]
        trainer.save_model(str(adapter))  # every process: gathers FSDP / ZeRO-3 shards; the main process writes
        summary = {"steps": trainer.state.global_step, "final_loss": losses[-1],  # the last logged loss
                   "adapter": str(adapter), "merged": None, "log": str(self.log_path), "eval": self.results,
                   "resumed_from": str(self.checkpoint) if self.checkpoint is not None else None}
        # rope_patch.json (+ learned tables): the adapter reloads with its patch. ZeRO-3 partitions the tables: they
        # are gathered on every process (a collective) for the main process to write
        with gathered_tables(self.model):
            if self.main_process:
                save_patch(self.model, adapter)
        for p in self.upcast:  # saved in float32; the base dtype again, as the rest of the model (build_model)
            p.data = p.data.to(getattr(torch, cfg.train.model_dtype))
        if self.main_process:
            self.tokenizer.save_pretrained(adapter)
            # Sharded parameters cannot be used by one process alone: evaluate and merge a copy rebuilt from the saved
            # adapter (which also exercises the save/reload round trip); otherwise use the trained model itself.
            sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled
            final = (rope_patch.from_pretrained(adapter, base_model=self.path,
                                                dtype=getattr(torch, cfg.train.model_dtype))
                     .to(self.args.device) if sharded else trainer.accelerator.unwrap_model(trainer.model))
            if cfg.output.merge:
                merged = (final if sharded else copy.deepcopy(final)).merge_and_unload()  # keeps the patch
                # the one save rule (native config.json or a warning), with the tokenizer a serving engine loads
                rope_patch.save_pretrained(merged, self.out / "merged", tokenizer=self.tokenizer)
                summary["merged"] = str(self.out / "merged")
            if cfg.eval is not None:
                self.results.update(self.evaluate("after", final))
                table = cfg.eval.table(self.results)
                self.log(table)
                (self.out / "eval.json").write_text(json.dumps(self.results, indent=2) + "\n")
                (self.out / "eval.md").write_text(table + "\n")
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        PartialState().wait_for_everyone()
        return summary

    def log(self, *text) -> None:
        if self.main_process:
            print(*text, flush=True)


# ---- command line --------------------------------------------------------------------------------------------------
def _label(scheme) -> str:
    """A scheme as the evaluation table names it: its name, and the Resonance flag where it is set (the two runs of
    tiny_yarn_4x.yaml and tiny_yarn_4x_resonance.yaml must not share a label)."""
    if scheme is None:
        return "unpatched"
    if scheme.kind == "stack":  # its parts, not "stack": two runs of different stacks must not share a label
        return " + ".join(_label(part) for part in scheme.schemes)
    return scheme.name + ("+resonance" if getattr(scheme, "resonance", False) else "")


def main(cfg, *, resume: bool = False, callbacks=()) -> dict:
    """`LoRAFinetuneRecipe(cfg, resume=..., callbacks=...).run()`."""
    return LoRAFinetuneRecipe(cfg, resume=resume, callbacks=callbacks).run()


@dataclass
class Command:
    """The recipe's flags; transformers' HfArgumentParser builds the parser from these fields."""

    config: str = field(metadata={"help": "YAML config (see recipes/configs/)"})
    resume: bool = field(default=False, metadata={"help": "continue from the newest complete checkpoint in output_dir"})
    merge: bool = field(default=False, metadata={"help": "also write a merged full model (output.merge)"})
    check: bool = field(default=False, metadata={"aliases": ["--dry-run"], "help": "validate the config and exit "
                                                 "(no model is loaded, nothing is written)"})
    set: list[str] = field(default_factory=list, metadata={
        "action": "extend", "metavar": "KEY=VALUE",
        "help": "override a config value, e.g. --set train.steps=10 (a YAML value; repeatable)"})


def parse_overrides(items: list[str]) -> dict:
    """--set's `section.key=value` strings -> {"section.key": value}, each value read as YAML."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set expects section.key=value, got {item!r}.")
        out[key] = yaml.safe_load(value)
    return out


def trim_log(path: Path, step: int) -> float:
    """Keep the train_log.jsonl lines up to `step`, the step resumed from (0: none; a missing log is created empty):
    a crashed run's later lines are written again. Returns the elapsed_s of the last line kept (JsonLogCallback's
    elapsed_before)."""
    kept = [ln for ln in (path.read_text().splitlines() if path.is_file() else [])
            if ln.strip() and json.loads(ln)["step"] <= step]
    write_text_atomic(path, "".join(ln + "\n" for ln in kept))
    return json.loads(kept[-1])["elapsed_s"] if kept else 0.0


def cli(argv=None) -> int:
    parser = HfArgumentParser(Command, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args, rest = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True, look_for_args_file=False)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        cfg = load_config(args.config, parse_overrides(args.set))
        cfg.output.merge = cfg.output.merge or args.merge
        if args.check:
            cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))
            print(f"{args.config}: OK")
            return 0
        main(cfg, resume=args.resume)
    except ConfigError as err:
        print(f"finetune_lora: config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
