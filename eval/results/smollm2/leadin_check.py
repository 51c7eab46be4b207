"""Why SmolLM2-135M-Instruct fails the templated passkey: where the answer's lead-in sits.

`rope-patch compare --chat-template on` puts the whole question, " What is the pass key? The pass key is", in the
user turn, and the model answers after the assistant header; RULER's lm-eval tasks instead end the user turn with
the question and start the assistant turn with the lead-in (their `gen_prefix`). This builds three 4k passkey
prompts in the passkey paper's haystack (depths 0.1 / 0.5 / 0.9, seeds 0-2) and answers each both ways, greedy,
8 new tokens. Not a results file: one measurement that points at the prompt, ~3 min at 1 thread.

    OMP_NUM_THREADS=1 python eval/results/smollm2/leadin_check.py
"""

from __future__ import annotations

import random

import torch

from rope_patch.evaluation import passkey as P
from rope_patch.evaluation.retrieval import greedy_generate
from rope_patch.zoo import load_model

LENGTH, DEPTHS, NEW = 4096, (0.1, 0.5, 0.9), 8


def main() -> None:
    model, tok = load_model("smollm2")
    filler = P.noise_filler(tok, LENGTH)
    lead = P._encode(tok, " The pass key is")
    _, tail = P.chat_wrap(tok)
    right = {"user turn": 0, "assistant turn": 0}
    for seed, depth in enumerate(DEPTHS):
        s = P.make_passkey_sample(tok, filler, LENGTH, depth, random.Random(seed), chat_template=True)
        ids, end = s["prompt_ids"], len(s["prompt_ids"]) - len(tail)
        assert ids[end - len(lead):end] == lead, "the lead-in is not a token suffix of the question"
        # the same prompt with the lead-in moved after the assistant header (the haystack loses nothing)
        moved = ids[: end - len(lead)] + tail + P._encode(tok, "The pass key is")
        for where, x in (("user turn", ids), ("assistant turn", moved)):
            answer = tok.decode(greedy_generate(model, torch.tensor([x]), NEW)[0])
            right[where] += P.score_passkey(answer, s["answer"])
            print(f"depth {depth}: key {s['answer']}, lead-in in the {where}: {answer!r}", flush=True)
    print("; ".join(f"lead-in in the {k}: {v}/{len(DEPTHS)}" for k, v in right.items()))


if __name__ == "__main__":
    main()
