#!/usr/bin/env bash
# SmolLM2-135M-Instruct (window 8192): passkey by length x depth (0.1 / 0.5 / 0.9), one thread per run (the machine
# has 2 shared cores; ~1.8 min per 4k-8k prompt, ~5 min per 16k prompt). Every run is resumable (--resume).
#   template   chat template on, 4k and 8k (inside the window), 3 prompts per cell, vanilla -> passkey-4k_8k-n3/
#              (17 min)
#   plain      chat template off, 4k and 8k, 3 prompts per cell, vanilla -> passkey_plain-4k_8k-n3/
#   beyond     chat template off, 16k (2x the window), 1 prompt per cell, vanilla / DCA / YaRN x2 (the best
#              attention-side and frequency schemes on perplexity at 16k, ppl-16k-n1/) -> passkey_plain-16k-n1/
#   noise      chat template on, the passkey paper's haystack ("The grass is green. ..." lines, --haystack noise,
#              which the model can search inside its window), one shared haystack per cell (--shared-haystack:
#              its prefix is prefilled once), 3 prompts per cell; vanilla at 4k / 8k / 16k ->
#              passkey_noise_shared-4k_8k_16k-n3/ (33 min), and each scheme given at 8k and 16k ->
#              passkey_noise_shared-8k_16k-n3-<scheme name>/ (one folder each, so they can run side by side; ~30 min
#              per scheme at 16k, ~10 at 8k)
# Folder names: eval/README.md, "Results".
# Usage: run_passkey.sh template|plain|beyond|noise [SCHEME ...]   (beyond: the schemes to run, default all three;
#        noise: none for vanilla, or the schemes to run at 8k and 16k)
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:?template, plain or beyond}; shift
common=(--model smollm2 --threads 1 --lengths 512 --windows 1 --depths 0.1 0.5 0.9 --resume)
case $mode in
  template) .venv/bin/rope-patch compare "${common[@]}" --chat-template on --passkey-samples 3 \
              --passkey-lengths 4096 8192 --schemes default --out eval/results/smollm2/passkey-4k_8k-n3 ;;
  plain)    .venv/bin/rope-patch compare "${common[@]}" --chat-template off --passkey-samples 3 \
              --passkey-lengths 4096 8192 --schemes default --out eval/results/smollm2/passkey_plain-4k_8k-n3 ;;
  beyond)   schemes=("$@"); [[ ${#schemes[@]} -gt 0 ]] || schemes=(default dca:chunk_size=6144,local_size=1024 yarn:factor=2)
            .venv/bin/rope-patch compare "${common[@]}" --chat-template off --passkey-samples 1 \
              --passkey-lengths 16384 --schemes "${schemes[@]}" --out "eval/results/smollm2/passkey_plain-16k-n1${OUT_SUFFIX:-}" ;;
  noise)    noise=(--chat-template on --haystack noise --shared-haystack --passkey-samples 3)
            if [[ $# -eq 0 ]]; then
              .venv/bin/rope-patch compare "${common[@]}" "${noise[@]}" --passkey-lengths 4096 8192 16384 \
                --schemes default --out eval/results/smollm2/passkey_noise_shared-4k_8k_16k-n3
            fi
            for s in "$@"; do
              .venv/bin/rope-patch compare "${common[@]}" "${noise[@]}" --passkey-lengths 8192 16384 \
                --schemes "$s" --out "eval/results/smollm2/passkey_noise_shared-8k_16k-n3-${s%%:*}"
            done ;;
  *) echo "unknown mode $mode: template, plain, beyond or noise" >&2; exit 2 ;;
esac
