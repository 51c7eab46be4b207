"""Run `rope-patch compare` from a checkout without installing the package (same arguments).

    python eval/compare.py --model tiny --schemes default linear:4 ntk:8 dynamic:4 yarn:8 llama3:8 \
        --lengths 256 512 1024 2048 --out results/
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rope_patch.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))
