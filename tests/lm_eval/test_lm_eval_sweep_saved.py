"""`rope-patch sweep --model DIR` on a folder saved with its patch (rope_patch.json): the `loaded` row measures the
model as saved (each lm-eval run loads DIR with its patch, which the other schemes replace), the model line says so,
and a resume refuses cells measured on other weights (the sweep's stamp records the folder's fingerprint)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.lm_eval import TASKS
from transformers import AutoModelForCausalLM, AutoTokenizer

import rope_patch


@pytest.fixture(scope="module")
def saved(assets, tmp_path_factory):
    folder = tmp_path_factory.mktemp("patched") / "model"
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    with torch.no_grad():  # away from the near-uniform initialisation, so that positions move the perplexity
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    rope_patch.apply(model, "yarn:4+logn")
    rope_patch.save_pretrained(model, folder)
    AutoTokenizer.from_pretrained(assets["model"]).save_pretrained(folder)
    return folder


def _args(model, assets, out):
    from rope_patch.cli import build_parser

    return build_parser().parse_args([
        "sweep", "--model", str(model), "--schemes", "default", "--tasks", "rope_ppl", "--lengths", "128",
        "--heldout", str(assets["heldout"]), "--include-path", str(TASKS), "--out", str(out), "--in-process",
        "--no-plots"])


def test_sweep_measures_the_saved_patch_and_refuses_other_weights(saved, assets, tmp_path):
    import rope_patch.integrations.lm_eval.sweep as S
    from rope_patch.evaluation.compare import run_compare
    from rope_patch.evaluation.results import load_results

    folder = shutil.copytree(saved, tmp_path / "model")
    out = tmp_path / "sweep"
    S.sweep(_args(folder, assets, out), log=lambda m: None)
    result = json.loads((out / "sweep.json").read_text())
    assert [s["spec"] for s in result["schemes"]] == ["loaded", "default"]
    patch = result["settings"]["patch"]
    assert patch["label"].startswith("yarn(factor=4.0) + logn(") and patch["file"] == str(folder / "rope_patch.json")
    assert f"as saved, with its rope_patch.json: {patch['label']}" in (out / "sweep.md").read_text().splitlines()[0]
    assert "| as loaded (yarn(factor=4.0) + logn(" in (out / "sweep.md").read_text()
    ppl = {r["scheme"]: r["value"] for r in result["rows"]}
    # the same numbers as `rope-patch compare` on the model as rope_patch.from_pretrained rebuilds it
    model, tok = rope_patch.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    ref = run_compare(model, tok, ["loaded", "default"], [128], passkey_lengths=[], heldout=assets["heldout"],
                      model_path=str(folder))
    for r in ref["records"]:
        assert ppl[r["scheme"]] == pytest.approx(r["perplexity"], rel=1e-9)
    assert ppl["loaded"] != pytest.approx(ppl["default"], rel=1e-4)
    cmp = load_results(out / "compare.json")
    assert cmp["model"]["patch"] == patch and cmp["model"]["window"] == 64  # the window before the patch

    stamp = json.loads((out / "sweep_settings.json").read_text())
    assert stamp["weights"].startswith("sha256:")
    other = AutoModelForCausalLM.from_pretrained(folder)  # the unpatched weights ...
    for p in other.parameters():
        p.data.mul_(1.01)  # ... changed, same shapes, saved into the same folder
    rope_patch.apply(other, "yarn:4+logn")
    rope_patch.save_pretrained(other, folder)
    with pytest.raises(ValueError, match="holds a sweep of other model files"):
        S.sweep(_args(folder, assets, out), log=lambda m: None)
