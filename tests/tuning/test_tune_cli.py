"""`rope-patch tune`: one line on bad input (exit 2, no traceback, nothing evaluated), a whole run on a tiny random
model folder (log, best spec, plot, acceptance), and --resume after an interruption."""

from __future__ import annotations

import json

import pytest
from helpers.models import tiny_model
from helpers.text import char_tokenizer, filler_text

import rope_patch
from rope_patch.cli import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    tiny_model("llama").save_pretrained(root / "m")
    char_tokenizer().save_pretrained(root / "m")
    (root / "heldout.txt").write_text(filler_text(2000))
    return root


def argv(saved, out, *extra):
    return ["tune", "--model", str(saved / "m"), "--heldout", str(saved / "heldout.txt"), "--target", "64",
            "--tokens", "128", "--accept-tokens", "128", "--threads", "1", "--out", str(out), *extra]


def error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and out == "", err
    return lines[0]


BAD = [
    (["--scheme", "longropee"], "Did you mean"),
    (["--scheme", "yarn", "--method", "evolution"], "the evolutionary search is LongRoPE's"),
    (["--scheme", "longrope", "--method", "grid"], "the evolutionary search is LongRoPE's"),
    (["--scheme", "yarn", "--space", "factor"], "expected KEY=V1,V2,... or KEY=LO..HI"),
    (["--scheme", "yarn", "--space", "factor=2..8"], "use --method random for ranges"),
    (["--scheme", "yarn", "--space", "bogus=1,2"], "yarn has no parameter 'bogus'"),
    (["--scheme", "yarn", "--method", "random", "--space", "factor=8..2"], "lo < hi"),
    # a value the scheme refuses in every combination: refused before the first evaluation, not skipped in the search
    (["--scheme", "yarn", "--space", "factor=-2,4"], "--space factor=-2: yarn refuses the candidate factor=-2"),
    (["--scheme", "yarn", "--method", "random", "--space", "factor=-1..4"], "refuses the range end factor=-1"),
    (["--scheme", "yarn", "--space", "factor=2,4", "beta_fast=1", "beta_slow=2"], "yarn refuses every candidate"),
    (["--scheme", "longrope", "--population", "1"], "argument --population: must be an integer >= 2"),
    (["--scheme", "longrope", "--population", "4", "--parents", "6"], "--parents must be between 2 and the population"),
    (["--scheme", "longrope", "--budget-minutes", "0"], "argument --budget-minutes: must be a number > 0"),
    (["--scheme", "longrope", "--max-evals", "0"], "argument --max-evals: must be an integer >= 1"),
    (["--scheme", "rope_tiny_has_no_such_scheme"], "Unknown"),
    (["--scheme", "longrope", "--accept", "yarn:zero"], "yarn"),
    (["--scheme", "longrope", "--init", "rerope:8"], "--init 'rerope:8': the initial factors come from a frequency"),
    (["--scheme", "yarn", "--haystack", "hay"], "argument --haystack: invalid choice: 'hay'"),
    # fewer tokens than one window of the target: before, found at the first evaluation (--tokens) or after the whole
    # search (--accept-tokens), as "Need at least 64 tokens ..., have 32", naming neither option
    (["--scheme", "yarn", "--tokens", "32"], "--tokens 32 is less than one window of --target 64"),
    (["--scheme", "yarn", "--accept-tokens", "32"], "--accept-tokens 32 is less than one window of --target 64"),
]


@pytest.mark.parametrize(("extra", "message"), BAD)
def test_bad_input_is_one_line(saved, tmp_path, capsys, extra, message):
    assert main(argv(saved, tmp_path / "out", *extra)) == 2
    line = error_line(capsys)
    assert line.startswith("rope-patch tune: error:") and message in line, line
    assert not (tmp_path / "out" / "search_log.json").exists()


def test_a_target_inside_the_window_is_refused_for_longrope(saved, tmp_path, capsys):
    args = argv(saved, tmp_path, "--scheme", "longrope")
    args[args.index("--target") + 1] = "32"
    assert main(args) == 2  # known once the model is loaded: its "Loading ..." line comes first
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "".join(err) and err[-1].startswith("rope-patch tune: error: LongRoPE's long factors")
    assert "--target must be > 32" in err[-1] and not (tmp_path / "search_log.json").exists()


