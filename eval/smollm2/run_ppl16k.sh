#!/usr/bin/env bash
# SmolLM2-135M-Instruct (window 8192) at 2x its window: perplexity by 2k position bucket inside one 16k window of
# held-out prose per scheme (rope_patch.suggest's parameters for N = 16384). CPU: ~1.5-5 min per scheme on 2 shared
# cores. Resumable (--resume): rerun to continue after an interruption.
set -euo pipefail
cd "$(dirname "$0")/../.."
.venv/bin/rope-patch compare --model smollm2 --threads 2 --lengths 16384 --windows 1 --bucket-size 2048 --passkey-lengths \
  --schemes default yarn:factor=2 self_extend:group_size=5,window_size=2048 rerope:window_size=4096 \
            dca:chunk_size=6144,local_size=1024 yarn:factor=2+string:shift_size=5461,window_size=128 \
            dynamic_yarn:factor=2 ntk:factor=2 linear:factor=2 dynamic:factor=2 llama3:factor=2 \
            leaky_rerope:window_size=2048,factor=2.34 yarn:factor=2,resonance=true ntk:factor=2,resonance=true \
            self_extend_logistic:group_size=5,window_size=1024,growth_rate=0.01 \
            dpe:group_sizes=4/4/4/4/4/4/4/4,window_size=1024 sink:sink_size=4,window_size=8188 \
  --out eval/results/smollm2/ppl-16k-n1 --resume
