"""The GPU check (issue 39): one prepared run (≤ 5 minutes on one H100/H200, no network, no model download, random
weights) of what a CPU-only machine cannot show. `bench/gpu_check.sh` runs it and writes
bench/results/gpu_check_<device>.json; run directly, results go to `--out` (default out/gpu_check.json in the
checkout, which git ignores, never the checkout's root; a `{device}` in the path becomes the device's short name),
one JSON line per row on stdout.

The rows, most important first (a global deadline, `--budget-s`, after which every remaining row is written as
skipped, with the reason, never dropped):

1. forward at 64k: one bf16 forward of the decoder (no LM head, no cache, batch 1) of a randomly initialised
   Llama-3.2-1B-shaped model (16 layers, hidden 2048, 32 query / 8 key-value heads of 64, intermediate 8192, vocab
   128256, θ = 500 000 with the checkpoint's llama3 scaling from an 8192-token window): vanilla (sdpa) first, then
   every length-extending scheme with `rope_patch.suggest`'s parameters for that length (attention-side schemes on
   flex_attention, compiled; frequency schemes on sdpa: only YaRN, as the others change inv_freq alone and run the
   same kernels; STRING, which suggest() says needs a frequency scheme, on top of YaRN's suggestion). Each row: a
   warm-up forward (which also compiles), then the best of two timed; peak memory (torch.cuda.max_memory_allocated,
   weights included) and the peak above the memory held before the forward; time, peak and extra as ratios to
   vanilla's at the same length.
2. exactness of each flex path (compiled, fp32, TF32 off) against the CPU eager path on a tiny random Llama: the bias
   schemes as one call with a `score_mod`, the re-positioning schemes as flex calls merged by log-sum-exp; max
   |Δlogit| per scheme, the target ≤ 1e-4 (compiled kernels reorder sums).
3. forward at 128k: as 1 (one timed forward after the warm-up).
4. decoding after a 32k prompt on the same model: the prompt prefilled into a DynamicCache, 4 untimed one-token
   steps, then `--decode-new` timed; ms per token and its ratio to vanilla's, the cache's size and its ratio; once per
   scheme, the last step's hidden state against recomputing the whole sequence without the cache (relative L2
   difference, ≤ 1e-4 in fp32, ≤ 5e-2 in bf16 through 16 layers of two different kernels' roundings).
5. one LoRA step (peft, r = 8 on q/k/v/o, gradient checkpointing, AdamW) at 32k: vanilla (sdpa), YaRN (sdpa) and
   Self-Extend (flex_attention: the only backend whose log-sum-exp carries gradients through the merge; on the CPU
   dry run sdpa, as torch's CPU flex has no backward). The loss is the mean square of the decoder's last hidden state
   (the LM head's 32k × 128k logits cost the same for every scheme and would only dilute the ratio); the timed step
   after a warm-up step; time and peak memory as ratios to vanilla's.

CPU dry run of the plumbing (eager flex, a tiny shape, short lengths; tests/bench/test_gpu_check.py runs it):
    python bench/gpu_check.py --device cpu --no-compile --shape tiny     # -> out/gpu_check.json
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when rope_patch is not installed

import rope_patch  # noqa: E402
from rope_patch.attention import flex, settings  # noqa: E402
from rope_patch.registry import get_scheme_class  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "out" / "gpu_check.json"  # the checkout's out/, ignored by git

TINY_WINDOW = 64
EXACT = {  # the schemes with a flex form, parameters for the tiny model's 64-token window (200 tokens run)
    "alibi": {},
    "relative_bias": {"init": "alibi", "num_buckets": 16, "max_distance": 64},
    "self_extend": {"group_size": 4, "window_size": 16},
    "self_extend_logistic": {"group_size": 6, "window_size": 16, "growth_rate": 0.5},
    "rerope": {"window_size": 16},
    "leaky_rerope": {"window_size": 16, "factor": 4.0},
    "string": {"shift_size": 40, "window_size": 8},
    "dca": {"chunk_size": 48, "local_size": 8},
    "dpe": {"group_sizes": [3, 1, 4, 8], "window_size": 16},
    "ms_poe": {"min_ratio": 1.2, "max_ratio": 1.8, "skip_layers": 1},
    "sink": {"window_size": 16, "sink_size": 4},
    "lm_infinite": {"local_size": 16, "global_size": 4, "max_distance": 12},
}
# Model shapes: the real one and a tiny one for CPU dry runs (same structure, llama3 scaling from `window`)
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, window=8192,
                         lengths=[65536, 131072], decode_prompt=32768, lora_length=32768),
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=97, window=64,
                 lengths=[256, 512], decode_prompt=128, lora_length=128),
}
# Forward and decoding rows: the schemes suggest() names, most important first; frequency schemes other than these
# change inv_freq only (the same sdpa kernels as vanilla) and are left out to keep the run within its budget.
PRIORITY = ("self_extend", "dca", "rerope", "string", "leaky_rerope", "self_extend_logistic", "dpe", "lm_infinite",
            "sink", "yarn")
FREQUENCY_KEPT = ("yarn",)
LORA = ("vanilla", "yarn", "self_extend")
CASES = ("forward", "exact", "decode", "lora")
TARGETS = {  # issue 39's targets on the GPU (ratios to vanilla in the same run); a row gets `on_target`
    "forward": {"time_x_vanilla": 1.3, "memory_x_vanilla": 1.2},
    "decode": {"time_x_vanilla": 1.3},
    "lora": {"time_x_vanilla": 1.5},
}
DECODE_WARM = 4  # untimed steps before the timed ones (the first use of the decode kernels, and compilation)


def _config(shape: dict):
    from transformers import LlamaConfig

    s = {k: v for k, v in shape.items() if k not in ("window", "lengths", "decode_prompt", "lora_length")}
    w = shape["window"]
    return LlamaConfig(**s, max_position_embeddings=16 * w, tie_word_embeddings=True, attention_dropout=0.0,
                       rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position_embeddings=w))


def _build(shape: dict, device, dtype, backend: str = "sdpa"):
    """A randomly initialised model of `shape`, initialised on `device` (no CPU copy of the 1B weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_config(shape), attn_implementation=backend, dtype=dtype)
    return model.eval()


