#!/usr/bin/env bash
# SmolLM2-135M-Instruct (window 8192) at 4x its window: perplexity by 4k position bucket inside one 32k window of
# held-out prose, for the schemes best at 16k (ppl-16k-n1/) with rope_patch.suggest's parameters for N = 32768, and
# vanilla. One thread per run (2 shared cores). Resumable (--resume).
# Usage: run_ppl32k.sh OUT_FOLDER SCHEME...   e.g.
#   run_ppl32k.sh ppl-32k-n1 dca:chunk_size=6144,local_size=1024 leaky_rerope:window_size=2048,factor=5.01
#   run_ppl32k.sh ppl-32k-n1 yarn:factor=4 default   (the same folder: --resume adds the schemes)
# (folder names: eval/README.md, "Results")
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?output folder under eval/results/smollm2}; shift
.venv/bin/rope-patch compare --model smollm2 --threads 1 --lengths 32768 --windows 1 --bucket-size 4096 \
  --passkey-lengths --schemes "$@" --out "eval/results/smollm2/$out" --resume