def test_resume_from_a_file_that_is_not_a_log_is_one_line(saved, tmp_path, capsys):
    (tmp_path / "search_log.json").write_text("{not json")
    assert main(argv(saved, tmp_path, "--scheme", "longrope", "--resume")) == 2
    line = error_line(capsys)
    assert f"{tmp_path / 'search_log.json'}: not valid JSON" in line
    assert "--overwrite (not --resume) starts over" in line
    (tmp_path / "search_log.json").write_text(json.dumps({"format": "rope_patch.compare/1"}))
    assert main(argv(saved, tmp_path, "--scheme", "longrope", "--resume")) == 2
    assert "is not a rope-patch tune search log" in error_line(capsys)


def test_a_run_writes_log_best_spec_plot_and_acceptance_and_resumes(saved, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    common = ("--scheme", "longrope", "--population", "4", "--generations", "2", "--accept", "linear:2")
    assert main(argv(saved, out, *common)) == 0
    capsys.readouterr()
    log = json.loads((out / "search_log.json").read_text())
    assert log["status"] == "done" and len(log["evaluations"]) == 4 + 2 * 2
    assert [r["label"] for r in log["acceptance"]["rows"]] == ["searched longrope", "linear×2"]
    best = json.loads((out / "best.json").read_text())
    assert best["spec"] == log["best"]["spec"] and (out / "search.png").stat().st_size > 0
    model = rope_patch.apply(tiny_model("llama"), best["spec"])
    assert rope_patch.current(model).name == "longrope"

    # interrupted after the fifth evaluation (Ctrl-C): one line that says what was kept, then --resume
    import rope_patch.tuning.search as S

    real = S.Objective.__call__
    count = [0]

    def interrupted(self, name, params):
        if count[0] == 5:
            raise KeyboardInterrupt
        count[0] += 1
        return real(self, name, params)

    monkeypatch.setattr(S.Objective, "__call__", interrupted)
    again = tmp_path / "again"
    assert main(argv(saved, again, *common)) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "".join(err) and err[-1].startswith("rope-patch tune: interrupted."), err
    assert "Kept 5 evaluation(s)" in err[-1] and "--resume" in err[-1], err
    monkeypatch.setattr(S.Objective, "__call__", real)
    assert main(argv(saved, again, *common, "--resume")) == 0
    resumed = json.loads((again / "search_log.json").read_text())
    strip = lambda recs: [{k: v for k, v in r.items() if k != "seconds"} for r in recs]  # noqa: E731
    assert strip(resumed["evaluations"]) == strip(log["evaluations"])
    assert resumed["best"] == log["best"] and resumed["acceptance"]["rows"] == log["acceptance"]["rows"]

    # a resume may extend the stopping rules, not the search settings
    capsys.readouterr()
    assert main(argv(saved, again, *common, "--resume", "--seed", "3")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "".join(err) and "settings differ in seed" in err[-1], err
    assert strip(json.loads((again / "search_log.json").read_text())["evaluations"]) == strip(log["evaluations"])


def test_the_search_figure_needs_a_finite_evaluation():
    from rope_patch import plots

    with pytest.raises(ValueError, match="no evaluation with a finite objective"):
        plots.search({"settings": {}, "evaluations": [{"index": 0, "generation": 0, "objective": None}]})
    fig = plots.search({"settings": {"method": "grid", "target": 64}, "evaluations": [
        {"index": 0, "generation": 0, "objective": 3.0}, {"index": 1, "generation": 0, "objective": 2.0}]})
    best = [line for line in fig.axes[0].get_lines() if line.get_label() == "best so far"][0]
    assert list(best.get_ydata()) == [3.0, 2.0]


@pytest.mark.parametrize(("extra", "haystack", "chat"), [
    ((), None, None),  # perplexity only: no passkey settings in the log
    (("--passkey-weight", "1", "--passkey-samples", "1"), "prose", {"mode": "auto", "used": False}),
    (("--passkey-weight", "1", "--passkey-samples", "1", "--haystack", "noise", "--chat-template", "off"), "noise",
     {"mode": "off", "used": False}),
])
def test_the_passkey_term_settings_reach_the_log(saved, tmp_path, capsys, extra, haystack, chat):
    out = tmp_path / "out"
    long = ("--target", "160", "--tokens", "160")  # room for the passkey prompt in characters
    assert main(argv(saved, out, "--scheme", "yarn", "--space", "factor=2", "--no-accept", "--no-plots", *long,
                     *extra)) == 0
    settings = json.loads((out / "search_log.json").read_text())["settings"]
    assert settings.get("haystack") == haystack and settings.get("chat_template") == chat
    assert settings.get("passkey_prompt") == (chat and "plain")  # these tokenizers have no template


@pytest.mark.parametrize(("extra", "message"), [
    (("--chat-template", "on", "--target", "160", "--tokens", "160", "--no-accept"), "has no chat template"),
    ((), "the passkey term (--passkey-weight) cannot build a prompt at --target 64: length_tokens=64 is too short"),
])
def test_passkey_term_errors_are_one_line(saved, tmp_path, capsys, extra, message):
    extra = ("--scheme", "yarn", "--space", "factor=2", "--passkey-weight", "1", *extra)
    assert main(argv(saved, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err  # found once the model is loaded: after its loading lines
    errors = [line for line in err.splitlines() if line.startswith("rope-patch tune:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "out" / "search_log.json").exists()


def test_a_logged_search_is_not_replaced_without_resume_or_overwrite(saved, tmp_path, capsys):
    (tmp_path / "search_log.json").write_text("{}")
    assert main(argv(saved, tmp_path, "--scheme", "longrope")) == 2
    line = error_line(capsys)
    assert "search_log.json holds the results of an earlier run" in line and "--overwrite" in line
    assert (tmp_path / "search_log.json").read_text() == "{}"


def test_a_search_stopped_before_an_accepted_candidate_says_to_raise_the_limit(saved, tmp_path, capsys):
    """The first candidate (S = W = 8) is refused by STRING, the next one is fine, and --max-evals 1 stops the search
    in between. Before: "Choose a --space the scheme accepts", wrong for a space holding accepted candidates."""
    extra = ("--scheme", "string", "--space", "shift_size=8,16", "window_size=8,4", "--max-evals", "1", "--no-plots")
    assert main(argv(saved, tmp_path, *extra)) == 2
    err = capsys.readouterr().err  # found once the search ran: after the model's loading lines
    errors = [line for line in err.splitlines() if line.startswith("rope-patch tune:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    line = errors[0]
    assert "--max-evals 1 stopped the search before a candidate the scheme accepts" in line, line
    assert "Choose a --space" not in line and "--resume" in line
    assert len(json.loads((tmp_path / "search_log.json").read_text())["evaluations"]) == 1
    assert main(argv(saved, tmp_path, *extra[:-3], "--max-evals", "2", "--no-plots", "--resume")) == 0
    assert json.loads((tmp_path / "best.json").read_text())["spec"] == "string:shift_size=8,window_size=4"


def test_refusals_that_differ_only_in_the_candidate_are_one_reason():
    """STRING refuses S <= W with the candidate's values in its message: seven refusals were seven "1x" entries whose
    visible 160 characters were identical (the values come after the cut). They are one reason, values elided."""
    from rope_patch.cli.tune import evaluation_count

    why = ("string: parameter `shift_size` must be larger than `window_size` (distances d ≥ S become d − S + W, which "
           "must be shorter than d), got shift_size={s}, window_size={w}. Raise shift_size or lower window_size.")
    pairs = [(32, 32), (32, 64), (42, 64), (64, 64), (64, 128)]
    records = [{"params": {"shift_size": s, "window_size": w}, "objective": None, "error": why.format(s=s, w=w)}
               for s, w in pairs] + [{"params": {"shift_size": 42, "window_size": 32}, "objective": 3.0}]
    text = evaluation_count({"evaluations": records})
    assert text.startswith("6 candidates: 1 evaluated, 5 refused by the scheme (5x string: parameter `shift_size`")
    assert text.count("x string:") == 1, text


def test_acceptance_tokens_below_the_window_are_refused_before_the_search(saved, tmp_path, capsys):
    """A target inside the window (16 < 32): the acceptance also reads whole windows of 32 tokens. Before, 20 tokens
    passed the check against --target and the run failed after the whole search."""
    args = argv(saved, tmp_path, "--scheme", "yarn", "--space", "factor=2", "--no-plots")
    args[args.index("--target") + 1], args[args.index("--accept-tokens") + 1] = "16", "20"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "rope-patch tune: error: --accept-tokens 20 is less than one window at the model's pre-training window 32")
    assert not (tmp_path / "search_log.json").exists()


@pytest.mark.parametrize(("why", "params", "elided"), [
    ("got factor=16.", {"factor": 1}, "got factor=16."),  # a value that starts another is not elided
    ("got local_window_size=8.", {"window_size": 8}, "got local_window_size=8."),  # nor a name that ends another
    ("got window_size=8, shift_size=8.", {"window_size": 8, "shift_size": 8}, "got window_size=…, shift_size=…."),
])
def test_only_whole_names_and_values_are_elided(why, params, elided):
    from rope_patch.cli.tune import _elided

    assert _elided(why, params) == elided
