"""Training throughput with a patch ÷ without: LoRA fine-tuning steps of the recipe, side by side in one run.

    python bench/finetune.py [--model tiny] [--seq-len 1024] [--steps 1] [--reps 9] [--schemes yarn:4 linear:4]

One LoRA-wrapped model (rope-tiny when it exists, else a random model of its shape: hidden 256, 4 layers, 4 heads
of 64, vocab 4096, window 256). For each scheme, blocks of `--steps` training steps (forward with the recipe's
inputs, weighted loss, backward, AdamW step) alternate between the patched model and the same model with the
patch removed, `--reps` times, so both see the same machine load; the ratio of the median tokens/s is reported
(and the median of the per-pair ratios, which cancels slow drifts). Target for frequency schemes: >= 0.98 —
a frequency patch only changes `inv_freq` / `attention_scaling`, so training must cost the same.
Absolute numbers on a shared machine are noisy; the ratios are the result.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import rope_patch
from rope_patch.training.pose import pose_inputs

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCHEMES = ["linear:4", "ntk:4", "yarn:4", "llama3:4", "dynamic:4", "default:500000"]


def _recipe():
    spec = importlib.util.spec_from_file_location("finetune_lora", ROOT / "recipes" / "finetune_lora.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the recipe's config dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


def build(model_spec: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    try:
        from rope_patch.zoo import resolve_model_path

        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(model_spec))
        source = str(resolve_model_path(model_spec))
    except (FileNotFoundError, ValueError):
        cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        source = "random model of rope-tiny's shape"
    import peft

    lora = peft.get_peft_model(model, peft.LoraConfig(
        r=16, lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        modules_to_save=["embed_tokens", "norm"], task_type="CAUSAL_LM"))
    return lora, source


def train_block(model, optimizer, loss_fn, batch, steps: int) -> float:
    """tokens/s over `steps` optimizer steps on one fixed batch."""
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(**batch, use_cache=False).logits
        loss = loss_fn(logits, batch["input_ids"], batch["weights"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps * batch["input_ids"].numel() / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--schemes", nargs="+", default=DEFAULT_SCHEMES)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1, help="training steps per timed block (1: finest interleaving)")
    parser.add_argument("--reps", type=int, default=9, help="patched/unpatched block pairs per scheme")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from rope_patch.specs import parse_scheme_spec

    loss_fn = _recipe().weighted_loss
    model, source = build(args.model)
    model.train()
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    batch = {**pose_inputs(ids, torch.arange(args.seq_len)), "weights": torch.ones(ids.shape)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    print(f"model: {source}; LoRA r=16 + embed/norm; batch {args.batch} x {args.seq_len} tokens; "
          f"{args.steps} steps per block, {args.reps} pairs; threads {args.threads}", flush=True)
    train_block(model, optimizer, loss_fn, batch, 1)  # warm-up (allocator, autograd graph caches)

    rows, pairs_all = [], []
    for spec in args.schemes:
        scheme = parse_scheme_spec(spec)  # original_max_position_embeddings defaults to the model window
        patched, plain = [], []
        for rep in range(args.reps):
            # Alternate the order inside each pair so neither side always runs first after a switch.
            for side in ((True, False) if rep % 2 == 0 else (False, True)):
                if side:
                    rope_patch.apply(model, scheme)
                    patched.append(train_block(model, optimizer, loss_fn, batch, args.steps))
                    rope_patch.remove(model)
                else:
                    plain.append(train_block(model, optimizer, loss_fn, batch, args.steps))
        ratio = statistics.median(patched) / statistics.median(plain)
        pair = statistics.median(p / q for p, q in zip(patched, plain, strict=True))
        if scheme.kind == "frequency":
            pairs_all.extend(p / q for p, q in zip(patched, plain, strict=True))
        rows.append({"scheme": spec, "kind": scheme.kind, "patched_tok_s": statistics.median(patched),
                     "plain_tok_s": statistics.median(plain), "ratio": ratio, "pair_ratio": pair})
        print(f"{spec:<16} patched {statistics.median(patched):8.0f} tok/s  "
              f"plain {statistics.median(plain):8.0f} tok/s  ratio {ratio:.3f}  (median pair ratio {pair:.3f})",
              flush=True)
    print("\n| scheme | patched tok/s | plain tok/s | ratio | median pair ratio |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['scheme']} | {r['patched_tok_s']:.0f} | {r['plain_tok_s']:.0f} | {r['ratio']:.3f} "
              f"| {r['pair_ratio']:.3f} |")
    if pairs_all:
        # Every frequency scheme runs the same code with different buffers: pooling their pairs halves the noise.
        print(f"\nall frequency schemes pooled: median pair ratio {statistics.median(pairs_all):.3f} "
              f"over {len(pairs_all)} pairs")
    if args.json:
        args.json.write_text(json.dumps({"source": source, "args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows,
                                         "pooled_pair_ratio": statistics.median(pairs_all) if pairs_all else None},
                                        indent=2))
    bad = [r["scheme"] for r in rows if r["kind"] == "frequency" and max(r["ratio"], r["pair_ratio"]) < 0.98]
    if bad:
        print(f"below the 0.98 target: {', '.join(bad)} (re-run on a quieter machine before trusting it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
