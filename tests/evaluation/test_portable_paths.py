"""Result files name no machine's home: compare.json, a tune log and a sweep's files write a path inside the home
directory as `~/...` (rope_patch.files.portable), and a result written with the absolute path on the same machine
still resumes. No model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rope_patch import files
from rope_patch.evaluation.compare import resume_mismatch
from rope_patch.evaluation.results import FORMAT, write_json
from rope_patch.tuning.log import check_resumable


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "someone"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert Path.home() == home
    return home


def test_a_path_inside_home_is_written_with_a_tilde(home):
    model = home / ".cache" / "rope_patch" / "smollm2"
    assert files.portable_path(model) == "~/.cache/rope_patch/smollm2"
    assert Path(files.portable_path(model)).expanduser() == model
    assert files.portable_path(home) == "~"
    assert files.portable_path(f"{home}x/m") == f"{home}x/m"  # a sibling folder is not inside home
    assert files.portable_path("smollm2") == "smollm2" and files.portable_path("/opt/m") == "/opt/m"
    assert files.portable({"a": [str(model), 1, None], "b": ("x",)}) == {"a": ["~/.cache/rope_patch/smollm2", 1, None],
                                                                        "b": ["x"]}


def test_a_file_shipped_with_the_package_is_written_from_the_package():
    heldout = files.PACKAGE / "data" / "heldout.txt"
    assert files.portable_path(heldout) == "rope_patch/data/heldout.txt"
    assert files.portable_path(files.PACKAGE) == "rope_patch"
    assert files.portable_path(f"{files.PACKAGE}x/y") == f"{files.PACKAGE}x/y"  # a sibling folder is not inside it
    assert (files.PACKAGE.parent / files.portable_path(heldout)).read_bytes() == heldout.read_bytes()


def _compare(path: str) -> dict:
    return {"format": FORMAT, "model": {"name": "m", "path": path, "model_type": "llama", "window": 8},
            "settings": {"heldout": {"path": path, "sha256": "0"}}}


def test_compare_json_writes_home_as_a_tilde_and_still_resumes(home, tmp_path):
    model = str(home / "models" / "m")
    out = tmp_path / "compare.json"
    write_json(_compare(model), out)
    text = out.read_text()
    assert str(home) not in text and json.loads(text)["model"]["path"] == "~/models/m"
    # the file as written (~) and one written before (the absolute path) both match a run of the same model
    assert resume_mismatch(json.loads(text), _compare(model)) is None
    assert resume_mismatch(_compare(model), _compare(model)) is None
    assert "model path" in resume_mismatch(json.loads(text), _compare(str(home / "models" / "other")))


def test_a_tune_log_resumes_across_the_tilde(home):
    header = {"model": {"name": "m", "path": str(home / "m")}, "split": {"tuning_tokens": [0, 1]},
              "heldout": {"path": str(home / "h.txt")}}
    written = files.portable(header)
    assert written["model"]["path"] == "~/m"
    check_resumable({**written, "settings": {}}, {**header, "settings": {}}, "log")  # does not raise
    with pytest.raises(ValueError, match="another model"):
        check_resumable({**written, "settings": {}}, {**header, "model": {"name": "m", "path": str(home / "n")},
                                                      "settings": {}}, "log")
