"""`rope-patch sweep`: one lm-eval run per scheme, aggregation like compare, resume by (scheme, task) cell."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.lm_eval import TASKS


def sweep_args(assets, out, **kw):
    from rope_patch.cli import build_parser

    argv = ["sweep", "--model", str(assets["model"]), "--schemes", "default", "yarn:2",
            "--tasks", "rope_passkey", "rope_ppl", "--lengths", "128", "256", "--passkey-samples", "1",
            "--depths", "0.5", "--heldout", str(assets["heldout"]), "--include-path", str(TASKS),
            "--out", str(out), "--in-process", "--no-plots"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", *v] if isinstance(v, list) else [f"--{k.replace('_', '-')}", v]
    return build_parser().parse_args(argv)


def test_sweep_aggregates_and_resumes(assets, tmp_path, monkeypatch):
    import rope_patch.integrations.lm_eval.sweep as S
    from rope_patch.evaluation.results import load_results

    calls = []
    real = S.run_in_process
    monkeypatch.setattr(S, "run_in_process", lambda st, sch, tasks, d, log: (calls.append((sch["spec"], tasks)),
                                                                              real(st, sch, tasks, d, log)))
    out = tmp_path / "sweep"
    state = S.sweep(sweep_args(assets, out), log=lambda m: None)
    tasks = ["rope_passkey_128", "rope_passkey_256", "rope_ppl_128", "rope_ppl_256"]
    assert calls == [("default", tasks), ("yarn:2", tasks)]  # same list, same order, once per scheme
    result = json.loads((out / "sweep.json").read_text())
    assert result["format"] == "rope_patch.sweep/1"
    assert len(result["rows"]) == 8
    ppl = {(r["scheme"], r["length"]): r["value"] for r in result["rows"] if r["family"] == "rope_ppl"}
    assert ppl[("default", 256)] != ppl[("yarn:2", 256)]  # the schemes really differ
    assert all(v > 1 for v in ppl.values())
    # separate response caches per scheme (lm-eval's cache key ignores the model)
    assert (out / "schemes" / "default" / "cache").is_dir() and (out / "schemes" / "yarn-2" / "cache").is_dir()
    cmp = load_results(out / "compare.json")
    assert {(r["scheme"], r["length"]) for r in cmp["records"]} == set(ppl)
    assert "| yarn×2 |" in (out / "sweep.md").read_text()
    # the same numbers as `rope-patch compare` with the same settings
    from rope_patch.evaluation.compare import run_compare
    from rope_patch.zoo import load_model

    model, tok = load_model(str(assets["model"]))
    ref = run_compare(model, tok, ["default", "yarn:2"], [128, 256], depths=[0.5], passkey_samples=1,
                      heldout=assets["heldout"])
    for r in ref["records"]:
        got = next(x for x in cmp["records"] if (x["scheme"], x["length"]) == (r["scheme"], r["length"]))
        assert got["perplexity"] == pytest.approx(r["perplexity"], rel=1e-9)
        assert got["passkey_accuracy"] == r["passkey_accuracy"]
    assert state["paths"]["compare_markdown"].exists()

    # resume: finished cells are skipped; a new length runs only its cells, for every scheme
    calls.clear()
    machine = result["machine"]
    assert machine["threads"] >= 1 and machine["cpu_count"] >= 1
    with monkeypatch.context() as m:  # a re-run on a busier machine that runs nothing keeps the runs' machine
        m.setattr(S, "_machine", lambda: {"threads": 99, "cpu_count": 99, "loadavg": [99.0, 99.0, 99.0]})
        S.sweep(sweep_args(assets, out), log=lambda m: None)
    assert calls == []
    assert json.loads((out / "sweep.json").read_text())["machine"] == machine
    # each cell, and each scheme of sweep.json, records the commit that measured it (this checkout's)
    from rope_patch.evaluation.common import source_commit

    summary = json.loads((out / "sweep.json").read_text())
    assert [s["commit"] for s in summary["schemes"]] == [source_commit()] * 2
    assert all(json.loads(p.read_text())["commit"] == source_commit() for p in out.glob("schemes/*/cells/*.json"))
    # a sweep folder made by another checkout (its raw paths, hence its stamp's fingerprint, differ; the settings it
    # records are the same) resumes too
    stamp = out / "sweep_settings.json"
    stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "fingerprint": "made-in-another-checkout"}))
    S.sweep(sweep_args(assets, out), log=lambda m: None)
    assert calls == []
    # the timings of the runs that made the cells survive a resume (they travel in the cells)
    first, resumed = state["elapsed_s"], json.loads((out / "sweep.json").read_text())["elapsed_s"]
    assert resumed["default"] == first["default"] > 0 and resumed["yarn:2"] == first["yarn:2"] > 0
    assert resumed["total"] == pytest.approx(first["default"] + first["yarn:2"]) and resumed["wall"] < first["wall"]
    # an interrupted scheme (a cell missing) runs only what is missing
    (out / "schemes" / "yarn-2" / "cells" / "rope_ppl_256.json").unlink()
    S.sweep(sweep_args(assets, out), log=lambda m: None)
    assert calls == [("yarn:2", ["rope_ppl_256"])]
    # ... and its time is both runs' (each run once, however many cells it wrote)
    cells = {p.stem: json.loads(p.read_text()) for p in (out / "schemes" / "yarn-2" / "cells").glob("*.json")}
    assert len({c["run_id"] for c in cells.values()}) == 2
    rerun = cells["rope_ppl_256"]["run_elapsed_s"]
    timed = json.loads((out / "sweep.json").read_text())["elapsed_s"]
    assert timed["yarn:2"] == pytest.approx(first["yarn:2"] + rerun) and timed["default"] == first["default"]
    again = {(r["scheme"], r["length"]): r["value"] for r in json.loads((out / "sweep.json").read_text())["rows"]
             if r["family"] == "rope_ppl"}
    assert again == pytest.approx(ppl)
    # other settings (here: more perplexity tokens) are refused, not mixed in
    with pytest.raises(ValueError, match="other settings"):
        S.sweep(sweep_args(assets, out, windows="7"), log=lambda m: None)

def test_sweep_refuses_other_settings_and_bad_schemes(assets, tmp_path):
    import rope_patch.integrations.lm_eval.sweep as S

    args = sweep_args(assets, tmp_path / "a")
    args.schemes = ["default", "yarnn:2"]  # the command line refuses it while parsing; the engine on its own, too
    with pytest.raises(ValueError, match="yarnn"):
        S.sweep(args, log=lambda m: None)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "sweep_settings.json").write_text(json.dumps({"fingerprint": "other"}))
    with pytest.raises(ValueError, match="other settings"):
        S.sweep(sweep_args(assets, tmp_path / "b"), log=lambda m: None)


def test_expand_and_scheme_args():
    from rope_patch.integrations.lm_eval.sweep import expand_tasks, scheme_args

    assert expand_tasks(["rope_passkey", "niah_single_1", "rope_ppl"], [256, 1024]) == [
        "rope_passkey_256", "rope_passkey_1024", "niah_single_1", "rope_ppl_256", "rope_ppl_1024"]
    assert scheme_args("yarn:4") == {"scheme": "yarn", "factor": 4}
    assert scheme_args("default") == {"scheme": "default"}


def test_sweep_rejects_lengths_without_tasks(assets, tmp_path):
    import rope_patch.integrations.lm_eval.sweep as S

    with pytest.raises(ValueError, match="rope_passkey_300"):
        S.sweep(sweep_args(assets, tmp_path / "c", lengths=["128", "300"]), log=lambda m: None)


@pytest.mark.parametrize("templated, mode, expected", [
    (False, "auto", False), (True, "auto", True), (True, "on", True), (True, "off", False), (False, "off", False)])
def test_chat_template_resolves_as_in_compare(assets, chat_model, tmp_path, templated, mode, expected):
    import rope_patch.integrations.lm_eval.sweep as S

    model = chat_model if templated else assets["model"]
    p = S.plan(sweep_args(assets, tmp_path / "s", model=str(model), chat_template=mode))
    assert p["settings"]["apply_chat_template"] is expected
    # the rope_* documents are built for the flag: a templated prompt is the length in the task's name
    assert p["settings"]["metadata"].get("chat_template", False) is expected
    argv = S.lm_eval_argv(p["settings"], p["schemes"][0], p["settings"]["tasks"], tmp_path)
    assert ("--apply_chat_template" in argv) is expected
    assert not (tmp_path / "s").exists()  # planning creates nothing


@pytest.mark.parametrize("mode, given", [("auto", "chat_template=false"), ("off", "chat_template=true")])
def test_a_chat_template_metadata_against_the_flag_is_refused_at_plan_time(assets, chat_model, tmp_path, mode, given):
    import rope_patch.integrations.lm_eval.sweep as S

    with pytest.raises(ValueError, match="would not be the length in their names"):
        S.plan(sweep_args(assets, tmp_path / "s", model=str(chat_model), chat_template=mode, metadata=[given]))


def test_chat_template_on_without_a_template_fails_before_anything_runs(assets, tmp_path):
    import rope_patch.integrations.lm_eval.sweep as S

    with pytest.raises(ValueError, match="has no chat template"):
        S.sweep(sweep_args(assets, tmp_path / "t", chat_template="on"), log=lambda m: None)
    assert not (tmp_path / "t").exists()


def test_a_templated_sweep_prompts_with_the_template(assets, chat_model, tmp_path):
    import rope_patch.integrations.lm_eval.sweep as S

    out = tmp_path / "chat"
    S.sweep(sweep_args(assets, out, model=str(chat_model), schemes=["default"], tasks=["rope_passkey"],
                       lengths=["128"]), log=lambda m: None)
    stamp = json.loads((out / "sweep_settings.json").read_text())
    assert stamp["settings"]["apply_chat_template"] is True  # auto, and the tokenizer has a template
    (samples,) = (out / "schemes" / "default" / "lm_eval").rglob("samples_rope_passkey_128_*.jsonl")
    prompts = [json.loads(line)["arguments"]["gen_args_0"]["arg_0"] for line in samples.read_text().splitlines()]
    assert len(prompts) == 1
    # the question closes the user turn, the answer's lead-in opens the assistant turn
    assert prompts[0].startswith("<|bos|>user\n") and prompts[0].endswith("?<|eos|><|bos|>assistant\nThe pass key is")
    assert stamp["settings"]["rope_prompt"] == "chat"
    # the template's tokens are counted in the task's length, as compare --chat-template on counts them
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(chat_model))(prompts[0], add_special_tokens=False)["input_ids"]) == 128
    assert stamp["settings"]["metadata"]["chat_template"] is True
    # a directory of 1.0 templated rope_passkey cells (no rope_prompt in its stamp) is not resumed into
    args = sweep_args(assets, out, model=str(chat_model), schemes=["default"], tasks=["rope_passkey"], lengths=["128"])
    old = {**stamp, "settings": {k: v for k, v in stamp["settings"].items() if k != "rope_prompt"}}
    (out / "sweep_settings.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="rope_passkey_128 cells were measured with the templated prompts of"):
        S.sweep(args, log=lambda m: None)
    # ... nor one of 2.0 templated cells, whose prompts had the template's tokens on top of their length
    meta = {k: v for k, v in stamp["settings"]["metadata"].items() if k != "chat_template"}
    older = {**stamp, "settings": {**stamp["settings"], "metadata": meta}}
    (out / "sweep_settings.json").write_text(json.dumps(older))
    with pytest.raises(ValueError, match="rope_passkey_128 cells were measured with prompts longer than their length"):
        S.sweep(args, log=lambda m: None)
    # one without rope_* retrieval cells (RULER, perplexity) has nothing of the old layout: it resumes
    (out / "sweep_settings.json").write_text(json.dumps({**old,
                                                         "settings": {**old["settings"], "tasks": ["rope_ppl_128"]}}))
    S.sweep(args, log=lambda m: None)


def test_chat_template_auto_without_a_loadable_tokenizer_says_what_to_do(assets, tmp_path):
    import rope_patch.integrations.lm_eval.sweep as S

    bare = tmp_path / "bare"
    shutil.copytree(assets["model"], bare)
    for f in bare.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match="no tokenizer loads from .*--chat-template off"):
        S.plan(sweep_args(assets, tmp_path / "s", model=str(bare)))
    assert S.plan(sweep_args(assets, tmp_path / "s", model=str(bare), chat_template="off"))["settings"][
        "apply_chat_template"] is False


@pytest.mark.parametrize("tasks, model_args, expected", [
    (["rope_passkey", "rope_ppl"], None, None),  # exact-token tasks are evaluated in full: nothing to set
    (["niah_single_1"], None, 256 + 256),  # text path: the longest length + TEXT_HEADROOM, for every scheme
    (["rope_ppl", "niah_single_1"], None, 256 + 256),
    (["niah_single_1"], ["max_length=300"], 300),  # the user's own value is kept
])
def test_text_tasks_get_one_max_length_above_the_longest_length(assets, tmp_path, tasks, model_args, expected):
    """HFLM cuts a text-path prompt longer than max_length from the left, and max_length defaults to each scheme's
    window: a 16k RULER prompt would lose its start (the needle) under vanilla but not under YaRN x2."""
    import rope_patch.integrations.lm_eval.sweep as S

    kw = {"tasks": tasks, **({"model_args": model_args} if model_args else {})}
    p = S.plan(sweep_args(assets, tmp_path / "s", **kw))
    assert S.TEXT_HEADROOM == 256
    assert p["settings"]["model_args"].get("max_length") == expected
    for scheme in p["schemes"]:
        argv = S.lm_eval_argv(p["settings"], scheme, p["settings"]["tasks"], tmp_path)
        args = json.loads(argv[argv.index("--model_args") + 1])
        assert args.get("max_length") == expected and args["scheme"] == scheme["args"]["scheme"]


@pytest.mark.parametrize("task, metrics, lengths, expected", [
    # RULER names its score by the length and reports -1 for its default lengths that did not run
    ("niah_single_1", {"4096": -1, "16384": 1.0}, [16384], ("16384", 1.0)),
    ("niah_single_1", {"4096": 0.4, "8192": -1}, [4096], ("4096", 0.4)),
    ("niah_single_1", {"4096": -1, "16384": 0.0}, [16384], ("16384", 0.0)),  # a score of 0 is a score
    ("hellaswag", {"acc": 0.25, "acc_norm": 0.3}, [256], ("acc", 0.25)),
    ("wikitext", {"4096": -1, "word_perplexity": 31.0}, [1024], ("word_perplexity", 31.0)),
    ("rope_ppl_256", {"token_perplexity": 40.0, "nll": 3.7}, [256], ("token_perplexity", 40.0)),
])
def test_main_metric(task, metrics, lengths, expected):
    from rope_patch.integrations.lm_eval.sweep import main_metric

    assert main_metric(task, metrics, lengths) == expected


def test_a_ruler_row_carries_its_length():
    from rope_patch.integrations.lm_eval.sweep import aggregate

    state = {"settings": {"tasks": ["niah_single_1"], "lengths": [16384]},
             "schemes": [{"spec": "default", "cells": {"niah_single_1": {"metrics": {"4096": -1, "16384": 0.8},
                                                                         "n_samples": 5}}}]}
    (row,) = aggregate(state)["rows"]
    assert (row["metric"], row["value"], row["length"], row["n_samples"]) == ("16384", 0.8, 16384, 5)


def test_a_task_sweep_writes_its_figure(tmp_path):
    from rope_patch.integrations.lm_eval.sweep import write_outputs

    state = {"settings": {"tasks": ["niah_single_1"], "lengths": [16384], "model": "m"},
             "schemes": [{"spec": "default", "cells": {"niah_single_1": {"metrics": {"4096": -1, "16384": 0.8},
                                                                         "n_samples": 5}}}], "elapsed_s": {}}
    paths = write_outputs(state, tmp_path)
    assert paths["tasks_figure"] == tmp_path / "tasks.png" and paths["tasks_figure"].stat().st_size > 0
    (tmp_path / "quiet").mkdir()
    assert "tasks_figure" not in write_outputs(state, tmp_path / "quiet", plots=False)
    assert not (tmp_path / "quiet" / "tasks.png").exists()


@pytest.mark.parametrize("tasks, in_process, environ, cached, refused", [
    (["niah_single_2"], False, {}, False, "Task 'niah_single_2' reads .*baber/paul_graham_essays"),
    (["niah_single_1", "niah_multivalue"], False, {}, False, "'niah_multivalue'"),
    (["ruler"], False, {}, False, "group 'ruler' includes niah_single_2, niah_single_3, niah_multikey_1"),
    (["niah_single_2"], False, {"HF_DATASETS_OFFLINE": "0"}, False, "niah_single_2"),  # the Hub is still offline
    (["niah_single_1", "niah_multikey_2", "ruler_vt", "ruler_cwe", "ruler_fwe"], False, {}, False, None),
    (["niah_single_2"], False, {"HF_DATASETS_OFFLINE": "0", "HF_HUB_OFFLINE": "0"}, False, None),  # online
    (["niah_single_2"], True, {}, False, None),  # in this process, unset means online, as datasets reads it
    (["niah_single_2"], True, {"HF_HUB_OFFLINE": "1"}, False, "niah_single_2"),
    (["ruler"], False, {}, True, None),  # the essays in the Hub cache: datasets finds them offline
])
def test_a_task_that_needs_the_hub_offline_fails_at_plan_time(tmp_path, monkeypatch, tasks, in_process, environ,
                                                              cached, refused):
    """lm-eval's essay-haystack RULER tasks would fail after the model loaded, in every scheme's run."""
    import huggingface_hub.constants

    import rope_patch.integrations.lm_eval.sweep as S

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    if cached:
        (tmp_path / "hub" / "datasets--baber--paul_graham_essays").mkdir(parents=True)
    if refused is None:
        S.check_offline_data(tasks, in_process=in_process, environ=environ)
    else:
        with pytest.raises(ValueError, match=refused) as err:
            S.check_offline_data(tasks, in_process=in_process, environ=environ)
        assert "run offline: niah_single_1 niah_multikey_2" in str(err.value)
        assert "HF_DATASETS_OFFLINE=0 and HF_HUB_OFFLINE=0" in str(err.value)


def test_a_sweep_of_an_essay_task_offline_creates_nothing(assets, tmp_path, monkeypatch):
    import rope_patch.integrations.lm_eval.sweep as S

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(S, "_cached", lambda dataset: False)
    args = sweep_args(assets, tmp_path / "s", tasks=["niah_single_3"])
    args.in_process = False  # the subprocess path, which runs lm-eval offline
    with pytest.raises(ValueError, match="niah_single_3"):
        S.sweep(args, log=lambda m: None)
    assert not (tmp_path / "s").exists()
    assert S.hub_env({})["HF_HUB_OFFLINE"] == "1" and S.hub_env({"HF_HUB_OFFLINE": "0"})["HF_HUB_OFFLINE"] == "0"


def test_a_passkey_only_sweep_writes_its_passkey_figure_and_no_perplexity_figure(tmp_path):
    """A sweep of rope_passkey tasks alone has no perplexity: its figures are the passkey grid, not an empty
    perplexity plot (which raised 'Data cannot be log-scaled' after every cell had finished)."""
    from rope_patch.integrations.lm_eval.sweep import write_outputs

    cell = {"metrics": {"acc": 1.0}, "n_samples": 2, "by_depth": {"0.1": {"n": 2, "correct": 2, "accuracy": 1.0}}}
    metadata = {"depths": [0.1], "samples": 2, "seed": 0, "windows": 1, "max_seq_lengths": [256]}
    state = {"settings": {"tasks": ["rope_passkey_256"], "lengths": [256], "model": "m", "model_path": str(tmp_path),
                          "metadata": metadata},
             "schemes": [{"spec": "default", "args": {}, "cells": {"rope_passkey_256": cell}}], "elapsed_s": {}}
    paths = write_outputs(state, tmp_path)
    assert "compare_passkey_plot" in paths and "compare_perplexity_plot" not in paths
    assert not (tmp_path / "perplexity.png").exists()


def _fake_lm_eval(calls):
    """A stand-in for one scheme's lm-eval run: writes the results file lm-eval would, a RULER-like task's score
    named by each length it ran (metadata max_seq_lengths), a rope_* task's by its metric."""
    import datetime

    def run(settings, scheme, tasks, sdir, log):
        ran = settings["metadata"]["max_seq_lengths"]
        calls.append((scheme["spec"], list(tasks), list(ran)))
        results = {t: ({"acc,none": 0.5} if t.startswith("rope_") else {f"{L},none": L / 10_000 for L in ran})
                   for t in tasks}
        date = datetime.datetime.now().strftime("%Y-%m-%dT%H-%M-%S.%f")
        (sdir / "lm_eval").mkdir(parents=True, exist_ok=True)
        (sdir / "lm_eval" / f"results_{date}.json").write_text(json.dumps({"results": results}))

    return run


