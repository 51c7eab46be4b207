"""How long a `compare` run will take, and trimming it to a time budget.

The estimate times forwards of the model on held-out tokens at two lengths (a warm-up forward first: the first
forward of a process is several times slower), under the machine's load at that moment, and fits the seconds per
token at a length L as a + b·L: a for what every token costs (projections, MLP, the LM head), b·L for attention,
whose work per token grows with the length. A perplexity window of L tokens then costs L·(a + b·L), a passkey prompt
the same (an upper bound when a shared prefix is prefilled once) plus each generated token a + 2·b·L (one query over
L keys). Before, one probe at ≤ 512 tokens was scaled by the token count alone, and a 16k run took twice the estimate.

`fit_budget` trims in a fixed order until the estimate fits: passkey samples per cell first (down to 1), then the
perplexity windows at the longest length (down to 1). What it trimmed is said in one line and recorded in the
results (settings.budget).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

PROBE_MAX_TOKENS = 512
PROBE_LONG_TOKENS = 2048  # the second probe: long enough for attention to show, short enough to cost little


@dataclasses.dataclass(frozen=True)
class Cost:
    """Seconds per token of a forward at length L: a + b·L (b ≥ 0)."""

    a: float
    b: float = 0.0
    probed: tuple = ()  # (tokens, seconds per token) of each probe

    def per_token(self, length: int) -> float:
        return self.a + self.b * length

    def window(self, length: int) -> float:
        return length * self.per_token(length)

    def generated(self, length: int) -> float:
        """One generated token after `length` tokens: its own share of the forward, attention over every key."""
        return self.a + 2.0 * self.b * length


@torch.no_grad()
def seconds_per_token(model, token_ids: Sequence[int], length: int) -> tuple[float, int]:
    """(seconds per token, tokens probed) of one forward of min(length, PROBE_MAX_TOKENS) held-out tokens, timed
    after one untimed warm-up forward."""
    return seconds_per_token_at(model, token_ids, max(2, min(int(length), PROBE_MAX_TOKENS, len(token_ids))))


def probe_cost(model, token_ids: Sequence[int], lengths: Sequence[int]) -> Cost:
    """The a + b·L fit from a short probe (the shortest length, ≤ 512 tokens) and a longer one (4× it, ≤ 2048 and
    the longest length), each timed after a warm-up, under the current load. One probe when they cannot differ."""
    short, n1 = seconds_per_token(model, token_ids, min(lengths))
    n2 = max(2, min(4 * n1, PROBE_LONG_TOKENS, max(lengths), len(token_ids)))
    if n2 <= n1:
        return Cost(a=short, probed=((n1, short),))
    long, n2 = seconds_per_token_at(model, token_ids, n2)
    b = max(0.0, (long - short) / (n2 - n1))
    return Cost(a=max(0.0, short - b * n1), b=b, probed=((n1, short), (n2, long)))


@torch.no_grad()
def seconds_per_token_at(model, token_ids: Sequence[int], n: int) -> tuple[float, int]:
    """As `seconds_per_token`, at exactly n tokens (no 512 cap)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids[:n])], dtype=torch.long, device=device)
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    t0 = time.perf_counter()
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return (time.perf_counter() - t0) / n, n


def run_seconds(cost: Cost, token_count: int, lengths: Sequence[int], passkey_lengths: Sequence[int], n_depths: int,
                passkey_samples: int, windows_at_longest: int, new_tokens: int = 7, longest: int | None = None) -> float:
    """Seconds a run takes for one scheme: its perplexity windows and passkey prompts with their generated tokens
    (the same counts as `run_tokens`), each at its length's cost."""
    lengths = sorted(set(lengths))
    longest = longest or (lengths[-1] if lengths else 0)
    n = windows_at_longest * longest if lengths else 0
    ppl = sum((min(n, token_count) // L) * cost.window(L) for L in lengths)
    pk = sum((cost.window(L) + new_tokens * cost.generated(L)) * n_depths * passkey_samples for L in set(passkey_lengths))
    return ppl + pk


def run_tokens(n_schemes: int, token_count: int, lengths: Sequence[int], passkey_lengths: Sequence[int],
               n_depths: int, passkey_samples: int, windows_at_longest: int, new_tokens: int = 7,
               longest: int | None = None) -> int:
    """Tokens a run processes: perplexity windows + passkey prompts + generated tokens, over all schemes.
    `longest`: the run's longest perplexity length, when `lengths` are only the ones left to run (every length reads
    `windows_at_longest` x the longest)."""
    lengths = sorted(set(lengths))
    longest = longest or (lengths[-1] if lengths else 0)
    n = windows_at_longest * longest if lengths else 0
    ppl = sum((min(n, token_count) // L) * L for L in lengths)
    pk = sum((L + new_tokens) * n_depths * passkey_samples for L in set(passkey_lengths))
    return n_schemes * (ppl + pk)


def fit_budget(estimate: Callable[[int, int], float], budget_s: float | None, passkey_samples: int,
               windows_at_longest: int, has_passkey: bool = True) -> dict:
    """The largest (passkey samples, windows) whose `estimate(samples, windows)` (seconds) fits `budget_s`,
    trimming samples first, then windows. Returns {"passkey_samples", "windows_at_longest", "estimate_s",
    "trimmed" (bool), "fits" (bool), "line"}: `line` says what was done in one sentence."""
    full = estimate(passkey_samples, windows_at_longest)
    plan = {"budget_s": budget_s, "passkey_samples": passkey_samples, "windows_at_longest": windows_at_longest,
            "estimate_s": full, "estimate_untrimmed_s": full, "trimmed": False, "fits": True}
    if budget_s is None or full <= budget_s:
        plan["line"] = (f"Estimated time: {_minutes(full)}" + (f", within the budget of {_minutes(budget_s)}."
                                                                if budget_s is not None else "."))
        return plan
    s, w = passkey_samples, windows_at_longest
    if has_passkey:
        while s > 1 and estimate(s, w) > budget_s:
            s -= 1
    while w > 1 and estimate(s, w) > budget_s:
        w -= 1
    est = estimate(s, w)
    changes = []
    if s != passkey_samples:
        changes.append(f"passkey samples per cell {passkey_samples} -> {s}")
    if w != windows_at_longest:
        changes.append(f"perplexity windows {windows_at_longest} -> {w}")
    fits = est <= budget_s
    plan.update(passkey_samples=s, windows_at_longest=w, estimate_s=est, trimmed=bool(changes), fits=fits)
    what = "; ".join(changes) if changes else "nothing left to trim"
    plan["line"] = (f"Budget {_minutes(budget_s)}: estimated {_minutes(full)}, trimmed {what}: now {_minutes(est)}."
                    if fits else
                    f"Budget {_minutes(budget_s)}: estimated {_minutes(full)}; even at the minimum ({what}) it is "
                    f"{_minutes(est)}: running that; raise --budget-minutes or drop schemes or lengths to fit.")
    return plan


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
