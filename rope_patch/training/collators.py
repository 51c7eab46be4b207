"""Data collators for transformers' Trainer (and TRL's SFTTrainer): PoSE position ids and passkey rows.

Every random draw is a pure function of (seed, sample index) through a per-sample generator (`seeding.py`), never
of the global RNG or of the batch: Trainer resumes by skipping the batches already seen without calling the
collator, so a collator with state or global randomness would draw differently after a resume. Each example must
therefore carry its `"index"` (`PackedDataset` rows do; otherwise wrap the dataset in `IndexedDataset`) and Trainer
must not drop that column: `TrainingArguments(remove_unused_columns=False)`.

    train = PackedDataset(token_docs, seq_len=1024, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    collator = PasskeyMixer(tok, train.stream, fraction=0.5, min_tokens=256, seed=args.seed,
                            collator=PoSECollator(target_length=8192, seed=args.seed))
    Trainer(model, args, train_dataset=train, data_collator=collator, callbacks=[RopePatchCallback()])

Rows must all have the same length (packed rows do): the collators make no padding, so the batch holds only
tokens to train on and the PoSE attention mask stays all ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..evaluation.passkey import LEAD_IN, NEEDLE, QUESTION, make_passkey_sample
from .data import INDEX
from .pose import pose_inputs, pose_position_ids, validate_pose
from .seeding import as_index, sample_rng

_NO_INDEX = ("the example has no {key!r} field: the collators draw per sample from (seed, index). Give every example "
             "its index in the dataset (rope_patch.training.PackedDataset rows have it; wrap other datasets in "
             "IndexedDataset) and keep Trainer from dropping the column: "
             "TrainingArguments(remove_unused_columns=False).")


def sample_index(example: Mapping, key: str = INDEX) -> int:
    """The example's sample index, or a ValueError that says how to provide it."""
    if not isinstance(example, Mapping):
        raise TypeError("expected examples as mappings ({'input_ids': ..., 'index': i}), "
                        f"got {type(example).__name__}.")
    if key not in example:
        raise ValueError(_NO_INDEX.format(key=key) + f" Fields found: {sorted(example)}.")
    return as_index(example[key], key)


def stack_rows(examples: Sequence[Mapping]) -> torch.Tensor:
    """[batch, seq] LongTensor of the examples' `input_ids`, which must all have the same length."""
    if not examples:
        raise ValueError("empty batch.")
    rows = [torch.as_tensor(ex["input_ids"], dtype=torch.long) for ex in examples]
    lengths = sorted({r.shape[-1] for r in rows})
    if len(lengths) > 1 or rows[0].dim() != 1:
        raise ValueError(f"rows of different lengths {lengths} in one batch: these collators do not pad; pack the "
                         "documents into rows of one length first (rope_patch.training.PackedDataset).")
    return torch.stack(rows)