@pytest.mark.parametrize("tasks, first, second, runs", [
    # a shorter length added: the RULER cell of 4096 alone must not stand for 2048 and 4096
    (["niah_single_1"], ["4096"], ["2048", "4096"], [("default", ["niah_single_1"], [2048, 4096])]),
    # with rope_* tasks the whole list runs again (RULER): its new RULER cell must replace the old one
    (["rope_ppl", "niah_single_1"], ["128"], ["64", "128"],
     [("default", ["rope_ppl_64", "rope_ppl_128", "niah_single_1"], [64, 128])]),
    # the same lengths: nothing to run
    (["niah_single_1"], ["4096"], ["4096"], []),
])
def test_a_cell_of_a_length_read_task_is_reused_only_at_its_lengths(assets, tmp_path, monkeypatch, tasks, first,
                                                                      second, runs):
    """A task that reads the lengths (RULER's max_seq_lengths) measured at other lengths is measured again on resume,
    not kept under the new lengths (sweep.json then claimed lengths that never ran)."""
    import rope_patch.integrations.lm_eval.sweep as S

    calls = []
    monkeypatch.setattr(S, "run_in_process", _fake_lm_eval(calls))
    monkeypatch.setattr(S, "check_task_names", lambda tasks, include: None)  # lm-eval's task index: slow
    out = tmp_path / "sweep"
    kw = dict(schemes=["default"], tasks=tasks, model_args=["max_length=5000"])
    S.sweep(sweep_args(assets, out, lengths=first, **kw), log=lambda m: None)
    calls.clear()
    S.sweep(sweep_args(assets, out, lengths=second, **kw), log=lambda m: None)
    assert calls == runs
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    ruler = [r for r in rows if r["task"] == "niah_single_1"]
    assert all(r["metrics"] == {L: int(L) / 10_000 for L in second} for r in ruler)
    assert {r["length"]: r["value"] for r in ruler} == {int(L): int(L) / 10_000 for L in second}


