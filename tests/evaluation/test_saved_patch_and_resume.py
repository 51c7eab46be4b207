"""`rope-patch compare` and `tune` on a folder saved with its patch, and `--resume` after the weights changed.

- A folder written by rope_patch.save_pretrained (or the recipe's --merge) is the patched model only with its
  rope_patch.json: compare and tune load it with that patch (as rope_patch.from_pretrained and the lm-eval model do),
  measure it as the `loaded` row, and say so in the model line. On main they loaded the unpatched model (a stack) or
  the native form alone, and the `loaded` row (when there was one) measured that.
- `--resume` compared the model by path, type, window, parameter count and dtype: new weights of the same shapes saved
  into the same folder were reused as if measured on them. The results now record a content fingerprint of the folder
  (rope_patch/fingerprint.py) and a resume refuses when it changed.
- Smaller: compare checks every file it will write before the first forward; tune reports refused candidates.
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.models import tiny_model
from helpers.text import char_tokenizer, filler_text

import rope_patch
from rope_patch import fingerprint
from rope_patch.cli import main
from rope_patch.evaluation.common import read_tokens
from rope_patch.evaluation.perplexity import evaluate_perplexity
from rope_patch.evaluation.results import load_results

PATCHES = ["yarn:4", "yarn:4+logn"]  # native (config.json alone reloads it) and a stack without a native form
INIT = 0.1  # initializer_range: large enough that positions move the perplexity of a random model (~3% for yarn x4)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    (root / "heldout.txt").write_text(filler_text(3000))
    out = {"root": root}
    for spec in [None, *PATCHES]:
        model = tiny_model(initializer_range=INIT)
        if spec:
            rope_patch.apply(model, spec)
        folder = root / (spec or "plain").replace(":", "_").replace("+", "_")
        rope_patch.save_pretrained(model, folder) if spec else model.save_pretrained(folder)
        char_tokenizer().save_pretrained(folder)
        out[spec or "plain"] = folder
    return out


@pytest.fixture
def forwards(monkeypatch):
    """The perplexity evaluations run (compare's forwards), as (n lengths) per call."""
    import rope_patch.evaluation.compare as C

    calls = []
    real = C.evaluate_perplexity

    def counted(model, ids, lengths, **kw):
        calls.append(list(lengths))
        return real(model, ids, lengths, **kw)

    monkeypatch.setattr(C, "evaluate_perplexity", counted)
    return calls


def compare_argv(folder, heldout, out, *extra):
    return ["compare", "--model", str(folder), "--schemes", "default", "--lengths", "64", "--passkey-lengths",
            "--windows", "1", "--heldout", str(heldout), "--threads", "1", "--out", str(out), "--no-plots", *extra]


def _reference_ppl(folder, heldout, length=64) -> float:
    """Perplexity of the model as rope_patch.from_pretrained rebuilds it (the saved patch re-applied)."""
    model = rope_patch.from_pretrained(folder).eval()
    ids, _ = read_tokens(char_tokenizer().from_pretrained(folder), heldout)
    return evaluate_perplexity(model, ids, [length], windows_at_longest=1)["lengths"][0]["perplexity"]


@pytest.mark.parametrize("spec", PATCHES)
def test_compare_measures_the_saved_patch_and_says_so(spec, folders, tmp_path, capsys):
    folder, heldout = folders[spec], folders["root"] / "heldout.txt"
    assert main(compare_argv(folder, heldout, tmp_path / "out")) == 0
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    data = load_results(tmp_path / "out" / "compare.json")
    assert [s["spec"] for s in data["schemes"]] == ["loaded", "default"]  # the model as saved comes first
    patch = data["model"]["patch"]
    assert patch["file"] == str(folder / "rope_patch.json") and patch["label"].startswith("yarn(factor=4.0)")
    assert data["schemes"][0]["label"] == f"as loaded ({patch['label']})"
    assert data["schemes"][0]["name"] == rope_patch.current(rope_patch.from_pretrained(folder)).name
    ppl = {r["scheme"]: r["perplexity"] for r in data["records"]}
    assert ppl["loaded"] == pytest.approx(_reference_ppl(folder, heldout), rel=1e-9)
    assert ppl["loaded"] != pytest.approx(ppl["default"], rel=1e-3)  # default: the unpatched model
    assert ppl["default"] == pytest.approx(_reference_ppl(folders["plain"], heldout), rel=1e-9)
    line = (tmp_path / "out" / "compare.md").read_text().splitlines()[0]
    assert f"as saved, with its rope_patch.json: {patch['label']}" in line, line
    assert "re-applied from" in err and data["model"]["window"] == 32  # the pre-training window, not the patch's


def test_an_unpatched_folder_has_no_loaded_row_and_the_same_model_line(folders, tmp_path):
    assert main(compare_argv(folders["plain"], folders["root"] / "heldout.txt", tmp_path / "out")) == 0
    data = load_results(tmp_path / "out" / "compare.json")
    assert [s["spec"] for s in data["schemes"]] == ["default"] and data["model"]["patch"] is None
    assert (tmp_path / "out" / "compare.md").read_text().startswith("Model `")
    assert "as saved" not in (tmp_path / "out" / "compare.md").read_text()


def test_tune_loads_the_saved_patch_and_measures_it_in_the_acceptance(folders, tmp_path, capsys):
    folder = folders["yarn:4+logn"]
    argv = ["tune", "--model", str(folder), "--heldout", str(folders["root"] / "heldout.txt"), "--scheme", "yarn",
            "--target", "64", "--space", "factor=2,4", "--tokens", "64", "--accept-tokens", "64", "--threads", "1",
            "--out", str(tmp_path / "tune"), "--no-plots"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    log = json.loads((tmp_path / "tune" / "search_log.json").read_text())
    assert log["model"]["patch"]["label"].startswith("yarn(factor=4.0) + logn(") and log["model"]["fingerprint"]
    rows = {r["spec"]: r["perplexity"] for r in log["acceptance"]["rows"]}
    assert set(rows) >= {"loaded", "default"} and rows["loaded"] != rows["default"]
    assert "as saved, with its rope_patch.json" in " ".join(out.split())


# ---- --resume and the model's files -----------------------------------------------------------------------------
def _resave(folder, seed):
    """New weights of the same shapes in the same folder (the header and the size of model.safetensors stay)."""
    tiny_model(seed=seed, initializer_range=INIT).save_pretrained(folder)


def test_compare_resume_refuses_cells_of_other_weights(folders, tmp_path, capsys, forwards):
    folder = shutil.copytree(folders["plain"], tmp_path / "model")
    heldout, out = folders["root"] / "heldout.txt", tmp_path / "out"
    assert main(compare_argv(folder, heldout, out)) == 0
    first = load_results(out / "compare.json")
    assert first["model"]["fingerprint"].startswith("sha256:") and len(forwards) == 1
    assert main(compare_argv(folder, heldout, out, "--resume")) == 0  # same files: every cell reused
    assert len(forwards) == 1
    first = load_results(out / "compare.json")
    size = (folder / "model.safetensors").stat().st_size
    _resave(folder, seed=1)
    assert (folder / "model.safetensors").stat().st_size == size
    capsys.readouterr()
    assert main(compare_argv(folder, heldout, out, "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the model's files (weights, config, tokenizer or saved patch) changed" in err and "--resume" in err, err
    assert len(forwards) == 1 and load_results(out / "compare.json") == first  # nothing run, nothing overwritten


def test_compare_resume_of_a_file_without_fingerprint_says_what_it_matched(folders, tmp_path, capsys, forwards):
    heldout, out = folders["root"] / "heldout.txt", tmp_path / "out"
    assert main(compare_argv(folders["plain"], heldout, out)) == 0
    data = json.loads((out / "compare.json").read_text())
    del data["model"]["fingerprint"]  # as written before fingerprints
    (out / "compare.json").write_text(json.dumps(data))
    assert main(compare_argv(folders["plain"], heldout, out, "--resume")) == 0
    assert "predates the model fingerprint" in " ".join(capsys.readouterr().err.split()) and len(forwards) == 1
    assert load_results(out / "compare.json")["model"]["fingerprint"].startswith("sha256:")


def test_tune_resume_refuses_a_log_of_other_weights(folders, tmp_path, capsys):
    folder = shutil.copytree(folders["plain"], tmp_path / "model")
    argv = ["tune", "--model", str(folder), "--heldout", str(folders["root"] / "heldout.txt"), "--scheme", "yarn",
            "--target", "64", "--space", "factor=2,4", "--tokens", "64", "--no-accept", "--threads", "1",
            "--out", str(tmp_path / "tune"), "--no-plots"]
    assert main([*argv, "--max-evals", "1"]) == 0
    _resave(folder, seed=1)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume from" in err
    assert "the model's files (weights, config, tokenizer or saved patch) changed" in err


def test_fingerprint_hashes_each_file_once_and_sees_a_same_size_rewrite(folders, tmp_path, monkeypatch):
    folder = shutil.copytree(folders["plain"], tmp_path / "model")
    cache = tmp_path / "cache.json"
    hashed = []
    real = fingerprint.sha256_file
    monkeypatch.setattr(fingerprint, "sha256_file", lambda p: (hashed.append(p.name), real(p))[1])
    first = fingerprint.model_fingerprint(folder, cache)
    assert sorted(hashed) == sorted(p.name for p in fingerprint.model_files(folder))
    assert "model.safetensors" in hashed and "tokenizer.json" in hashed and "config.json" in hashed
    hashed.clear()
    assert fingerprint.model_fingerprint(folder, cache) == first and hashed == []  # cached by path, size, mtime
    _resave(folder, seed=1)
    changed = fingerprint.model_fingerprint(folder, cache)
    assert changed != first and "model.safetensors" in hashed
    (folder / "notes.txt").write_text("not part of the model")
    assert fingerprint.model_fingerprint(folder, cache) == changed
    assert fingerprint.model_fingerprint(tmp_path / "missing", cache) is None
    cache.write_text("{not json")  # a damaged cache is rebuilt, not an error
    assert fingerprint.model_fingerprint(folder, cache) == changed


# ---- smaller: files checked before the first forward, refused candidates counted ---------------------------------
@pytest.mark.parametrize("blocked", ["compare.json", "compare.md", "perplexity.png"])
def test_compare_checks_every_file_it_will_write_before_the_first_forward(blocked, folders, tmp_path, capsys,
                                                                          forwards):
    out = tmp_path / "out"
    (out / blocked).mkdir(parents=True)  # a folder in the place of one of its files
    argv = compare_argv(folders["plain"], folders["root"] / "heldout.txt", out)
    argv.remove("--no-plots")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot write {out / blocked} (a folder is in its place)" in err and "Nothing has been evaluated" in err
    assert forwards == [] and "Loading" not in err


def test_tune_counts_refused_candidates_and_says_why(folders, tmp_path, capsys):
    argv = ["tune", "--model", str(folders["plain"]), "--heldout", str(folders["root"] / "heldout.txt"),
            "--scheme", "string", "--target", "64", "--space", "shift_size=16,24", "window_size=8,16", "--tokens",
            "64", "--no-accept", "--threads", "1", "--out", str(tmp_path / "tune"), "--no-plots"]
    # S = 16 with W = 16 is refused only together (STRING needs S > W); a value no combination accepts would be
    # refused before the search (tests/tuning/test_tune_cli.py)
    assert main(argv) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "4 candidates: 3 evaluated, 1 refused by the scheme (1x string" in err and "shift_size" in err, err
    assert "4 evaluations" not in err
