"""lm-eval's own `--apply_chat_template` passes through `rope-patch-lm-eval` and reaches the rope_* prompts: the
templated prompt is what the model sees (the documents' raw token ids are then not used). `rope-patch compare` has
no NIAH measurement of its own: NIAH runs through these lm-eval tasks, so lm-eval's flag is its chat-template switch."""

from __future__ import annotations

import re
import sys
import warnings

import pytest
from helpers.lm_eval import by_doc, evaluate


def test_the_flag_passes_through(monkeypatch, assets):
    from lm_eval._cli import HarnessCLI

    from rope_patch.integrations.lm_eval.cli import adjust

    for argv, expected in ((["--apply_chat_template"], True), ([], False)):
        monkeypatch.setattr(sys, "argv", ["rope-patch-lm-eval", "--model", "rope_patch", "--model_args",
                                          f"pretrained={assets['model']}", "--tasks", "rope_passkey_128", *argv])
        args = HarnessCLI().parse_args()
        adjust(args)
        assert bool(getattr(args, "apply_chat_template", False)) is expected  # absent when not given


def _run(assets, chat_model, monkeypatch, task, apply, built):
    """(lm-eval's prompts, the ids the exact-token path generated from, the texts HFLM's text path got) of a run with
    --apply_chat_template `apply` on documents built with metadata chat_template `built`."""
    import rope_patch.evaluation.retrieval as retrieval

    exact, texts = [], []
    monkeypatch.setattr(retrieval, "greedy_generate", lambda m, ids, new: exact.extend(ids.tolist()) or ids[:, :new])
    from lm_eval.models.huggingface import HFLM

    def text_path(self, requests, disable_tqdm=False):
        texts.extend(r.args[0] for r in requests)
        return ["" for _ in requests]

    monkeypatch.setattr(HFLM, "generate_until", text_path)
    res = evaluate("rope_patch", [task], assets, model_args={"pretrained": str(chat_model)},
                   apply_chat_template=apply, meta={"samples": 1, "tokenizer": str(chat_model), "chat_template": built})
    return [s["arguments"][0][0] for s in by_doc(res["samples"][task])], exact, texts


@pytest.mark.parametrize("task", ["rope_passkey_128", "rope_niah_256"])
@pytest.mark.parametrize("apply", [True, False])
def test_templated_prompts_reach_the_model(assets, chat_model, monkeypatch, apply, task):
    """Documents built for the way they are read (metadata chat_template = --apply_chat_template, as
    rope-patch-lm-eval and the sweep set it): the model reads the documents' exact ids, which spell lm-eval's
    prompt, templated or not."""
    prompts, exact, texts = _run(assets, chat_model, monkeypatch, task, apply, apply)
    assert len(prompts) == 3
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    assert texts == [] and [tok.decode(ids, skip_special_tokens=False) for ids in exact] == prompts
    if apply:
        lead = "The pass key is" if "passkey" in task else "The special magic number for "
        assert all(p.startswith("<|bos|>user\n") and f"<|bos|>assistant\n{lead}" in p for p in prompts)
        assert all(p.endswith(" is") and p.count("<|bos|>assistant") == 1 for p in prompts)  # the lead-in opens it
        # no BOS inside the user turn: the template has its own opening (two <|bos|>: the user's and the assistant's)
        assert all(not p.startswith("<|bos|>user\n<|bos|>") and p.count("<|bos|>") == 2 for p in prompts)
    else:  # plain prompts: the documents' exact ids, as rope-patch compare
        assert not any("assistant" in p for p in prompts)


