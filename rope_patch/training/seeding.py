"""Per-sample random generators: every random draw of a training row is a pure function of (seed, sample index).

Why: transformers' `Trainer` resumes by skipping the batches already seen *without calling the collator* (accelerate's
`skip_first_batches`) and restores only the global RNG states saved with the checkpoint. A collator that draws from
the global generator (or from one generator it advances batch by batch) therefore draws differently after a resume
than in the uninterrupted run. A generator seeded from (seed, index) does not care what ran before: the same sample
gets the same draw whatever the batch it lands in, its order in the batch, the number of processes or data-loader
workers, and whether the run was resumed.

The seed is a sha256 of `"{seed}/{stream}/{index}"`: independent of PYTHONHASHSEED, and a different `stream` per
kind of draw ("pose", "passkey") keeps them independent, so switching one on does not change the other's draws
(recipes/finetune_lora.py draws all its rows through these collators).
"""

from __future__ import annotations

import hashlib
import random

import torch


def sample_seed(seed: int, index: int, stream: str = "") -> int:
    """A 63-bit integer seed for sample `index` of the draw `stream` (a valid `torch.Generator.manual_seed`)."""
    digest = hashlib.sha256(f"{as_index(seed, 'seed')}/{stream}/{as_index(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def as_index(value, name: str = "index") -> int:
    """`value` as a Python int (a dataset may give a 0-d tensor or a numpy integer); TypeError otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool {value!r}.")
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    if hasattr(value, "__index__"):  # numpy integers
        return value.__index__()
    raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}.")


def sample_rng(seed: int, index: int, stream: str = "") -> random.Random:
    """`random.Random` for one sample (what `pose_position_ids` and `make_passkey_sample` draw from)."""
    return random.Random(sample_seed(seed, index, stream))


def sample_generator(seed: int, index: int, stream: str = "") -> torch.Generator:
    """`torch.Generator` for one sample, for draws made with torch (`torch.rand(..., generator=g)`)."""
    return torch.Generator().manual_seed(sample_seed(seed, index, stream))
