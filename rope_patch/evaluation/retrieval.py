"""Passkey retrieval over a grid of prompt length x needle depth.

Prompts come from `passkey.make_passkey_sample` - the same generator the training recipe mixes in - so the
evaluation format is exactly the trained one. For each (length, depth) cell, `n_samples` prompts are drawn from
`random.Random(cell_seed(seed, length, depth))`: the same seed gives the same keys and filler stretches for every
scheme (a paired comparison) and whatever ran before in the process. All prompts of a cell have the same length,
so a cell is one padding-free batch; decoding is greedy (argmax) with a KV cache, `len(answer tokens) + 1` new
tokens (the extra one catches "482130" for "48213"), and a sample is right when the first generated number is
exactly the key (`passkey.score_passkey`).

Length-dependent RoPE (dynamic NTK, dynamic YaRN, LongRoPE) and the KV cache: before the prefill the frequencies are
frozen at those of the final length (prompt + new tokens) with `rope_patch.fix_length`, so the cached prompt keys and
the generated tokens' queries share one set - what a full recompute of the final sequence would use - instead of a
cache that mixes them (transformers #25104); `fixed_length=False` lets them follow the length (transformers'
behaviour, or the scheme's `cache_rotation`). See `common.at_length`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from .common import at_length
from .passkey import make_passkey_sample, score_passkey

DEFAULT_DEPTHS = (0.1, 0.5, 0.9)


def cell_seed(seed: int, length: int, depth: float) -> int:
    """A deterministic integer seed per grid cell (independent of PYTHONHASHSEED and of the order of cells)."""
    return (int(seed) * 1_000_003 + int(length)) * 10_007 + round(float(depth) * 1000)


def make_cell(tokenizer, filler_ids: Sequence[int], length: int, depth: float, n_samples: int, seed: int) -> list[dict]:
    rng = random.Random(cell_seed(seed, length, depth))
    return [make_passkey_sample(tokenizer, filler_ids, length, depth, rng) for _ in range(n_samples)]


@torch.no_grad()
def greedy_generate(model, prompt_ids: torch.Tensor, max_new_tokens: int, *, fixed_length: bool = True) -> torch.Tensor:
    """Greedy continuation [batch, max_new_tokens] of equal-length prompts [batch, T], with a KV cache; with
    `fixed_length` a length-dependent RoPE is frozen at the final length T + max_new_tokens (module docstring)."""
    t = prompt_ids.shape[1]
    if not fixed_length:
        return _greedy(model, prompt_ids, max_new_tokens)
    with at_length(model, t + max_new_tokens):
        return _greedy(model, prompt_ids, max_new_tokens)


def _greedy(model, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    b, t = prompt_ids.shape
    device = prompt_ids.device
    mask = torch.ones(b, t, dtype=torch.long, device=device)
    out = model(input_ids=prompt_ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    cache = out.cache
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(max_new_tokens - 1):
        mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
        out = model(input_ids=tokens[-1][:, None], attention_mask=mask, cache=cache, use_cache=True)
        cache = out.cache
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, dim=1)


@torch.no_grad()
def evaluate_passkey(model, tokenizer, filler_ids: Sequence[int], lengths: Sequence[int],
                     depths: Sequence[float] = DEFAULT_DEPTHS, n_samples: int = 4, seed: int = 0,
                     max_batch: int = 16, progress: Callable[[int], None] | None = None,
                     fixed_length: bool = True) -> list[dict]:
    """Accuracy per (length, depth) cell (`fixed_length`: see `greedy_generate`).

    Returns one record per cell: {"length", "depth", "n", "correct", "accuracy", "answers", "outputs"} with the
    keys and the decoded generations (for inspection), in the order lengths x depths.
    """
    device = next(model.parameters()).device
    records = []
    for length in lengths:
        for depth in depths:
            samples = make_cell(tokenizer, filler_ids, length, depth, n_samples, seed)
            new = max(len(s["answer_ids"]) for s in samples) + 1
            outputs = []
            for i in range(0, len(samples), max_batch):
                chunk = samples[i : i + max_batch]
                ids = torch.tensor([s["prompt_ids"] for s in chunk], dtype=torch.long, device=device)
                gen = (greedy_generate(model, ids, new) if fixed_length
                       else greedy_generate(model, ids, new, fixed_length=False))
                outputs += [tokenizer.decode(g.tolist(), skip_special_tokens=True) for g in gen]
                if progress is not None:
                    progress(len(chunk))
            answers = [s["answer"] for s in samples]
            correct = sum(score_passkey(o, a) for o, a in zip(outputs, answers, strict=True))
            records.append({"length": int(length), "depth": float(depth), "n": len(samples), "correct": correct,
                            "accuracy": correct / len(samples) if samples else float("nan"),
                            "answers": answers, "outputs": outputs})
    return records


def accuracy_by_length(records: Sequence[dict]) -> dict[int, float]:
    """Pooled accuracy per length over all depths."""
    tot: dict[int, list[int]] = {}
    for r in records:
        c = tot.setdefault(r["length"], [0, 0])
        c[0] += r["correct"]
        c[1] += r["n"]
    return {k: (c / n if n else float("nan")) for k, (c, n) in tot.items()}