@pytest.mark.parametrize("task, length", [("rope_passkey_128", 128), ("rope_niah_256", 256)])
@pytest.mark.parametrize("apply, built, exact_path", [
    (True, True, True),     # rope-patch-lm-eval / sweep with --apply_chat_template: the template's tokens counted
    (False, False, True),   # plain
    (True, False, False),   # plain documents under a template (lm-eval alone): longer than stated, said loudly
    (False, True, False),   # chat documents without a template: shorter than stated, said loudly
])
def test_a_templated_prompt_is_the_length_in_the_task_name(assets, chat_model, monkeypatch, task, length, apply,
                                                          built, exact_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prompts, exact, texts = _run(assets, chat_model, monkeypatch, task, apply, built)
    lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    said = [str(w.message) for w in caught if re.search(rf"prompt is ({'|'.join(map(str, lengths))}) tokens, not the "
                                                         rf"task's {length}:", str(w.message))]
    if exact_path:
        assert lengths == [length] * 3 and [len(ids) for ids in exact] == [length] * 3 and texts == []
        assert said == []
    else:
        assert all(n != length for n in lengths) and exact == [] and texts == prompts
        assert len(said) == 1 and "--metadata chat_template=true exactly when you pass --apply_chat_template" in said[0]


@pytest.mark.parametrize("argv, metadata, expected", [
    (["--apply_chat_template"], None, True),
    ([], None, False),
    (["--apply_chat_template"], "chat_template=true", True),
    (["--apply_chat_template"], "chat_template=false", "disagrees with --apply_chat_template given"),
    ([], "chat_template=true", "disagrees with --apply_chat_template not given"),
])
def test_the_entry_point_builds_documents_for_the_flag(monkeypatch, assets, argv, metadata, expected):
    from lm_eval._cli import HarnessCLI

    from rope_patch.integrations.lm_eval.cli import adjust, check_chat_layout

    monkeypatch.setattr(sys, "argv", ["rope-patch-lm-eval", "--model", "rope_patch", "--model_args",
                                      f"pretrained={assets['model']}", "--tasks", "rope_passkey_128,rope_ppl_128",
                                      *argv, *(["--metadata", metadata] if metadata else [])])
    args = HarnessCLI().parse_args()
    adjust(args)
    error = check_chat_layout(args)
    if isinstance(expected, bool):
        assert error is None and str(args.metadata["chat_template"]).lower() == str(expected).lower()
    else:
        assert expected in error and "rope_passkey_128" in error and "rope_ppl" not in error


def _request(tok, doc: dict, templated: bool, task: str):
    """lm-eval's generate_until request for `doc`, its prompt rendered with the chat template or not, as
    --cache_requests gives it back: built elsewhere, no apply_chat_template call on the model reading it."""
    from lm_eval.api.instance import Instance

    if templated:
        turn = doc["text"][len(tok.bos_token):] if doc["text"].startswith(tok.bos_token) else doc["text"]
        context = tok.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                          tokenize=False) + doc["lead_in"]
    else:
        context = f"{doc['text']} {doc['lead_in']}"
    return Instance(request_type="generate_until", doc=doc, arguments=(context, {}), idx=0, metadata=(task, 0, 1))


