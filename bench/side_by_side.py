"""Two commits side by side in one run: a bench of this checkout run against rope_patch at `--base` and at the
working tree, alternately, `--rounds` times, so that the machine's load hits both alike.

    python bench/side_by_side.py --base HEAD~3 attention --lengths 16384 --schemes rope self_extend rerope
    python bench/side_by_side.py --base HEAD~3 decode --prompts 8192 --schemes self_extend rerope sink

The base is checked out into a temporary git worktree; both runs use this checkout's bench script, with rope_patch
imported from the base's tree or from this one (PYTHONPATH), so only the library differs. Each run reports every
scheme as a multiple of vanilla measured in the same run (`attention`: steady time and peak tensor memory against
`rope`; `decode`: ms per token and cache bytes against `vanilla`); the table gives, per scheme, the best round's
multiple at the base and here, and here ÷ base (the issue's budget: within 5%, ≤ 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ratios(bench: str, result) -> dict[str, tuple[float, float]]:
    """scheme → (time multiple, memory multiple) of one run's JSON, against that run's vanilla."""
    if bench == "attention":
        out = {}
        for length in sorted({r["length"] for r in result}):
            rows = {r["scheme"]: r for r in result if r["length"] == length}
            base = rows["rope"]
            for name, r in rows.items():
                out[f"{name} L={length}"] = (r["time_s"] / base["time_s"], r["peak_mb"] / base["peak_mb"])
        return out
    out = {}
    for run in result:
        for r in run["rows"]:
            out[f"{r['scheme']} prompt={run['prompt']}"] = (r["ratio"], r["cache_ratio"])
    return out


def run_once(bench: str, args: list[str], tree: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        flag = ["--json", str(out)] if bench == "attention" else ["--out", str(out)]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, str(ROOT / "bench" / f"{bench}.py"), *args, *flag]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed under {tree.name}:\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
    return ratios(bench, result if bench == "attention" else (result if isinstance(result, list) else [result]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision to compare against (e.g. the parent commit)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("bench", choices=["attention", "decode"])
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the bench's own arguments")
    a = ap.parse_args()
    base_rev = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), base_rev], cwd=ROOT, check=True)
        try:
            best: dict[str, dict[str, tuple[float, float]]] = {"base": {}, "here": {}}
            for k in range(a.rounds):
                for side, tree in (("base", base_tree), ("here", ROOT)):
                    got = run_once(a.bench, a.args, tree)
                    print(f"round {k + 1} {side}: " + ", ".join(f"{s} {t:.3f}/{m:.3f}" for s, (t, m) in got.items()),
                          file=sys.stderr, flush=True)
                    for s, (t, m) in got.items():
                        was = best[side].get(s, (float("inf"), float("inf")))
                        best[side][s] = (min(was[0], t), min(was[1], m))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    print(f"{a.bench} {' '.join(a.args)}; base {base_rev}, here {head} (+ working tree); best of {a.rounds} rounds; "
          f"load {os.getloadavg()[0]:.1f}")
    print("| scheme | time × vanilla, base | here | here ÷ base | memory × vanilla, base | here | here ÷ base |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in best["here"]:
        if s not in best["base"]:
            continue
        (tb, mb), (th, mh) = best["base"][s], best["here"][s]
        print(f"| {s} | {tb:.3f} | {th:.3f} | {th / tb:.3f} | {mb:.3f} | {mh:.3f} | {mh / mb:.3f} |")


if __name__ == "__main__":
    main()
