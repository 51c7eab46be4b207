"""The offline task suite (rope_patch/data/tasks/rope): scoring end to end, equality with `rope-patch compare`,
determinism."""

from __future__ import annotations

import functools
import math
import re
import sys

import lm_eval
import pytest
from helpers.lm_eval import TASKS, by_doc, evaluate
from lm_eval.api.model import LM  # noqa: E402

sys.path.insert(0, str(TASKS / "rope"))
import rope_tasks_utils as U  # noqa: E402

NEEDLE = re.compile(r"pass key is (\d+)")
NIAH_ASK = re.compile(r"special magic number for (\w+)\? The special magic number for \1 is$")


class ScriptedLM(LM):
    """A model that answers from the prompt text: `oracle` copies the asked needle, `never` never does."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode

    def generate_until(self, requests, disable_tqdm=False):
        out = []
        for req in requests:
            context = req.args[0]
            if self.mode == "never":
                out.append(" 0. I do not remember.")
                continue
            asked = NIAH_ASK.search(context)
            if asked:
                value = re.search(rf"special magic number for {asked.group(1)} is (\d+)\.", context).group(1)
            else:
                value = NEEDLE.search(context).group(1)
            out.append(f" {value}. Yes, {value}.")
        return out

    def loglikelihood(self, requests, disable_tqdm=False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError


@pytest.mark.parametrize("mode, expected", [("oracle", 1.0), ("never", 0.0)])
def test_oracle_and_never(assets, mode, expected):
    res = evaluate(ScriptedLM(mode), ["rope_passkey_128", "rope_niah_256"], assets, meta={"samples": 3})
    for task in ("rope_passkey_128", "rope_niah_256"):
        assert res["results"][task]["acc,none"] == expected, task
        assert len(res["samples"][task]) == 3 * 3  # 3 depths x 3 samples


def test_exact_token_path_oracle(assets, monkeypatch):
    """The rope_patch model feeds the documents' token ids to the same greedy decoder as `compare`: a decoder
    that copies the needle from those ids scores 1.0."""
    import torch
    from transformers import AutoTokenizer

    import rope_patch.evaluation.retrieval as retrieval

    tok = AutoTokenizer.from_pretrained(str(assets["model"]))

    def copy_needle(model, ids, new):
        rows = []
        for row in ids.tolist():
            text = tok.decode(row)
            asked = NIAH_ASK.search(text)
            value = (re.search(rf"special magic number for {asked.group(1)} is (\d+)\.", text).group(1) if asked
                     else NEEDLE.search(text).group(1))
            gen = tok.encode(f" {value}.", add_special_tokens=False)
            rows.append((gen + [tok.eos_token_id] * new)[:new])
        return torch.tensor(rows)

    monkeypatch.setattr(retrieval, "greedy_generate", copy_needle)
    res = evaluate("rope_patch", ["rope_passkey_128", "rope_niah_256"], assets,
                   model_args={"pretrained": str(assets["model"])})
    assert res["results"]["rope_passkey_128"]["acc,none"] == 1.0
    assert res["results"]["rope_niah_256"]["acc,none"] == 1.0


@pytest.mark.parametrize("spec, params", [("dynamic:4", {"scheme": "dynamic", "factor": 4}),
                                          ("yarn:2", {"scheme": "yarn", "factor": 2})])
def test_equal_to_compare(assets, spec, params):
    """On the same samples, lm-eval's passkey outputs/accuracy and perplexity equal `rope-patch compare`'s."""
    from rope_patch.evaluation.compare import run_compare
    from rope_patch.zoo import load_model

    model, tok = load_model(str(assets["model"]))
    cmp = run_compare(model, tok, [spec], [128], passkey_lengths=[128], passkey_samples=2, heldout=assets["heldout"])
    res = evaluate("rope_patch", ["rope_passkey_128", "rope_ppl_128"], assets,
                   model_args={"pretrained": str(assets["model"]), **params})

    record = cmp["records"][0]
    assert res["results"]["rope_ppl_128"]["token_perplexity,none"] == pytest.approx(record["perplexity"], rel=1e-9)
    assert res["results"]["rope_ppl_128"]["nll,none"] == pytest.approx(record["nll"], rel=1e-9)
    assert res["results"]["rope_passkey_128"]["acc,none"] == pytest.approx(record["passkey_accuracy"])
    want = [o for cell in cmp["passkey"] for o in cell["outputs"]]
    got = [s["resps"][0][0] for s in by_doc(res["samples"]["rope_passkey_128"])]
    assert got == want
    answers = [a for cell in cmp["passkey"] for a in cell["answers"]]
    assert [s["doc"]["answer"] for s in by_doc(res["samples"]["rope_passkey_128"])] == answers


class ContextLM(ScriptedLM):
    """Records the prompts lm-eval builds; renders chat turns with a tiny template (transformers' own rendering)."""

    TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant {% endif %}")

    def __init__(self, tokenizer):
        super().__init__("never")
        self.tok, self.contexts = tokenizer, []

    def generate_until(self, requests, disable_tqdm=False):
        self.contexts += [req.args[0] for req in requests]
        return super().generate_until(requests, disable_tqdm)

    @property
    def tokenizer_name(self) -> str:
        return "context-lm"

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        return self.tok.apply_chat_template(chat_history, chat_template=self.TEMPLATE, tokenize=False,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=not add_generation_prompt)


@pytest.mark.parametrize("task, lead", [("rope_passkey_128", "The pass key is"),
                                        ("rope_niah_256", "The special magic number for {key} is")])
def test_lead_in_closes_a_plain_prompt_and_opens_the_assistant_turn(assets, task, lead):
    """Without a chat template lm-eval's prompt is exactly the document's ids (the exact-token path of the rope_patch
    model); with --apply_chat_template the answer's lead-in opens the assistant turn, as RULER's gen_prefix and
    `rope-patch compare --chat-template on` put it, instead of closing the user turn."""
    tok = U.load_tokenizer(str(assets["model"]))
    plain, chat = ContextLM(tok), ContextLM(tok)
    res = evaluate(plain, [task], assets)
    evaluate(chat, [task], assets, apply_chat_template=True)
    docs = [s["doc"] for s in res["samples"][task]]
    assert len(plain.contexts) == len(chat.contexts) == len(docs) == 6
    for doc in docs:
        full = tok.decode(doc["prompt_ids"], skip_special_tokens=False)
        want = lead.format(key=doc.get("key"))
        assert full in plain.contexts and full.endswith("? " + want)
        assert f"<s>user {doc['text']}</s><s>assistant {want}" in chat.contexts


def test_a_prompt_that_does_not_end_with_the_lead_in_keeps_its_text(assets):
    tok = U.load_tokenizer(str(assets["model"]))
    ids = tok.encode(" What is the pass key? The pass key is", add_special_tokens=False)
    assert U.split_lead_in(tok, ids, " The pass key is") == (" What is the pass key?", "The pass key is")
    assert U.split_lead_in(tok, ids[:-1], " The pass key is") == (tok.decode(ids[:-1]), None)  # no lead-in for lm-eval


def test_the_lead_in_splits_on_text_for_a_sentencepiece_tokenizer():
    """A Llama-2-style tokenizer (a "▁" prepended, pieces start with "▁") encodes " The pass key is" alone with an
    extra "▁" token, so the prompt does not end with the lead-in's own tokens: the split is on the text, so lm-eval
    still gets the lead-in and the plain context is still the ids' text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    raw.train_from_iterator(["What is the pass key? The pass key is"] * 4,
                            trainers.BpeTrainer(special_tokens=["<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    ids = tok.encode(" What is the pass key? The pass key is", add_special_tokens=False)
    lead_ids = tok.encode(" The pass key is", add_special_tokens=False)
    assert ids[-len(lead_ids):] != lead_ids  # the premise: the token suffix is not the lead-in's tokens
    text, lead = U.split_lead_in(tok, ids, " The pass key is")
    assert (text, lead) == (" What is the pass key?", "The pass key is") and text + " " + lead == tok.decode(ids)


def test_documents_are_deterministic_and_exact(assets):
    kw = {"tokenizer": str(assets["model"]), "heldout": str(assets["heldout"]), "length": 128, "samples": 2}
    a, b = U.passkey_dataset(**kw)["test"], U.passkey_dataset(**kw)["test"]
    assert a.to_list() == b.to_list()
    assert all(len(r["prompt_ids"]) == 128 for r in a)
    assert [r["depth"] for r in a] == [0.1, 0.1, 0.5, 0.5, 0.9, 0.9]
    c = U.passkey_dataset(**{**kw, "seed": 1})["test"]
    assert [r["answer"] for r in c] != [r["answer"] for r in a]
    # metadata haystack=noise: compare --haystack noise's prompts (the key hidden in the paper's repeated lines)
    from rope_patch.evaluation.passkey import noise_filler
    from rope_patch.evaluation.retrieval import make_cell

    tok = U.load_tokenizer(str(assets["model"]))
    noisy = U.passkey_dataset(**{**kw, "haystack": "noise"})["test"]
    assert [r["prompt_ids"] for r in noisy if r["depth"] == 0.5] == [
        s["prompt_ids"] for s in make_cell(tok, noise_filler(tok, 128), 128, 0.5, 2, 0)]
    assert [r["prompt_ids"] for r in noisy] != [r["prompt_ids"] for r in a]
    with pytest.raises(ValueError, match="unknown passkey haystack"):
        U.niah_dataset(**{**kw, "haystack": "hay"})
    assert len(U.niah_dataset(**{**kw, "length": 256, "haystack": "noise"})["test"]) == 6
    n = U.niah_dataset(**{**kw, "length": 256})["test"]
    for r in n:
        assert len(r["prompt_ids"]) == 256
        assert r["text"].count("special magic number for") == 4 + 1  # 4 needles + the question; the lead-in:
        assert r["lead_in"] == f"The special magic number for {r['key']} is"
        assert r["key"] not in r["distractors"] and len(r["distractors"]) == 3
    p = U.ppl_dataset(**{**kw, "ppl_tokens": 1024})["test"]
    assert len(p) == 8 and all(len(r["input_ids"]) == 128 for r in p)


def test_task_files_are_generated(assets):
    """rope_patch/data/tasks/rope/*.yaml are what make_tasks.py writes (edit the templates / make_tasks.py, then
    rerun it)."""
    import make_tasks

    for name, text in make_tasks.files().items():
        assert (TASKS / "rope" / name).read_text() == text, name


def test_ppl_metrics_are_consistent(assets):
    res = evaluate("rope_patch", ["rope_ppl_64"], assets, model_args={"pretrained": str(assets["model"])})
    r = res["results"]["rope_ppl_64"]
    assert r["token_perplexity,none"] == pytest.approx(math.exp(r["nll,none"]), rel=1e-9)
    assert r["bits_per_byte,none"] == pytest.approx(math.log2(r["byte_perplexity,none"]), rel=1e-9)


@functools.cache
def _ppl_run(assets_root: str, task: str):
    """(lm-eval's rope_ppl results, its documents) of the rope_patch model on the tiny assets."""
    from pathlib import Path

    assets = {"model": Path(assets_root) / "model", "heldout": Path(assets_root) / "heldout.txt"}
    res = evaluate("rope_patch", [task], assets, model_args={"pretrained": str(assets["model"])},
                   meta={"ppl_tokens": 512})
    return res["results"][task], [s["doc"] for s in by_doc(res["samples"][task])]


@pytest.mark.parametrize("task", ["rope_ppl_64", "rope_ppl_128"])
@pytest.mark.parametrize("metric, formula", [
    ("token_perplexity", lambda nll, n, words, n_bytes: math.exp(nll / n)),
    ("word_perplexity", lambda nll, n, words, n_bytes: math.exp(nll / words)),
    ("byte_perplexity", lambda nll, n, words, n_bytes: math.exp(nll / n_bytes)),
    ("bits_per_byte", lambda nll, n, words, n_bytes: nll / n_bytes / math.log(2)),
])
def test_ppl_metrics_equal_a_direct_computation(assets, task, metric, formula):
    """Each window's log-likelihood covers its tokens after the first (scored from position 0, as compare): the
    word and byte counts are of that same text, the window's decoded tokens 1..L-1 (not of its whole text, which
    made word perplexity and bits per byte low by up to 1/L)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    got, docs = _ppl_run(str(assets["root"]), task)
    tok = AutoTokenizer.from_pretrained(str(assets["model"]))
    model = AutoModelForCausalLM.from_pretrained(str(assets["model"]), dtype=torch.float32).eval()
    nll = n = words = n_bytes = 0
    for doc in docs:
        ids = torch.tensor([doc["input_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].double()
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        text = tok.decode(doc["input_ids"][1:])  # what the L-1 predictions spell
        n, words, n_bytes = n + ids.shape[1] - 1, words + len(text.split()), n_bytes + len(text.encode("utf-8"))
    assert len(docs) == 512 // int(task.rsplit("_", 1)[1])
    assert got[f"{metric},none"] == pytest.approx(formula(nll, n, words, n_bytes), rel=1e-5)


RULER_OFFLINE = ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe"]


@pytest.mark.slow
def test_ruler_offline_tasks_run(tmp_path_factory):
    """The six RULER tasks that generate their data locally run offline on a tiny model (nltk's punkt_tab download
    fails offline and is not needed by them). RULER needs a tokenizer with a realistic vocabulary (its template and
    128 reserved tokens must fit), and its cwe task breaks below ~2k tokens upstream: 4,000 BPE tokens, 2048."""
    import os

    from helpers.lm_eval import REPO, tiny_llama
    from helpers.text import bpe_tokenizer as train_tokenizer

    held = REPO / "rope_patch" / "data" / "heldout.txt"  # package data: always there
    root = tmp_path_factory.mktemp("ruler")
    tok = train_tokenizer(held.read_text(encoding="utf-8"), vocab_size=4000)
    tiny_llama(tok).save_pretrained(root)
    tok.save_pretrained(root)
    ruler = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "ruler")
    res = evaluate("rope_patch", RULER_OFFLINE, {"model": root, "heldout": held},
                   model_args={"pretrained": str(root), "max_length": 2048},
                   meta={"max_seq_lengths": [2048]}, include_path=ruler, limit=1)
    for task in RULER_OFFLINE:
        assert "2048,none" in res["results"][task], (task, res["results"][task])
        (sample,) = res["samples"][task]  # limit=1: one document, generated from, scored
        assert isinstance(sample["resps"][0][0], str) and sample["target"], (task, sample.keys())
        assert len(tok(sample["arguments"][0][0]).input_ids) <= 2048, task


def test_text_path_runs_and_is_close(assets):
    """exact_tokens=false (what any other lm-eval model does): the documents' text through HFLM's own generate /
    rolling loglikelihood. Not identical (re-encoding; rolling also scores the first token from BOS), but close."""
    args = {"pretrained": str(assets["model"]), "scheme": "yarn", "factor": 2}
    tasks = ["rope_passkey_128", "rope_ppl_128"]
    text = evaluate("rope_patch", tasks, assets, model_args={**args, "exact_tokens": False, "max_length": 256})
    exact = evaluate("rope_patch", tasks, assets, model_args=args)
    acc, n = text["results"]["rope_passkey_128"]["acc,none"], len(text["samples"]["rope_passkey_128"])
    assert n == len(exact["samples"]["rope_passkey_128"]) > 0 and abs(acc * n - round(acc * n)) < 1e-9  # k of n right
    a = text["results"]["rope_ppl_128"]["byte_perplexity,none"]
    b = exact["results"]["rope_ppl_128"]["byte_perplexity,none"]
    assert a != b and abs(a / b - 1) < 0.2
