#!/usr/bin/env bash
# SmolLM2-135M-Instruct at 2x its window: passkey with its chat template at 16k, depths 0.1 / 0.5 / 0.9, one prompt
# (its own haystack) per cell, vanilla vs DCA (the best re-positioning scheme on perplexity at 16k, ppl-16k-n1/). The
# reduced form of run_passkey.sh that fit this session's CPU: ~5 min per 16k prompt at 1 thread. Resumable.
set -euo pipefail
cd "$(dirname "$0")/../.."
.venv/bin/rope-patch compare --model smollm2 --threads 1 --lengths 512 --windows 1 \
  --passkey-lengths 16384 --depths 0.1 0.5 0.9 --passkey-samples 1 --chat-template on \
  --schemes default dca:chunk_size=6144,local_size=1024 \
  --out eval/results/smollm2/passkey-16k-n1 --resume
