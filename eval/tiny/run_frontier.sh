#!/usr/bin/env bash
# The issue-13 frontier on rope-tiny (window 256) at 4x and 8x its window: the parameters are rope_patch.suggest's
# for each target (rope-patch compare --target N prints them); STRING beyond the window is composed with YaRN.
set -euo pipefail
cd "$(dirname "$0")/../.."
rp=.venv/bin/rope-patch
$rp compare --model tiny --threads 1 --lengths 256 1024 --passkey-lengths 1024 --depths 0.1 0.5 0.9 --passkey-samples 10 \
  --schemes default yarn:4 dynamic_yarn:4 self_extend:group_size=9,window_size=64 rerope:window_size=128 \
            string:shift_size=341,window_size=8 yarn:4+string:shift_size=341,window_size=8 dca:chunk_size=192,local_size=32 \
            yarn:factor=4,beta_fast=2 dynamic_yarn:factor=4,beta_fast=2 yarn:factor=4,beta_fast=2+string:shift_size=341,window_size=8 \
  --out eval/results/tiny/ppl_passkey-256_1k-n10-frontier --resume
$rp compare --model tiny --threads 1 --lengths 256 2048 --passkey-lengths 2048 --depths 0.1 0.5 0.9 --passkey-samples 10 \
  --schemes default yarn:8 dynamic_yarn:8 self_extend:group_size=19,window_size=64 rerope:window_size=128 \
            string:shift_size=683,window_size=8 yarn:8+string:shift_size=683,window_size=8 dca:chunk_size=192,local_size=32 \
            yarn:factor=8,beta_fast=2 dynamic_yarn:factor=8,beta_fast=2 yarn:factor=8,beta_fast=2+string:shift_size=683,window_size=8 \
  --out eval/results/tiny/ppl_passkey-256_2k-n10-frontier --resume
# The suggested YaRN betas for a 256-token window (rope_patch.suggest: beta_fast = 2) are in the last three rows.
# STRING's own claim is inside the window (N <= L): S = N/3.
$rp compare --model tiny --threads 1 --lengths 256 --passkey-lengths 256 --depths 0.1 0.5 0.9 --passkey-samples 10 \
  --schemes default string:shift_size=85,window_size=8 string:shift_size=128,window_size=32 \
  --out eval/results/tiny/ppl_passkey-256-n10-frontier --resume