def suggested(shape: dict, length: int) -> dict[str, tuple[str | None, str]]:
    """scheme -> (spec, backend) for `length` tokens on `shape`'s window, vanilla first, then PRIORITY's order, then
    any other attention-side scheme suggest() names (a new one joins without an edit here)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(_config(shape), attn_implementation="sdpa")
    found = {s.scheme: s for s in rope_patch.suggest(meta, length, verify=False)}  # meta: apply tries nothing
    kinds = {name: get_scheme_class(name).kind for name in found}
    specs: dict[str, tuple[str | None, str]] = {"vanilla": (None, "sdpa")}
    order = [n for n in PRIORITY if n in found] + sorted(n for n in found if n not in PRIORITY)
    for name in order:
        s = found[name]
        if kinds[name] == "frequency":
            if name in FREQUENCY_KEPT:
                specs[name] = (s.spec, "sdpa")
            continue
        spec = s.spec if s.alone else f"{found['yarn'].spec}+{s.spec}"  # STRING beyond the window: with YaRN
        specs[name] = (spec, "flex_attention")
    return specs


# ---- rows --------------------------------------------------------------------------------------------------------
class Runner:
    """Holds the shared model (applied / removed per row: `rope_patch.remove` is exact) and the deadline."""

    def __init__(self, args, device):
        self.args, self.device = args, device
        self.shape = SHAPES[args.shape]
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.deadline = time.monotonic() + args.budget_s
        self._model = None

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def model(self):
        if self._model is None:
            self._model = _build(self.shape, self.device, self.dtype)
        return self._model

    def patched(self, spec, backend):
        model = self.model()
        model.set_attn_implementation(backend)
        if spec is not None:
            rope_patch.apply(model, spec)
        return model

    def restore(self, spec):
        model = self.model()
        if spec is not None and rope_patch.current(model) is not None:
            rope_patch.remove(model)
        model.set_attn_implementation("sdpa")
        self.free()

    def free(self):
        gc.collect()  # a failed row's model and activations sit in reference cycles (frames, hooks)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def drop_model(self):
        self._model = None
        self.free()

    def ids(self, length: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.shape["vocab_size"], (1, length), generator=g).to(self.device)

    def peak(self):
        return torch.cuda.max_memory_allocated() / 2**20 if self.device.type == "cuda" else None

    def reset_peak(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated() / 2**20
        return None

    # -- forward
    def forward(self, row, spec, backend):
        try:  # restored also when apply() fails half-way (the backend switched, the patch refused)
            model = self.patched(spec, backend)
            ids = self.ids(row["length"], 1)
            timed = 2 if row["length"] <= 65536 else 1
            times, peak, held = [], None, None
            with torch.no_grad():
                for _ in range(1 + timed):  # warm-up (compiles), then timed
                    self.sync()
                    held = self.reset_peak()
                    t0 = time.perf_counter()
                    model.model(ids, use_cache=False)
                    self.sync()
                    times.append(time.perf_counter() - t0)
                    peak = self.peak()
            return {"spec": spec, "backend": backend, "first_s": times[0], "time_s": min(times[1:]),
                    "peak_mib": peak, "extra_mib": None if peak is None else peak - held}
        finally:
            self.restore(spec)

    # -- decoding
    def decode(self, row, spec, backend):
        from transformers import DynamicCache

        prompt, new = row["prompt"], self.args.decode_new
        try:
            model = self.patched(spec, backend)
            ids = self.ids(prompt + DECODE_WARM + new, 2)
            cache = DynamicCache(config=model.config)
            kw = _cache_kwarg(model.model)
            with torch.no_grad():
                model.model(ids[:, :prompt], use_cache=True, **{kw: cache})
                for t in range(prompt, prompt + DECODE_WARM):
                    model.model(ids[:, t:t + 1], use_cache=True, **{kw: cache})
                self.sync()
                t0 = time.perf_counter()
                for t in range(prompt + DECODE_WARM, ids.shape[1]):
                    last = model.model(ids[:, t:t + 1], use_cache=True, **{kw: cache}).last_hidden_state[:, -1]
                self.sync()
                ms = (time.perf_counter() - t0) / new * 1e3
                size = _cache_mib(cache)
                del cache
                full = model.model(ids, use_cache=False).last_hidden_state[:, -1]
            rel = ((last.float() - full.float()).norm() / full.float().norm()).item()
            tol = 1e-4 if self.dtype == torch.float32 else 5e-2
            return {"spec": spec, "backend": backend, "new_tokens": new, "ms_per_token": ms, "cache_mib": size,
                    "recompute_rel_diff": rel, "ok": rel <= tol}
        finally:
            self.restore(spec)

    # -- LoRA step
    def lora(self, row, spec, backend):
        from peft import LoraConfig, get_peft_model

        self.drop_model()  # the step needs the memory; the forward rows' model is rebuilt if a row needs it again
        model = None
        try:
            model = _build(self.shape, self.device, self.dtype, backend)
            if spec is not None:
                rope_patch.apply(model, spec)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
            peft_model.train()
            decoder = peft_model.get_base_model().model
            params = [p for p in peft_model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-4)
            ids = self.ids(row["length"], 3)
            times, peak, held = [], None, None
            for _ in range(2):  # warm-up step (compiles forward and backward), then the timed one
                self.sync()
                held = self.reset_peak()
                t0 = time.perf_counter()
                loss = decoder(ids, use_cache=False).last_hidden_state.float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                self.sync()
                times.append(time.perf_counter() - t0)
                peak = self.peak()
            return {"spec": spec, "backend": backend, "first_s": times[0], "time_s": times[1], "peak_mib": peak,
                    "extra_mib": None if peak is None else peak - held, "loss": loss.item(),
                    "trainable": sum(p.numel() for p in params)}
        finally:
            del model
            self.free()


def _cache_kwarg(decoder) -> str:
    """The cache keyword of this transformers (`cache` from 5.24, `past_key_values` before)."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def _cache_mib(cache) -> float:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor)) / 2**20


