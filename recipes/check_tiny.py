"""Check that the embedded model rope-tiny is fit for its job as the project's test subject.

rope-tiny exists to show position-encoding effects on a CPU, so it must (1) retrieve a passkey inside its
256-token training window and (2) visibly fail beyond it with vanilla RoPE - otherwise a context-extension scheme
has nothing to fix. This script measures both on the saved model and exits non-zero when a target is missed:

- passkey accuracy at 256 tokens >= 90%;
- held-out perplexity at 1024 tokens >= 1.5 x perplexity at 256.

Both measurements are `rope_patch.evaluation`'s, the ones `rope-patch compare` and the fine-tuning recipe report:
perplexity over non-overlapping windows of the first `--tokens` held-out tokens (no BOS added, every length scoring
the same tokens; `evaluation.perplexity`), passkey prompts from `evaluation.passkey` at the depths below, seeded per
(length, depth) cell, greedy decoding of the answer's length + 1 tokens, exact match of the first number
(`evaluation.retrieval`). The same model and settings therefore give the same numbers in all three places.

    python recipes/check_tiny.py [--model rope_patch/data/rope-tiny] [--heldout rope_patch/data/heldout.txt]

``recipes/pretrain_tiny.py`` imports the two measurements from here for the model card.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rope_patch.evaluation.common import read_tokens  # noqa: E402
from rope_patch.evaluation.perplexity import evaluate_perplexity  # noqa: E402
from rope_patch.evaluation.retrieval import accuracy_by_length, evaluate_passkey  # noqa: E402

PASSKEY_TARGET = 0.9
PPL_RATIO_TARGET = 1.5
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # the fine-tuning configs' passkey depths


def perplexity(model, token_ids: list[int], window: int) -> float:
    """Perplexity over the non-overlapping ``window``-token windows of ``token_ids`` (`evaluate_perplexity`).

    Only whole windows are scored; pass a token count divisible by every window compared, so that all lengths
    see exactly the same text.
    """
    return evaluate_perplexity(model, token_ids, [window], n_tokens=len(token_ids))["lengths"][0]["perplexity"]


def passkey_accuracy(model, tokenizer, filler_ids: list[int], length: int, n_samples: int = 50, seed: int = 0) -> float:
    """Fraction answered exactly of ``n_samples`` passkey prompts of ``length`` tokens, spread evenly over
    `DEPTHS` (`evaluate_passkey`; ``n_samples`` is rounded down to a multiple of their number)."""
    per_depth = max(1, n_samples // len(DEPTHS))
    records = evaluate_passkey(model, tokenizer, filler_ids, [length], DEPTHS, per_depth, seed=seed)
    return accuracy_by_length(records)[length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="rope_patch/data/rope-tiny")
    parser.add_argument("--heldout", default="rope_patch/data/heldout.txt")
    parser.add_argument("--samples", type=int, default=50, help="passkey prompts per length (a multiple of 5)")
    parser.add_argument("--tokens", type=int, default=65536, help="held-out tokens scored (divisible by 8 x window)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = LlamaForCausalLM.from_pretrained(args.model).eval()
    window = model.config.max_position_embeddings
    heldout_ids, _ = read_tokens(tokenizer, args.heldout, max_tokens=args.tokens)
    lengths = [window, 2 * window, 4 * window, 8 * window]

    print(f"{args.model}: {sum(p.numel() for p in model.parameters()):,} parameters, window {window}")
    print(f"held-out text: {len(heldout_ids):,} tokens scored at every length; passkey: {args.samples} "
          "prompts per length")
    print(f"{'length':>7} {'perplexity':>11} {'passkey':>8}")
    ppl, acc = {}, {}
    for length in lengths:
        ppl[length] = perplexity(model, heldout_ids, length)
        acc[length] = passkey_accuracy(model, tokenizer, heldout_ids, length, args.samples)
        print(f"{length:>7} {ppl[length]:>11.1f} {acc[length]:>8.0%}", flush=True)

    ratio = ppl[4 * window] / ppl[window]
    checks = [
        (f"passkey accuracy at {window} >= {PASSKEY_TARGET:.0%}", acc[window] >= PASSKEY_TARGET, f"{acc[window]:.0%}"),
        (f"perplexity at {4 * window} >= {PPL_RATIO_TARGET}x at {window}", ratio >= PPL_RATIO_TARGET, f"{ratio:.2f}x"),
    ]
    for name, ok, value in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value}")
    sys.exit(0 if all(ok for _, ok, _ in checks) else 1)


if __name__ == "__main__":
    main()
