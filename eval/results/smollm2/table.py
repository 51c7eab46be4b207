"""The README's SmolLM2 table from eval/results/smollm2/ppl16k/compare.json (what run_ppl16k.sh writes).

    python eval/results/smollm2/table.py            # prints the table
    python eval/results/smollm2/table.py --readme   # rewrites it in README.md, below <!-- smollm2-table -->
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "eval/results/smollm2/ppl16k/compare.json"
MARK = "<!-- smollm2-table -->"


def table(results: dict) -> str:
    buckets = {}
    for b in results["buckets"]:
        buckets.setdefault(b["scheme"], []).append(b)
    spans = [(b["start"], b["end"]) for b in next(iter(buckets.values()))]
    head = "| scheme | all 16k | " + " | ".join(f"{s // 1024}–{e // 1024}k" for s, e in spans) + " |"
    rows = [head, "| --- | ---: | " + " | ".join("---:" for _ in spans) + " |"]
    for r in results["records"]:
        cells = [f"{b['perplexity']:.1f}" for b in sorted(buckets[r["scheme"]], key=lambda b: b["start"])]
        rows.append(f"| `{r['scheme']}` | {r['perplexity']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    text = table(json.loads(RESULTS.read_text()))
    if "--readme" not in sys.argv[1:]:
        print(text)
        return
    readme = ROOT / "README.md"
    lines = readme.read_text().split("\n")
    start = lines.index(MARK) + 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    readme.write_text("\n".join(lines[:start] + text.split("\n") + lines[end:]))


if __name__ == "__main__":
    main()
