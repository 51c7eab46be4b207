"""Memory and speed of the attention-side schemes against vanilla sdpa RoPE, side by side in one run.

    python bench/attention.py                                   # L = 2048 4096 8192 16384, 1 thread
    python bench/attention.py --lengths 2048 4096 --threads 2 --repeats 3

Model: a tiny random Llama (2 layers, hidden 256, 4 heads of 64, intermediate 688, vocab 4096, fp32). One forward of
the decoder (`model.model`, no LM head: its L × vocab logits are the same for every scheme and would hide attention)
without cache, batch 1, under `torch.no_grad()`.

Memory: each (scheme, L) runs one forward in a fresh subprocess under torch's profiler with `profile_memory`: the peak
is the maximum of the running total of every CPU tensor allocation and free during the forward (what
`torch.cuda.max_memory_allocated` measures on a GPU). The process's peak resident set growth (VmHWM − VmRSS before)
is reported beside it: it also counts malloc arenas and page granularity, and varies by ±30% between identical runs.
Time: one subprocess per L loads the model once and runs `--repeats` rounds, each round one forward of every scheme in
turn (apply, forward, remove), and keeps each scheme's best; interleaving makes the ratios see the same machine load.
`naive` is Self-Extend materialised, as existing patches do it: rope_patch's eager (dense) function, which holds the
whole (heads × L × L) score matrix with the neighbour and grouped regions written into it; the reference for the
≥ 4× memory claim. It is skipped where it would not fit (`--naive-max`) and then reported as its quadratic
extrapolation.

First call: each (scheme, L) also runs in fresh subprocesses that load the model, apply the scheme and time its very
first forward at L (no warm-up: what a user's first call pays, kernel and allocator set-up included), `--first-runs`
rounds over the schemes, column `first s` their median; the steady-state column is the best of `--repeats`
warmed-up forwards.

One thread by default: on a shared machine torch's two-thread pool spends most of its time in barriers on small
ops, which says more about the neighbours than about the schemes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SCHEMES = {
    "rope": None,  # vanilla: the model's own sdpa RoPE
    "alibi": {},
    "relative_bias": {},
    "self_extend": {"group_size": 8, "window_size": 1024},
    "rerope": {"window_size": 1024},
    "leaky_rerope": {"window_size": 1024, "factor": 16.0},
    "string": {"shift_size": 5461, "window_size": 128},  # S = N/3 for N = 16384 (rope_patch.suggest)
    "dca": {"chunk_size": 1536, "local_size": 256},  # 3/4 L and L/8 of the bench model's 2048-token window
    "lm_infinite": {"local_size": 2048, "global_size": 10, "max_distance": 2047},  # rope_patch.suggest's setting
    "naive": {"group_size": 8, "window_size": 1024},  # Self-Extend, materialised (the eager backend)
}
LIMITS = {"alibi": (1.25, 1.1), "relative_bias": (1.25, 1.1), "self_extend": (1.25, 1.25), "rerope": (1.25, 1.25),
          # targets (issue 29): (peak memory, steady time) as multiples of vanilla
          "leaky_rerope": (1.25, 1.25), "string": (1.25, 1.25), "dca": (1.25, 1.25), "lm_infinite": (1.25, 1.25)}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _model(threads: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.set_num_threads(threads)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=4096, max_position_embeddings=2048)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _patch(model, scheme: str) -> None:
    import rope_patch

    if scheme == "naive":  # the eager backend: rope_patch's dense function, the whole score matrix at once
        model.set_attn_implementation("eager")
    if SCHEMES[scheme] is not None:
        rope_patch.apply(model, "self_extend" if scheme == "naive" else scheme, **SCHEMES[scheme])


def worker_memory(scheme: str, length: int, threads: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    model = _model(threads)
    _patch(model, scheme)
    with torch.no_grad():
        model.model(torch.randint(0, 4096, (1, 256)), use_cache=False)  # warm-up
        ids = torch.randint(0, 4096, (1, length), generator=torch.Generator().manual_seed(1))
        before = _status("VmRSS")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model.model(ids, use_cache=False)
        rss = _status("VmHWM") - before
    # every CPU tensor allocation and free of the forward, in order: the running total's maximum is the peak
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return {"scheme": scheme, "length": length, "peak_mb": peak / 2**20, "rss_mb": rss / 2**20}


def worker_first(scheme: str, length: int, threads: int) -> dict:
    """The first forward of a fresh process: model built, scheme applied, one timed forward at `length`."""
    import torch

    model = _model(threads)
    _patch(model, scheme)
    ids = torch.randint(0, 4096, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        t0 = time.perf_counter()
        model.model(ids, use_cache=False)
        return {"first_s": time.perf_counter() - t0}


def worker_time(schemes: list[str], length: int, repeats: int, threads: int) -> dict:
    import torch

    import rope_patch

    model = _model(threads)
    ids = torch.randint(0, 4096, (1, length), generator=torch.Generator().manual_seed(1))
    best = {s: float("inf") for s in schemes}
    with torch.no_grad():
        for _ in range(repeats):
            for scheme in schemes:
                _patch(model, scheme)
                model.model(ids[:, :256], use_cache=False)  # warm-up of this scheme's path
                t0 = time.perf_counter()
                model.model(ids, use_cache=False)
                best[scheme] = min(best[scheme], time.perf_counter() - t0)
                rope_patch.remove(model)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--first-runs", type=int, default=3,
                    help="fresh processes per scheme for the first call (rounds interleaved across "
                         "schemes; the median)")
    ap.add_argument("--naive-max", type=int, default=8192, help="longest L at which the naive reference is run")
    ap.add_argument("--json", help="also write the raw rows here")
    ap.add_argument("--worker-memory", nargs=2, metavar=("SCHEME", "L"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-time", nargs="+", metavar="L SCHEME", help=argparse.SUPPRESS)
    ap.add_argument("--worker-first", nargs=2, metavar=("SCHEME", "L"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_memory:
        print(json.dumps(worker_memory(args.worker_memory[0], int(args.worker_memory[1]), args.threads)))
        return
    if args.worker_first:
        print(json.dumps(worker_first(args.worker_first[0], int(args.worker_first[1]), args.threads)))
        return
    if args.worker_time:
        length, *schemes = args.worker_time
        print(json.dumps(worker_time(schemes, int(length), args.repeats, args.threads)))
        return

    def run(*extra):
        cmd = [sys.executable, __file__, "--repeats", str(args.repeats), "--threads", str(args.threads), *extra]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(f"{' '.join(extra)}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            return None
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows, load = [], os.getloadavg()[0]  # the 1-minute load before and after, beside every row
    for length in args.lengths:
        schemes = [s for s in args.schemes if s != "naive" or length <= args.naive_max]
        times = run("--worker-time", str(length), *schemes) or {}
        # one fresh process's first call varies by ±15% on a quiet machine: rounds over the schemes, their median
        firsts = {scheme: [] for scheme in schemes}
        for _ in range(args.first_runs):
            for scheme in schemes:
                if (first := run("--worker-first", scheme, str(length))) is not None:
                    firsts[scheme].append(first["first_s"])
        for scheme in schemes:
            mem = run("--worker-memory", scheme, str(length))
            if mem is None or not firsts[scheme] or scheme not in times:
                continue
            first = {"first_s": statistics.median(firsts[scheme]), "first_runs_s": firsts[scheme]}
            rows.append({**mem, **first, "time_s": times[scheme]})
            r = rows[-1]
            print(f"  {scheme:14s} L={length:6d}  peak {r['peak_mb']:9.1f} MiB (rss {r['rss_mb']:9.1f})  "
                  f"time {r['time_s']:8.2f} s  first call {r['first_s']:8.2f} s", file=sys.stderr, flush=True)
    for r in rows:
        r["load"] = [load, os.getloadavg()[0]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows, args.lengths))


def table(rows: list[dict], lengths: list[int]) -> str:
    by = {(r["scheme"], r["length"]): r for r in rows}
    lines = ["| scheme | L | peak MiB (tensors) | RSS growth MiB | time s | mem ×rope | time ×rope "
             "| first call s | first ×rope | naive mem ÷ scheme mem | limits (mem, time) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for length in lengths:
        base = by.get(("rope", length))
        naive = by.get(("naive", length))
        naive_mb, extrapolated = (naive["peak_mb"], False) if naive else (None, False)
        if naive_mb is None:  # quadratic extrapolation from the longest measured naive run
            known = sorted(r["length"] for r in rows if r["scheme"] == "naive")
            if known:
                naive_mb, extrapolated = by[("naive", known[-1])]["peak_mb"] * (length / known[-1]) ** 2, True
        for scheme in SCHEMES:
            r = by.get((scheme, length))
            if r is None:
                continue
            mem = r["peak_mb"] / base["peak_mb"] if base else float("nan")
            tim = r["time_s"] / base["time_s"] if base else float("nan")
            first = r["first_s"] / base["first_s"] if base and "first_s" in r else float("nan")
            vs_naive = ""
            if naive_mb and scheme in ("self_extend", "rerope", "leaky_rerope"):
                vs_naive = f"{naive_mb / r['peak_mb']:.1f}" + (" (naive extrapolated)" if extrapolated else "")
            lim = LIMITS.get(scheme)
            ok = "" if lim is None else (f"≤{lim[0]}, ≤{lim[1]} "
                                         + ("ok" if mem <= lim[0] and tim <= lim[1] else "MISSED"))
            lines.append(f"| {scheme} | {length} | {r['peak_mb']:.1f} | {r['rss_mb']:.1f} | {r['time_s']:.2f} "
                         f"| {mem:.2f} | {tim:.2f} | {r.get('first_s', float('nan')):.2f} | {first:.2f} "
                         f"| {vs_naive} | {ok} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