@pytest.mark.parametrize("build", ["passkey_dataset", "niah_dataset"])
@pytest.mark.parametrize("built, templated, earlier_template, warns", [
    (True, True, False, False),   # --cache_requests: templated prompts loaded without apply_chat_template
    (False, True, False, True),   # cached plain documents under a template (lm-eval's cache key ignores metadata)
    (False, False, True, False),  # one model object, a templated run before a plain one
    (True, False, True, True),    # ... and chat documents read without a template after a templated run
    (True, True, True, False),
    (False, False, False, False),
])
def test_the_layout_warning_is_read_from_each_prompt(assets, chat_model, monkeypatch, build, built, templated,
                                                     earlier_template, warns):
    """The chat-layout warning follows the prompt it is about, not whether this model object ever rendered a
    template: with --cache_requests lm-eval loads rendered prompts without calling apply_chat_template."""
    import rope_patch.evaluation.retrieval as retrieval
    from rope_patch.data.tasks.rope import rope_tasks_utils as U
    from rope_patch.integrations.lm_eval.model import RopePatchLM

    exact = []
    monkeypatch.setattr(retrieval, "greedy_generate", lambda m, ids, new: exact.extend(ids.tolist()) or ids[:, :new])
    from lm_eval.models.huggingface import HFLM

    monkeypatch.setattr(HFLM, "generate_until", lambda self, requests, disable_tqdm=False: ["" for _ in requests])
    length = 128 if build == "passkey_dataset" else 256
    doc = getattr(U, build)(tokenizer=str(chat_model), heldout=str(assets["heldout"]), length=length, samples=1,
                            depths=[0.5], chat_template=built)["test"][0]
    lm = RopePatchLM(pretrained=str(chat_model))
    if earlier_template:
        lm.apply_chat_template([{"role": "user", "content": "an earlier run's prompt"}])
    req = _request(lm.tokenizer, doc, templated, "rope_task")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm.generate_until([req])
    said = [str(w.message) for w in caught if f"not the task's {length}:" in str(w.message)]
    assert len(said) == int(warns)
    assert exact == ([doc["prompt_ids"]] if built == templated else [])  # the prompt is the ids' text: read from them
    if warns:
        assert ("lm-eval wrapped it in one" if templated else "lm-eval applied none") in said[0]


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), (" TRUE ", True), ("yes", True), ("On", True), (True, True), (1, True),
    ("0", False), ("false", False), ("off", False), ("no", False), ("", False), (False, False), (0, False),
])
def test_one_reading_of_the_chat_template_metadata(chat_model, value, expected):
    """The tasks, rope-patch-lm-eval and the sweep read metadata chat_template the same way (`metadata_flag`), and
    refuse a disagreeing one with the same message (`chat_layout_error`)."""
    from types import SimpleNamespace

    import rope_patch.integrations.lm_eval.sweep as S
    from rope_patch.data.tasks.rope import rope_tasks_utils as U
    from rope_patch.integrations.lm_eval.cli import check_chat_layout
    from rope_patch.integrations.lm_eval.tasks import chat_layout_error, metadata_flag

    assert metadata_flag(value) is expected
    assert U._chat({"chat_template": value}, U.load_tokenizer(str(chat_model))) is expected
    for applied in (True, False):
        args = SimpleNamespace(command="run", tasks=["rope_passkey_128"], metadata={"chat_template": value},
                               apply_chat_template=applied)
        error = check_chat_layout(args)
        assert (error is None) is (expected is applied)
        swept = chat_layout_error(value, applied, "--chat-template x", "rope_passkey_128")
        assert (swept is None) is (expected is applied)
        if error:  # one message: only the flag's name differs
            assert error.split(" (prompts ")[1] == swept.split(" (prompts ")[1]
    assert S.chat_layout_error is chat_layout_error


@pytest.mark.parametrize("chat", [True, False])
def test_niah_new_tokens_are_retrievals(assets, chat_model, chat):
    """rope_niah's max_new_tokens are `retrieval.new_tokens` with the niah lead-ins (one per asked key): the answer's
    tokens + 1, plus the longest lead-in's with a chat template."""
    from rope_patch.data.tasks.rope import rope_tasks_utils as U
    from rope_patch.evaluation.retrieval import new_tokens

    tok = U.load_tokenizer(str(chat_model))
    rows = U.niah_dataset(tokenizer=str(chat_model), heldout=str(assets["heldout"]), length=256, samples=3,
                          depths=[0.5], chat_template=chat)["test"]
    answers = max(len(tok.encode(f" {r['answer']}", add_special_tokens=False)) for r in rows)
    leads = max(len(tok.encode(U.NIAH_LEAD_IN.format(key=r["key"]), add_special_tokens=False)) for r in rows)
    assert {r["max_new_tokens"] for r in rows} == {answers + 1 + (leads if chat else 0)}
    cell = [{"answer_ids": tok.encode(f" {r['answer']}", add_special_tokens=False), "key": r["key"]} for r in rows]
    assert new_tokens(tok, cell, chat, lambda s: U.NIAH_LEAD_IN.format(key=s["key"])) == answers + 1 + (
        leads if chat else 0)
    assert new_tokens(tok, cell, chat, " The pass key is") == new_tokens(tok, cell, chat)  # a string: passkey's
