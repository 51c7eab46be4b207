"""Passkey with a shared haystack: the common prefix prefilled once (cached) vs. every prompt in full (uncached).

    python bench/passkey_cache.py [--model tiny] [--length 1024] [--samples 5] [--reps 3] [--scheme yarn:4]
        [--threads N]

On rope-tiny (`rope_patch.zoo.load_model("tiny")`; `--model smollm2` or a folder for another), one cell per depth (0.1,
0.5, 0.9) of `--samples` prompts that share one haystack (`retrieval.make_cell(..., shared_haystack=True)`): the same
prompts are evaluated with `reuse_prefix=False` and `reuse_prefix=True`, alternately in one process after a warm-up,
`--reps` times; the answers must be equal (the script exits 1 otherwise). Prints the median seconds of each, their
ratio, threads and the load average before and after (the machine is shared: the ratio is what this measures, not
absolute times). Expected from the token counts: the cached run prefills depth·n_filler once and (1 - depth)·n_filler
per prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

import rope_patch
from rope_patch.evaluation.common import read_tokens
from rope_patch.evaluation.retrieval import evaluate_passkey
from rope_patch.zoo import load_model

DEPTHS = (0.1, 0.5, 0.9)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder (default: tiny)")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scheme", default=None, help="a scheme spec to apply first (default: the model as loaded)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    ids, _ = read_tokens(tok)
    load_before = os.getloadavg()
    kw = dict(lengths=[args.length], depths=DEPTHS, n_samples=args.samples, shared_haystack=True)
    times = {"uncached": [], "cached": []}
    outputs = {}
    with rope_patch.patched(model, args.scheme) if args.scheme else contextlib.nullcontext():
        evaluate_passkey(model, tok, ids, **{**kw, "n_samples": 2})  # warm-up
        for rep in range(args.reps):
            order = ("uncached", "cached") if rep % 2 == 0 else ("cached", "uncached")
            for mode in order:
                t0 = time.perf_counter()
                recs = evaluate_passkey(model, tok, ids, reuse_prefix=(mode == "cached"), **kw)
                times[mode].append(time.perf_counter() - t0)
                outputs[mode] = [r["outputs"] for r in recs]
                shared = [r["shared_prefix"] for r in recs]
                if mode == "cached":
                    cached_shared = shared
    same = outputs["uncached"] == outputs["cached"]
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {"model": args.model, "length": args.length, "depths": list(DEPTHS), "samples_per_cell": args.samples,
              "reps": args.reps,
              "scheme": args.scheme, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
              "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()],
              "shared_prefix_tokens": cached_shared, "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
              "median_s": {k: round(v, 3) for k, v in med.items()},
              "speedup": round(med["uncached"] / med["cached"], 2),
              "answers_equal": same}
    print(json.dumps(report, indent=1))
    print(f"passkey {args.length} tokens, {len(DEPTHS)} depths x {args.samples} samples: uncached "
          f"{med['uncached']:.2f} s, cached {med['cached']:.2f} s, speed-up {report['speedup']:.2f}x "
          f"({report['threads']} threads, load {load_before[0]:.2f} -> {report['loadavg_after'][0]:.2f}); "
          f"answers {'equal' if same else 'DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
