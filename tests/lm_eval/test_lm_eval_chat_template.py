"""lm-eval's own `--apply_chat_template` passes through `rope-patch-lm-eval` and reaches the rope_* prompts: the
templated prompt is what the model sees (the documents' raw token ids are then not used). `rope-patch compare` has
no NIAH measurement of its own: NIAH runs through these lm-eval tasks, so lm-eval's flag is its chat-template switch."""

from __future__ import annotations

import sys

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


@pytest.mark.parametrize("task", ["rope_passkey_128", "rope_niah_256"])
@pytest.mark.parametrize("apply", [True, False])
def test_templated_prompts_reach_the_model(assets, chat_model, monkeypatch, apply, task):
    import rope_patch.evaluation.retrieval as retrieval

    exact, texts = [], []
    monkeypatch.setattr(retrieval, "greedy_generate", lambda m, ids, new: exact.append(ids) or ids[:, :new])
    from lm_eval.models.huggingface import HFLM

    def text_path(self, requests, disable_tqdm=False):
        texts.extend(r.args[0] for r in requests)
        return ["" for _ in requests]

    monkeypatch.setattr(HFLM, "generate_until", text_path)
    res = evaluate("rope_patch", [task], assets, model_args={"pretrained": str(chat_model)},
                   apply_chat_template=apply, meta={"samples": 1, "tokenizer": str(chat_model)})
    prompts = [s["arguments"][0][0] for s in by_doc(res["samples"][task])]
    assert len(prompts) == 3
    if apply:  # lm-eval templated the text: the raw ids no longer match it, so the model reads the templated text
        lead = "The pass key is" if "passkey" in task else "The special magic number for "
        assert all(p.startswith("<|bos|>user\n") and f"<|bos|>assistant\n{lead}" in p for p in prompts)
        assert all(p.endswith(" is") and p.count("<|bos|>assistant") == 1 for p in prompts)  # the lead-in opens it
        # the documents' BOS (their text is their ids', BOS first) is not put inside the user turn: the template has
        # its own opening (two <|bos|>: the user's turn and the assistant's)
        assert all(not p.startswith("<|bos|>user\n<|bos|>") and p.count("<|bos|>") == 2 for p in prompts)
        assert texts == prompts and exact == []
    else:  # plain prompts: the documents' exact ids, as rope-patch compare
        assert not any("assistant" in p for p in prompts)
        assert texts == [] and len(exact) == 3
