#!/usr/bin/env bash
# Gemma 3 270M base (window 32768; 5 of 6 layers in a 512-token sliding window) at 2x its window: perplexity by 8k
# position bucket inside one 65,536-token window of Moby-Dick (eval/gemma3/book.py) per scheme, each scheme at
# the parameters rope_patch.suggest gave for N = 65536 before it restricted a hybrid's frequency schemes to the layer
# types that see past L, in the order they are worth running (trim from the end), and YaRN on
# the 3 global layers only (layer_types=full_attention: the local layers keep their RoPE, as Gemma 3 4B+ ship it).
# CPU: ~12 min for vanilla on 2 cores (windowed sliding layers, chunked loss). Resumable (--resume): rerun to go on.
set -euo pipefail
cd "$(dirname "$0")/../.."
BOOK=$(.venv/bin/python eval/gemma3/book.py)
.venv/bin/rope-patch compare --model gemma3 --threads 2 --lengths 65536 --windows 1 --bucket-size 8192 \
  --passkey-lengths --heldout "$BOOK" --no-plots \
  --schemes default yarn:factor=2 self_extend:group_size=5,window_size=8192 dca:chunk_size=24576,local_size=4096 \
            yarn:factor=2,layer_types=full_attention \
            rerope:window_size=16384 leaky_rerope:window_size=8192,factor=2.34 \
            string:shift_size=21845,window_size=128 dynamic:factor=2 \
            self_extend_logistic:group_size=5,window_size=4096,growth_rate=0.0025 sink:sink_size=4,window_size=32764 \
  --out eval/results/gemma3/ppl-64k-n1 --resume "$@"
