#!/usr/bin/env bash
# RULER's needle (niah_single_1, the packaged offline task) at 64k through lm-eval: 3 samples each for vanilla and the
# 3 schemes of lowest 64k perplexity (eval/gemma3/best.py reads them from the finished perplexity table). Greedy
# decoding runs the sliding layers windowed (no L x L mask). Resumable: rerun to go on.
set -euo pipefail
cd "$(dirname "$0")/../.."
SCHEMES=$(.venv/bin/python eval/gemma3/best.py "$@")  # specs hold no spaces
# shellcheck disable=SC2086
.venv/bin/rope-patch sweep --model gemma3 --tasks niah_single_1 --lengths 65536 --limit 3 --schemes $SCHEMES \
  --out eval/results/gemma3/ruler_niah_single_1-64k-n3
