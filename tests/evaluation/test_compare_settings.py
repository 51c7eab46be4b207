"""run_compare records what makes a CPU measurement trustworthy: chat template, shared haystack, buckets, budget
trimming, threads and load, sample counts, Wilson intervals; and the table and figure show them."""

from __future__ import annotations

import json

import pytest
from helpers.models import tiny_model
from helpers.text import char_tokenizer, filler_text

from rope_patch import plots
from rope_patch.evaluation import compare as compare_mod
from rope_patch.evaluation.budget import Cost, fit_budget, run_seconds, run_tokens
from rope_patch.evaluation.compare import resume_mismatch, run_compare
from rope_patch.evaluation.results import load_results, markdown_table, read_results, write_results
from rope_patch.evaluation.retrieval import wilson_interval

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant {% endif %}")
KW = dict(passkey_lengths=[200], depths=[0.3, 0.8], passkey_samples=3, windows_at_longest=2, model_spec="random")


@pytest.fixture(scope="module")
def setup():
    tok = char_tokenizer()
    return tiny_model("llama"), tok, tok.encode(filler_text(), add_special_tokens=False)


@pytest.fixture(scope="module")
def chat_tok():
    t = char_tokenizer()
    t.chat_template = TEMPLATE
    return t


def _run(setup, tok=None, **kw):
    model, base_tok, ids = setup
    return run_compare(model, tok or base_tok, ["default"], [32, 64], token_ids=ids, **{**KW, **kw})


@pytest.mark.parametrize("mode,templated,used", [("auto", False, False), ("auto", True, True), ("off", True, False),
                                                 ("on", True, True)])
def test_chat_template_is_resolved_and_recorded(setup, chat_tok, mode, templated, used):
    res = _run(setup, chat_tok if templated else None, chat_template=mode, passkey_samples=1, depths=[0.5])
    assert res["settings"]["chat_template"] == {"mode": mode, "used": used}
    assert res["settings"]["passkey_prompt"] == ("chat" if used else "plain")  # where the lead-in sat: a resume key


def test_chat_template_on_without_template_fails_before_any_evaluation(setup, monkeypatch):
    monkeypatch.setattr(compare_mod, "evaluate_perplexity", lambda *a, **k: pytest.fail("evaluated"))
    with pytest.raises(ValueError, match="has no chat template"):
        _run(setup, chat_template="on")


def test_settings_machine_counts_and_intervals(setup):
    res = _run(setup, shared_haystack=True, bucket_size=16)
    s = res["settings"]
    assert s["shared_haystack"] is True and s["bucket_size"] == 16 and s["budget"] is None
    m = s["machine"]
    assert m["threads"] >= 1 and m["cpu_count"] >= 1 and len(m["loadavg_start"]) == 3 and len(m["loadavg_end"]) == 3
    assert s["counts"] == {"passkey_per_cell": 3, "passkey_cells": 2, "passkey_prompts": 6,
                           "perplexity_windows": {"32": 128, "64": 64}}  # 2 x 2048 tokens at each length
    assert [(b["start"], b["end"]) for b in res["buckets"]] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    for p in res["passkey"]:
        assert (p["ci_low"], p["ci_high"]) == wilson_interval(p["correct"], p["n"]) and p["n"] == 3
        assert p["shared_prefix"] > 0  # the shared haystack's prefix was prefilled once
    rec = next(r for r in res["records"] if r["length"] == 200)
    k = sum(p["correct"] for p in res["passkey"])
    assert (rec["passkey_correct"], rec["passkey_n"]) == (k, 6)
    assert (rec["passkey_ci_low"], rec["passkey_ci_high"]) == wilson_interval(k, 6)


def test_markdown_and_figure_show_n_and_interval(setup, tmp_path):
    res = _run(setup)
    md = markdown_table(res)
    rec = next(r for r in res["records"] if r["length"] == 200)
    lo, hi = round(100 * rec["passkey_ci_low"]), round(100 * rec["passkey_ci_high"])
    assert f"({rec['passkey_correct']}/6, {lo}-{hi})" in md and "Wilson 95% interval" in md
    assert "threads on" in md and "chat template off (auto)" in md
    paths = write_results(res, tmp_path)
    back = load_results(paths["json"])
    norm = read_results(back)
    assert {(p["n"], p["correct"]) for p in norm["passkey"]} == {(3, p["correct"]) for p in res["passkey"]}
    assert all(r["passkey_ci_low"] is not None for r in norm["records"] if r["passkey_accuracy"] is not None)
    fig = plots.passkey(norm)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any(f"{res['passkey'][0]['correct']}/3" in t for t in texts), texts
    fig2 = plots.results(norm)
    assert any(c.__class__.__name__ == "LineCollection" for ax in fig2.axes for c in ax.collections)  # error bars