@pytest.mark.parametrize("metrics, n_samples, expected", [
    # RULER at two lengths in one cell: a row each, with its own length and its share of the documents
    ({"4096": -1, "2048": 0.5, "8192": 0.25}, 10, [(2048, 0.5, 5), (8192, 0.25, 5)]),
    # one of them ran: one row, as before
    ({"4096": -1, "2048": 0.5}, 5, [(2048, 0.5, 5)]),
])
def test_a_ruler_cell_of_several_lengths_is_a_row_per_length(tmp_path, metrics, n_samples, expected):
    """sweep.md and tasks.png showed the shortest length's score alone (one row per cell)."""
    from rope_patch.integrations.lm_eval.sweep import aggregate, markdown

    state = {"settings": {"tasks": ["niah_single_1"], "lengths": [2048, 8192], "model": "m"},
             "schemes": [{"spec": "default", "cells": {"niah_single_1": {"metrics": metrics,
                                                                         "n_samples": n_samples}}}]}
    result = aggregate(state)
    assert [(r["length"], r["value"], r["n_samples"]) for r in result["rows"]] == expected
    assert [r["metric"] for r in result["rows"]] == [str(L) for L, _, _ in expected]
    table = markdown(result)
    for L, value, _ in expected:
        assert f"{value:.4g}" in table and (len(expected) == 1 or f"niah_single_1 ({L})" in table)


