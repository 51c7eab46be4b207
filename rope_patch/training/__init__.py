"""Fine-tuning with rope_patch on transformers' Trainer (and TRL's SFTTrainer, launched by accelerate or DeepSpeed).

- `PackedDataset`: documents packed into rows of exactly `seq_len` tokens; `IndexedDataset`: adds each example's
  sample index (what the collators seed from); `TextWindows`: windows of a token stream at offsets drawn from
  (seed, sample index), a new index (and so new collator draws) for every sample of a run; `token_stream`:
  documents tokenised once into one `[BOS] doc [EOS] ...` stream, cached on disk; `training_samples`: either
  sampling cut to whole global batches.
- Collators: `PoSECollator` (PoSE skip-wise position ids, `pose.py`), `PasskeyMixer` (passkey-retrieval rows mixed
  into the training rows), `CausalLMCollator` (plain rows). Every random draw is a pure function of
  (seed, sample index) (`seeding.py`), so a resumed Trainer run draws exactly what an uninterrupted one does.
- `RopePatchCallback`: `rope_patch.json` (+ learned tables) in every checkpoint, the patch restored or checked on
  resume; `restore_patch(model, checkpoint)` before building peft / the Trainer; `learned_modules_to_save(model)`
  for `peft.LoraConfig(modules_to_save=...)` (`frozen_tables`: the learned tables a LoRA left frozen, which the
  callback warns about). `CompleteCheckpointCallback` + `last_checkpoint(output_dir)`: resume only from checkpoints
  every process finished writing (`resume_checkpoint` also checks the config's fingerprint;
  `discard_checkpoints_after`); `JsonLogCallback`: one JSON line per logged step.
- `WeightedLossTrainer` + `WeightedCollator`: a per-token weighted loss (passkey answers count more).
- `config.py`: the fine-tuning recipe's YAML config as dataclasses (`load_config` -> `RecipeConfig`), read with
  transformers' `HfArgumentParser`; `ConfigError` for every config mistake, one line.

Set `TrainingArguments(remove_unused_columns=False)`: Trainer would otherwise drop the `"index"` field.
"""

from .collators import CausalLMCollator, PasskeyMixer, PoSECollator, WeightedCollator, sample_index
from .config import ConfigError, RecipeConfig, load_config
from .data import IndexedDataset, PackedDataset, TextWindows, token_stream, training_samples
from .seeding import sample_generator, sample_rng, sample_seed

__all__ = [
    "CausalLMCollator",
    "CompleteCheckpointCallback",
    "ConfigError",
    "IndexedDataset",
    "JsonLogCallback",
    "PackedDataset",
    "PasskeyMixer",
    "PoSECollator",
    "RecipeConfig",
    "RopePatchCallback",
    "TextWindows",
    "WeightedCollator",
    "WeightedLossTrainer",
    "check_patch",
    "checkpoint_step",
    "complete_checkpoints",
    "discard_checkpoints_after",
    "frozen_tables",
    "last_checkpoint",
    "learned_modules_to_save",
    "load_config",
    "restore_patch",
    "resume_checkpoint",
    "sample_generator",
    "sample_index",
    "sample_rng",
    "sample_seed",
    "token_stream",
    "training_samples",
    "weighted_loss",
]

# transformers' Trainer machinery (~3 s to import) only when it is used: `rope_patch.training.pose`, the collators
# and the config stay light.
_LAZY = {name: module for module, names in {
    "callback": ("RopePatchCallback", "check_patch", "learned_modules_to_save", "restore_patch",
                 "frozen_tables", "CompleteCheckpointCallback", "JsonLogCallback", "complete_checkpoints",
                 "last_checkpoint", "checkpoint_step", "resume_checkpoint", "discard_checkpoints_after"),
    "trainer": ("WeightedLossTrainer", "weighted_loss"),
}.items() for name in names}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
