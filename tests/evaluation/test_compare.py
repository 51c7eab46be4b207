"""`compare` on a tiny random model: records, JSON/CSV/markdown/plots, vanilla restored, CLI errors."""

from __future__ import annotations

import csv
import json
import subprocess

import pytest
import torch
from helpers.models import tiny_model
from helpers.text import char_tokenizer, filler_text
from rich.console import Console

import rope_patch
from rope_patch import plots
from rope_patch.cli import main
from rope_patch.evaluation.common import source_commit
from rope_patch.evaluation.compare import parse_schemes, resumed_units, run_compare, work_units
from rope_patch.evaluation.results import FORMAT, load_results, markdown_table, rich_table, spec_cell, write_results
from rope_patch.suggest import specs_for_target

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
    assert result["settings"]["ppl_tokens"] is None and result["settings"]["seed"] == 0
    assert result["settings"]["ppl_shared_length"] == 2048  # each length reads 2 x 2048 tokens (of 16923)
    assert {r["length"]: r["n_windows"] for r in result["records"] if r["n_windows"]} == {32: 128, 64: 64}


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
    assert set(paths) == {"json", "csv", "markdown"}
    paths.update(plots.write_figures(result, tmp_path / "out"))
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
    console = Console(record=True, width=200)
    console.print(rich_table(back))  # renders from a reloaded file too: every scheme, every length
    shown = console.export_text()
    assert all(spec_cell(s["label"]) in shown for s in back["schemes"])
    assert all(str(r["length"]) in shown for r in back["records"])
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
    assert "passkey_plot" not in plots.write_figures(res, tmp_path)
    with pytest.raises(ValueError, match="held-out text has"):
        run_compare(model, tok, ["default"], [32], token_ids=ids[:40])


# ---- never throw finished work away: checks before the first evaluation, incremental JSON, --resume -------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random model folder with its tokenizer, and a held-out file: what the command line loads."""
    root = tmp_path_factory.mktemp("saved")
    tiny_model("llama").save_pretrained(root / "m")
    char_tokenizer().save_pretrained(root / "m")
    (root / "heldout.txt").write_text(filler_text())
    return root


def compare_argv(saved, out, *schemes, extra=()):
    return ["compare", "--model", str(saved / "m"), "--schemes", *(schemes or ("default", "ntk:2")),
            "--lengths", "32", "64", "--passkey-lengths", "128", "--depths", "0.5", "--passkey-samples", "1",
            "--windows", "1", "--heldout", str(saved / "heldout.txt"), "--out", str(out), "--no-plots", *extra]


@pytest.fixture
def evaluations(monkeypatch):
    """Records (scheme name, "ppl" | "passkey", lengths) of every evaluation that runs; `fail_on[name] = exc` makes
    the perplexity evaluation of that scheme raise instead."""
    import rope_patch.evaluation.compare as C

    calls, fail_on = [], {}
    real_ppl, real_pk = C.evaluate_scheme_perplexity, C.evaluate_passkey

    def ppl(model, token_ids, lengths, *a, **kw):
        name = rope_patch.current(model).name
        if name in fail_on:
            raise fail_on[name]
        if lengths:
            calls.append((name, "ppl", list(lengths)))
        return real_ppl(model, token_ids, lengths, *a, **kw)

    def passkey(model, tokenizer, filler, lengths, *a, **kw):
        calls.append((rope_patch.current(model).name, "passkey", list(lengths)))
        return real_pk(model, tokenizer, filler, lengths, *a, **kw)

    monkeypatch.setattr(C, "evaluate_scheme_perplexity", ppl)
    monkeypatch.setattr(C, "evaluate_passkey", passkey)
    return calls, fail_on


