"""One long forward of a hybrid model (sliding-window + global layers), today's path and the windowed one, side by side.

    python bench/long_forward.py                                  # gemma3 if fetched, else a random hybrid; L = 2048
    python bench/long_forward.py --model gemma3 --length 16384 --threads 2 --json FILE
    python bench/long_forward.py --model gemma3 --length 65536 --paths windowed   # the issue-41 target (~30 min)

The forward is the perplexity evaluation's (evaluation/common.py `token_nll`): the decoder once, then the output
projection and the loss over slices of positions. Paths, in one process, in turn on the same tokens:
    default   the model as loaded (sdpa): a sliding layer gets a (1, 1, L, L) boolean mask and computes all L² scores
    windowed  `rope_patch.attention.windowed.windowed(model)`: sliding layers per query block over their window only

Reported per path: wall time, peak RSS above the RSS before the forward (a thread samples /proc/self/statm every
5 ms; large blocks are returned to the OS when freed, so each path's peak is its own), the mean NLL (the two must
agree), and the load average before and after. One warm-up forward of 256 tokens per path first.

Models: "gemma3" is Gemma 3 270M (`rope-patch models fetch gemma3`, held-out prose as input); "hybrid" is a random
model of Gemma 3 270M's layer layout at a quarter of its width (6 layers: 5 sliding in a window of 512, 1 global;
hidden 256, 4 query heads / 1 KV head of 64, vocabulary 32768), random tokens as input, no download.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rope_patch.attention.windowed import windowed
from rope_patch.evaluation.common import read_tokens, token_nll
from rope_patch.zoo import load_model, model_name, resolve_model_path

HYBRID = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=1,
              head_dim=64, vocab_size=32768, sliding_window=512, max_position_embeddings=32768,
              layer_types=["sliding_attention"] * 5 + ["full_attention"], pad_token_id=0, bos_token_id=2,
              eos_token_id=1)
PATHS = ("default", "windowed")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak RSS above the RSS at entry, sampled by a thread every `every` seconds while the block runs."""

    def __init__(self, every: float = 0.005):
        self.every, self.peak, self._stop = every, 0, threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes() - self.base)
            time.sleep(self.every)

    def __enter__(self):
        self.base = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes() - self.base)


def build(name: str, length: int):
    """(model, input ids (1, length), a label) for "gemma3", "hybrid" or a model folder."""
    if name == "hybrid":
        torch.manual_seed(0)
        cfg = AutoConfig.for_model("gemma3_text", **HYBRID)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
        ids = torch.randint(3, HYBRID["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))
        return model, ids, "hybrid (random, Gemma 3 270M layout at 1/4 width)"
    model, tokenizer = load_model(name)
    model.set_attn_implementation("sdpa")
    tokens, info = read_tokens(tokenizer, max_tokens=length)
    if len(tokens) < length:
        raise SystemExit(f"The held-out text has {len(tokens)} tokens, fewer than --length {length}.")
    # the zoo name, or the folder's own name: results carry no machine path
    return model, torch.tensor([tokens]), model_name(name)


def forward(model, ids, path: str) -> torch.Tensor:
    if path == "windowed":
        with windowed(model):
            return token_nll(model, ids)
    return token_nll(model, ids)


def measure(model, ids, path: str) -> dict:
    load_before = os.getloadavg()[0]
    with PeakRSS() as peak:
        start = time.perf_counter()
        nll = forward(model, ids, path)
        seconds = time.perf_counter() - start
    return {"path": path, "length": ids.shape[1], "time_s": round(seconds, 2), "peak_rss_mb": round(peak.peak / 2**20),
            "mean_nll": round(nll.mean().item(), 6), "load": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="gemma3, hybrid or a model folder (default: gemma3 if fetched)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    name = args.model
    if name is None:
        try:
            resolve_model_path("gemma3")
            name = "gemma3"
        except FileNotFoundError:
            name = "hybrid"
    torch.set_num_threads(args.threads)
    model, ids, label = build(name, args.length)
    print(f"{label}: L = {args.length}, {args.threads} thread(s), sliding window {model.config.sliding_window}")
    for path in args.paths:  # warm-up: one-time costs (kernels, allocator) out of the timed forward
        forward(model, ids[:, :256], path)
    rows = [measure(model, ids, path) for path in args.paths]
    print("| path | L | time (s) | peak RSS (MB) | mean NLL | load before / after |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['path']} | {r['length']} | {r['time_s']} | {r['peak_rss_mb']} | {r['mean_nll']} | "
              f"{r['load'][0]} / {r['load'][1]} |")
    if len(rows) == 2:
        print(f"windowed / default: time {rows[1]['time_s'] / rows[0]['time_s']:.2f}x, "
              f"|Δ mean NLL| {abs(rows[1]['mean_nll'] - rows[0]['mean_nll']):.1e}")
    if args.json:
        meta = {"model": label, "threads": args.threads, "torch": torch.__version__}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
            f.write("\n")
    return rows


if __name__ == "__main__":
    main()
