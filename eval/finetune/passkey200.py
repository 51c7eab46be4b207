"""Passkey at the target length of saved fine-tunes (merged folders) on 200 prompts: 5 depths x 10 prompts for
each of the seeds 0-3 (seed 0's 50 are the ones the recipes scored before they took 40 per depth). With 50 prompts
a 95% interval is ~16 points wide, too wide to read a 90% target.

    python eval/finetune/passkey200.py [--length 1024] out/finetune/tiny_yarn_4x/merged ... > out.json

(eval/results/tiny/passkey-1k_2k-n40-finetuned/passkey200.json: five saved fine-tunes, at 1024 and 2048.)
"""

import json
import sys

import torch
from transformers import AutoTokenizer

import rope_patch
from rope_patch.evaluation.common import read_tokens
from rope_patch.evaluation.retrieval import evaluate_passkey, wilson_interval

torch.set_num_threads(1)
DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9]
args = sys.argv[1:]
LENGTH = int(args[1]) if args[:1] == ["--length"] else 1024
folders = args[2:] if args[:1] == ["--length"] else args
out = {}
for folder in folders:
    model = rope_patch.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids, _ = read_tokens(tok, "rope_patch/data/heldout.txt")
    by_seed = {}
    for seed in range(4):
        recs = evaluate_passkey(model, tok, ids, [LENGTH], DEPTHS, 10, seed=seed)
        by_seed[seed] = {str(r["depth"]): r["correct"] for r in recs}
    k = sum(sum(v.values()) for v in by_seed.values())
    by_depth = {str(d): sum(v[str(d)] for v in by_seed.values()) for d in DEPTHS}
    low, high = wilson_interval(k, 200)
    out[folder] = {"scheme": str(rope_patch.current(model)), "length": LENGTH, "correct": k, "n": 200,
                   "accuracy": k / 200,
                   "ci_low": low, "ci_high": high, "by_seed": by_seed, "by_depth_of_40": by_depth}
    print(f"{folder}: {k}/200 ({low:.0%}-{high:.0%}), by depth {by_depth}", file=sys.stderr, flush=True)
print(json.dumps(out, indent=1))
