"""The SmolLM2 study's tables (docs/studies/smollm2.md) from the committed runs: perplexity by position at 16k
(run_ppl16k.sh) and 32k (run_ppl32k.sh), the tuned scheme against the baselines on the acceptance text
(`rope-patch tune`), passkey by length x depth in prose and in the passkey paper's haystack (run_passkey.sh,
run_passkey16k.sh), and RULER through lm-eval (`rope-patch sweep`). tables.json beside this file lists each table's mark
and runs; the tables are computed by rope_patch.evaluation.tables, which tests/evaluation/test_study_results.py also
reads.

    python eval/smollm2/table.py            # prints the tables
    python eval/smollm2/table.py --write    # rewrites them in docs/studies/smollm2.md, below their marks
"""

from __future__ import annotations

import sys
from pathlib import Path

from rope_patch.evaluation import tables

if __name__ == "__main__":
    tables.main(Path(__file__).resolve().with_name("tables.json"), sys.argv[1:])
