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

Chat templates (`chat_template=True`): every prompt is the tokenizer's chat template around the user turn, and the
answer is generated after the assistant prefix and the lead-in "The pass key is" that opens the assistant turn
(`passkey.make_passkey_sample`); the template's tokens count in the length, and the answer gets the lead-in's tokens
more to be generated, for a model that restates it.

Shared haystack and prefix reuse (`shared_haystack=True`): the prompts of a cell take the same filler stretch (one
offset drawn per cell), so they differ only from the needle on; what they share is everything before it: BOS (or the
chat template's opening), the filler before the needle (a `depth` fraction of it). That common prefix is prefilled
once per batch of a cell, its KV cache copied for every prompt (`copy.deepcopy`, then repeated over the batch), and
only the rest of each prompt (needle, the filler after it, question) is run on top of it. Greedy answers equal the
uncached run (tests/evaluation/test_retrieval.py). With one haystack per cell the samples of a cell are not
independent draws of the filler (only of the key and the needle's text): on SmolLM2 the samples of a cell then
succeed or fail together, and the Wilson interval, which assumes independent samples, is too narrow; the default,
`shared_haystack=False`, draws a filler stretch per sample as before, and then only the common prefix that remains (BOS,
the template) is shared: below `MIN_SHARED_PREFIX` tokens the prefix is not reused. A model whose own RoPE follows the
length without a patch (a checkpoint shipping dynamic NTK or LongRoPE, unpatched) is never run in two pieces:
transformers would reset its frequencies for the shorter prefix forward.

Uncertainty: every cell carries `n`, `correct` and the Wilson 95% interval of its accuracy (`wilson_interval`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from collections.abc import Callable, Sequence

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..api import current
from ..discovery import find_target
from .common import at_length, windowed_from
from .defaults import DEFAULT_DEPTHS
from .passkey import LEAD_IN, make_passkey_sample, score_passkey

# The KV cache's argument and output field: `cache` from transformers 5.24 (`past_key_values` warns there), before it
# `past_key_values` (a `cache=` there is swallowed by the forward's **kwargs: every step would run without the cache)
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

MIN_SHARED_PREFIX = 16  # a shorter common prefix is not worth a separate prefill


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% for the default z), as (low, high) in [0, 1].

    With p = correct / n:  centre = (p + z²/2n) / (1 + z²/n),  half-width = z·sqrt(p(1−p)/n + z²/4n²) / (1 + z²/n).
    Source: E. B. Wilson, "Probable inference, the law of succession, and statistical inference", Journal of the
    American Statistical Association 22 (1927) 209-212; recommended over the normal (Wald) interval for small n and
    p near 0 or 1 by Brown, Cai & DasGupta, "Interval Estimation for a Binomial Proportion", Statistical Science 16
    (2001) 101-133. It never leaves [0, 1] and is not empty at 0/n or n/n. n = 0 gives (0, 1).
    """
    if n <= 0:
        return 0.0, 1.0
    p = correct / n
    z2 = z * z
    denom = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    low = 0.0 if correct <= 0 else max(0.0, centre - half)  # exact bounds at 0/n and n/n (no rounding below p)
    high = 1.0 if correct >= n else min(1.0, centre + half)
    return low, high


def cell_seed(seed: int, length: int, depth: float) -> int:
    """A deterministic integer seed per grid cell (independent of PYTHONHASHSEED and of the order of cells)."""
    return (int(seed) * 1_000_003 + int(length)) * 10_007 + round(float(depth) * 1000)


def make_cell(tokenizer, filler_ids: Sequence[int], length: int, depth: float, n_samples: int, seed: int, *,
              chat_template: bool = False, shared_haystack: bool = False) -> list[dict]:
    """The `n_samples` prompts of one cell (module docstring); `shared_haystack`: one filler offset for all."""
    rng = random.Random(cell_seed(seed, length, depth))
    start = rng.randint(0, max(0, len(filler_ids) - length)) if shared_haystack else None
    return [make_passkey_sample(tokenizer, filler_ids, length, depth, rng, chat_template=chat_template,
                                filler_start=start) for _ in range(n_samples)]


def new_tokens(tokenizer, samples: Sequence[dict], chat_template: bool = False,
               lead_in: str | Callable[[dict], str] = LEAD_IN) -> int:
    """Tokens to generate for a cell: the key's tokens + 1 (catches "482130" for "48213"), plus the lead-in's
    (" The pass key is") with a chat template, for a chat model that restates it. `lead_in`: the answer's lead-in,
    or a function of a sample giving its own (the niah tasks': one per asked key); the longest counts."""
    extra = 0
    if chat_template:
        lead = lead_in if callable(lead_in) else lambda s: lead_in
        extra = max(len(tokenizer.encode(lead(s), add_special_tokens=False)) for s in samples)
    return max(len(s["answer_ids"]) for s in samples) + 1 + extra


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix all `rows` share."""
    first = rows[0]
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != first[i] for r in rows[1:]):
            return i
    return n


def can_split_prefill(model) -> bool:
    """False for a model whose own RoPE follows the sequence length without a patch (dynamic NTK, LongRoPE as
    shipped): transformers would recompute its frequencies for a shorter prefix forward. A patched model is frozen
    at the final length by `at_length`."""
    if current(model) is not None:
        return True
    try:
        rope_type = find_target(model).rotary.rope_type
    except Exception:  # no rotary module: nothing depends on the length
        return True
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return not any("dynamic" in str(t) or "longrope" in str(t) for t in types)


@torch.no_grad()
def greedy_generate(model, prompt_ids: torch.Tensor, max_new_tokens: int, *, fixed_length: bool = True,
                    prefix_cache=None, prefix_len: int = 0) -> torch.Tensor:
    """Greedy continuation [batch, max_new_tokens] of equal-length prompts [batch, T], with a KV cache; with
    `fixed_length` a length-dependent RoPE is frozen at the final length T + max_new_tokens (module docstring).
    `prefix_cache`: the KV cache of the first `prefix_len` tokens, which every prompt shares (batch 1; not
    modified): only the rest of the prompts is run (`prefill_prefix`)."""
    t = prompt_ids.shape[1]
    if not fixed_length:
        return _greedy(model, prompt_ids, max_new_tokens, prefix_cache, prefix_len)
    with at_length(model, t + max_new_tokens):
        return _greedy(model, prompt_ids, max_new_tokens, prefix_cache, prefix_len)


@torch.no_grad()
def prefill_prefix(model, prefix_ids: torch.Tensor, total_length: int, *, fixed_length: bool = True):
    """The KV cache of `prefix_ids` [1, p], with a length-dependent RoPE frozen at `total_length` (the final length
    of the prompts it will serve plus their new tokens), for `greedy_generate(..., prefix_cache=)`."""
    mask = torch.ones_like(prefix_ids)
    with at_length(model, total_length) if fixed_length else contextlib.nullcontext(), \
            windowed_from(model, prefix_ids.shape[1]):
        return getattr(model(input_ids=prefix_ids, attention_mask=mask, use_cache=True, logits_to_keep=1), CACHE)


def _greedy(model, prompt_ids: torch.Tensor, max_new_tokens: int, prefix_cache=None,
            prefix_len: int = 0) -> torch.Tensor:
    with windowed_from(model, prompt_ids.shape[1]):  # a long prompt: sliding layers over their window only
        return _greedy_steps(model, prompt_ids, max_new_tokens, prefix_cache, prefix_len)


def _greedy_steps(model, prompt_ids: torch.Tensor, max_new_tokens: int, prefix_cache, prefix_len: int):
    b, t = prompt_ids.shape
    device = prompt_ids.device
    mask = torch.ones(b, t, dtype=torch.long, device=device)
    if prefix_cache is not None and 0 < prefix_len < t:
        cache = copy.deepcopy(prefix_cache)  # the shared prefix's cache stays as it was for the next batch
        if b > 1:
            cache.batch_repeat_interleave(b)
        out = model(input_ids=prompt_ids[:, prefix_len:], attention_mask=mask, **{CACHE: cache}, use_cache=True,
                    logits_to_keep=1)
    else:
        out = model(input_ids=prompt_ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    cache = getattr(out, CACHE)
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(max_new_tokens - 1):
        mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
        out = model(input_ids=tokens[-1][:, None], attention_mask=mask, **{CACHE: cache}, use_cache=True)
        cache = getattr(out, CACHE)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, dim=1)


@torch.no_grad()
def evaluate_passkey(model, tokenizer, filler_ids: Sequence[int], lengths: Sequence[int],
                     depths: Sequence[float] = DEFAULT_DEPTHS, n_samples: int = 4, seed: int = 0,
                     max_batch: int = 16, progress: Callable[[int], None] | None = None,
                     fixed_length: bool = True, chat_template: bool = False, shared_haystack: bool = False,
                     reuse_prefix: bool = True) -> list[dict]:
    """Accuracy per (length, depth) cell (`fixed_length`: see `greedy_generate`; `chat_template`,
    `shared_haystack` and `reuse_prefix`: module docstring).

    Returns one record per cell: {"length", "depth", "n", "correct", "accuracy", "ci_low", "ci_high" (Wilson 95%),
    "shared_prefix" (tokens prefilled once, 0 when not reused), "answers", "outputs"} with the keys and the decoded
    generations (for inspection), in the order lengths x depths.
    """
    device = next(model.parameters()).device
    split = reuse_prefix and can_split_prefill(model)
    records = []
    for length in lengths:
        for depth in depths:
            samples = make_cell(tokenizer, filler_ids, length, depth, n_samples, seed, chat_template=chat_template,
                                shared_haystack=shared_haystack)
            new = new_tokens(tokenizer, samples, chat_template)
            outputs = []
            shared = 0
            for i in range(0, len(samples), max_batch):
                chunk = samples[i : i + max_batch]
                ids = torch.tensor([s["prompt_ids"] for s in chunk], dtype=torch.long, device=device)
                p = common_prefix([s["prompt_ids"] for s in chunk]) if split else 0
                p = min(p, ids.shape[1] - 1)  # at least one token of each prompt runs on top of the cache
                cache = None
                if p >= MIN_SHARED_PREFIX and len(chunk) > 1:
                    cache = prefill_prefix(model, ids[:1, :p], ids.shape[1] + new, fixed_length=fixed_length)
                    shared = p
                kw = {} if fixed_length else {"fixed_length": False}
                if cache is not None:
                    kw.update(prefix_cache=cache, prefix_len=p)
                gen = greedy_generate(model, ids, new, **kw)
                outputs += [tokenizer.decode(g.tolist(), skip_special_tokens=True) for g in gen]
                if progress is not None:
                    progress(len(chunk))
            answers = [s["answer"] for s in samples]
            correct = sum(score_passkey(o, a) for o, a in zip(outputs, answers, strict=True))
            low, high = wilson_interval(correct, len(samples))
            records.append({"length": int(length), "depth": float(depth), "n": len(samples), "correct": correct,
                            "accuracy": correct / len(samples) if samples else float("nan"),
                            "ci_low": low, "ci_high": high, "shared_prefix": shared,
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
