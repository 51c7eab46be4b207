"""`compare` on a tiny random model: records, JSON/CSV/markdown/plots, vanilla restored, CLI errors."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from conftest import tiny_model
from eval_helpers import char_tokenizer, filler_text, single_thread  # noqa: F401 (autouse fixture)

import rope_patch
from rope_patch.cli import main
from rope_patch.evaluation.compare import (
    FORMAT,
    load_results,
    markdown_table,
    parse_schemes,
    rich_table,
    run_compare,
    work_units,
    write_results,
)

SCHEMES = ["default", "yarn:2", "dynamic:factor=2"]


@pytest.fixture(scope="module")
def setup():
    tok = char_tokenizer()
    return tiny_model("llama"), tok, tok.encode(filler_text(), add_special_tokens=False)


@pytest.fixture(scope="module")
def result(setup):
    model, tok, ids = setup
    done = []
    res = run_compare(model, tok, SCHEMES, [32, 64], passkey_lengths=[128, 160], depths=[0.2, 0.8],
                      passkey_samples=2, windows_at_longest=2, token_ids=ids, model_spec="random",
                      progress=lambda n, label: done.append(n))
    res["_done"] = sum(done)
    return res


def test_result_structure(result, setup):
    assert result["format"] == FORMAT
    assert result["_done"] == work_units(3, len(setup[2]), [32, 64], [128, 160], [0.2, 0.8], 2, 2)
    assert [s["spec"] for s in result["schemes"]] == SCHEMES
    assert [s["label"] for s in result["schemes"]] == ["default", "yarn×2", "dynamic:factor=2"]
    yarn = result["schemes"][1]
    assert yarn["name"] == "yarn" and yarn["params"]["factor"] == 2.0
    assert yarn["params"]["original_max_position_embeddings"] == 32  # model-derived default recorded
    rec = [(r["scheme"], r["length"]) for r in result["records"]]
    assert rec == [(s, L) for s in SCHEMES for L in (32, 64, 128, 160)]
    by = {(r["scheme"], r["length"]): r for r in result["records"]}
    assert by[("default", 64)]["passkey_accuracy"] is None and by[("default", 128)]["perplexity"] is None
    assert by[("default", 128)]["passkey_n"] == 4
    assert len(result["passkey"]) == 3 * 2 * 2 and len(result["buckets"]) == 3 * 2
    assert {"torch", "transformers", "rope_patch"} <= set(result["versions"])
    assert result["settings"]["ppl_tokens"] == 128 and result["settings"]["seed"] == 0


def test_schemes_are_paired_and_model_restored(setup, result):
    model, tok, ids = setup
    answers = {}
    for p in result["passkey"]:
        answers.setdefault((p["length"], p["depth"]), set()).add(tuple(p["answers"]))
    assert all(len(v) == 1 for v in answers.values())  # every scheme saw the same prompts
    assert rope_patch.current(model) is None
    x = torch.tensor(ids[:64])[None]
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, tiny_model("llama")(x).logits, atol=0, rtol=0)
    by = {(r["scheme"], r["length"]): r["perplexity"] for r in result["records"]}
    assert by[("default", 32)] == by[("dynamic:factor=2", 32)]  # dynamic = vanilla inside the window
    assert by[("default", 64)] != by[("dynamic:factor=2", 64)]


def test_write_results(result, tmp_path):
    paths = write_results(result, tmp_path / "out")
    assert set(paths) == {"json", "csv", "markdown", "perplexity_plot", "passkey_plot"}
    for p in paths.values():
        assert p.stat().st_size > 0
    assert paths["perplexity_plot"].read_bytes()[:4] == b"\x89PNG"
    back = load_results(paths["json"])
    assert back["records"] == json.loads(json.dumps(result["records"]))
    rows = list(csv.DictReader(open(paths["csv"])))
    assert len(rows) == 12 and json.loads(rows[4]["params"])["factor"] == 2.0
    md = paths["markdown"].read_text()
    assert "| yarn×2 |" in md and "Perplexity by position" in md
    assert markdown_table(back) == md
    rich_table(back)  # renders from a reloaded file too
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a rope-patch compare result"):
        load_results(bad)


@pytest.mark.parametrize("spec, match", [("yran:8", "Did you mean 'yarn'"), ("yarn:0.5", "factor"),
                                         ("yarn:facto=8", "Did you mean 'factor'"), ("linear", "factor")])
def test_bad_specs(spec, match):
    with pytest.raises((ValueError, TypeError), match=match) as err:
        parse_schemes(["default", spec])
    assert repr(spec) in str(err.value)
    with pytest.raises(ValueError, match="twice"):
        parse_schemes(["yarn:2", "yarn:2"])


def test_cli_rejects_bad_spec_before_loading(capsys):
    assert main(["compare", "--model", "does/not/exist", "--schemes", "default", "yran:8"]) == 2
    assert "Did you mean 'yarn'" in capsys.readouterr().err


def test_cli_compare_end_to_end(tmp_path, monkeypatch, capsys):
    """The command on a saved tiny random model (a local path), with its own held-out file."""
    model, tok = tiny_model("llama"), char_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "heldout.txt").write_text(filler_text())
    argv = ["compare", "--model", str(tmp_path / "m"), "--schemes", "default", "ntk:2", "--lengths", "32", "64",
            "--passkey-lengths", "128", "--depths", "0.5", "--passkey-samples", "1", "--windows", "1",
            "--heldout", str(tmp_path / "heldout.txt"), "--out", str(tmp_path / "res")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ntk×2" in out
    data = load_results(tmp_path / "res" / "compare.json")
    assert data["model"]["name"] == "m" and len(data["records"]) == 6
    assert (tmp_path / "res" / "passkey.png").exists()


def test_perplexity_only(setup, tmp_path):
    model, tok, ids = setup
    res = run_compare(model, tok, ["default"], [32], passkey_lengths=[], windows_at_longest=1, token_ids=ids)
    assert res["passkey"] == [] and res["records"][0]["passkey_accuracy"] is None
    assert "passkey_plot" not in write_results(res, tmp_path)
    with pytest.raises(ValueError, match="held-out text has"):
        run_compare(model, tok, ["default"], [32], token_ids=ids[:40])
