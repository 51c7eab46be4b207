"""How long a `compare` run will take, and trimming it to a time budget.

The estimate times, at two lengths and under the machine's load at that moment (a warm-up forward first: the first
forward of a process is several times slower), what the run itself computes, and fits the seconds per token at a
length L as a + b·L: a for what every token costs (projections, MLP), b·L for attention, whose work per token grows
with the length.
- A perplexity window runs the decoder, the output layer over every position and the loss (`token_nll`): timed as
  such, a window of L tokens costs L·(a + b·L).
- A passkey prompt runs the decoder with the output layer on its last position only: its own fit, L·(a′ + b′·L) (an
  upper bound when a shared prefix is prefilled once), plus its answer's decoding steps, one cached forward of the
  whole batch of a cell's prompts each (`greedy_generate`, timed at the short length: on a CPU a step of a small model
  is mostly fixed cost, not a + 2·b·L).
Before, every part was costed as a forward that computes the logits of one position: on `make demo` (rope-tiny,
vocabulary 4096, hidden 256) the output layer and the loss doubled a perplexity window's cost and the decoding steps
were left out, so the run took about twice the estimate. One probe at ≤ 512 tokens scaled by the token count alone
had been the earlier cause of a 16k run taking twice the estimate.

`fit_budget` trims in a fixed order until the estimate fits: passkey samples per cell first (down to 1), then the
perplexity windows (`windows_at_longest`, down to 1). What it trimmed is said in one line and recorded in the
results (settings.budget).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Sequence

import torch

from .common import token_nll
from .perplexity import scored_tokens
from .retrieval import evaluate_passkey, greedy_generate

PROBE_MAX_TOKENS = 512
PROBE_LONG_TOKENS = 2048  # the second probe: long enough for attention to show, short enough to cost little
# prompts of one passkey cell decoded together (evaluate_passkey's max_batch): a decoding step serves them all
PASSKEY_BATCH = inspect.signature(evaluate_passkey).parameters["max_batch"].default


@dataclasses.dataclass(frozen=True)
class Cost:
    """Seconds per token at length L: a + b·L (b ≥ 0) for a perplexity window; `prefill` (a′, b′) for a passkey
    prompt (None: the same a, b) and `step` for one decoding step of a batch of prompts (None: each generated token
    costs a + 2·b·L, one query over L keys)."""

    a: float
    b: float = 0.0
    probed: tuple = ()  # (tokens, seconds per token) of each probe
    prefill: tuple[float, float] | None = None
    step: float | None = None

    def per_token(self, length: int) -> float:
        return self.a + self.b * length

    def window(self, length: int) -> float:
        return length * self.per_token(length)

    def prompt(self, length: int) -> float:
        """A passkey prompt of `length` tokens, up to the first generated token."""
        a, b = self.prefill or (self.a, self.b)
        return length * (a + b * length)

    def generated(self, length: int) -> float:
        """One generated token after `length` tokens: its own share of the forward, attention over every key."""
        return self.a + 2.0 * self.b * length

    def answers(self, length: int, prompts: int, new_tokens: int) -> float:
        """The decoding of `prompts` answers of `new_tokens` tokens after `length`-token prompts (one cell)."""
        if self.step is None:
            return prompts * new_tokens * self.generated(length)
        return math.ceil(prompts / PASSKEY_BATCH) * max(0, new_tokens - 1) * self.step


@torch.no_grad()
def seconds_per_token(model, token_ids: Sequence[int], length: int) -> tuple[float, int]:
    """(seconds per token, tokens probed) of one forward of min(length, PROBE_MAX_TOKENS) held-out tokens, timed
    after one untimed warm-up forward."""
    return seconds_per_token_at(model, token_ids, max(2, min(int(length), PROBE_MAX_TOKENS, len(token_ids))))


def probe_cost(model, token_ids: Sequence[int], lengths: Sequence[int], new_tokens: int = 7) -> Cost:
    """The a + b·L fits from a short probe (the shortest length, ≤ 512 tokens) and a longer one (4× it, ≤ 2048 and
    the longest length), each timed after a warm-up, under the current load: a perplexity window's computation
    (`token_nll`) and a passkey prompt's (the output layer on the last position), plus one decoding step at the short
    length. One probe length when they cannot differ."""
    prefill1, n1 = seconds_per_token(model, token_ids, min(lengths))
    ppl1 = _timed_nll(model, token_ids, n1)
    step = _timed_step(model, token_ids, n1, new_tokens, prefill1 * n1)
    n2 = max(2, min(4 * n1, PROBE_LONG_TOKENS, max(lengths), len(token_ids)))
    if n2 <= n1:
        return Cost(a=ppl1, probed=((n1, ppl1),), prefill=(prefill1, 0.0), step=step)
    prefill2, n2 = seconds_per_token_at(model, token_ids, n2)
    ppl2 = _timed_nll(model, token_ids, n2)
    a, b = _line(n1, ppl1, n2, ppl2)
    return Cost(a=a, b=b, probed=((n1, ppl1), (n2, ppl2)), prefill=_line(n1, prefill1, n2, prefill2), step=step)


def _line(n1: int, y1: float, n2: int, y2: float) -> tuple[float, float]:
    """(a, b) of a + b·n through (n1, y1) and (n2, y2), with b ≥ 0 and a ≥ 0."""
    b = max(0.0, (y2 - y1) / (n2 - n1))
    return max(0.0, y1 - b * n1), b


@torch.no_grad()
def _timed_nll(model, token_ids: Sequence[int], n: int) -> float:
    """Seconds per token of a perplexity window of n tokens (after a forward at that length: warm)."""
    ids = torch.tensor([list(token_ids[:n])], dtype=torch.long, device=next(model.parameters()).device)
    t0 = time.perf_counter()
    token_nll(model, ids)
    return (time.perf_counter() - t0) / n


def _timed_step(model, token_ids: Sequence[int], n: int, new_tokens: int, prefill_s: float) -> float | None:
    """Seconds of one decoding step after an n-token prompt: a greedy answer of `new_tokens` tokens, less the
    prompt's forward, per step."""
    if new_tokens < 2:
        return None
    ids = torch.tensor([list(token_ids[:n])], dtype=torch.long, device=next(model.parameters()).device)
    t0 = time.perf_counter()
    greedy_generate(model, ids, new_tokens)
    return max(0.0, time.perf_counter() - t0 - prefill_s) / (new_tokens - 1)


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
                passkey_samples: int, windows_at_longest: int, new_tokens: int = 7,
                n_tokens: int | None = None) -> float:
    """Seconds a run takes for one scheme: its perplexity windows (`perplexity.scored_tokens` at each length) and
    passkey prompts with their generated tokens (the same counts as `run_tokens`), each at its length's cost."""
    ppl = sum(scored_tokens(L, token_count, windows_at_longest, n_tokens) // L * cost.window(L) for L in set(lengths))
    pk = sum((passkey_samples * cost.prompt(L) + cost.answers(L, passkey_samples, new_tokens)) * n_depths
             for L in set(passkey_lengths))
    return ppl + pk


def run_tokens(n_schemes: int, token_count: int, lengths: Sequence[int], passkey_lengths: Sequence[int],
               n_depths: int, passkey_samples: int, windows_at_longest: int, new_tokens: int = 7,
               n_tokens: int | None = None) -> int:
    """Tokens a run processes: perplexity windows (`perplexity.scored_tokens` at each length) + passkey prompts +
    generated tokens, over all schemes."""
    ppl = sum(scored_tokens(L, token_count, windows_at_longest, n_tokens) for L in set(lengths))
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
