"""Start-up time of the `rope-patch` command line against a bare `import torch`, measured side by side (issue 29).

    python bench/cli_startup.py [--reps 7] [--out bench/results/cli_startup.json]

Each repetition runs, in a fresh process each and in a rotating order (so that a burst of load on a shared machine
falls on every case alike): `rope-patch --help`, an argument error (`rope-patch compare --model tiny --lengths 1k`),
`rope-patch list`, `python -c "import torch"` and `python -c pass` (the interpreter's own start). It reports the
median wall time of each, its ratio to the bare `import torch`, the load average before and after (`os.getloadavg()`),
and the heaviest imports of `rope-patch --help` (`python -X importtime`). Target: `--help` and the argument error
<= 0.2x `import torch`. The JSON summary goes to --out, else to stdout; the table to stderr. Absolute times on a
shared machine are noisy: the ratios, measured in the same run, are what this reports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET = 0.2  # --help and an argument error: at most this fraction of a bare `import torch`


def cli_command() -> list[str]:
    """The console script installed beside this interpreter (what users run), else `python -m rope_patch.cli`."""
    script = Path(sys.executable).with_name("rope-patch")
    if script.is_file():
        return [str(script)]
    found = shutil.which("rope-patch")
    return [found] if found else [sys.executable, "-m", "rope_patch.cli"]


def cases(cli: list[str]) -> dict[str, tuple[list[str], int]]:
    """name -> (argv, the exit status it must end with)."""
    return {
        "help": ([*cli, "--help"], 0),
        "argument_error": ([*cli, "compare", "--model", "tiny", "--lengths", "1k"], 2),
        "list": ([*cli, "list"], 0),
        "import_torch": ([sys.executable, "-c", "import torch"], 0),
        "python": ([sys.executable, "-c", "pass"], 0),
    }


def shown(argv: list[str], cli: list[str]) -> str:
    """`rope-patch --help` / `python -c 'import torch'`: the command as a user would type it."""
    head, rest = (["rope-patch"], argv[len(cli):]) if argv[:len(cli)] == cli else (["python"], argv[1:])
    return shlex.join(head + rest)


def time_once(argv: list[str], expected: int) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != expected:
        raise SystemExit(f"{' '.join(argv)} exited with {proc.returncode}, expected {expected}: {proc.stderr[-500:]}")
    return elapsed


def import_profile(top: int = 8) -> dict:
    """The cumulative import times of `rope-patch --help` in one process (`-X importtime`): the heaviest `top`
    modules, and whether torch / transformers were imported at all."""
    code = "from rope_patch.cli import main; main(['--help'])"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    rows = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            _, cumulative, name = line.split("|")
            if cumulative.strip().isdigit():
                rows.append((int(cumulative), name.strip()))
    names = {name for _, name in rows}
    return {"modules": len(rows), "torch_imported": "torch" in names, "transformers_imported": "transformers" in names,
            "top_cumulative_ms": [[name, round(us / 1000, 1)] for us, name in sorted(rows, reverse=True)[:top]]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7, help="runs of each case (default: %(default)s)")
    parser.add_argument("--out", default=None, help="write the JSON summary here (default: stdout)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    cli = cli_command()
    todo = cases(cli)
    names = list(todo)
    times: dict[str, list[float]] = {name: [] for name in names}
    load_start = os.getloadavg()
    for argv_ in todo.values():  # warm the file cache once, untimed: the first run of anything reads from disk
        time_once(*argv_)
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotate: no case always runs first
        for name in order:
            times[name].append(time_once(*todo[name]))
    load_end = os.getloadavg()
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    ratios = {name: medians[name] / medians["import_torch"] for name in names}
    summary = {
        "benchmark": "cli_startup",
        "command": " ".join(["python", "bench/cli_startup.py", *(argv if argv is not None else sys.argv[1:])]),
        "cli": [Path(a).name if Path(a).is_absolute() else a for a in cli],  # what ran, not where
        "cases": {name: {"command": shown(todo[name][0], cli), "times_s": [round(t, 4) for t in times[name]],
                         "median_s": round(medians[name], 4),
                         "x_import_torch": round(ratios[name], 3)} for name in names},
        "target": {"x_import_torch": TARGET,
                   "met": {name: ratios[name] <= TARGET for name in ("help", "argument_error")}},
        "import_profile_help": import_profile(),
        "machine": {"cpu_count": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load_start],
                    "loadavg_end": [round(x, 2) for x in load_end], "python": platform.python_version(),
                    "platform": platform.platform()},
        "reps": args.reps,
    }
    width = max(map(len, names))
    lines = [f"{'case':<{width}}  median s   x import torch   ({args.reps} runs each, interleaved; load "
             f"{load_start[0]:.2f} -> {load_end[0]:.2f} on {os.cpu_count()} cores)"]
    lines += [f"{name:<{width}}  {medians[name]:8.3f}   {ratios[name]:14.3f}" for name in names]
    lines.append(f"target: help and argument_error <= {TARGET}x import torch: "
                 + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in summary["target"]["met"].items()))
    print("\n".join(lines), file=sys.stderr)
    text = json.dumps(summary, indent=1) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"Wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0 if all(summary["target"]["met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
