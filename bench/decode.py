"""Decoding speed and cache memory of every scheme against vanilla RoPE, side by side in one run.

    python bench/decode.py                                     # SmolLM2-135M's shape, 8k prompt, 1 thread
    python bench/decode.py --model 2-layer --prompts 2048 8192 16384 --threads 1 2 --out FILE

Per (model, prompt length, threads): every scheme's model (random weights, one shared set for all) is built and patched,
its prompt prefilled once into a DynamicCache; then `--rounds` rounds, each cropping every cache back to the prompt
and timing `--new` one-token cached steps of every scheme in turn (interleaved: the machine's load hits all alike).
Reported per scheme: the median ms per token, its ratio to vanilla's (and each round's, against vanilla's same round),
the cache's bytes after the prefill and their ratio to vanilla's, and the load average before and after. Prefill
time is reported once (not interleaved).

Models: "smollm2" is SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV heads of 64, vocab 49152) with random
weights (no download); "2-layer" is a 2-layer hidden-256 model, where Python overhead per step dominates.
`--layers N` keeps the model's shape with N layers (a short prefill, attention a larger share of a step);
`--clock cpu` times the process's CPU time instead of the wall clock (less moved by other tenants of a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import rope_patch

MODELS = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "2-layer": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, vocab_size=4096, max_position_embeddings=4096),
}


def schemes(window: int) -> dict:
    """Each scheme at settings its authors would use for a window L (prompts up to 2L)."""
    return {
        "vanilla": None,
        "yarn": {"factor": 2.0},
        "alibi": {},
        "relative_bias": {},
        "self_extend": {"group_size": 4, "window_size": window // 8},
        "rerope": {"window_size": window // 8},
        "leaky_rerope": {"window_size": window // 8, "factor": 16.0},
        "string": {"shift_size": window // 2, "window_size": window // 32},
        "dca": {"chunk_size": window * 3 // 4, "local_size": window // 8},
        "self_extend_logistic": {"group_size": 5, "window_size": window // 8, "growth_rate": 0.01},
        "dpe": {"group_sizes": [4] * 8, "window_size": window // 8},
        "ms_poe": {},  # the authors' ratios 1.2-1.8, first 2 layers kept
        "sink": {"sink_size": 4, "window_size": window - 4},
        "lm_infinite": {"local_size": window // 2, "global_size": 10},  # a local branch shorter than the prompt
    }


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))


def run(model_name: str, prompt: int, threads: int, new: int, rounds: int, only: list[str] | None = None,
        layers: int | None = None, clock=time.perf_counter) -> dict:
    torch.set_num_threads(threads)
    shape = {**MODELS[model_name], **({"num_hidden_layers": layers} if layers else {})}
    config = LlamaConfig(**shape, attn_implementation="sdpa")
    ids = torch.randint(3, config.vocab_size, (1, prompt + new), generator=torch.Generator().manual_seed(0))
    entries = {}
    torch.manual_seed(0)
    weights = LlamaForCausalLM(config).state_dict()
    for name, params in schemes(config.max_position_embeddings).items():
        if only and name != "vanilla" and name not in only:
            continue
        model = LlamaForCausalLM(config).eval()
        # one set of weights in memory for every scheme's model (assign: the tensors are shared, not copied), so each
        # step reads the same weight memory and 13 models fit beside their caches; a patch changes no weight
        model.load_state_dict(weights, assign=True)
        if params is not None:
            rope_patch.apply(model, name, **params)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            start = time.perf_counter()
            model(ids[:, :prompt], cache=cache, use_cache=True, logits_to_keep=1)
            prefill = time.perf_counter() - start
        entries[name] = dict(model=model, cache=cache, prefill=prefill, bytes=cache_bytes(cache), times=[])
    load_before = os.getloadavg()
    for _ in range(rounds):
        for entry in entries.values():
            grown = entry["cache"].get_seq_length() - prompt
            if grown:
                entry["cache"].crop(-grown)  # back to the prompt (transformers 5: a negative count of tokens to drop)
            with torch.no_grad():
                start = clock()
                for t in range(prompt, prompt + new):
                    entry["model"](ids[:, t:t + 1], cache=entry["cache"], use_cache=True)
                entry["times"].append((clock() - start) / new)
    base = entries["vanilla"]
    vanilla_ms, vanilla_bytes = statistics.median(base["times"]) * 1e3, base["bytes"]
    rows = []
    for name, entry in entries.items():
        ms = statistics.median(entry["times"]) * 1e3
        rows.append({"scheme": name, "ms_per_token": round(ms, 2), "ratio": round(ms / vanilla_ms, 2),
                     # each round's ratio to vanilla's same round (side by side): the spread the median hides
                     "round_ratios": [round(t / v, 2) for t, v in zip(entry["times"], base["times"], strict=True)],
                     "cache_mb": round(entry["bytes"] / 2**20, 1),
                     "cache_ratio": round(entry["bytes"] / vanilla_bytes, 2),
                     "prefill_s": round(entry["prefill"], 2)})
    return {"model": model_name, "layers": config.num_hidden_layers, "clock": clock.__name__, "prompt": prompt,
            "threads": threads, "new_tokens": new, "rounds": rounds,
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
            "rows": rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), nargs="+", default=["smollm2"])
    parser.add_argument("--prompts", type=int, nargs="+", default=[8192])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--new", type=int, default=32, help="cached one-token steps timed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schemes", nargs="+", default=None, help="only these (vanilla is always run beside them)")
    parser.add_argument("--layers", type=int, default=None, help="the model's shape with this many layers")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time the wall clock (perf_counter) or the process's CPU time (process_time)")
    parser.add_argument("--out", default=None, help="write the JSON summary here (default: stdout)")
    args = parser.parse_args(argv)
    results = []
    for model_name in args.model:
        for prompt in args.prompts:
            for threads in args.threads:
                result = run(model_name, prompt, threads, args.new, args.rounds, args.schemes, args.layers,
                             time.perf_counter if args.clock == "wall" else time.process_time)
                results.append(result)
                print(f"{model_name}, prompt {prompt}, {threads} thread(s), load {result['load_before'][0]} -> "
                      f"{result['load_after'][0]}", file=sys.stderr)
                for row in result["rows"]:
                    print(f"  {row['scheme']:14s} {row['ms_per_token']:8.2f} ms/token  x{row['ratio']:<5} "
                          f"cache {row['cache_mb']:7.1f} MB x{row['cache_ratio']:<5} prefill {row['prefill_s']} s "
                          f"rounds {row['round_ratios']}",
                          file=sys.stderr)
    text = json.dumps(results, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
