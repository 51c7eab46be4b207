"""Passkey accuracy of dynamic NTK when generation crosses the window: transformers' native KV cache (keys keep the
rotation of their step, #25104), cache_rotation="consistent" (keys re-rotated with each step's base) and
fix_length (the base of the final length from the prefill on).

    .venv/bin/python eval/cache_rotation.py --scheme dynamic:4 --lengths 248 250 252 254 256 --samples 10

rope-tiny (window 256); prompts of these lengths answer with ~6 generated tokens, so decoding runs at ℓ > 256.
Greedy decoding with a KV cache, seed 0, depths 0.1 / 0.5 / 0.9, the passkey prompts of `rope-patch compare`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import rope_patch
from rope_patch import zoo
from rope_patch.evaluation.common import read_tokens
from rope_patch.evaluation.retrieval import DEFAULT_DEPTHS, evaluate_passkey

MODES = {  # label: (extra apply() parameters, fixed_length)
    "native": ({}, False),
    "consistent": ({"cache_rotation": "consistent"}, False),
    "fix_length": ({}, True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--scheme", default="dynamic:4")
    p.add_argument("--lengths", nargs="+", type=int, default=[248, 250, 252, 254, 256])
    p.add_argument("--samples", type=int, default=10, help="prompts per (length, depth) cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the records as JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = zoo.load_model(args.model)
    filler, _ = read_tokens(tok)
    result = {"model": args.model, "scheme": args.scheme, "lengths": args.lengths, "samples": args.samples,
              "seed": args.seed, "depths": list(DEFAULT_DEPTHS), "modes": {}}
    for label, (extra, fixed) in MODES.items():
        start = time.time()
        rope_patch.apply(model, args.scheme, **extra)
        recs = evaluate_passkey(model, tok, filler, args.lengths, n_samples=args.samples, seed=args.seed,
                                fixed_length=fixed)
        rope_patch.remove(model)
        correct, n = sum(r["correct"] for r in recs), sum(r["n"] for r in recs)
        by_length = {}
        for r in recs:
            c = by_length.setdefault(r["length"], [0, 0])
            c[0] += r["correct"]
            c[1] += r["n"]
        result["modes"][label] = {"correct": correct, "n": n, "accuracy": correct / n,
                                  "by_length": {k: f"{c}/{m}" for k, (c, m) in by_length.items()},
                                  "outputs": [o for r in recs for o in r["outputs"]]}
        print(f"{label:>11}: {correct}/{n} = {correct / n:.1%}  by length {result['modes'][label]['by_length']}  "
              f"({time.time() - start:.0f} s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