@pytest.mark.parametrize("tasks, lengths, limit, refused", [
    (["niah_single_1"], ["2048", "4096"], "20", True),  # RULER lists its documents length by length
    (["ruler"], ["2048", "4096"], "0.5", True),  # its group too; a fraction keeps the first ones as well
    (["rope_passkey", "niah_multikey_2"], ["2048", "4096"], "5", True),
    (["niah_single_1"], ["4096"], "20", False),  # one length: the limit takes that length's first documents
    (["niah_single_1"], ["2048", "4096"], None, False),  # no limit: every length runs
    (["rope_passkey", "rope_ppl"], ["128", "256"], "2", False),  # rope_* tasks: one task per length
])
def test_a_limit_with_several_ruler_lengths_is_refused_at_plan_time(assets, tmp_path, monkeypatch, tasks, lengths,
                                                                     limit, refused):
    """With --limit and several --lengths, RULER ran only the shortest length, and the others were missing from the
    sweep's results without a word."""
    import rope_patch.integrations.lm_eval.sweep as S

    monkeypatch.setattr(S, "check_task_names", lambda tasks, include: None)  # lm-eval's task index: slow
    args = sweep_args(assets, tmp_path / "s", tasks=tasks, lengths=lengths, **({"limit": limit} if limit else {}))
    if refused:
        with pytest.raises(ValueError, match=f"only length {lengths[0]} would run.*one length per call"):
            S.plan(args)
    else:
        S.plan(args)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("task, recorded, expected", [
    ("rope_ppl_128", None, True),        # before cells recorded it: rope_ppl 1.0's word / byte counts
    ("rope_ppl_128", 1.0, True),
    ("rope_ppl_128", "2.0", False),      # today's
    ("rope_passkey_128", None, False),   # plain prompts are the same in every version
    ("rope_passkey_128", 2.0, True),
    ("rope_passkey_128", 3.0, False),
    ("niah_single_1", None, False),      # lm-eval's own tasks: not ours to version
])
def test_a_cell_of_an_earlier_task_version_is_outdated(task, recorded, expected):
    import rope_patch.integrations.lm_eval.sweep as S

    cell = {"task": task, "metrics": {}, **({} if recorded is None else {"task_version": recorded})}
    assert S.outdated(cell, task, str(TASKS)) is expected


def test_a_resumed_sweep_measures_an_earlier_ppl_cell_again(assets, tmp_path):
    import rope_patch.integrations.lm_eval.sweep as S

    out, lines = tmp_path / "v", []
    args = sweep_args(assets, out, schemes=["default"], tasks=["rope_ppl"], lengths=["128"])
    S.sweep(args, log=lines.append)
    path = out / "schemes" / "default" / "cells" / "rope_ppl_128.json"
    cell = json.loads(path.read_text())
    assert cell["task_version"] == S.task_version(str(TASKS), "rope_ppl_128") == 2.0
    path.write_text(json.dumps({k: v for k, v in cell.items() if k != "task_version"}))  # a cell of rope_ppl 1.0
    lines.clear()
    S.sweep(args, log=lines.append)
    assert any("rope_ppl_128: measured by an earlier version of the task; measured again" in x for x in lines)
    assert json.loads(path.read_text())["task_version"] == 2.0
    lines.clear()
    S.sweep(args, log=lines.append)  # today's cell is kept
    assert any("all 1 cells done: skipped" in x for x in lines)
