"""transformers' Trainer with a per-token weighted loss (the passkey answers of `PasskeyMixer` rows count more).

    collator = WeightedCollator(PasskeyMixer(tok, stream, fraction=0.5, seed=0), answer_loss_weight=10.0)
    trainer = WeightedLossTrainer(model=model, args=args, train_dataset=train, data_collator=collator, callbacks=...)

The collator puts "loss_weights" [batch, seq] into every batch; `compute_loss` pops them and returns
`weighted_loss`: each row's weighted mean next-token NLL, then the mean over rows, so a row weighs the same whatever
its weights sum to. With weights of 1 it is the model's own loss for rows of equal length.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from transformers import Trainer

from .config import ConfigError

# accelerate 1.15+ AcceleratorState.__init__ (state.py) turns a run into FSDP only when its distributed type is one
# of MULTI_GPU / MLU / SDAA / MUSA / NPU / XPU / HPU / NEURON: a CPU run (MULTI_CPU over gloo, or one process) stays
# DDP and ignores ACCELERATE_USE_FSDP and TrainingArguments(fsdp=...) without a word, and `accelerate launch` with an
# FSDP config plus --cpu falls back to its simple launcher (one process). So FSDP cannot run on CPU through
# Trainer + accelerate here; `refuse_fsdp_on_cpu` stops such a run instead of letting it train with DDP.
FSDP_ON_CPU = ("FSDP was requested (ACCELERATE_USE_FSDP / train.fsdp), but accelerate runs FSDP only on GPUs and other "
               "accelerators: on CPU it would silently train with plain DDP ({kind}). Use torchrun without the FSDP "
               "settings for DDP on CPU, or run the FSDP config on GPUs.")


def weighted_loss(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over rows of each row's weighted next-token NLL (rows weigh equally, whatever their weights sum to)."""
    # logits [b, s, V] -> predictions for positions 1..s-1: [b, V, s-1] for cross_entropy's class dim.
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")  # [b, s-1]
    w = weights[:, 1:].to(nll.dtype)
    return ((nll * w).sum(1) / w.sum(1)).mean()


class WeightedLossTrainer(Trainer):
    """Trainer whose loss is `weighted_loss` of the batch's "loss_weights" (`WeightedCollator`)."""

    loss_is_scaled_for_ga = False  # a per-micro-batch mean: Trainer divides it by the accumulation steps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        weights = inputs.pop("loss_weights")
        outputs = model(**inputs, use_cache=False)
        loss = weighted_loss(outputs.logits, inputs["input_ids"], weights)
        return (loss, outputs) if return_outputs else loss


def refuse_fsdp_on_cpu(trainer: Trainer) -> None:
    """ConfigError when FSDP was asked for (ACCELERATE_USE_FSDP or TrainingArguments.fsdp) but accelerate did not
    enable it (on CPU it never does; see FSDP_ON_CPU)."""
    wanted = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or bool(trainer.args.fsdp)
    if wanted and not trainer.is_fsdp_enabled:
        raise ConfigError(FSDP_ON_CPU.format(kind=trainer.accelerator.distributed_type.value))


@contextlib.contextmanager
def torch_settings(*, threads: int | None = None, deterministic: bool = False):
    """Process-wide torch settings for one run, restored on exit (a run may be one call among others in a
    process, as in the tests): `threads` for `torch.set_num_threads` (None: unchanged), `deterministic` for
    `torch.use_deterministic_algorithms` (warn-only on CUDA, where some kernels have no deterministic version)."""
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        if threads:
            torch.set_num_threads(threads)
        if deterministic:
            torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])