def one_line(err: str) -> str:
    """The command's error: the one line of stderr after the progress output, and no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("rope-patch compare: ")]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]) and "Traceback" not in err, err
    return lines[0]


def test_unwritable_out_fails_before_loading_or_evaluating(saved, tmp_path, evaluations, monkeypatch, capsys):
    import rope_patch.zoo

    monkeypatch.setattr(rope_patch.zoo, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "file").write_text("not a folder")
    assert main(compare_argv(saved, tmp_path / "file" / "out")) == 2
    line = one_line(capsys.readouterr().err)
    assert "cannot write results to --out" in line and "file/out" in line and "Nothing has been evaluated" in line
    assert evaluations[0] == []


def test_a_refused_scheme_listed_last_fails_before_the_first_evaluation(saved, tmp_path, evaluations, capsys):
    refused, match = "longrope:factor=2,short_factor=1/1,long_factor=1/1", "must have rotary_dim/2 = 8 entries"
    assert main(compare_argv(saved, tmp_path / "out", "default", "ntk:2", refused)) == 2
    line = one_line(capsys.readouterr().err)
    assert f"Scheme {refused!r} cannot be applied to this model (llama)" in line and match in line
    assert evaluations[0] == [] and not (tmp_path / "out" / "compare.json").exists()


def test_a_late_error_keeps_the_finished_schemes_and_resume_runs_only_the_rest(saved, tmp_path, evaluations, capsys):
    calls, fail_on = evaluations
    out = tmp_path / "out"
    fail_on["ntk"] = RuntimeError("boom on the second scheme")
    assert main(compare_argv(saved, out)) == 2
    line = one_line(capsys.readouterr().err)
    assert "boom on the second scheme" in line and "Kept 1 finished scheme(s)" in line and "--resume" in line
    kept = load_results(out / "compare.json")
    assert [s["spec"] for s in kept["schemes"]] == ["default"] and kept["pending"] == ["ntk:2"]
    assert {r["scheme"] for r in kept["records"]} == {"default"} and (out / "compare.md").exists()
    assert calls == [("default", "ppl", [32, 64]), ("default", "passkey", [128])]

    calls.clear()
    fail_on.clear()
    assert main(compare_argv(saved, out, extra=["--resume"])) == 0
    assert calls == [("ntk", "ppl", [32, 64]), ("ntk", "passkey", [128])]  # default's cells were reused
    done = load_results(out / "compare.json")
    assert [s["spec"] for s in done["schemes"]] == ["default", "ntk:2"] and done["pending"] == []
    assert [r for r in done["records"] if r["scheme"] == "default"] == kept["records"]
    assert len(done["records"]) == 2 * 3 and len(done["passkey"]) == 2 and len(done["buckets"]) == 2 * 2

    calls.clear()
    assert main(compare_argv(saved, out, extra=["--resume"])) == 0  # everything there: nothing runs
    assert calls == []
    assert load_results(out / "compare.json")["records"] == done["records"]


def test_interrupt_exits_130_and_says_what_was_kept(saved, tmp_path, evaluations, capsys):
    evaluations[1]["ntk"] = KeyboardInterrupt()
    assert main(compare_argv(saved, tmp_path / "out")) == 130
    line = one_line(capsys.readouterr().err)
    assert line.startswith("rope-patch compare: interrupted. Kept 1 finished scheme(s)")
    assert [s["spec"] for s in load_results(tmp_path / "out" / "compare.json")["schemes"]] == ["default"]


def test_resume_refuses_other_settings(saved, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(compare_argv(saved, out, "default")) == 0
    assert main(compare_argv(saved, out, "default", extra=["--resume", "--seed", "1"])) == 2
    line = one_line(capsys.readouterr().err)
    assert "seed 0 -> 1" in line and "--overwrite (not --resume)" in line


def test_resume_from_a_broken_file_is_one_line(saved, tmp_path, evaluations, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "compare.json").write_text('{"format": "rope_patch.compare/1", "schem')
    assert main(compare_argv(saved, tmp_path / "out", extra=["--resume"])) == 2
    line = one_line(capsys.readouterr().err)
    assert f"cannot resume: {tmp_path / 'out' / 'compare.json'}: not valid JSON" in line and evaluations[0] == []


def test_resume_reuses_cells_and_equals_a_fresh_run(setup, evaluations):
    """Cell level: a new length and a new scheme run alone; the result equals one run of everything."""
    model, tok, ids = setup
    kw = dict(passkey_lengths=[128], depths=[0.5], passkey_samples=1, ppl_tokens=128, token_ids=ids)
    first = run_compare(model, tok, ["default"], [32], **kw)
    evaluations[0].clear()
    resumed = run_compare(model, tok, ["default", "yarn:2"], [32, 64], **kw, resume=json.loads(json.dumps(first)))
    assert evaluations[0] == [("default", "ppl", [64]), ("yarn", "ppl", [32, 64]), ("yarn", "passkey", [128])]
    fresh = run_compare(model, tok, ["default", "yarn:2"], [32, 64], **kw)
    for key in ("schemes", "records", "passkey", "buckets"):
        assert resumed[key] == fresh[key], key
    total = work_units(2, len(ids), [32, 64], [128], [0.5], 1, ppl_tokens=128)
    skipped = resumed_units(first, ["default", "yarn:2"], len(ids), [32, 64], [128], [0.5], 1, ppl_tokens=128)
    assert skipped == 128 + 128 and total - skipped > 0


def test_each_scheme_records_the_commit_that_measured_it(setup, evaluations):
    """A scheme measured now gets this source's commit; one whose cells are all reused keeps the commit of the run
    that measured them (a resumed study over several commits says which cell ran where)."""
    model, tok, ids = setup
    kw = dict(passkey_lengths=[], ppl_tokens=128, token_ids=ids)
    first = run_compare(model, tok, ["default"], [32], **kw)
    here = source_commit()
    assert first["versions"]["commit"] == here and first["schemes"][0]["commit"] == here
    earlier = json.loads(json.dumps(first))
    earlier["schemes"][0]["commit"] = "0" * 40
    resumed = run_compare(model, tok, ["default", "yarn:2"], [32], **kw, resume=earlier)
    assert [s["commit"] for s in resumed["schemes"]] == ["0" * 40, here]


def test_the_commit_is_the_packages_own_checkout_or_none(tmp_path):
    """A package inside another project's repository (a venv's site-packages) records no commit; in its own checkout
    the commit, `+dirty` with a changed or untracked file under rope_patch/."""
    def git(where, *args):
        subprocess.run(["git", "-C", str(where), *args], check=True, capture_output=True)

    project = tmp_path / "project"
    inside = project / "site-packages"
    (inside / "rope_patch").mkdir(parents=True)
    (inside / "rope_patch" / "__init__.py").write_text("")
    git(project, "init", "-q")
    assert source_commit(inside) is None  # another repository's commit is not rope_patch's
    checkout = tmp_path / "checkout"
    (checkout / "rope_patch").mkdir(parents=True)
    (checkout / "rope_patch" / "__init__.py").write_text("")
    git(checkout, "init", "-q")
    assert source_commit(checkout) is None  # not tracked yet
    git(checkout, "add", "rope_patch/__init__.py")
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert source_commit(checkout) == head.strip()
    (checkout / "rope_patch" / "new.py").write_text("")
    assert source_commit(checkout) == head.strip() + "+dirty"


def test_a_cell_is_the_same_whatever_the_other_lengths_of_the_run(setup):
    """The scored tokens depended on the run's longest length (windows x longest at every length): 512 read 1 window
    beside 256 and 4 beside 2048. Now each length reads its own (the first windows x max(L, 2048) tokens)."""
    model, tok, ids = setup
    kw = dict(passkey_lengths=[], windows_at_longest=1, token_ids=ids)
    short, long = (run_compare(model, tok, ["default", "yarn:2"], lengths, **kw)
                   for lengths in ([256, 512], [512, 2048]))
    for spec in ("default", "yarn:2"):
        a, b = ({r["length"]: r for r in res["records"] if r["scheme"] == spec}[512] for res in (short, long))
        assert (a["n_windows"], a["n_tokens"]) == (b["n_windows"], b["n_tokens"]) == (4, 4 * 511)
        assert a["perplexity"] == b["perplexity"]


def test_resume_measures_again_a_cell_that_read_other_tokens(setup, evaluations, caplog):
    """A cell written under the earlier rule (here: 512 read 1 window, windows x a longest of 512) is not mixed into
    a run that reads 4 windows there: measured again, with a warning; a cell that read the same tokens is reused."""
    model, tok, ids = setup
    kw = dict(passkey_lengths=[], windows_at_longest=1, token_ids=ids)
    first = run_compare(model, tok, ["default"], [256, 512], **kw)
    earlier = json.loads(json.dumps(first))
    del earlier["settings"]["ppl_shared_length"]
    cell = next(r for r in earlier["records"] if r["length"] == 512)
    cell.update(n_windows=1, n_tokens=511, perplexity=1e6)  # as the earlier rule wrote it
    evaluations[0].clear()
    with caplog.at_level("WARNING", logger="rope_patch"):
        resumed = run_compare(model, tok, ["default"], [256, 512], **kw, resume=earlier)
    assert evaluations[0] == [("default", "ppl", [512])]  # 256 read the same 2048 tokens: reused
    assert resumed["records"] == first["records"] and resumed["buckets"] == first["buckets"]
    assert "perplexity of default at 512 (1 windows there, 4 here) read other held-out tokens" in caplog.text
    sizes = (len(ids), [256, 512], [], [0.5], 1, 1)
    assert resumed_units(earlier, ["default"], *sizes) == 2048  # only 256's cell is skipped


def test_on_scheme_sees_each_finished_scheme(setup):
    model, tok, ids = setup
    snapshots = []
    run_compare(model, tok, SCHEMES, [32], passkey_lengths=[], windows_at_longest=1, token_ids=ids,
                on_scheme=lambda r: snapshots.append((len(r["schemes"]), list(r["pending"]))))
    assert snapshots == [(1, SCHEMES[1:]), (2, SCHEMES[2:]), (3, [])]


def test_shipped_scaling_baseline_is_the_model_as_loaded(setup):
    """On a checkpoint that ships with scaling the first row is the model as loaded, labelled with its rope type,
    and `default` is labelled unscaled RoPE (it throws the shipped scaling away)."""
    _, tok, ids = setup
    model = tiny_model("llama", max_position_embeddings=128, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    with pytest.warns(UserWarning, match="shipped window"):
        res = run_compare(model, tok, ["default", "yarn:8"], [32, 64], passkey_lengths=[], windows_at_longest=1,
                          token_ids=ids, model_spec="llama3-shipped")
    assert [(s["spec"], s["label"]) for s in res["schemes"]] == [
        ("loaded", "as loaded (llama3)"), ("default", "unscaled RoPE"), ("yarn:8", "yarn×8")]
    assert res["model"]["window"] == 32  # the pre-training window: buckets and the "beyond" marks
    loaded = {r["length"]: r["perplexity"] for r in res["records"] if r["scheme"] == "loaded"}
    plain = run_compare(model, tok, ["loaded"], [32, 64], passkey_lengths=[], windows_at_longest=1, token_ids=ids)
    assert loaded == {r["length"]: r["perplexity"] for r in plain["records"]}
    assert res["schemes"][0]["params"]["rope_type"] == "llama3" and rope_patch.current(model) is None


@pytest.mark.parametrize("specs,longest,refused", [
    (["learned_absolute:max_position_embeddings=64"], 64, False),
    (["learned_absolute:max_position_embeddings=64"], 65, True),
    (["default", "learned_absolute:max_position_embeddings=64"], 200, True),
    (["learned_absolute:max_position_embeddings=64+logn"], 65, True),  # a stack: its part's table
    (["yarn:2", "rerope:window_size=16"], 10_000, False),  # past the window a scheme degrades, it does not fail
])
def test_a_scheme_that_cannot_run_the_longest_input_is_refused_before_any_evaluation(specs, longest, refused):
    """learned_absolute's table has max_position_embeddings rows: past them its forward fails. compare checks the
    longest input (the longest length, a passkey prompt plus its answer) against every scheme's `longest_input` before
    the first evaluation, so no finished cell is lost to a later scheme's failure."""
    from rope_patch.evaluation.compare import check_schemes

    model = tiny_model("llama")
    if refused:
        with pytest.raises(ValueError, match=r"runs at most 64 positions .* max_position_embeddings=" + str(longest)):
            check_schemes(model, parse_schemes(specs), longest)
    else:
        check_schemes(model, parse_schemes(specs), longest)
    assert rope_patch.current(model) is None


