"""The sweep's compare-format view carries the passkey counts with Wilson intervals, and sweep.json the machine."""

from __future__ import annotations

import pytest

from rope_patch.evaluation.retrieval import wilson_interval
from rope_patch.integrations.lm_eval import sweep as S


def _state():
    by_depth = {"0.1": {"n": 4, "correct": 3, "accuracy": 0.75}, "0.9": {"n": 4, "correct": 0, "accuracy": 0.0}}
    cells = {"rope_passkey_128": {"task": "rope_passkey_128", "metrics": {"acc": 0.375}, "n_samples": 8,
                                  "by_depth": by_depth},
             "rope_ppl_128": {"task": "rope_ppl_128", "metrics": {"token_perplexity": 40.0, "nll": 3.7},
                              "n_samples": 2}}
    return {"settings": {"tasks": ["rope_passkey_128", "rope_ppl_128"], "lengths": [128], "model": "m",
                         "model_path": "/nonexistent", "metadata": {"depths": [0.1, 0.9], "samples": 4}},
            "schemes": [{"spec": "default", "args": {"scheme": "default"}, "cells": cells}]}


def test_compare_view_has_counts_and_intervals():
    result = S.aggregate(_state())
    m = result["machine"]
    assert m["threads"] >= 1 and m["cpu_count"] >= 1 and len(m["loadavg"]) == 3
    cmp = S.compare_format(result)
    (rec,) = cmp["records"]
    assert (rec["passkey_correct"], rec["passkey_n"]) == (3, 8)
    assert (rec["passkey_ci_low"], rec["passkey_ci_high"]) == pytest.approx(wilson_interval(3, 8))
    cells = {p["depth"]: p for p in cmp["passkey"]}
    assert (cells[0.1]["ci_low"], cells[0.1]["ci_high"]) == wilson_interval(3, 4)
    assert cells[0.9]["ci_low"] == 0.0 and cells[0.9]["ci_high"] == pytest.approx(0.4899, abs=1e-4)
    assert cmp["settings"]["machine"]["loadavg_end"] == m["loadavg"]
