"""rope_patch ships py.typed: the public API's annotations are checked by mypy, as a user's type checker reads them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def mypy(*files: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
                           "--cache-dir", str(cache), *map(str, files)], capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_public_api_type_checks_and_misuse_is_caught(tmp_path):
    bad = tmp_path / "misuse.py"
    bad.write_text(
        "from torch import nn\nimport rope_patch\n\n\n"
        "def window(model: nn.Module) -> str:\n    return rope_patch.context_window(model)\n\n\n"
        "def scheme(model: nn.Module) -> None:\n    rope_patch.apply(model, 3.5)\n"
    )
    run = mypy(HERE / "typing" / "public_api.py", bad, cache=tmp_path / "cache")
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert all(str(bad) in line or "misuse.py" in line for line in errors), run.stdout  # the real usage is clean
    assert any('got "int", expected "str"' in e for e in errors), run.stdout
    assert any('Argument 2 to "apply"' in e and "str | Scheme" in e for e in errors), run.stdout
