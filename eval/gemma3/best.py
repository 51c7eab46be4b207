"""The study's RULER schemes: vanilla and the `n` schemes with the lowest perplexity over the whole 64k window in
the finished perplexity table (eval/results/gemma3/ppl-64k-n1/compare.json), as specs for `rope-patch sweep`.

    python eval/gemma3/best.py            # 'default' and the 3 best, one per line
    python eval/gemma3/best.py --partial  # the same from an unfinished table (says which schemes it lacks)
"""

from __future__ import annotations

import sys
from pathlib import Path

from rope_patch.evaluation.results import load_results

RUN = Path(__file__).resolve().parents[1] / "results" / "gemma3" / "ppl-64k-n1" / "compare.json"
# constant-memory windows, not extensions: they read nothing older than their window, so a needle in the first half
# of the input is out of their reach whatever their perplexity (the SmolLM2 study leaves them out of RULER too)
WINDOWS = ("sink", "lm_infinite")


def best(results: dict, n: int = 3) -> list[str]:
    """'default' and the `n` other schemes of lowest whole-window perplexity, best first (windows left out)."""
    rows = sorted((r["perplexity"], r["scheme"]) for r in results["records"]
                  if r["scheme"] != "default" and r["name"] not in WINDOWS)
    return ["default", *(scheme for _, scheme in rows[:n])]


def main(argv: list[str], results: dict | None = None) -> None:
    results = load_results(RUN) if results is None else results
    if results.get("pending") and "--partial" not in argv:
        sys.exit(f"best.py: the perplexity table is not finished ({len(results['pending'])} schemes pending: "
                 f"{', '.join(results['pending'])}); finish eval/gemma3/run_ppl64k.sh, or pass --partial")
    print("\n".join(best(results)))


if __name__ == "__main__":
    main(sys.argv[1:])