@pytest.mark.parametrize("schemes, lengths, passkey_lengths, left_out", [
    (["default"], [32, 64], [128, 160], "scheme.s. yarn:2, dynamic:factor=2"),  # one scheme added to: the rest lost
    (SCHEMES, [64], [128, 160], r"perplexity length.s. 32"),
    (SCHEMES, [32, 64], [], r"passkey length.s. 128, 160"),
    (["default", "yarn:2", "dynamic:factor=2", "ntk:2"], [32, 64, 128], [128, 160, 200], None),  # added: reused
])
def test_resume_refuses_to_leave_out_earlier_cells(result, setup, evaluations, schemes, lengths, passkey_lengths,
                                                  left_out):
    """A resumed run writes its own schemes and lengths alone: resumed with fewer than the earlier run (to add one
    scheme, say), the rewritten compare.json lost every other finished cell without a word."""
    model, tok, ids = setup
    earlier = json.loads(json.dumps({k: v for k, v in result.items() if k != "_done"}))
    kw = dict(passkey_lengths=passkey_lengths, depths=[0.2, 0.8], passkey_samples=2, windows_at_longest=2,
              token_ids=ids, model_spec="random", resume=earlier)
    if left_out is None:
        evaluations[0].clear()
        resumed = run_compare(model, tok, schemes, lengths, **kw)
        assert ("default", "ppl", [32]) not in evaluations[0] and {r["scheme"] for r in resumed["records"]} == set(
            schemes)
        return
    evaluations[1].update(default=AssertionError("evaluated"))
    with pytest.raises(ValueError, match=f"earlier results hold {left_out} that this run leaves out.*Nothing has "
                                         "been evaluated"):
        run_compare(model, tok, schemes, lengths, **kw)


