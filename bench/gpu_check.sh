#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py: compiled flex exactness on a tiny model, then time and memory at 32k / 64k on a
# SmolLM2-shaped random model): one prepared run of <= 5 minutes on one CUDA GPU, from any directory. Needs torch
# with CUDA and transformers (no network, no weights, rope_patch from this checkout). Writes $OUT/gpu_check.json
# (or out/gpu_check.json in the checkout, which git ignores) and exits non-zero if a case failed or missed its tolerance.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONUNBUFFERED=1 "${PYTHON:-python3}" bench/gpu_check.py --out "${OUT:-out}/gpu_check.json" "$@"
