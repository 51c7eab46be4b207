"""DPE on rope-tiny (window L = 256) at N = 1024: the authors' detection, then perplexity beside yarn x4 and
Self-Extend.

    PYTHONPATH=. python bench/dpe_tiny.py            # about 5 minutes on one CPU core

The detection (`rope_patch.tuning.detect_group_sizes`, the sweep of LuLuLuyi/DPE's run_niah_detect.sh: each of the
8 frequency groups at 1, 2, 4, 8, 16 while the others sit at 2N/L = 8) scores each setting by minus the perplexity
at N on the tuning half of the held-out text (2 windows): rope-tiny cannot retrieve a needle, so the authors' NIAH
score would be 0 everywhere. Then perplexity at N on the acceptance half (8 windows of N, text the detection never
read) for the model as loaded, yarn x4, the suggested Self-Extend, DPE at the detection baseline and DPE with the
detected sizes. Prints one line per spec and writes the numbers as JSON to stdout's last line.
"""

from __future__ import annotations

import json
import math
import time

import torch

import rope_patch
from rope_patch.evaluation.perplexity import window_nll
from rope_patch.resources import heldout_text
from rope_patch.tuning import detect_group_sizes, split_heldout
from rope_patch.zoo import load_model

N, W = 1024, 32  # W = L/8: rope_patch.suggest's window for DPE on a 256-token model


def perplexity(model, token_ids, n_tokens: int) -> float:
    return math.exp(window_nll(model, token_ids, N, n_tokens).double().mean().item())


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model("tiny")
    tuning, acceptance, _ = split_heldout(tokenizer(heldout_text().read_text())["input_ids"])
    start = time.time()
    sizes = detect_group_sizes(model, lambda m: -perplexity(m, tuning, 2 * N), target=N, window_size=W)
    print(f"detected group sizes {sizes} in {time.time() - start:.0f}s")
    self_extend = next(s.spec for s in rope_patch.suggest(model, N) if s.scheme == "self_extend")
    specs = ["default", "yarn:4", self_extend, f"dpe:group_sizes={'/'.join(['8'] * 8)},window_size={W}",
             f"dpe:group_sizes={'/'.join(map(str, sizes))},window_size={W}"]
    results = {"detected": sizes}
    for spec in specs:
        with rope_patch.patched(model, spec):
            results[spec] = round(perplexity(model, acceptance, 8 * N), 2)
        print(f"{spec:48s} perplexity at {N}: {results[spec]}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