# `compare --target N`: a bare name, or a bare part of a stack, is sized for N by rope_patch.suggest; a spec with
# parameters (or a name that needs none and has no suggestion) is kept as given. On L = 64, N = 256 (factor 4):
YARN, NTK, SELF_EXTEND = "yarn:factor=4,beta_fast=2", "ntk:factor=4", "self_extend:group_size=9,window_size=16"
SIZED_FOR_TARGET = [
    (["yarn", "self_extend"], [YARN, SELF_EXTEND]),
    (["yarn+logn"], [YARN + "+logn"]),
    (["logn+yarn"], ["logn+" + YARN]),
    (["ntk+self_extend"], [NTK + "+" + SELF_EXTEND]),
    (["ntk:2+self_extend"], ["ntk:2+" + SELF_EXTEND]),
    (["yarn:2+logn", "yarn:8", "self_extend:group_size=2,window_size=8"],
     ["yarn:2+logn", "yarn:8", "self_extend:group_size=2,window_size=8"]),
    (["loaded", "default", "alibi", "logn"], ["loaded", "default", "alibi", "logn"]),
]


@pytest.fixture(scope="module")
def window_64():
    return tiny_model(max_position_embeddings=64)


@pytest.mark.parametrize("given,sized", SIZED_FOR_TARGET, ids=[" ".join(g) for g, _ in SIZED_FOR_TARGET])
def test_target_sizes_bare_names_and_bare_parts_of_stacks(window_64, given, sized):
    from rope_patch.evaluation.compare import check_specs, schemes_for_target

    check_specs(given, sized_by_target=True)  # before the model loads: bare names wait for the target
    assert schemes_for_target(window_64, 256, given) == sized
    parse_schemes(sized)  # and what they become builds
    assert schemes_for_target(window_64, 256, None) == specs_for_target(window_64, 256)


