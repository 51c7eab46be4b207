"""The GPU check: one prepared run (≤ 5 minutes on one CUDA GPU, no network, no model download) of what a CPU-only
machine cannot show. `bench/gpu_check.sh` runs it; results go to `--out` (JSON; default out/gpu_check.json in the
checkout, which git ignores, never the checkout's root), one line per case on stdout.

1. Exactness of the compiled flex_attention paths. A tiny random Llama on the GPU with attn_implementation=
   "flex_attention" (compiled, as transformers' own flex backend): the bias schemes as a `score_mod` (alibi,
   relative_bias) and the re-positioning schemes as flex calls merged by log-sum-exp (self_extend, rerope,
   leaky_rerope, string: two calls; dca: three) against the same scheme on CPU through the eager backend, which the
   tests check against the paper references. fp32, 200 tokens past the 64-token window; max |Δlogit| per scheme
   (the target is ≤ 1e-4: compiled kernels reorder sums, and TF32 is off).
2. Time and peak memory at 32k and 64k on a randomly initialised SmolLM2-135M-shaped model (30 layers, hidden 576,
   9 query / 3 key-value heads of 64, θ = 100 000, window 8192; bf16): one forward of the decoder (no LM head, no
   cache, batch 1) for vanilla and YaRN (sdpa) and Self-Extend, ReRoPE, STRING, DCA (flex), each the best of two
   after a warm-up forward (which also compiles). Peak memory is torch.cuda.max_memory_allocated over the forward.

3. Decoding on the same model: the prompt (`--decode-prompt`, 8192: the model's window, so every scheme's regions
   are in play) prefilled into a DynamicCache, then `--decode-new` one-token cached steps timed (after one warm-up
   step, which also compiles), for the same schemes; ms per token, its ratio to vanilla's, and the cache's size and
   its ratio (the re-positioning schemes cache a key copy per position map).

Each case runs under a deadline (`--budget-s`): what does not fit is recorded as skipped, so one run always returns
what it measured. Local dry run of the plumbing on CPU (eager flex, short lengths):
    python bench/gpu_check.py --device cpu --no-compile --lengths 256     # -> out/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when rope_patch is not installed

import rope_patch  # noqa: E402
from rope_patch.attention import flex, settings  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "out" / "gpu_check.json"  # the checkout's out/, ignored by git

TINY_WINDOW = 64
EXACT = {  # the schemes with a flex form, parameters for the tiny model's 64-token window
    "alibi": {},
    "relative_bias": {"init": "alibi", "num_buckets": 16, "max_distance": 64},
    "self_extend": {"group_size": 4, "window_size": 16},
    "rerope": {"window_size": 16},
    "leaky_rerope": {"window_size": 16, "factor": 4.0},
    "string": {"shift_size": 40, "window_size": 8},
    "dca": {"chunk_size": 48, "local_size": 8},
}
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True)
SPEED = {  # scheme -> (spec for N = 32k..64k on an 8k window, backend); rope_patch.suggest's rules
    "vanilla": (None, "sdpa"),
    "yarn": ("yarn:factor=8", "sdpa"),
    "self_extend": ("self_extend:group_size=16,window_size=2048", "flex_attention"),
    "rerope": ("rerope:window_size=4096", "flex_attention"),
    "string": ("yarn:factor=8+string:shift_size=10922,window_size=128", "flex_attention"),
    "dca": ("dca:chunk_size=6144,local_size=1024", "flex_attention"),
}


def _llama(backend: str, device, dtype, **cfg):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**cfg)
    return AutoModelForCausalLM.from_config(config, attn_implementation=backend, dtype=dtype).to(device).eval()


def exactness(device, compile_flex: bool) -> list[dict]:
    tiny = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=97, max_position_embeddings=TINY_WINDOW)
    ids = torch.randint(3, 97, (2, 200), generator=torch.Generator().manual_seed(0))
    settings.FLEX_COMPILE = compile_flex
    rows = []
    for scheme, params in EXACT.items():
        t0 = time.perf_counter()
        try:
            ref = _llama("eager", "cpu", torch.float32, **tiny)
            gpu = _llama("flex_attention", device, torch.float32, **tiny)
            gpu.load_state_dict(ref.state_dict())  # the same weights, then the same learned tables
            rope_patch.apply(ref, scheme, **params)
            rope_patch.apply(gpu, scheme, **params)
            for path, table in rope_patch.api.patch_modules(gpu).items():
                table.load_state_dict(rope_patch.api.patch_modules(ref)[path].state_dict())
            with torch.no_grad():
                want = ref(ids).logits
                got = gpu(ids.to(device)).logits.float().cpu()
            diff = (got - want).abs().max().item()
            rows.append({"case": "exact", "scheme": scheme, "max_abs_diff": diff, "ok": diff <= 1e-4,
                         "s": time.perf_counter() - t0})
        except Exception as e:  # recorded: one broken case must not hide the others
            rows.append({"case": "exact", "scheme": scheme, "error": f"{type(e).__name__}: {e}"[:500],
                         "trace": traceback.format_exc()[-1500:]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _over_budget(rows: list, deadline: float, **row) -> bool:
    """Past the deadline: record the case as skipped (one run always returns what it measured)."""
    if time.monotonic() <= deadline:
        return False
    rows.append({**row, "skipped": "budget"})
    print(json.dumps(rows[-1]), flush=True)
    return True


def _patched(spec, backend: str, device, dtype):
    """The SmolLM2-shaped model on `backend`, with `spec` applied (None: vanilla)."""
    model = _llama(backend, device, dtype, **SMOLLM2)
    if spec is not None:
        rope_patch.apply(model, spec)
    return model


def speed(device, lengths, deadline: float) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for length in lengths:
        ids = torch.randint(0, SMOLLM2["vocab_size"], (1, length),
                            generator=torch.Generator().manual_seed(1)).to(device)
        for name, (spec, backend) in SPEED.items():
            if _over_budget(rows, deadline, case="speed", scheme=name, length=length):
                continue
            try:
                model = _patched(spec, backend, device, dtype)
                times = []
                with torch.no_grad():
                    for _ in range(3):  # warm-up (compiles), then two timed
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                        t0 = time.perf_counter()
                        model.model(ids, use_cache=False)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
                peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
                rows.append({"case": "speed", "scheme": name, "spec": spec, "backend": backend, "length": length,
                             "first_s": times[0], "time_s": min(times[1:]), "peak_mib": peak})
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            except Exception as e:
                rows.append({"case": "speed", "scheme": name, "length": length,
                             "error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-1500:]})
            print(json.dumps(rows[-1]), flush=True)
    base = {r["length"]: r for r in rows if r.get("scheme") == "vanilla" and "time_s" in r}
    for r in rows:
        b = base.get(r.get("length"))
        if b and "time_s" in r:
            r["time_x_vanilla"] = r["time_s"] / b["time_s"]
            if r.get("peak_mib") and b.get("peak_mib"):
                r["memory_x_vanilla"] = r["peak_mib"] / b["peak_mib"]
    return rows


def _cache_mib(cache) -> float:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor)) / 2**20


def decode(device, prompt: int, new: int, deadline: float) -> list[dict]:
    from transformers import DynamicCache

    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ids = torch.randint(0, SMOLLM2["vocab_size"], (1, prompt + new + 1), generator=torch.Generator().manual_seed(2))
    ids = ids.to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # one untimed vanilla round first: on a fresh H200 the first case measured (vanilla, 58 ms per token) ran 2.9× the
    # same math right after it (yarn ×8, 20 ms): the GPU's and allocator's first use, not the scheme
    with torch.no_grad():
        warm = _patched(None, "sdpa", device, dtype)
        cache = DynamicCache(config=warm.config)
        warm(ids[:, :prompt], cache=cache, use_cache=True, logits_to_keep=1)
        for t in range(prompt, min(prompt + 4, ids.shape[1])):
            warm(ids[:, t:t + 1], cache=cache, use_cache=True)
        del warm, cache
    for name, (spec, backend) in SPEED.items():
        if _over_budget(rows, deadline, case="decode", scheme=name, prompt=prompt):
            continue
        try:
            model = _patched(spec, backend, device, dtype)
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                model(ids[:, :prompt], cache=cache, use_cache=True, logits_to_keep=1)
                model(ids[:, prompt:prompt + 1], cache=cache, use_cache=True)  # warm-up step (compiles)
                sync()
                t0 = time.perf_counter()
                for t in range(prompt + 1, prompt + 1 + new):
                    model(ids[:, t:t + 1], cache=cache, use_cache=True)
                sync()
            rows.append({"case": "decode", "scheme": name, "spec": spec, "backend": backend, "prompt": prompt,
                         "new_tokens": new, "ms_per_token": (time.perf_counter() - t0) / new * 1e3,
                         "cache_mib": _cache_mib(cache)})
            del model, cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:
            rows.append({"case": "decode", "scheme": name, "prompt": prompt,
                         "error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-1500:]})
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["scheme"] == "vanilla" and "ms_per_token" in r), None)
    for r in rows:
        if base and "ms_per_token" in r:
            r["time_x_vanilla"] = r["ms_per_token"] / base["ms_per_token"]
            r["cache_x_vanilla"] = r["cache_mib"] / base["cache_mib"]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--no-compile", action="store_true", help="eager flex (CPU dry runs)")
    ap.add_argument("--decode-prompt", type=int, default=8192, help="prompt tokens before the timed decoding steps")
    ap.add_argument("--decode-new", type=int, default=32, help="timed one-token cached steps")
    ap.add_argument("--budget-s", type=float, default=270.0, help="no speed case starts after 60%% of this many "
                                                                  "seconds, no decoding case after all of it")
    ap.add_argument("--out", type=Path, default=OUT, help=f"the JSON results (default: {OUT})")
    args = ap.parse_args()
    start = time.monotonic()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"}
    import transformers

    info["transformers"] = transformers.__version__
    print(json.dumps(info), flush=True)
    rows = exactness(device, compile_flex=not args.no_compile)
    rows += speed(device, args.lengths, start + 0.6 * args.budget_s)  # decoding keeps the budget's last 40%
    rows += decode(device, args.decode_prompt, args.decode_new, start + args.budget_s)
    info["flex_variants"] = flex.compiled_variants()  # past settings.FLEX_RECOMPILES a call raises
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"info": info, "rows": rows, "elapsed_s": time.monotonic() - start}, indent=1))
    bad = [r for r in rows if "error" in r or r.get("ok") is False]
    print(f"{len(rows)} cases, {len(bad)} failed or off target, {time.monotonic() - start:.0f} s; wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
