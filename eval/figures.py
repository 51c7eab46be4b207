"""Redraw the figures of runs under eval/results from their JSON, beside it: perplexity.png and passkey.png
(compare.json), tasks.png (sweep.json of lm-eval's own tasks), search.png (search_log.json). The repository keeps
only the figures the README and the docs show (eval/README.md, "eval/results/"); this draws any other.

    python eval/figures.py                                         # every run
    python eval/figures.py eval/results/smollm2/ppl-16k-n1 ...     # these runs
"""

from __future__ import annotations

import sys
from pathlib import Path

from rope_patch import plots, schema
from rope_patch.evaluation.results import load_results
from rope_patch.tuning import load_log

RESULTS = Path(__file__).resolve().parent / "results"


def redraw(run: Path) -> list[Path]:
    """The figures of one run folder, drawn again; [] where it has none (a fine-tune, a cache-rotation check)."""
    drawn = []
    if (run / "compare.json").is_file():
        drawn += plots.write_figures(load_results(run / "compare.json"), run).values()
    if (run / "sweep.json").is_file():
        tasks = plots.write_tasks_figure(schema.read(run / "sweep.json", schema.SWEEP), run)
        drawn += [tasks] if tasks is not None else []
    if (run / "search_log.json").is_file():
        drawn.append(plots.write_search_figure(load_log(run / "search_log.json"), run))
    return drawn


def main(argv: list[str] | None = None) -> int:
    runs = [Path(a) for a in (sys.argv[1:] if argv is None else argv)] or sorted(RESULTS.glob("*/*/"))
    for run in runs:
        for path in redraw(run):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
