"""The passkey haystack: the held-out prose (default) or the passkey paper's repeated lines (`--haystack noise`)."""

from __future__ import annotations

import json
import random

import pytest
from helpers.models import tiny_model
from helpers.text import bpe_tokenizer, char_tokenizer, filler_text

from rope_patch.cli import main
from rope_patch.evaluation import compare as compare_mod
from rope_patch.evaluation.compare import resume_mismatch, run_compare
from rope_patch.evaluation.passkey import NOISE, haystack_filler, make_passkey_sample, noise_filler

KW = dict(passkey_lengths=[160, 200], depths=[0.5], passkey_samples=2, windows_at_longest=1, model_spec="random")


@pytest.fixture(scope="module")
def setup():
    tok = char_tokenizer()
    return tiny_model("llama"), tok, tok.encode(filler_text(), add_special_tokens=False)


@pytest.fixture(scope="module")
def bpe():  # a tokenizer that spells every character of NOISE (the char tokenizer has no "H")
    return bpe_tokenizer(filler_text() + NOISE * 20)


@pytest.mark.parametrize("n", [1, 50, 1000])
def test_noise_filler_is_the_repeated_line(bpe, n):
    tok = bpe
    ids = noise_filler(tok, n)
    assert len(ids) >= n
    text = tok.decode(ids)
    assert text == NOISE * (len(text) // len(NOISE)) and text.startswith(NOISE)  # whole copies, nothing else


def test_noise_filler_is_long_enough_when_tokens_merge_across_copies():
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())  # no pre-tokenizer: merges may span a copy's end and the next one's start
    tk.train_from_iterator([NOISE * 50], trainers.BpeTrainer(vocab_size=400, show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    one, two = (len(tok.encode(NOISE * k, add_special_tokens=False)) for k in (1, 2))
    assert two < 2 * one  # the case: two copies take fewer tokens than twice one
    for n in (64, 500):  # (a tokenizer without a pre-tokenizer is slow on long text: keep n small)
        assert len(noise_filler(tok, n)) >= n


def test_haystack_filler_choices(bpe):
    tok = bpe
    ids = tok.encode(filler_text(), add_special_tokens=False)
    assert haystack_filler(tok, "prose", ids, 500) is ids
    assert tok.decode(haystack_filler(tok, "noise", ids, 500)).startswith(NOISE)
    with pytest.raises(ValueError, match="unknown passkey haystack 'grass': use one of prose, noise"):
        haystack_filler(tok, "grass", ids, 500)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_a_noise_prompt_hides_the_needle_in_the_lines(bpe, depth):
    tok = bpe
    s = make_passkey_sample(tok, noise_filler(tok, 300), 300, depth, random.Random(1))
    assert len(s["prompt_ids"]) == 300
    ids = s["prompt_ids"]
    haystack = ids[s["haystack_start"]:s["needle_start"]] + ids[s["needle_end"]:s["haystack_end"]]
    text = tok.decode(haystack)
    assert text in NOISE * (len(text) // len(NOISE) + 3)  # a stretch of the repeated line, the needle cut out
    assert s["needle_start"] - s["haystack_start"] == round(depth * len(haystack))


def test_compare_hides_the_key_in_noise_and_records_it(setup, monkeypatch):
    model, tok, ids = setup
    seen = []
    real = compare_mod.evaluate_passkey

    def spy(model_, tokenizer, filler, *a, **k):
        seen.append(list(filler))
        return real(model_, tokenizer, filler, *a, **k)

    monkeypatch.setattr(compare_mod, "evaluate_passkey", spy)
    prose = run_compare(model, tok, ["default"], [32, 64], token_ids=ids, **KW)
    noise = run_compare(model, tok, ["default"], [32, 64], token_ids=ids, haystack="noise", **KW)
    # each length's own noise filler: the one its rope_passkey_{L} lm-eval task builds (tests/lm_eval)
    assert seen == [list(ids), list(ids), noise_filler(tok, 160), noise_filler(tok, 200)]
    assert prose["settings"]["haystack"] == "prose" and noise["settings"]["haystack"] == "noise"
    # perplexity reads the held-out text either way
    assert [r["perplexity"] for r in noise["records"]] == [r["perplexity"] for r in prose["records"]]
    assert "haystack 'prose' -> 'noise'" in resume_mismatch(prose, noise)
    old = json.loads(json.dumps(prose))
    del old["settings"]["haystack"]  # a result from before the setting: its passkey read prose
    assert resume_mismatch(old, prose) is None and resume_mismatch(old, noise)


def test_unknown_haystack_fails_before_any_evaluation(setup, monkeypatch):
    model, tok, ids = setup
    monkeypatch.setattr(compare_mod, "evaluate_perplexity", lambda *a, **k: pytest.fail("evaluated"))
    with pytest.raises(ValueError, match="unknown passkey haystack"):
        run_compare(model, tok, ["default"], [32], token_ids=ids, haystack="hay", **KW)


def test_cli_flag(tmp_path, capsys):
    model, tok = tiny_model("llama"), char_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "heldout.txt").write_text(filler_text())
    base = ["compare", "--model", str(tmp_path / "m"), "--schemes", "default", "--lengths", "32",
            "--passkey-lengths", "160", "--depths", "0.5", "--passkey-samples", "1", "--windows", "1",
            "--heldout", str(tmp_path / "heldout.txt"), "--no-plots"]
    assert main([*base, "--haystack", "noise", "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["settings"]["haystack"] == "noise"
    assert main([*base, "--haystack", "hay", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "argument --haystack: invalid choice: 'hay'" in err and "Traceback" not in err