def test_older_results_resume_with_the_defaults(setup):
    res = _run(setup, passkey_samples=1, depths=[0.5])
    old = json.loads(json.dumps(res))
    for k in ("chat_template", "passkey_prompt", "shared_haystack", "bucket_size"):
        del old["settings"][k]
    assert resume_mismatch(old, res) is None
    # a templated result from before `passkey_prompt` put its lead-in in the user turn: not resumed into today's
    chat = json.loads(json.dumps(res))
    chat["settings"].update(chat_template={"mode": "on", "used": True}, passkey_prompt="chat")
    old_chat = json.loads(json.dumps(chat))
    del old_chat["settings"]["passkey_prompt"]
    assert resume_mismatch(old_chat, chat) == "passkey_prompt 'chat-lead-in-in-user-turn' -> 'chat'"
    # a perplexity-only result (like ppl-16k-n1/, measured with the template) has no prompts to mix: it still resumes
    for r in (old_chat, chat):
        r["settings"]["passkey_lengths"] = []
    assert resume_mismatch(old_chat, chat) is None
    changed = _run(setup, passkey_samples=1, depths=[0.5], shared_haystack=True)
    assert "shared_haystack False -> True" in resume_mismatch(res, changed)


# ---- budget -----------------------------------------------------------------------------------------------------
def _cost(samples, windows):  # seconds: 10 per passkey sample, 30 per window
    return 10.0 * samples + 30.0 * windows


@pytest.mark.parametrize("budget,samples,windows,fits,trimmed,words", [
    (None, 10, 4, True, False, "Estimated time: 3.7 min."),
    (600, 10, 4, True, False, "within the budget of 10.0 min"),
    (150, 3, 4, True, True, "passkey samples per cell 10 -> 3"),
    (70, 1, 2, True, True, "passkey samples per cell 10 -> 1; perplexity windows 4 -> 2"),
    (20, 1, 1, False, True, "even at the minimum"),
])
def test_fit_budget_trims_samples_then_windows(budget, samples, windows, fits, trimmed, words):
    plan = fit_budget(_cost, budget, 10, 4)
    assert (plan["passkey_samples"], plan["windows_at_longest"], plan["fits"], plan["trimmed"]) == \
        (samples, windows, fits, trimmed)
    assert words in plan["line"] and "\n" not in plan["line"]
    assert plan["estimate_s"] == _cost(samples, windows) and plan["estimate_untrimmed_s"] == _cost(10, 4)


def test_fit_budget_without_passkey_trims_windows():
    plan = fit_budget(_cost, 100, 10, 4, has_passkey=False)
    assert (plan["passkey_samples"], plan["windows_at_longest"]) == (10, 1)


def test_run_tokens_counts_windows_prompts_and_answers():
    # perplexity: 2 x 2048 tokens at each length up to 2048, 2 windows of its own at a longer one
    assert run_tokens(2, 10_000, [32, 64], [100], 3, 4, 2, new_tokens=7) == 2 * ((4096 + 4096) + 107 * 3 * 4)
    assert run_tokens(1, 10_000, [32, 4096], [], 3, 4, 2) == 4096 + 8192


def test_run_seconds_weighs_each_length_by_its_attention():
    """a + b·L per token: a window of L costs L·(a + b·L), a generated token a + 2·b·L; with b = 0 it is run_tokens'
    count times a."""
    linear = Cost(a=1e-3)
    assert run_seconds(linear, 10_000, [32, 64], [100], 3, 4, 2, new_tokens=7) == pytest.approx(
        1e-3 * run_tokens(1, 10_000, [32, 64], [100], 3, 4, 2, new_tokens=7))
    cost = Cost(a=1e-3, b=1e-6)
    want = 4096 * (1e-3 + 32e-6) + 4096 * (1e-3 + 64e-6) + (100 * (1e-3 + 100e-6) + 7 * (1e-3 + 200e-6)) * 3 * 4
    assert run_seconds(cost, 10_000, [32, 64], [100], 3, 4, 2, new_tokens=7) == pytest.approx(want)


