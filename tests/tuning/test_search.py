"""The search machinery: resume reproduces an uninterrupted log, --max-evals / --budget-minutes stop it, grid search
finds a known optimum, the real objective on a tiny random model, and the held-out split."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
from helpers.models import WINDOW, tiny_model
from helpers.text import char_tokenizer, filler_text

import rope_patch
from rope_patch.evaluation.passkey import noise_filler
from rope_patch.evaluation.perplexity import window_nll
from rope_patch.tuning import (
    EvolutionSettings,
    SearchLog,
    TuneOptions,
    accept,
    evolve,
    grid_points,
    load_log,
    random_points,
    scalar_search,
    spec_of,
    split_heldout,
    tune,
)
from rope_patch.tuning.log import check_resumable

OPT = [1.0, 1.0, 1.2, 1.6, 2.2, 3.0, 3.9, 4.6]
INITIAL = {"linear": [4.0] * 8, "ntk": [4 ** (2 * i / 14) for i in range(8)], "yarn": [1, 1, 1.3, 2, 3, 4, 4, 4]}
SETTINGS = EvolutionSettings(population=6, generations=4)


def objective(f):
    return {"objective": sum((x - y) ** 2 for x, y in zip(f, OPT, strict=True))}


def strip(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


class Interrupt(Exception):
    pass


def test_resume_reproduces_an_uninterrupted_evolution(tmp_path):
    full = SearchLog({"settings": {}}, tmp_path / "full.json")
    evolve(full, objective, INITIAL, SETTINGS, 4.0, seed=7)
    full.finish(None)

    calls = []

    def dies_at_9(f):
        if len(calls) == 9:
            raise Interrupt
        calls.append(f)
        return objective(f)

    part = SearchLog({"settings": {}}, tmp_path / "part.json")
    with pytest.raises(Interrupt):
        evolve(part, dies_at_9, INITIAL, SETTINGS, 4.0, seed=7)
    written = load_log(tmp_path / "part.json")
    assert len(written["evaluations"]) == 9 and written["status"] == "running"  # each evaluation written at once

    ran = []
    resumed = SearchLog({"settings": {}}, tmp_path / "part.json", previous=written,
                        on_record=lambda rec, replayed: ran.append(replayed))
    evolve(resumed, objective, INITIAL, SETTINGS, 4.0, seed=7)
    resumed.finish(None)
    assert ran[:9] == [True] * 9 and not any(ran[9:])  # the logged nine are not evaluated again
    assert strip(load_log(tmp_path / "part.json")["evaluations"]) == strip(full.evaluations)
    assert load_log(tmp_path / "part.json")["best"] == full.data["best"]


def test_another_seed_does_not_resume_silently(tmp_path):
    part = SearchLog({"settings": {}}, tmp_path / "log.json", max_evals=8)
    evolve(part, objective, INITIAL, SETTINGS, 4.0, seed=1)
    again = SearchLog({"settings": {}}, previous=load_log(tmp_path / "log.json"))
    with pytest.raises(ValueError, match="cannot resume: evaluation"):
        evolve(again, objective, {"ntk": INITIAL["ntk"], "linear": INITIAL["linear"]}, SETTINGS, 4.0, seed=1)


def test_changed_settings_are_refused_but_stopping_rules_may_change():
    old = {"model": {"a": 1}, "split": {"s": 1}, "settings": {"seed": 0, "max_evals": 5, "target": 64}}
    check_resumable(old, {**old, "settings": {"seed": 0, "max_evals": None, "target": 64}}, "log.json")
    with pytest.raises(ValueError, match="settings differ in seed"):
        check_resumable(old, {**old, "settings": {"seed": 1, "max_evals": 5, "target": 64}}, "log.json")
    with pytest.raises(ValueError, match="another model"):
        check_resumable(old, {**old, "model": {"a": 2}}, "log.json")


@pytest.mark.parametrize(("new", "resumes"), [
    ({"haystack": "prose", "chat_template": {"mode": "auto", "used": False}}, True),  # what the old log ran
    ({"haystack": "prose", "chat_template": {"mode": "off", "used": False}}, True),   # the same prompts
    ({"haystack": "noise", "chat_template": {"mode": "auto", "used": False}}, False),
    ({"haystack": "prose", "chat_template": {"mode": "auto", "used": True}}, False),
    ({"haystack": "prose", "chat_template": {"mode": "off", "used": False}, "passkey_prompt": "plain"}, True),
])
def test_a_passkey_log_from_before_its_haystack_setting_resumes_as_prose_untemplated(new, resumes):
    old = {"model": {"a": 1}, "split": {"s": 1}, "settings": {"seed": 0, "passkey_weight": 1.0, "target": 64}}
    header = {**old, "settings": {**old["settings"], **new}}
    if resumes:
        check_resumable(old, header, "log.json")
    else:
        with pytest.raises(ValueError, match="settings differ in (haystack|chat_template)"):
            check_resumable(old, header, "log.json")


def test_a_templated_log_from_before_the_lead_in_moved_is_not_resumed():
    """Such a log's passkey prompts closed the user turn with the lead-in; today's open the assistant turn with it."""
    chat = {"haystack": "prose", "chat_template": {"mode": "on", "used": True}}
    old = {"model": {"a": 1}, "split": {"s": 1}, "settings": {"passkey_weight": 1.0, "target": 64, **chat}}
    check_resumable(old, old, "log.json")
    new = {**old, "settings": {**old["settings"], "passkey_prompt": "chat"}}
    check_resumable(new, new, "log.json")
    with pytest.raises(ValueError, match="settings differ in passkey_prompt"):
        check_resumable(old, new, "log.json")


def test_max_evals_stops_the_search():
    log = SearchLog({"settings": {}}, max_evals=10)
    assert evolve(log, objective, INITIAL, SETTINGS, 4.0) == "max_evals"
    log.finish("max_evals")
    assert len(log.evaluations) == 10 and log.data["status"] == "stopped" and log.data["best"] is not None


def test_the_budget_stops_the_search_and_counts_resumed_time(tmp_path):
    now = [0.0]

    def clock():
        now[0] += 5.0  # every call 5 s later: each evaluation takes 5 s
        return now[0]

    points = [{"x": x} for x in range(20)]
    log = SearchLog({"settings": {}}, tmp_path / "log.json", budget_s=22, clock=clock)
    assert scalar_search(log, lambda p: {"objective": p["x"]}, points, str) == "budget"
    assert len(log.evaluations) == 5  # 0, 5, 10, 15, 20 s spent: the fifth starts below 22 s, the sixth does not
    resumed = SearchLog({"settings": {}}, previous=load_log(tmp_path / "log.json"), budget_s=22, clock=clock)
    assert scalar_search(resumed, lambda p: {"objective": p["x"]}, points, str) == "budget"
    assert len(resumed.evaluations) == 5  # the resumed run has no new time left
    longer = SearchLog({"settings": {}}, previous=load_log(tmp_path / "log.json"), budget_s=32, clock=clock)
    scalar_search(longer, lambda p: {"objective": p["x"]}, points, str)
    assert len(longer.evaluations) == 7


def test_grid_search_over_a_tiny_model_finds_the_known_optimum():
    """Synthetic objective through apply(): distance of the patched model's served window from 96 = 3 × 32
    (yarn factor 3), plus a penalty that prefers beta_fast 16."""
    model = tiny_model("llama")

    def served(p):
        with rope_patch.patched(model, "yarn", **p):
            window = rope_patch.context_window(model)
        return {"objective": abs(window - 3 * WINDOW) + (0 if p["beta_fast"] == 16 else 1)}

    space = {"factor": [1.5, 2.0, 3.0, 4.0, 6.0], "beta_fast": [8, 16, 32]}
    points = grid_points(space)
    assert len(points) == 15
    log = SearchLog({"settings": {}})
    assert scalar_search(log, served, points, lambda p: spec_of("yarn", p)) is None
    assert log.data["best"]["params"] == {"factor": 3.0, "beta_fast": 16}
    assert log.data["best"]["spec"] == "yarn:factor=3.0,beta_fast=16"
    assert rope_patch.current(model) is None


def test_random_points_are_distinct_and_in_range():
    pts = random_points({"g": [2, 4, 8], "w": (4, 16), "f": (1.0, 2.0)}, 30, random.Random(0))
    assert len(pts) == 30 and len({tuple(sorted(p.items())) for p in pts}) == 30
    assert all(p["g"] in (2, 4, 8) and 4 <= p["w"] <= 16 and isinstance(p["w"], int) and 1 <= p["f"] <= 2 for p in pts)
    assert len(random_points({"g": [2, 4]}, 10, random.Random(0))) == 2


def test_the_split_is_disjoint_and_covers_the_text():
    tune_ids, accept_ids, info = split_heldout(list(range(101)))
    assert tune_ids == list(range(50)) and accept_ids == list(range(50, 101))
    assert info["tuning_tokens"] == [0, 50] and info["acceptance_tokens"] == [50, 101]


@pytest.fixture(scope="module")
def text_ids():
    return char_tokenizer().encode(filler_text(2000), add_special_tokens=False)


@pytest.mark.parametrize(("space", "message"), [
    ({"factor": [-2.0, 4.0]}, "--space factor=-2.0: yarn refuses the candidate factor=-2.0 in every combination"),
    ({"factor": [2.0, 4.0], "beta_fast": [1.0], "beta_slow": [2.0]}, "yarn refuses every candidate"),
])
def test_a_space_with_a_value_no_candidate_can_use_is_refused_before_any_evaluation(text_ids, tmp_path, space,
                                                                                    message):
    """Before: the search skipped each refused candidate, ran the rest and finished as if nothing were wrong."""
    opts = TuneOptions(scheme="yarn", target=64, space=space, n_tokens=128)
    with pytest.raises(ValueError, match=re.escape(message)):
        tune(tiny_model("llama"), char_tokenizer(), text_ids, opts, log_path=tmp_path / "s.json")
    assert not (tmp_path / "s.json").exists()


def test_tune_on_a_tiny_model_scalar_and_longrope(text_ids, tmp_path):
    model, tok = tiny_model("llama"), char_tokenizer()
    # every value is used by some candidate; the combination S <= W (8, 8) is refused by STRING and logged
    opts = TuneOptions(scheme="string", target=64, space={"shift_size": [8, 16], "window_size": [4, 8]}, n_tokens=128)
    log = tune(model, tok, text_ids, opts, log_path=tmp_path / "s.json")
    recs = log["evaluations"]
    assert len(recs) == 4 and log["status"] == "done"
    refused = [r for r in recs if r["objective"] is None]  # S <= W: STRING refuses, the log says why
    assert [r["params"] for r in refused] == [{"shift_size": 8, "window_size": 8}]
    assert all("shift_size" in r["error"] for r in refused)
    assert all(r["perplexity"] > 1 for r in recs if r["objective"] is not None)
    assert log["best"]["spec"].startswith("string:")

    opts = TuneOptions(scheme="longrope", target=64, evolution=EvolutionSettings(population=4, generations=1),
                       n_tokens=128)
    log = tune(model, tok, text_ids, opts, log_path=tmp_path / "l.json")
    assert len(log["evaluations"]) == 4 + 2
    assert all(r["objective"] == r["perplexity"] for r in log["evaluations"])  # no passkey term
    best = log["best"]["params"]
    assert best["short_factor"] == [1.0] * 8 and best["factor"] == 2.0
    assert best["original_max_position_embeddings"] == WINDOW
    rope_patch.apply(model, log["best"]["spec"])
    rope_patch.remove(model)
    acc = accept(model, text_ids, log, ["linear:2"], n_tokens=128, log_path=tmp_path / "l.json")
    assert [r["label"] for r in acc["rows"]] == ["searched longrope", "linear×2"] and acc["lengths"] == [WINDOW, 64]
    on_disk = json.loads((tmp_path / "l.json").read_text())
    assert on_disk["acceptance"]["rows"][0]["perplexity"].keys() == {"32", "64"}
    assert on_disk["split"]["acceptance_tokens"][0] == on_disk["split"]["tuning_tokens"][1]


def test_the_passkey_term_of_the_objective(text_ids, monkeypatch):
    import math

    import rope_patch.tuning.objective as O

    model, tok = tiny_model("llama"), char_tokenizer()
    plain = O.Objective(model, tok, text_ids, 160, 160)("yarn", {"factor": 2.0})
    assert plain["passkey_accuracy"] is None and plain["objective"] == plain["perplexity"]
    seen = {}

    def passkey(model_, tokenizer, filler, lengths, depths, n, seed, chat_template):
        seen.update(lengths=list(lengths), filler=list(filler), scheme=rope_patch.current(model_).name,
                    chat_template=chat_template)
        return [{"correct": 1, "n": 2}, {"correct": 2, "n": 2}]

    monkeypatch.setattr(O, "evaluate_passkey", passkey)
    weighted = O.Objective(model, tok, text_ids, 160, 160, passkey_weight=2.0)("yarn", {"factor": 2.0})
    assert weighted["passkey_accuracy"] == 0.75 and weighted["perplexity"] == pytest.approx(plain["perplexity"])
    assert weighted["objective"] == pytest.approx(plain["perplexity"] * math.exp(-2.0 * 0.75))
    assert seen == {"lengths": [160], "filler": list(text_ids), "scheme": "yarn",  # at the target, under the patch
                    "chat_template": False}
    assert rope_patch.current(model) is None
    # the paper's haystack instead of the tuning text, in templated prompts
    chat = char_tokenizer()
    chat.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    O.Objective(model, chat, text_ids, 160, 160, passkey_weight=2.0, haystack="noise", chat_template=True)(
        "yarn", {"factor": 2.0})
    assert seen["filler"] == noise_filler(tok, 160) and seen["chat_template"] is True


def test_the_needle_objective_is_the_perplexity_of_the_answer_tokens(text_ids):
    """--objective needle: LongRoPE2's needle-driven perplexity = exp(mean NLL) over the answer tokens of passkey
    prompts of the target length, under the patch; equal to a reference from the full logits."""
    import math

    import torch

    import rope_patch.tuning.objective as O
    from rope_patch.evaluation.retrieval import make_cell

    model, tok = tiny_model("llama"), char_tokenizer()
    needle = O.Objective(model, tok, text_ids, 160, 160, needle=True, passkey_samples=2, depths=(0.2, 0.8))
    got = needle("yarn", {"factor": 2.0})
    assert set(got) == {"objective", "needle_perplexity", "passkey_accuracy"} and rope_patch.current(model) is None
    total, count = 0.0, 0
    with rope_patch.patched(model, "yarn", factor=2.0):
        for depth in (0.2, 0.8):
            for sample in make_cell(tok, needle.filler, 160, depth, 2, 0):
                ids = torch.tensor([sample["prompt_ids"] + sample["answer_ids"]])
                with torch.no_grad():
                    logp = torch.log_softmax(model(ids).logits[0].double(), -1)
                start = len(sample["prompt_ids"])
                total -= sum(logp[start - 1 + j, t].item() for j, t in enumerate(sample["answer_ids"]))
                count += len(sample["answer_ids"])
    assert got["objective"] == got["needle_perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    # the text's perplexity is another number; the passkey weight multiplies the needle one as it does the text's
    text_only = O.Objective(model, tok, text_ids, 160, 160)("yarn", {"factor": 2.0})
    assert got["objective"] != pytest.approx(text_only["objective"])
    with pytest.raises(ValueError, match="--objective needle cannot build a prompt at --target 20"):
        O.Objective(model, tok, text_ids, 20, 20, needle=True)


def test_tune_with_the_needle_objective_logs_it_and_resumes_only_a_needle_search(text_ids, tmp_path):
    model, tok = tiny_model("llama"), char_tokenizer()
    opts = TuneOptions(scheme="yarn", target=160, space={"factor": [2.0, 3.0]}, objective="needle", passkey_samples=1,
                       n_tokens=160)
    log = tune(model, tok, text_ids, opts, log_path=tmp_path / "n.json")
    assert log["settings"]["objective"] == "needle" and log["settings"]["passkey_samples"] == 1
    assert all(r["objective"] == r["needle_perplexity"] and "perplexity" not in r for r in log["evaluations"])
    assert load_log(tmp_path / "n.json")["best"]["needle_perplexity"] == log["best"]["objective"]
    text = TuneOptions(scheme="yarn", target=160, space={"factor": [2.0, 3.0]}, passkey_samples=1, n_tokens=160)
    with pytest.raises(ValueError, match="objective"):
        tune(model, tok, text_ids, text, log_path=tmp_path / "n.json", previous=load_log(tmp_path / "n.json"))
    with pytest.raises(ValueError, match="unknown objective 'needles': use one of perplexity, needle"):
        tune(model, tok, text_ids, TuneOptions(scheme="yarn", target=96, objective="needles"))


def test_the_command_line_offers_the_search_objectives():
    from rope_patch.cli.main import build_parser
    from rope_patch.tuning.search import OBJECTIVES

    tune_parser = build_parser()._subparsers._group_actions[0].choices["tune"]
    assert next(a for a in tune_parser._actions if a.dest == "objective").choices == OBJECTIVES


def test_a_misspelled_space_key_gets_a_did_you_mean():
    from rope_patch.tuning.scalar import check_space

    expected = r"yarn has no parameter 'factr' to search\. Did you mean 'factor'\? Parameters of 'yarn': "
    with pytest.raises(ValueError, match=expected):
        check_space("yarn", {"factr": [2, 4]}, "grid")


def test_longrope_search_on_a_per_layer_type_rotary(text_ids, tmp_path):
    """The evolutionary search runs on Gemma 3 (a rotary per layer type; before: AttributeError reading its seeds),
    and its best spec applies there and reproduces its logged objective."""
    model, tok = tiny_model("gemma3"), char_tokenizer()
    window = model.config.max_position_embeddings
    opts = TuneOptions(scheme="longrope", target=2 * window, evolution=EvolutionSettings(population=4, generations=1),
                       n_tokens=4 * window)
    log = tune(model, tok, text_ids, opts, log_path=tmp_path / "l.json")
    assert log["status"] == "done" and len(log["evaluations"]) == 4 + 2
    assert all(math.isfinite(r["objective"]) for r in log["evaluations"])
    with rope_patch.patched(model, log["best"]["spec"]):
        ppl = math.exp(window_nll(model, split_heldout(text_ids)[0], 2 * window, 4 * window).double().mean().item())
    assert ppl == pytest.approx(log["best"]["objective"], rel=1e-9)


def test_a_search_resumes_only_in_the_precision_it_ran_in(text_ids, tmp_path):
    """The objective depends on the weights' dtype: a float32 search resumed with --dtype bfloat16 mixed the two in one
    log and one ranking (the log did not record the dtype). A log from before the dtype was recorded still resumes."""
    import torch

    opts = TuneOptions(scheme="yarn", target=64, space={"factor": [2.0, 3.0, 4.0]}, n_tokens=128, max_evals=1)
    log = tune(tiny_model("llama"), char_tokenizer(), text_ids, opts, log_path=tmp_path / "s.json")
    assert log["model"]["dtype"] == "float32"
    previous = load_log(tmp_path / "s.json")
    opts = TuneOptions(scheme="yarn", target=64, space={"factor": [2.0, 3.0, 4.0]}, n_tokens=128)
    with pytest.raises(ValueError, match="another model \\(dtype: 'float32' in the log, 'bfloat16' now\\)"):
        tune(tiny_model("llama").to(torch.bfloat16), char_tokenizer(), text_ids, opts, log_path=tmp_path / "s.json",
             previous=previous)
    assert len(load_log(tmp_path / "s.json")["evaluations"]) == 1  # the kept evaluation is untouched
    del previous["model"]["dtype"]  # written before the dtype was recorded
    done = tune(tiny_model("llama"), char_tokenizer(), text_ids, opts, log_path=tmp_path / "s.json", previous=previous)
    assert done["status"] == "done" and len(done["evaluations"]) == 3


@pytest.mark.parametrize("window, target", [(8192, 4096), (8192, 16384), (8192, 32768), (2048, 8192), (512, 1024)])
def test_every_default_space_holds_only_candidates_the_scheme_accepts(window, target):
    """A default grid is the paper's neighbourhood of a setting the scheme itself accepts: no candidate is refused by
    its own checks (STRING's W ≥ S pairs were 7 of 9 at a target inside the window)."""
    from rope_patch.registry import get_scheme_class, list_schemes
    from rope_patch.tuning.scalar import grid_points

    for name in list_schemes():
        cls = get_scheme_class(name)
        space = cls.search_space(window, target)
        for point in grid_points(space) if space is not None else ():
            cls.from_params(**point)  # raises ValueError naming the refused pair
