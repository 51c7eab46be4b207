"""Why SmolLM2-135M-Instruct fails the templated passkey: where the answer's lead-in sits.

Until 2026-12-02 `rope-patch compare --chat-template on` put the whole question, " What is the pass key? The pass key
is", in the user turn, and the model answered after the assistant header. RULER's lm-eval tasks instead end the user
turn with the question and start the assistant turn with the lead-in (their `gen_prefix`), and so does `compare`
now (`passkey.PROMPT_FORMS`). This builds three 4k passkey prompts in the passkey paper's haystack (depths 0.1 /
0.5 / 0.9, seeds 0-2) and answers each both ways, greedy, 8 new tokens. Not a results file: the measurement that
moved the prompt, ~3 min at 1 thread.

    OMP_NUM_THREADS=1 python eval/smollm2/leadin_check.py
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
    lead = P._encode(tok, P.LEAD_IN.strip())
    _, header = P.chat_wrap(tok)
    right = {"user turn": 0, "assistant turn": 0}
    for seed, depth in enumerate(DEPTHS):
        s = P.make_passkey_sample(tok, filler, LENGTH, depth, random.Random(seed), chat_template=True)
        ids = s["prompt_ids"]  # today's prompt: the lead-in opens the assistant turn
        end = len(ids) - len(header) - len(lead)
        assert ids[end:] == header + lead, "the prompt does not end with the assistant header and the lead-in"
        # the same prompt with the lead-in closing the user turn instead (the haystack loses nothing)
        moved = ids[:end] + P._encode(tok, P.LEAD_IN) + header
        for where, x in (("user turn", moved), ("assistant turn", ids)):
            answer = tok.decode(greedy_generate(model, torch.tensor([x]), NEW)[0])
            right[where] += P.score_passkey(answer, s["answer"])
            print(f"depth {depth}: key {s['answer']}, lead-in in the {where}: {answer!r}", flush=True)
    print("; ".join(f"lead-in in the {k}: {v}/{len(DEPTHS)}" for k, v in right.items()))


if __name__ == "__main__":
    main()
