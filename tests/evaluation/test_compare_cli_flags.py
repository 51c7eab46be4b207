"""`rope-patch compare --chat-template / --shared-haystack / --bucket-size / --budget-minutes` on a saved tiny model."""

from __future__ import annotations

import re

import pytest
from helpers.models import tiny_model
from helpers.text import char_tokenizer, filler_text

from rope_patch.cli import main
from rope_patch.evaluation.results import load_results

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant {% endif %}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    model = tiny_model("llama")
    for name, template in (("plain", None), ("chat", TEMPLATE)):
        tok = char_tokenizer()
        if template:
            tok.chat_template = template
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "heldout.txt").write_text(filler_text())
    return root


def argv(saved, out, model="plain", extra=()):
    return ["compare", "--model", str(saved / model), "--schemes", "default", "--lengths", "32", "64",
            "--passkey-lengths", "200", "--depths", "0.5", "--passkey-samples", "2", "--windows", "1",
            "--heldout", str(saved / "heldout.txt"), "--out", str(out), "--no-plots", *extra]


def only_line(err: str, prefix: str = "rope-patch compare: ") -> str:
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("extra,message", [
    (["--budget-minutes", "0"], "argument --budget-minutes: must be a number > 0, got 0"),
    (["--budget-minutes", "soon"], "argument --budget-minutes: expected a number, got 'soon'"),
    (["--bucket-size", "0"], "argument --bucket-size: must be an integer >= 1, got 0"),
    (["--chat-template", "maybe"], "argument --chat-template: invalid choice: 'maybe'"),
])
def test_bad_flags_are_one_line(saved, tmp_path, capsys, extra, message):
    assert main(argv(saved, tmp_path / "out", extra=extra)) == 2
    assert message in only_line(capsys.readouterr().err)


@pytest.mark.parametrize("extra,message", [
    (["--chat-template", "on"], "has no chat template (tokenizer.chat_template is empty): use 'auto' or 'off'"),
    (["--bucket-size", "100"], "bucket size must be between 1 and the longest length (64), got 100"),
])
def test_errors_found_after_loading_are_one_line(saved, tmp_path, capsys, extra, message):
    assert main(argv(saved, tmp_path / "out", extra=extra)) == 2
    assert message in only_line(capsys.readouterr().err)
    assert not (tmp_path / "out" / "compare.json").exists()


@pytest.mark.parametrize("model,extra,used", [("chat", [], True), ("chat", ["--chat-template", "off"], False),
                                              ("plain", [], False)])
def test_flags_reach_the_results(saved, tmp_path, capsys, model, extra, used):
    flags = [*extra, "--shared-haystack", "--bucket-size", "16", "--budget-minutes", "30"]
    assert main(argv(saved, tmp_path / "out", model, flags)) == 0
    err = capsys.readouterr().err
    assert "Estimated time: " in err and "within the budget of 30.0 min" in err  # printed before the run
    data = load_results(tmp_path / "out" / "compare.json")
    s = data["settings"]
    assert s["chat_template"] == {"mode": extra[1] if extra else "auto", "used": used}
    assert s["shared_haystack"] and s["bucket_size"] == 16 and s["budget"]["minutes"] == 30.0
    assert not s["budget"]["trimmed"] and s["machine"]["loadavg_start"] is not None
    assert [(b["start"], b["end"]) for b in data["buckets"]] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert all(p["shared_prefix"] > 0 for p in data["passkey"])
    assert re.search(r" / \d+% \([0-2]/2, \d+-\d+\) \|", (tmp_path / "out" / "compare.md").read_text())


