"""What a sweep keeps of lm-eval's output (rope_patch.integrations.lm_eval.outputs): lm-eval's files in the scheme's
own `lm_eval/` folder, not in one named after the model path; cells that name their results file relative to the
scheme folder; one small `samples.json` per scheme (prompt hash, target, answer, scores, whether the answer is text
of the prompt); settings that write the home directory as `~`."""

from __future__ import annotations

import json

import pytest
from helpers.lm_eval import TASKS

from rope_patch import schema
from rope_patch.integrations.lm_eval import outputs


def _args(assets, out, **kw):
    from rope_patch.cli import build_parser

    argv = ["sweep", "--model", str(assets["model"]), "--schemes", "default", "--tasks", "rope_passkey", "rope_ppl",
            "--lengths", "128", "--passkey-samples", "2", "--depths", "0.1", "0.9", "--heldout", str(assets["heldout"]),
            "--include-path", str(TASKS), "--out", str(out), "--in-process", "--no-plots"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", v]
    return build_parser().parse_args(argv)


def test_a_sweep_keeps_a_compact_summary_and_no_path_in_names(assets, tmp_path, monkeypatch):
    import rope_patch.integrations.lm_eval.sweep as S

    monkeypatch.setenv("HOME", str(assets["root"].parent))  # the model lies "in the home directory"
    out = tmp_path / "sweep"
    S.sweep(_args(assets, out), log=lambda m: None)
    sdir = out / "schemes" / "default"
    raw = sorted(p.name for p in (sdir / "lm_eval").iterdir())
    assert all(p.is_file() for p in (sdir / "lm_eval").iterdir()), raw  # no folder named after the model path
    assert any(n.startswith("results_") for n in raw) and "samples_rope_passkey_128" in " ".join(raw)
    cell = schema.read(sdir / "cells" / "rope_passkey_128.json", schema.SWEEP_CELL)
    assert cell["results_file"].startswith("lm_eval/results_") and (sdir / cell["results_file"]).is_file()
    summary = outputs.read_samples(sdir / "samples.json")
    assert summary["scheme"] == "default" and list(summary["tasks"]) == ["rope_passkey_128", "rope_ppl_128"]
    passkey = summary["tasks"]["rope_passkey_128"]
    assert passkey["results_file"] == cell["results_file"] and passkey["versions"]["lm_eval"]
    assert len(passkey["samples"]) == cell["n_samples"] == 4
    assert sorted(s["depth"] for s in passkey["samples"]) == [0.1, 0.1, 0.9, 0.9]
    for s in passkey["samples"]:
        assert len(s["prompt"]) == 16 and isinstance(s["response"], str) and set(s["metrics"]) == {"acc"}
        if s["metrics"]["acc"] == 1:
            assert s["in_prompt"]  # a right answer is the key, which the prompt holds
    # one line per sample: the file is small and a re-run's diff shows the answers that changed
    lines = (sdir / "samples.json").read_text().splitlines()
    assert (sum(line.lstrip().startswith('{"doc_id"') for line in lines)
            == 4 + len(summary["tasks"]["rope_ppl_128"]["samples"]))
    # settings name the home directory as ~
    home = str(assets["root"].parent)
    for name in ("sweep_settings.json", "sweep.json", "compare.json"):
        text = (out / name).read_text()
        assert home not in text and '"~/' in text, name

    # a cell measured again replaces its task's samples and keeps the others'
    (sdir / "cells" / "rope_ppl_128.json").unlink()
    S.sweep(_args(assets, out), log=lambda m: None)
    again = outputs.read_samples(sdir / "samples.json")
    assert again["tasks"]["rope_passkey_128"] == passkey
    assert again["tasks"]["rope_ppl_128"]["results_file"] != passkey["results_file"]


@pytest.mark.parametrize("response, prompt, expected", [
    (" 2672188.", "One of the special magic numbers for x is: 2672188.\n", True),  # another key's value
    (": 94b2d530-0a30.", "key: 94b2d530-0a30.", True),
    (" 11.", "The grass is green. The number is 1123456.", False),  # cut short: not text of the prompt as such
    ("  ", "anything", False),
])
def test_answer_in_prompt(response, prompt, expected):
    assert outputs.answer_in_prompt(response, prompt) is expected


def test_compact_sample_and_its_layout():
    sample = {"doc_id": 3, "doc": {"input": "haystack 123 haystack", "depth": "0.5"}, "target": "['123']",
              "arguments": {"gen_args_0": {"arg_0": "<chat>haystack 123 haystack", "arg_1": {}}},
              "resps": [[" 123. And more"]], "filtered_resps": [" 123."], "filter": "none", "metrics": ["acc"],
              "acc": 1.0, "prompt_hash": "ab" * 32}
    row = outputs.compact_sample(sample)
    assert row == {"doc_id": 3, "prompt": "ab" * 8, "target": "['123']", "response": " 123.", "raw": " 123. And more",
                   "metrics": {"acc": 1.0}, "depth": 0.5, "in_prompt": True}
    data = {"format": outputs.SAMPLES_FORMAT, "scheme": "yarn:2",
            "tasks": {"t1": {"results_file": "lm_eval/results_x.json", "samples": [row, {**row, "doc_id": 4}]},
                      "t2": {"samples": []}}}
    text = outputs.dumps_samples(data)
    assert json.loads(text) == data and len(text.splitlines()) == 7
    assert outputs.run_date(outputs.samples_file(outputs.Path("d/results_2026-12-02T01-03-52.348063.json"), "t1")) \
        == "2026-12-02T01-03-52.348063"