def exactness(device, compile_flex: bool, scheme: str) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    tiny = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=97, max_position_embeddings=TINY_WINDOW)
    ids = torch.randint(3, 97, (2, 200), generator=torch.Generator().manual_seed(0))
    settings.FLEX_COMPILE = compile_flex
    params = EXACT[scheme]

    def llama(backend, dev):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**tiny), attn_implementation=backend,
                                                 dtype=torch.float32)
        return model.to(dev).eval()

    ref, gpu = llama("eager", "cpu"), llama("flex_attention", device)
    gpu.load_state_dict(ref.state_dict())  # the same weights, then the same learned tables
    rope_patch.apply(ref, scheme, **params)
    rope_patch.apply(gpu, scheme, **params)
    for path, table in rope_patch.api.patch_modules(gpu).items():
        table.load_state_dict(rope_patch.api.patch_modules(ref)[path].state_dict())
    with torch.no_grad():
        want = ref(ids).logits
        got = gpu(ids.to(device)).logits.float().cpu()
    diff = (got - want).abs().max().item()
    return {"params": params, "max_abs_diff": diff, "ok": diff <= 1e-4}


def plan(args) -> list[dict]:
    """Every row of the run, in the order they run (most important first), with what it needs to run."""
    shape = SHAPES[args.shape]
    lengths = args.lengths or shape["lengths"]
    prompt = args.decode_prompt or shape["decode_prompt"]
    lora_length = args.lora_length or shape["lora_length"]

    def chosen(name):  # --schemes: these (and vanilla, the baseline) only
        return args.schemes is None or name == "vanilla" or name in args.schemes

    rows = []
    for i, length in enumerate(lengths):
        rows += [{"case": "forward", "scheme": name, "length": length, "_run": (spec, backend)}
                 for name, (spec, backend) in suggested(shape, length).items() if chosen(name)]
        if i == 0:  # exactness right after the first (most important) length
            rows += [{"case": "exact", "scheme": name} for name in EXACT if chosen(name)]
    rows += [{"case": "decode", "scheme": name, "prompt": prompt, "_run": run}
             for name, run in suggested(shape, prompt + DECODE_WARM + args.decode_new).items() if chosen(name)]
    lora_specs = suggested(shape, lora_length)
    rows += [{"case": "lora", "scheme": name, "length": lora_length, "_run": lora_specs.get(name)}
             for name in LORA if chosen(name)]
    return [r for r in rows if args.cases is None or r["case"] in args.cases]


