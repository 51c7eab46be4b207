"""Package data lookup (rope_patch/resources.py), also when a folder named rope_patch shadows the package."""

from __future__ import annotations

import subprocess
import sys
from importlib.resources.readers import MultiplexedPath
from pathlib import Path

import pytest

from rope_patch import resources

PACKAGE_DIR = Path(resources.__file__).resolve().parent

LOOKUP = "from rope_patch.resources import tiny_model_dir; print(tiny_model_dir())"


def _run(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOOKUP], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_data_is_found():
    assert (resources.tiny_model_dir() / "config.json").is_file()
    assert resources.data_path("tasks", "rope").is_dir() and resources.heldout_text().is_file()


def test_a_namespace_of_several_folders_is_joined_one_part_at_a_time(tmp_path, monkeypatch):
    """Python 3.11's MultiplexedPath.joinpath takes one part: joinpath("data", "rope-tiny") raised a TypeError."""
    monkeypatch.setattr(resources, "package_root", lambda: MultiplexedPath(str(tmp_path), str(PACKAGE_DIR)))
    assert resources.data_path("rope-tiny") == PACKAGE_DIR / "data" / "rope-tiny"


def test_a_folder_that_shadows_the_package_is_named(tmp_path):
    """A checkout (a rope_patch/ folder without __init__.py) in the folder a script runs from: it was
    `TypeError: MultiplexedPath.joinpath() takes 2 positional arguments but 3 were given`."""
    (tmp_path / "rope_patch").mkdir()
    probe = subprocess.run([sys.executable, "-c", "import rope_patch; print(rope_patch.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "None":  # a regular (non-editable) install wins over a namespace folder
        pytest.skip("rope_patch is not installed in editable mode: no folder can shadow it")
    run = _run(tmp_path)
    assert run.returncode != 0 and "MultiplexedPath" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("rope_patch.resources.ShadowedPackage: `import rope_patch` found "
                           f"{tmp_path / 'rope_patch'}, a folder without __init__.py"), last
    assert str(PACKAGE_DIR) in last and "Run the script from another folder" in last


def test_the_checkout_root_itself_imports_the_checkout():
    """Run from the repository root: its rope_patch/ is the package itself (it has __init__.py)."""
    run = _run(PACKAGE_DIR.parent)
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == PACKAGE_DIR / "data" / "rope-tiny"
