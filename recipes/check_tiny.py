"""Check that the embedded model rope-tiny is fit for its job as the project's test subject.

rope-tiny exists to show position-encoding effects on a CPU, so it must (1) retrieve a passkey inside its
256-token training window and (2) visibly fail beyond it with vanilla RoPE - otherwise a context-extension scheme
has nothing to fix. This script measures both on the saved model and exits non-zero when a target is missed:

- passkey accuracy at 256 tokens >= 90% (greedy decoding, exact match of the first generated number);
- held-out perplexity at 1024 tokens >= 1.5 x perplexity at 256 (non-overlapping windows, same tokens).

    python recipes/check_tiny.py [--model rope_patch/data/rope-tiny] [--heldout rope_patch/data/heldout.txt]

``recipes/pretrain_tiny.py`` imports the two measurements from here for the model card.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaForCausalLM

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rope_patch.evaluation.passkey import make_passkey_sample, score_passkey  # noqa: E402

PASSKEY_TARGET = 0.9
PPL_RATIO_TARGET = 1.5


@torch.no_grad()
def perplexity(model, token_ids: list[int], window: int, batch_size: int = 8) -> float:
    """Perplexity over non-overlapping ``window``-token windows, each scored independently from position 0.

    Only whole windows are scored; pass a token count divisible by every window compared, so that all lengths
    see exactly the same text.
    """
    n_windows = len(token_ids) // window
    ids = torch.tensor(token_ids[: n_windows * window]).view(n_windows, window)
    total_nll, total_tokens = 0.0, 0
    for batch in ids.split(batch_size):
        logits = model(input_ids=batch).logits[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    return math.exp(total_nll / total_tokens)


@torch.no_grad()
def passkey_accuracy(
    model, tokenizer, filler_ids: list[int], length: int, n_samples: int = 50, seed: int = 0, batch_size: int = 25
) -> float:
    """Fraction of ``n_samples`` passkey prompts of ``length`` tokens answered exactly, needles at depths
    spread evenly over [0, 1], keys and filler stretches drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    depths = [i / max(n_samples - 1, 1) for i in range(n_samples)]
    samples = [make_passkey_sample(tokenizer, filler_ids, length, depth, rng) for depth in depths]
    correct = 0
    for start in range(0, n_samples, batch_size):
        chunk = samples[start : start + batch_size]
        # Every prompt has exactly `length` tokens, so the batch needs no padding.
        prompts = torch.tensor([s["prompt_ids"] for s in chunk])
        out = model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
        for sample, new_ids in zip(chunk, out[:, length:], strict=False):
            correct += score_passkey(tokenizer.decode(new_ids, skip_special_tokens=True), sample["answer"])
    return correct / n_samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="rope_patch/data/rope-tiny")
    parser.add_argument("--heldout", default="rope_patch/data/heldout.txt")
    parser.add_argument("--samples", type=int, default=50, help="passkey prompts per length")
    parser.add_argument("--tokens", type=int, default=65536, help="held-out tokens scored (divisible by 8 x window)")
    args = parser.parse_args()

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = LlamaForCausalLM.from_pretrained(args.model).eval()
    window = model.config.max_position_embeddings
    heldout_ids = tokenizer.encode(Path(args.heldout).read_text(encoding="utf-8"))
    lengths = [window, 2 * window, 4 * window, 8 * window]
    heldout_ids = heldout_ids[: args.tokens]

    print(f"{args.model}: {sum(p.numel() for p in model.parameters()):,} parameters, window {window}")
    print(f"held-out text: {len(heldout_ids):,} tokens scored at every length")
    print(f"{'length':>7} {'perplexity':>11} {'passkey':>8}")
    ppl, acc = {}, {}
    for length in lengths:
        ppl[length] = perplexity(model, heldout_ids, length)
        acc[length] = passkey_accuracy(model, tokenizer, heldout_ids, length, args.samples)
        print(f"{length:>7} {ppl[length]:>11.1f} {acc[length]:>8.0%}")

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
