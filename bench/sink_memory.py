"""StreamingLLM (`sink`) generating 4× past the window at constant memory: cache size per step, measured.

    python bench/sink_memory.py                                 # rope-tiny (L = 256): 200-token prompt + 1024 tokens
    python bench/sink_memory.py --new 2048 --every 256 --out FILE

rope-tiny (`rope_patch.zoo.load_model("tiny")`, pre-training window L = 256) with `sink` at the authors' setting for
it (`rope_patch.suggest`: 4 sinks, window L − 4 = 252), a prompt of held-out prose, greedy generation of `--new`
tokens twice: through a `SinkCache` (keeps 4 + 251 keys per layer) and through the default `DynamicCache` (keeps
every key; the rule hides the middle). A logits processor reads each cache while `generate` runs: the keys per layer
and the bytes of all key and value tensors, every `--every` tokens. Both runs must give the same tokens (the scheme is
exact with either cache); the SinkCache's bytes stay flat, the DynamicCache's grow linearly. One thread; the time per
token is reported beside the load average (a shared machine makes it noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import rope_patch
from rope_patch.resources import heldout_text
from rope_patch.schemes.sink import SinkCache
from rope_patch.zoo import load_model


def cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


class Watch(LogitsProcessor):
    """Records (tokens so far, keys held by layer 0, KiB of the whole cache) every `every` tokens."""

    def __init__(self, cache, every: int):
        self.cache, self.every, self.rows = cache, every, []

    def __call__(self, input_ids, scores):
        n = input_ids.shape[1]
        if n % self.every == 0:
            self.rows.append((n, self.cache.layers[0].keys.shape[-2], cache_bytes(self.cache) / 1024))
        return scores


def run(model, ids, cache, new: int, every: int):
    watch = Watch(cache, every)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             logits_processor=LogitsProcessorList([watch]))
    return out, watch.rows, (time.perf_counter() - start) / new


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--every", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("tiny")
    window = model.config.max_position_embeddings
    spec = next(s for s in rope_patch.suggest(model, 4 * window) if s.scheme == "sink")
    rope_patch.apply(model, spec.spec)
    ids = tokenizer(heldout_text().read_text()[:8000], return_tensors="pt").input_ids[:, :args.prompt]
    load = os.getloadavg()[0]
    sink_out, sink_rows, sink_s = run(model, ids, SinkCache.for_model(model), args.new, args.every)
    full_out, full_rows, full_s = run(model, ids, DynamicCache(), args.new, args.every)
    result = {"model": "rope-tiny", "window": window, "scheme": spec.spec, "prompt": args.prompt, "new": args.new,
              "same_tokens": bool(torch.equal(sink_out, full_out)), "load_before": load,
              "load_after": os.getloadavg()[0],
              "ms_per_token": {"SinkCache": 1000 * sink_s, "DynamicCache": 1000 * full_s},
              "rows": [{"tokens": a[0], "sink_keys": a[1], "sink_kib": round(a[2], 1), "dynamic_keys": b[1],
                        "dynamic_kib": round(b[2], 1)} for a, b in zip(sink_rows, full_rows, strict=True)]}
    print(f"rope-tiny (L = {window}), {spec.spec}, prompt {args.prompt} + {args.new} new tokens; same tokens with "
          f"both caches: {result['same_tokens']}")
    print(f"{'tokens':>6} | {'SinkCache keys':>14} | {'KiB':>6} | {'DynamicCache keys':>17} | {'KiB':>7}")
    for r in result["rows"]:
        print(f"{r['tokens']:6d} | {r['sink_keys']:14d} | {r['sink_kib']:6.0f} | {r['dynamic_keys']:17d} | "
              f"{r['dynamic_kib']:7.0f}")
    print(f"ms per token: SinkCache {result['ms_per_token']['SinkCache']:.1f}, DynamicCache "
          f"{result['ms_per_token']['DynamicCache']:.1f} (load {load:.1f} -> {result['load_after']:.1f})")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