@pytest.mark.parametrize("specs,match", [
    (["yarn"], "yarn: missing required parameter `factor`"),
    (["default", "yarn+logn"], "yarn: missing required parameter `factor`"),
    (["self_extend"], "self_extend: missing required parameter `group_size`"),
])
def test_bare_names_that_need_parameters_are_refused_without_a_target(specs, match):
    from rope_patch.evaluation.compare import check_specs

    with pytest.raises(TypeError, match=match) as err:
        check_specs(specs)
    assert "Bad scheme spec" in str(err.value)


@pytest.mark.parametrize("specs,error,match", [
    (["yarn", "yran:8"], ValueError, "Did you mean 'yarn'"),
    (["yarn+logn", "yarn:facto=8+logn"], TypeError, "Did you mean 'factor'"),
    (["yarn:0.5+logn"], ValueError, "factor"),
    (["yarn+self_extend:group_size=0,window_size=8"], ValueError, "group_size"),
    (["yarn", "yarn"], ValueError, "listed twice"),
])
def test_specs_sized_by_the_target_are_still_checked_before_loading(specs, error, match):
    from rope_patch.evaluation.compare import check_specs

    with pytest.raises(error, match=match):
        check_specs(specs, sized_by_target=True)


@pytest.mark.parametrize("specs,target,bad", [(["yarn", "longrope"], 256, "longrope"),
                                              (["longrope+logn"], 256, "longrope"), (["p_rope"], 256, "p_rope"),
                                              (["yarn+logn"], 64, "yarn")])  # N <= L: no extension suggested