@dataclass
class CausalLMCollator:
    """Rows of equal length -> {"input_ids", "attention_mask" (all ones), "labels" (= input_ids; the model shifts)}.
    Deterministic: no draw at all."""

    def __call__(self, examples: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        ids = stack_rows(examples)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@dataclass
class PoSECollator:
    """PoSE (Zhu et al. 2023, arXiv:2309.10400): rows of `train_length` tokens whose position ids skip ahead so that
    distances up to `target_length` occur in training (`pose.pose_position_ids`: `n_chunks` chunks, the first at 0,
    increasing, the largest <= target_length - 1).

    The position ids of the example with index i are drawn from `random.Random(sample_seed(seed, i, "pose"))`: the
    same for that example whatever the batch, order, process count or resume. Returns {"input_ids", "position_ids",
    "attention_mask", "labels"}; the all-ones attention mask is required (without it transformers reads the skips
    as packed-sequence boundaries and builds a block-diagonal mask: see `pose.py`).

    PoSE acts through `position_ids`: RoPE and the frequency schemes read them, and so do the additive absolute
    schemes (`learned_absolute`, `sinusoidal`); the bias schemes (`alibi`, `relative_bias`) measure distance by
    token order, so the skips do not reach them.
    """

    target_length: int
    n_chunks: int = 2
    seed: int = 0

    def __post_init__(self):
        validate_pose(1, self.target_length, 1)  # target_length's type and sign; the row length comes per batch
        if isinstance(self.n_chunks, bool) or not isinstance(self.n_chunks, int) or self.n_chunks < 1:
            raise ValueError(f"pose.n_chunks must be a positive integer, got {self.n_chunks!r}.")

    def position_ids(self, index: int, train_length: int) -> list[int]:
        """The PoSE position ids of sample `index` (a row of `train_length` tokens)."""
        return pose_position_ids(train_length, self.target_length, self.n_chunks, sample_rng(self.seed, index, "pose"))

    def __call__(self, examples: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        ids = stack_rows(examples)
        validate_pose(ids.shape[1], self.target_length, self.n_chunks)
        positions = [self.position_ids(sample_index(ex), ids.shape[1]) for ex in examples]
        batch = pose_inputs(ids, positions)
        batch["labels"] = ids.clone()
        return batch


@dataclass
class PasskeyMixer:
    """Mix passkey-retrieval rows into the training rows, as recipes/finetune_lora.py does.

    With probability `fraction` a row (of n tokens) becomes: a passkey prompt (`evaluation.passkey.
    make_passkey_sample`, the same format the evaluation scores) of a length drawn uniformly from
    [min_tokens, n - 8], a needle depth uniform in [0, 1) and a filler stretch from `filler_ids`, then the answer
    ` 12345` and EOS, then the row's own first tokens up to n (8: room for the answer and EOS, as in the recipe).
    Everything is drawn from `random.Random(sample_seed(seed, index, "passkey"))`; the other rows pass unchanged.
    The mixed examples then go to `collator` (default `CausalLMCollator()`; chain `PoSECollator` for PoSE rows).

    `mix(example)` returns the example as training sees it; a passkey row carries a "passkey" field ({"answer",
    "depth", "prompt_tokens", "needle_start", "needle_end", "answer_start", "answer_end"}: token spans in the row)
    for inspection, which the collators ignore. The model's own loss treats every token alike; to weigh the answer
    tokens more (recipes/finetune_lora.py's `answer_loss_weight`) build per-token weights from
    `answer_start:answer_end` and compute the loss yourself (a `Trainer.compute_loss` override, as the recipe does).
    """

    tokenizer: Any
    filler_ids: Sequence[int]
    fraction: float
    min_tokens: int = 64
    seed: int = 0
    collator: Callable[[Sequence[Mapping]], dict] = field(default_factory=CausalLMCollator)

    def __post_init__(self):
        if (isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float))
                or not 0.0 <= self.fraction <= 1.0):
            raise ValueError(f"PasskeyMixer: fraction must be a number in [0, 1], got {self.fraction!r}.")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 16:
            raise ValueError("PasskeyMixer: min_tokens must be an integer >= 16 (room for the needle and "
                             f"the question), got {self.min_tokens!r}.")
        self.filler_ids = (self.filler_ids.tolist() if isinstance(self.filler_ids, torch.Tensor)
                           else [int(t) for t in self.filler_ids])
        # BOS + needle + question with a 5-digit key: the shortest prompt this tokenizer can make.
        shortest = (self.tokenizer.bos_token_id is not None) + sum(
            len(self.tokenizer.encode(text, add_special_tokens=False))
            for text in (NEEDLE.format(passkey=99999), QUESTION + LEAD_IN))
        if self.min_tokens < shortest:
            raise ValueError(f"PasskeyMixer: min_tokens={self.min_tokens} cannot hold the needle and the question, "
                             f"which take {shortest} tokens with this tokenizer: set min_tokens >= {shortest}.")

    def mix(self, example: Mapping) -> dict:
        index = sample_index(example)
        rng = sample_rng(self.seed, index, "passkey")
        if not (self.fraction > 0 and rng.random() < self.fraction):
            return dict(example)
        row = torch.as_tensor(example["input_ids"], dtype=torch.long).tolist()
        n = len(row)
        if not self.min_tokens <= n - 8:
            raise ValueError(f"PasskeyMixer: rows of {n} tokens cannot hold a passkey prompt of min_tokens="
                             f"{self.min_tokens} plus the answer: lower min_tokens to at most {n - 8}.")
        length = rng.randint(self.min_tokens, n - 8)
        sample = make_passkey_sample(self.tokenizer, self.filler_ids, length, rng.random(), rng)
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        ids = sample["prompt_ids"] + sample["answer_ids"] + eos
        if len(ids) > n:
            raise ValueError(f"PasskeyMixer: the answer {sample['answer_ids']} takes more than the 8 tokens left in a "
                             f"row of {n}: lower min_tokens.")
        ids += row[: n - len(ids)]
        info = {"answer": sample["answer"], "depth": sample["depth"], "prompt_tokens": length,
                "needle_start": sample["needle_start"], "needle_end": sample["needle_end"],
                "answer_start": length, "answer_end": length + len(sample["answer_ids"])}
        return {**example, "input_ids": torch.tensor(ids, dtype=torch.long), "passkey": info}

    def __call__(self, examples: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        return self.collator([self.mix(ex) for ex in examples])


@dataclass
class WeightedCollator:
    """`collator`'s batch plus "loss_weights" [batch, seq] for `WeightedLossTrainer` (trainer.py): `answer_loss_weight`
    on the answer tokens of each passkey row (`answer_start:answer_end` of a `PasskeyMixer`'s record) and 1 elsewhere.
    "labels" is dropped: the loss is computed from input_ids and the weights.

    `collator`: a `PasskeyMixer` (its rows are mixed here, so that their records are seen, then passed to its own
    collator) or any collator of this module (no passkey rows: every weight is 1)."""

    collator: Callable[[Sequence[Mapping]], dict]
    answer_loss_weight: float = 1.0

    def __call__(self, examples: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        mixer = self.collator if isinstance(self.collator, PasskeyMixer) else None
        rows = [mixer.mix(ex) for ex in examples] if mixer is not None else list(examples)
        batch = (mixer.collator if mixer is not None else self.collator)(rows)
        batch.pop("labels", None)
        weights = torch.ones(batch["input_ids"].shape, dtype=torch.float32)
        for i, row in enumerate(rows):
            if "passkey" in row:
                start, end = row["passkey"]["answer_start"], row["passkey"]["answer_end"]
                weights[i, start:end] = float(self.answer_loss_weight)
        batch["loss_weights"] = weights
        return batch
