#!/usr/bin/env bash
# SmolLM2-135M-Instruct (window 8192): passkey with its chat template at 4k, 8k (inside the window) and 16k (2x),
# needle at depths 0.1 / 0.5 / 0.9, one prompt (its own haystack) per cell, for vanilla and the two schemes best on
# perplexity at 16k (ppl16k/). CPU: ~5 min per 16k prompt on 2 shared cores. Resumable (--resume).
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/rope-patch compare --model smollm2 --threads 2 --lengths 512 --windows 1 \
  --passkey-lengths 4096 8192 16384 --depths 0.1 0.5 0.9 --passkey-samples 1 --chat-template on \
  --schemes default dca:chunk_size=6144,local_size=1024 yarn:factor=2 \
  --out eval/results/smollm2/passkey --resume
