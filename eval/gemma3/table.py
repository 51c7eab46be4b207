"""The Gemma 3 study's tables (docs/studies/gemma3.md) from the committed runs that tables.json beside this file lists:
perplexity by position at 64k (run_ppl64k.sh), computed by rope_patch.evaluation.tables, which
tests/evaluation/test_study_results.py also reads.

    python eval/gemma3/table.py            # prints the tables
    python eval/gemma3/table.py --write    # rewrites them in docs/studies/gemma3.md, below their marks
"""

from __future__ import annotations

import sys
from pathlib import Path

from rope_patch.evaluation import tables

if __name__ == "__main__":
    tables.main(Path(__file__).resolve().with_name("tables.json"), sys.argv[1:])
