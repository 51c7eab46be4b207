"""The run-time estimate of `compare` (rope_patch/evaluation/budget.py): the probe times what the run computes."""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch import nn

from rope_patch.evaluation import budget
from rope_patch.evaluation.budget import PASSKEY_BATCH, Cost, probe_cost, run_seconds
from rope_patch.evaluation.defaults import PPL_SHARED_LENGTH

# seconds per token at length n of each computation the fake model "runs" (a + b·n): a forward that computes the
# logits of the last position (a passkey prompt), and a perplexity window (the output layer and the loss at every
# position: several times the former on a small model with a large vocabulary)
PREFILL = (1e-4, 1e-8)
WINDOW = (3e-4, 1e-8)
STEP = 0.02  # one decoding step


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, n: int, cost: tuple[float, float]) -> None:
        self.now += n * (cost[0] + cost[1] * n)


class _Model(nn.Module):
    def __init__(self, clock: _Clock):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.clock = clock

    def forward(self, input_ids, **kw):
        self.clock.spend(input_ids.shape[1], PREFILL)


@pytest.fixture
def timed(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(budget, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(budget, "token_nll", lambda model, ids: clock.spend(ids.shape[1], WINDOW))

    def greedy(model, ids, new_tokens):
        clock.spend(ids.shape[1], PREFILL)
        clock.now += (new_tokens - 1) * STEP

    monkeypatch.setattr(budget, "greedy_generate", greedy)
    return _Model(clock)


def test_the_probe_times_a_perplexity_window_a_prompt_and_a_decoding_step(timed):
    """A perplexity window is costed as the window's own computation (before: as a forward computing one position's
    logits, half the real cost on `make demo`), a prompt as a forward, an answer by its decoding steps."""
    cost = probe_cost(timed, list(range(5000)), [256, 2048], new_tokens=7)
    assert (cost.a, cost.b) == pytest.approx(WINDOW)
    assert cost.prefill == pytest.approx(PREFILL)
    assert cost.step == pytest.approx(STEP)
    assert [n for n, _ in cost.probed] == [256, 1024]


def test_one_probe_length_when_the_run_has_one(timed):
    cost = probe_cost(timed, list(range(5000)), [256], new_tokens=7)
    assert cost.a == pytest.approx(WINDOW[0] + WINDOW[1] * 256) and cost.b == 0
    assert cost.step == pytest.approx(STEP)


@pytest.mark.parametrize("samples", [1, 4, PASSKEY_BATCH + 1])
def test_a_cell_decodes_its_prompts_together(samples):
    """Each passkey cell: its prompts' forwards, then new_tokens − 1 decoding steps per batch of PASSKEY_BATCH."""
    cost = Cost(a=WINDOW[0], b=WINDOW[1], prefill=PREFILL, step=STEP)
    lengths, depths, new = [256, 1024], 3, 7
    want = sum(depths * (samples * L * (PREFILL[0] + PREFILL[1] * L) + math.ceil(samples / PASSKEY_BATCH) * (new - 1)
                         * STEP) for L in lengths)
    want += sum((2 * PPL_SHARED_LENGTH // L) * L * (WINDOW[0] + WINDOW[1] * L) for L in lengths)  # both <= 2048
    assert run_seconds(cost, 10_000, lengths, lengths, depths, samples, 2, new_tokens=new) == pytest.approx(want)
