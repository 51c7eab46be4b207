"""No tracked file names a machine's home or temp directory, in its path or in its text (issue 30, "results as data"):
results write a path inside the home directory as `~/...` (rope_patch.files.portable), a sweep's lm-eval files sit in
a folder of their own instead of one named after the model path (rope_patch.integrations.lm_eval.outputs), and
examples use relative paths. The forbidden strings are built here from their parts, so this file does not hold them."""

from __future__ import annotations

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