def test_a_bare_name_the_target_cannot_size_says_what_to_give(window_64, specs, target, bad):
    from rope_patch.evaluation.compare import schemes_for_target

    with pytest.raises(ValueError, match=f"rope_patch.suggest has no parameters for {bad!r}") as err:
        schemes_for_target(window_64, target, specs)
    assert "missing required parameter" in str(err.value) and "Give them in the spec" in str(err.value)


@pytest.mark.parametrize("folder", ["gptj", "codegen"])
def test_the_loaded_row_of_a_table_rotary_model(folder, tmp_path):
    """GPT-J / CodeGen: a table rotary and a config without rope_parameters; the model as loaded is a row like any
    other (no parameters to record), and the model is left as it was."""
    tok = char_tokenizer()
    model = tiny_model(folder)
    before = {name: b.clone() for name, b in model.named_buffers()}
    ids = tok.encode(filler_text(), add_special_tokens=False)
    res = run_compare(model, tok, ["loaded", "yarn:2"], [32, 64], passkey_lengths=[110], depths=[0.5],
                      passkey_samples=1, windows_at_longest=1, token_ids=ids, model_spec="random")
    loaded, yarn = res["schemes"]
    assert (loaded["spec"], loaded["params"]) == ("loaded", {}) and yarn["spec"] == "yarn:2"
    rows = {(r["scheme"], r["length"]): r["perplexity"] is not None for r in res["records"]}
    assert rows == {(s, n): n < 110 for s in ("loaded", "yarn:2") for n in (32, 64, 110)}
    assert rope_patch.current(model) is None
    assert all(torch.equal(b, before[name]) for name, b in model.named_buffers())
    write_results(res, tmp_path)
    assert load_results(tmp_path / "compare.json")["schemes"][0]["params"] == {}