def run(args, device) -> list[dict]:
    runner = Runner(args, device)
    done = []
    for item in plan(args):
        row = {k: v for k, v in item.items() if not k.startswith("_")}
        t0 = time.monotonic()
        if t0 > runner.deadline:
            row["skipped"] = "budget"
        else:
            try:
                if row["case"] == "exact":
                    row.update(exactness(device, not args.no_compile, row["scheme"]))
                elif item["_run"] is None:
                    row["skipped"] = f"rope_patch.suggest names no {row['scheme']} for {row['length']} tokens"
                else:
                    spec, backend = item["_run"]
                    if row["case"] == "lora" and row["scheme"] == "self_extend" and device.type != "cuda":
                        backend = "sdpa"  # torch's CPU flex has no backward (the CPU dry run tests the plumbing)
                    if row["case"] == "lora":
                        try:
                            import peft  # noqa: F401
                        except ImportError:
                            row["skipped"] = "peft is not installed"
                    if "skipped" not in row:
                        settings.FLEX_COMPILE = not args.no_compile
                        row.update(getattr(runner, row["case"])(row, spec, backend))
            except Exception as e:  # recorded: one broken row must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"[:500]
                row["trace"] = traceback.format_exc()[-1500:]
            if "error" in row:  # after the except block: the exception's frames no longer hold the row's tensors
                runner.free()
            row["s"] = time.monotonic() - t0
        done.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
    _ratios(done)
    return done


def _ratios(rows: list[dict]) -> None:
    """Each measured row's time and memory against vanilla's in the same case (and length)."""
    for case, key, fields in (("forward", "length", ("time_s", "peak_mib", "extra_mib")),
                              ("decode", "prompt", ("ms_per_token", "cache_mib")),
                              ("lora", "length", ("time_s", "peak_mib", "extra_mib"))):
        base = {r[key]: r for r in rows if r["case"] == case and r["scheme"] == "vanilla" and fields[0] in r}
        for r in rows:
            b = base.get(r.get(key)) if r["case"] == case else None
            if b is None or fields[0] not in r:
                continue
            for f in fields:
                if r.get(f) is not None and b.get(f):
                    name = {"time_s": "time", "ms_per_token": "time", "peak_mib": "memory", "extra_mib": "extra",
                            "cache_mib": "cache"}[f]
                    r[f"{name}_x_vanilla"] = r[f] / b[f]
            if r["scheme"] != "vanilla":
                r["on_target"] = all(r[k] <= x for k, x in TARGETS[case].items() if k in r)


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def short_name(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100' (the results file's suffix)."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    return words[0] if words else "cpu"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b", help="model shape (tiny: CPU dry runs)")
    ap.add_argument("--lengths", type=int, nargs="+", help="forward lengths (default: the shape's, 64k and 128k)")
    ap.add_argument("--no-compile", action="store_true", help="eager flex (CPU dry runs)")
    ap.add_argument("--decode-prompt", type=int, help="prompt tokens before the decoding steps (default: 32k)")
    ap.add_argument("--decode-new", type=int, default=32, help="timed one-token cached steps")
    ap.add_argument("--lora-length", type=int, help="tokens of the LoRA step (default: 32k)")
    ap.add_argument("--schemes", nargs="+", help="only these schemes' rows (vanilla's always run): a second check "
                                                 "of what the first one showed")
    ap.add_argument("--cases", nargs="+", choices=CASES, help=f"only these cases (default: all: {' '.join(CASES)})")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="no row starts after this many seconds from the start; the rest are written as skipped")
    ap.add_argument("--out", default=str(OUT), help=f"the JSON results; '{{device}}' becomes e.g. h200 "
                                                    f"(default: {OUT})")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import transformers

    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device_name(device),
            "transformers": transformers.__version__, "shape": args.shape, "budget_s": args.budget_s}
    print(json.dumps(info), flush=True)
    rows = run(args, device)
    info["flex_variants"] = flex.compiled_variants()  # past settings.FLEX_RECOMPILES a call raises
    out = Path(args.out.replace("{device}", short_name(info["device"])))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "rows": rows, "elapsed_s": time.monotonic() - start}, indent=1))
    bad = [r for r in rows if "error" in r or r.get("ok") is False]
    skipped = [r for r in rows if "skipped" in r]
    off = [r for r in rows if r.get("on_target") is False]
    print(f"{len(rows)} rows, {len(bad)} failed or inexact, {len(off)} off issue 39's targets, {len(skipped)} skipped, "
          f"{time.monotonic() - start:.0f} s; wrote {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
