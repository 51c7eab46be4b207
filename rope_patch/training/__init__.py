"""Fine-tuning with rope_patch on transformers' Trainer (and TRL's SFTTrainer, launched by accelerate or DeepSpeed).

- `PackedDataset`: documents packed into rows of exactly `seq_len` tokens; `IndexedDataset`: adds each example's
  sample index (what the collators seed from); `TextWindows`: windows of a token stream at offsets drawn from
  (seed, sample index), a new index (and so new collator draws) for every sample of a run.
- Collators: `PoSECollator` (PoSE skip-wise position ids, `pose.py`), `PasskeyMixer` (passkey-retrieval rows mixed
  into the training rows), `CausalLMCollator` (plain rows). Every random draw is a pure function of
  (seed, sample index) (`seeding.py`), so a resumed Trainer run draws exactly what an uninterrupted one does.
- `RopePatchCallback`: `rope_patch.json` (+ learned tables) in every checkpoint, the patch restored or checked on
  resume; `restore_patch(model, checkpoint)` before building peft / the Trainer; `learned_modules_to_save(model)`
  for `peft.LoraConfig(modules_to_save=...)`.

Set `TrainingArguments(remove_unused_columns=False)`: Trainer would otherwise drop the `"index"` field.
"""

from .collators import CausalLMCollator, PasskeyMixer, PoSECollator, sample_index
from .data import IndexedDataset, PackedDataset, TextWindows
from .seeding import sample_generator, sample_rng, sample_seed

__all__ = [
    "CausalLMCollator",
    "IndexedDataset",
    "PackedDataset",
    "PasskeyMixer",
    "PoSECollator",
    "RopePatchCallback",
    "TextWindows",
    "check_patch",
    "learned_modules_to_save",
    "restore_patch",
    "sample_generator",
    "sample_index",
    "sample_rng",
    "sample_seed",
]

_CALLBACK = ("RopePatchCallback", "check_patch", "learned_modules_to_save", "restore_patch")


def __getattr__(name: str):
    # transformers' Trainer machinery (~3 s to import) only when the callback is used: `rope_patch.training.pose`
    # and the collators stay light (the recipe imports them).
    if name in _CALLBACK:
        from . import callback

        return getattr(callback, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