def test_run_compare_trims_to_the_budget_and_records_it(setup, monkeypatch):
    monkeypatch.setattr(compare_mod, "probe_cost", lambda model, ids, lengths: Cost(a=1e-3))
    plans = []
    res = _run(setup, passkey_samples=6, windows_at_longest=3, budget_minutes=13.2 / 60, on_plan=plans.append)
    (plan,) = plans
    # 1 ms a token: untrimmed 6 samples x 2 depths x 207 + 3 x 2048 tokens at 32 and at 64 = 14.77 s; 13.2 s fits 2
    # samples (13.12 s), not 3 (13.53 s)
    assert plan["estimate_untrimmed_s"] == pytest.approx(1e-3 * (6 * 2 * 207 + 2 * 6144))
    assert plan["trimmed"] and plan["passkey_samples"] == 2 and plan["windows_at_longest"] == 3
    assert res["settings"]["passkey_samples"] == 2 and res["settings"]["budget"]["line"] == plan["line"]
    assert all(p["n"] == 2 for p in res["passkey"]) and res["settings"]["budget"]["minutes"] == 13.2 / 60
    assert "passkey samples per cell 6 -> 2" in markdown_table(res)


def test_a_resumed_run_estimates_only_the_cells_left(setup, monkeypatch):
    """A finished scheme resumed with one more passkey length costs that length's prompts (it was estimated 0 s)."""
    monkeypatch.setattr(compare_mod, "probe_cost", lambda model, ids, lengths: Cost(a=1e-3))
    first = _run(setup, passkey_samples=1)
    plans = []
    _run(setup, passkey_samples=1, passkey_lengths=[200, 120], resume=first, on_plan=plans.append)
    assert plans[0]["estimate_s"] == pytest.approx(1e-3 * (120 + 7) * 2 * 1)  # 2 depths x 1 sample at 120 only
    plans.clear()
    _run(setup, passkey_samples=1, resume=first, on_plan=plans.append)
    assert plans[0]["estimate_s"] == 0  # nothing left


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("samples, windows, budget_s, later, kept", [
    # 1 ms a token: 2 schemes fit with 2 samples; the scheme left alone would fit with 6
    (6, 3, 26.4, 1e-3, (2, 3)),
    # 2 schemes fit with 2 windows; on a less busy machine (0.7 ms a token) the resumed run would fit with 3
    (1, 3, 20.0, 0.7e-3, (1, 2)),
])
def test_a_run_trimmed_to_its_budget_resumes_with_what_it_ran(setup, monkeypatch, samples, windows, budget_s, later,
                                                              kept):
    """The same command with --resume after an interruption: fitted to the cells left alone (or to a less busy
    machine), the budget gave back the samples (the earlier cells were then refused as other settings) or the windows
    (the earlier perplexity cells were measured again)."""
    monkeypatch.setattr(compare_mod, "probe_cost", lambda model, ids, lengths: Cost(a=1e-3))
    model, tok, ids = setup
    kw = {**KW, "passkey_samples": samples, "windows_at_longest": windows, "budget_minutes": budget_s / 60,
          "token_ids": ids}
    saved = []

    def interrupt(result):
        saved.append(result)
        raise _Interrupted

    with pytest.raises(_Interrupted):
        run_compare(model, tok, ["default", "yarn:2"], [32, 64], on_scheme=interrupt, **kw)
    (first,) = saved
    assert (first["settings"]["passkey_samples"], first["settings"]["windows_at_longest"]) == kept
    monkeypatch.setattr(compare_mod, "probe_cost", lambda model, ids, lengths: Cost(a=later))
    measured = []
    real = compare_mod.evaluate_scheme_perplexity

    def measure(m, t, lengths, *a, **k):
        measured.append(list(lengths))
        return real(m, t, lengths, *a, **k)

    monkeypatch.setattr(compare_mod, "evaluate_scheme_perplexity", measure)
    plans = []
    res = run_compare(model, tok, ["default", "yarn:2"], [32, 64], resume=first, on_plan=plans.append, **kw)
    assert (res["settings"]["passkey_samples"], res["settings"]["windows_at_longest"]) == kept
    assert measured == [[], [32, 64]]  # the finished scheme's cells are reused, the other one is measured
    assert [r for r in res["records"] if r["scheme"] == "default"] == [r for r in first["records"]]
    assert plans[0]["trimmed"] and "Resumed with the earlier run's trimmed settings" in plans[0]["line"]
    # resumed again (the second run interrupted too): the same settings
    again = run_compare(model, tok, ["default", "yarn:2"], [32, 64], resume=res, **kw)
    assert (again["settings"]["passkey_samples"], again["settings"]["windows_at_longest"]) == kept


@pytest.mark.parametrize("minutes", [0, -1.0])
def test_budget_must_be_positive(setup, minutes):
    with pytest.raises(ValueError, match="positive number of minutes"):
        _run(setup, budget_minutes=minutes)


def test_bucket_size_outside_the_window_fails_before_evaluating(setup, monkeypatch):
    monkeypatch.setattr(compare_mod, "evaluate_perplexity", lambda *a, **k: pytest.fail("evaluated"))
    with pytest.raises(ValueError, match="--bucket-size"):
        _run(setup, bucket_size=65)
