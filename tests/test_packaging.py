"""The package works wherever it is installed: a wheel built from this checkout, installed into a fresh virtual
environment, runs the commands from an empty directory with its own data (rope-tiny, the held-out text, the lm-eval
tasks) and without the checkout on its path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import rope_patch

REPO = Path(__file__).resolve().parents[1]


def run(cmd, cwd, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ROPE_PATCH_TINY")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, venv bin, empty working dir). The new venv sees the test environment's dependencies through a
    .pth line (a path, so the editable install's own .pth hooks there do not run: the checkout stays invisible) and
    gets rope_patch only from the wheel."""
    root = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
         str(REPO)], cwd=root)
    (wheel,) = (root / "dist").glob("rope_patch-*.whl")
    run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], cwd=root)
    py = root / "venv" / "bin" / "python"
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).strip())
    (site / "test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], cwd=root)
    work = root / "empty"
    work.mkdir()
    return py, py.parent, work, wheel


@pytest.mark.slow
def test_wheel_carries_the_data_the_commands_need(installed):
    names = set(zipfile.ZipFile(installed[3]).namelist())
    for needed in ("rope_patch/py.typed", "rope_patch/data/heldout.txt", "rope_patch/data/rope-tiny/model.safetensors",
                   "rope_patch/data/rope-tiny/tokenizer.json", "rope_patch/data/tasks/rope/rope_passkey_128.yaml",
                   "rope_patch/data/tasks/rope/rope_tasks_utils.py",
                   "rope_patch/data/scheme_names.json",  # the name table `rope-patch` parses with, before torch
                   "rope_patch/data/engines.json"):  # what `rope-patch export --engine` checks against
        assert needed in names, needed
    assert any(n.endswith("licenses/LICENSE") for n in names)


@pytest.mark.slow
def test_installed_package_is_the_wheel_not_the_checkout(installed):
    py, _, work, _ = installed
    out = run([str(py), "-c", "import rope_patch, json; print(json.dumps([rope_patch.__file__, "
                              "rope_patch.__version__]))"], cwd=work)
    path, version = json.loads(out)
    assert str(REPO) not in path and "site-packages" in path
    assert version == rope_patch.__version__


@pytest.mark.slow
def test_commands_run_from_an_empty_directory(installed):
    _, bin_dir, work, _ = installed
    listing = run([str(bin_dir / "rope-patch"), "models", "list"], cwd=work)
    assert "tiny" in listing and "smollm2" in listing
    schemes = run([str(bin_dir / "rope-patch"), "list"], cwd=work)  # from the wheel's name table
    assert "yarn " in schemes and "self_extend " in schemes
    run([str(bin_dir / "rope-patch"), "compare", "--model", "tiny", "--schemes", "default", "yarn:2", "--lengths", "64",
         "--passkey-lengths", "128", "--depths", "0.5", "--passkey-samples", "1", "--windows", "1", "--threads", "1",
         "--out", "res", "--no-plots"], cwd=work)
    result = json.loads((work / "res" / "compare.json").read_text())
    assert [s["spec"] for s in result["schemes"]] == ["default", "yarn:2"] and not result["pending"]
    # the packaged held-out text, read from the install and recorded relative to the package (files.portable_path)
    assert result["settings"]["heldout"]["path"] == "rope_patch/data/heldout.txt"
    meta = json.dumps({"samples": 1})
    run([str(bin_dir / "rope-patch-lm-eval"), "--model", "rope_patch", "--model_args", "pretrained=tiny",
         "--tasks", "rope_passkey_128", "--output_path", "lm", "--metadata", meta], cwd=work)
    (results,) = (work / "lm").rglob("results_*.json")
    assert "rope_passkey_128" in json.loads(results.read_text())["results"]
