#!/usr/bin/env bash
# The GPU check (issue 39; bench/gpu_check.py says what each row measures): on a random Llama-3.2-1B-shaped model,
# the bf16 forward at 64k of vanilla sdpa and every length-extending scheme first, then the compiled flex paths'
# exactness on a tiny model, the forward at 128k, decoding after a 32k prompt, one LoRA step at 32k. One prepared run
# of <= 5 minutes on one H100/H200 (--budget-s 270: rows that do not fit are written as skipped), from any directory.
# Needs torch with CUDA, transformers and (for the LoRA rows, else skipped) peft; no network, no weights, rope_patch
# from this checkout. Writes bench/results/gpu_check_<device>.json (OUT=dir to write elsewhere) and exits non-zero if
# a row failed or missed its tolerance. Extra arguments go to the script, e.g. a second check of a few rows:
#     bash bench/gpu_check.sh --schemes dca rerope --cases forward decode
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONUNBUFFERED=1 "${PYTHON:-python3}" bench/gpu_check.py --out "${OUT:-bench/results}/gpu_check_{device}.json" "$@"
