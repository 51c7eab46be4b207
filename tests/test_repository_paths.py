"""No tracked file names a machine's home or temp directory, in its path or in its text (issue 30, "results as data"):
results write a path inside the home directory as `~/...` (rope_patch.files.portable), a sweep's lm-eval files sit in
a folder of their own instead of one named after the model path (rope_patch.integrations.lm_eval.outputs), and
examples use relative paths. The forbidden strings are built here from their parts, so this file does not hold them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLASH, UNDER = "/", "_" * 2
# home directories (Linux root's and users', macOS users'), the temp directory, and lm-eval's sanitised form of a
# model path under root's home (its folder name for `/root/.cache/...`)
FORBIDDEN = [SLASH + name + SLASH for name in ("root", "home", "Users", "tmp")] + [UNDER + "root" + UNDER]
ALLOWED = {"tests/test_repository_paths.py"}  # builds the strings above; nothing else needs to name them


def tracked() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode("utf-8").split("\0") if p and p not in ALLOWED]


def test_the_needles_are_what_the_issue_names():
    assert FORBIDDEN == ["/root/", "/home/", "/Users/", "/tmp/", "__root__"]


def test_no_tracked_name_holds_a_machine_path():
    bad = [p for p in tracked() if any(s in SLASH + p for s in FORBIDDEN)]
    assert not bad, f"{len(bad)} tracked file names hold a home or temp directory, e.g. {bad[:5]}"


def test_no_tracked_text_holds_a_machine_path():
    bad = []
    for name in tracked():
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (figures, weights)
            continue
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            hits = [s for s in FORBIDDEN if s in line]
            if hits:
                bad.append(f"{name}:{number}: {hits[0]!r} in {line.strip()[:120]!r}")
    assert not bad, (f"{len(bad)} lines of tracked files name a home or temp directory (write ~/..., a relative "
                     "path, or a placeholder such as OUT_DIR):\n" + "\n".join(bad[:20]))


# An absolute path of three or more parts outside the system's own folders (a checkout, a venv, a data disk: any
# machine's layout), not part of a URL or of a relative path. Tests that need a path that exists nowhere use
# /nonexistent/.
ABSOLUTE = re.compile(r"(?<![\w.~:/\-\])}])/(?!usr/|bin/|dev/|etc/|proc/|sys/|nonexistent/)[A-Za-z_][\w.-]*/[\w.-]+/")


@pytest.mark.parametrize("text, found", [
    ('"path": "/srv/ckpt/rope_patch/data/heldout.txt"', True),
    ("warning from /opt/venv/lib/python3.11/site-packages/x.py:3", True),
    ('"path": "rope_patch/data/heldout.txt"', False),
    ("see https://github.com/mit-han-lab/streaming-llm/blob/main/x.py", False),
    ("#!/usr/bin/env bash", False),
    ("~/.cache/rope_patch/smollm2 and ./out/run/x", False),
])
def test_the_absolute_path_pattern(text, found):
    assert bool(ABSOLUTE.search(text)) is found


def test_no_tracked_text_holds_an_absolute_path():
    """Beyond home and temp: the checkout's own location (where results were made) is a machine path too."""
    bad = []
    for name in tracked():
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            hit = ABSOLUTE.search(line)
            if hit:
                bad.append(f"{name}:{number}: {line[max(0, hit.start() - 20):hit.end() + 40].strip()!r}")
    assert not bad, (f"{len(bad)} lines of tracked files hold an absolute path (write it relative to the "
                     "repository, as rope_patch/... for the package's files, or ~/...):\n" + "\n".join(bad[:20]))
