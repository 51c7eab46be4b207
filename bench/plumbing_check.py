"""What the apply-time plumbing check (rope_patch/attention/plumbing.py) costs: `apply()` of an attention-side scheme
with the check and without it (`check=False`), on a model of SmolLM2-135M's shape with random weights (30 layers,
hidden 576, 9 query / 3 KV heads of 64, vocab 49152) and on a 2-layer model, interleaved, medians of a few runs.

    python bench/plumbing_check.py [--reps 5] [--threads 2] [--out FILE]

The check runs once per architecture and process (plumbing.CHECKED, cleared here before each timed apply), about
3 + c forwards of a 48-token, 2-row input for c position copies (Self-Extend: 3 copies + the check's extra one), each
attention layer also run alone 2 or 3 times: its cost is that of a few short forwards, in proportion to the layer's
size (the projections and attention of 2 × 48 tokens), not to any input the model will later see.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rope_patch
from rope_patch.attention import plumbing

SHAPES = {
    "smollm2-135m-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "2-layer": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=4096, max_position_embeddings=2048),
}
SCHEMES = {"self_extend": dict(group_size=4, window_size=1024), "alibi": {}}


def timed_apply(config, scheme, params, check: bool) -> float:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    plumbing.CHECKED.clear()
    start = time.perf_counter()
    rope_patch.apply(model, scheme, check=check, **params)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the JSON summary here (default: stdout)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for shape, sizes in SHAPES.items():
        config = LlamaConfig(**sizes, attn_implementation="sdpa")
        for scheme, params in SCHEMES.items():
            times = {True: [], False: []}
            for _ in range(args.reps):  # interleaved: the machine's load hits both alike
                for check in (True, False):
                    times[check].append(timed_apply(config, scheme, params, check))
            on, off = statistics.median(times[True]), statistics.median(times[False])
            rows.append({"model": shape, "scheme": scheme, "apply_with_check_s": round(on, 3),
                         "apply_without_s": round(off, 3), "check_s": round(on - off, 3)})
            print(f"{shape:20s} {scheme:12s} apply {on:6.2f} s with the check, {off:6.2f} s without: "
                  f"the check {on - off:5.2f} s", file=sys.stderr)
    summary = {"threads": args.threads, "reps": args.reps, "load_before": os.getloadavg(), "rows": rows}
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