def test_budget_trims_and_says_so(saved, tmp_path, capsys, monkeypatch):
    import rope_patch.evaluation.compare as C
    from rope_patch.evaluation.budget import Cost

    # 1 ms a token: 2 x 2048 perplexity tokens (4.1 s) + 207 per passkey prompt; 4.8 s fits 3 prompts, not 4
    monkeypatch.setattr(C, "probe_cost", lambda model, ids, lengths: Cost(a=0.001))
    assert main(argv(saved, tmp_path / "out", extra=["--passkey-samples", "5", "--budget-minutes", "0.08"])) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("Budget 5 s"))
    assert "passkey samples per cell 5 -> " in line
    data = load_results(tmp_path / "out" / "compare.json")
    assert data["settings"]["budget"]["line"] == line and data["settings"]["passkey_samples"] < 5
    assert all(p["n"] == data["settings"]["passkey_samples"] for p in data["passkey"])


def test_finished_results_are_not_replaced_without_resume_or_overwrite(saved, tmp_path, capsys):
    """A second run into a folder that holds compare.json is refused before the model loads (it would replace the
    finished work); --resume adds to it, --overwrite replaces it."""
    out = tmp_path / "out"
    assert main(argv(saved, out)) == 0
    before = (out / "compare.json").read_bytes()
    capsys.readouterr()
    assert main(argv(saved, out, extra=["--lengths", "32"])) == 2
    line = only_line(capsys.readouterr().err)
    assert "holds the results of an earlier run" in line and "--resume" in line and "--overwrite" in line
    assert (out / "compare.json").read_bytes() == before
    assert main(argv(saved, out, extra=["--lengths", "32", "--overwrite"])) == 0
    assert load_results(out / "compare.json")["settings"]["lengths"] == [32]


def target_argv(saved, out, model, *schemes, target=("--target", "128")):
    model = model if model == "does/not/exist" else str(saved / model)
    return ["compare", "--model", model, *target, "--schemes", *schemes, "--lengths", "32", "--passkey-lengths",
            "--windows", "1", "--heldout", str(saved / "heldout.txt"), "--out", str(out), "--no-plots",
            "--threads", "1"]


# `compare --target N --schemes ...`: bare names, and bare parts of a stack, get rope_patch.suggest's parameters for
# N (docs/guides/choosing-a-scheme.md); L = 32 here, so N = 128 is factor 4.
def test_target_sizes_bare_names_and_stack_parts(saved, tmp_path, capsys):
    yarn = "yarn:factor=4,beta_fast=2"
    schemes = ["default", "yarn", "yarn+logn", "rerope:window_size=8"]
    assert main(target_argv(saved, tmp_path / "out", "plain", *schemes)) == 0
    sized = ["default", yarn, yarn + "+logn", "rerope:window_size=8"]
    assert "--target 128: " + " ".join(sized) in " ".join(capsys.readouterr().err.split())  # rich wraps the line
    assert [s["spec"] for s in load_results(tmp_path / "out" / "compare.json")["schemes"]] == sized


@pytest.mark.parametrize("model,schemes,target,message", [
    # without --target a bare name that needs parameters is refused before the model loads
    ("does/not/exist", ["yarn"], (), "Bad scheme spec 'yarn': yarn: missing required parameter `factor`"),
    ("does/not/exist", ["default", "yarn+logn"], (), "Bad scheme spec 'yarn+logn': yarn: missing required parameter"),
    # with it, bare names wait for the model, and every other mistake is still found before it loads
    ("does/not/exist", ["yarn", "yarn+logn"], ("--target", "128"), "The model folder does/not/exist does not exist"),
    ("does/not/exist", ["yarn", "yarn:factr=2+logn"], ("--target", "128"), "Did you mean 'factor'?"),
    ("does/not/exist", ["yarn", "yarn:0.5"], ("--target", "128"), "Bad scheme spec 'yarn:0.5'"),
    # a bare name that needs parameters and gets no suggestion for N on this model says what to give
    ("plain", ["yarn", "longrope"], ("--target", "128"), "rope_patch.suggest has no parameters for 'longrope'"),
])
def test_target_errors_are_one_line(saved, tmp_path, capsys, model, schemes, target, message):
    assert main(target_argv(saved, tmp_path / "out", model, *schemes, target=target)) == 2
    assert message in only_line(capsys.readouterr().err)
    assert not (tmp_path / "out" / "compare.json").exists()
