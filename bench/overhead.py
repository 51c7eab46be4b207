"""Run-time cost of a frequency patch: patched model ÷ natively configured model, measured side by side.

    python bench/overhead.py [--lengths 512 1024 2048 4096] [--reps 7]

For each frequency scheme, a tiny Llama patched with rope_patch and its native twin (the same weights, built by
transformers from the resulting `rope_parameters`) run forward passes alternately in one process (time), and
alternately in fresh subprocesses (peak memory: the rise of the process's peak RSS during one forward). Absolute
times on shared machines are noisy; the ratios are what this reports. Target: median ratio ≤ 1.02.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rope_patch

SCHEMES = {
    "default:500000": ("default", dict(rope_theta=500_000.0)),
    "linear:4": ("linear", dict(factor=4.0)),
    "ntk:4": ("ntk", dict(factor=4.0)),
    "dynamic:4": ("dynamic", dict(factor=4.0)),
    "yarn:8": ("yarn", dict(factor=8.0)),
    "llama3:8": ("llama3", dict(factor=8.0)),
    "longrope:8": ("longrope", dict(factor=8.0, short_factor=[1.0] * 32, long_factor=[1.0 + i / 4 for i in range(32)])),
}


def build_pair(label: str, seed: int = 0):
    """The tiny model (hidden 256, 4 heads of 64, 4 layers, window 512): patched, and natively configured."""
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    name, params = SCHEMES[label]
    rope_patch.apply(model, name, **params)
    native_cfg = copy.deepcopy(cfg)
    native_cfg.rope_parameters = copy.deepcopy(model.config.rope_parameters)
    # transformers' dynamic NTK starts scaling at max_position_embeddings: the native twin keeps the original window
    native_cfg.max_position_embeddings = 512 if name == "dynamic" else model.config.max_position_embeddings
    twin = LlamaForCausalLM(native_cfg).eval()
    twin.load_state_dict(model.state_dict())
    return model, twin


def forward(model, length: int) -> None:
    ids = torch.randint(0, 4096, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        model(ids, logits_to_keep=1)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def memory_worker(label: str, patched: bool, length: int) -> None:
    # Both models live in every worker so that allocator state is the same whichever one runs.
    pair = build_pair(label)
    model = pair[0] if patched else pair[1]
    forward(model, 16)  # warm-up allocations that are not the forward's
    before = _rss_mib()
    forward(model, length)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_rise_mib": peak - before}))


def peak_rise(label: str, patched: bool, length: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--memory-worker", label, str(int(patched)), str(length)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rise_mib"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    p.add_argument("--memory-worker", nargs=3, metavar=("SCHEME", "PATCHED", "LENGTH"))
    args = p.parse_args()
    if args.memory_worker:
        label, patched, length = args.memory_worker
        return memory_worker(label, bool(int(patched)), int(length))

    torch.set_num_threads(2)
    print(f"| scheme | {' | '.join(f'time ratio @{n}' for n in args.lengths)} | median "
          f"| {' | '.join(f'mem ratio @{n}' for n in args.lengths)} |")
    print("|---" * (2 + 2 * len(args.lengths)) + "|")
    worst = 0.0
    for label in args.schemes:
        patched, native = build_pair(label)
        time_ratios, mem_ratios = [], []
        for n in args.lengths:
            forward(patched, n), forward(native, n)  # warm-up
            ratios = []
            for rep in range(args.reps):
                pair = {}
                for which, model in ((("patched", patched), ("native", native)) if rep % 2 == 0
                                     else (("native", native), ("patched", patched))):
                    t0 = time.perf_counter()
                    forward(model, n)
                    pair[which] = time.perf_counter() - t0
                ratios.append(pair["patched"] / pair["native"])
            time_ratios.append(statistics.median(ratios))
            mem_ratios.append(peak_rise(label, True, n) / max(peak_rise(label, False, n), 1e-9))
        median = statistics.median(time_ratios)
        worst = max(worst, median)
        print(f"| {label} | {' | '.join(f'{r:.3f}' for r in time_ratios)} | {median:.3f} "
              f"| {' | '.join(f'{r:.2f}' for r in mem_ratios)} |", flush=True)
    print(f"\nworst per-scheme median time ratio: {worst:.3f} (target <= 1.02; "
          f"torch threads: {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
