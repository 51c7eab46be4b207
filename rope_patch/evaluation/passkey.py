"""Passkey retrieval: a random 5-digit number hidden in filler text, to be recalled at the end.

The task follows Mohtashami & Jaggi, "Landmark Attention: Random-Access Infinite Context Length for
Transformers" (2023, arXiv:2305.16300), the passkey retrieval test later used by Position
Interpolation (Chen et al. 2023), YaRN (Peng et al. 2023) and LongLoRA to show whether a model can still *use* a
position it was never trained on. A prompt is

    <filler> The pass key is 48213. Remember it. 48213 is the pass key. <filler> What is the pass key? The pass key is

and the model is right when the first number it generates is the key. The question ends with the answer's lead-in
(``LEAD_IN``, " The pass key is"), so the next thing to say is the key. Two departures from the paper, both
deliberate:

- The filler is real prose (a random stretch of a given text) instead of the repeated "The grass is green. The sky
  is blue. ..." lines: a language model trained on prose is then tested on in-distribution text, and it cannot
  solve the task by spotting the one sentence that breaks a repetition. The paper's own filler is one call away
  (``noise_filler``, ``haystack="noise"`` in `rope-patch compare` and `tune`): a small model that cannot find a key
  in prose even inside its window may still find it there, which is what RULER's ``niah_single_1`` measures too.
- The needle sits at an exact ``depth`` (0 = start, 1 = end of the filler) so that accuracy can be swept over
  depth as in the "needle in a haystack" plots, and the prompt is exactly ``length_tokens`` tokens long, measured
  in the model's own tokens, so that lengths can be set relative to its training window.

Everything random comes from the ``random.Random`` passed in, never from the global generator: the same seed
gives the same samples for training-data mixing (``recipes/pretrain_tiny.py``) and for evaluation, whatever else
the process draws.

Chat models (``chat_template``): the haystack, needle and question are the user turn of the tokenizer's own chat
template, and the lead-in opens the assistant turn, after its assistant prefix (``apply_chat_template(messages,
add_generation_prompt=True)``), where the model's own answer would start:

    <|im_start|>user\n<filler> ... <filler> What is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is

That is where RULER's prompts put theirs (lm-eval's ``gen_prefix``). A lead-in that closes the user turn instead
reads as part of the question: SmolLM2-135M-Instruct then explains what a pass key is (0/3 at 4k in the paper's
haystack) and answers 3/3 on the same prompts with the lead-in in its own turn (eval/smollm2/leadin_check.py;
``PROMPT_FORMS`` names both, and results record which one they used). The prompt is still exactly ``length_tokens``
tokens, the template's included (the haystack is shortened by them), and ``depth`` is a fraction of the haystack,
not of the templated prompt. An instruction-tuned model asked without its template often rambles instead of
answering.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

NEEDLE = " The pass key is {passkey}. Remember it. {passkey} is the pass key."
# Mohtashami & Jaggi's filler line, repeated with a space between copies as in their code (Landmark Attention)
NOISE = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HAYSTACKS = ("prose", "noise")  # the held-out text, or NOISE
QUESTION = " What is the pass key?"
# the answer's opening: the prompt's last words (with a chat template, the assistant's first)
LEAD_IN = " The pass key is"
# How a prompt was laid out, as results record it (`prompt_form`): no template; the template with the lead-in opening
# the assistant turn (today's); the template with the lead-in closing the user turn (results before 2026-12-02).
PROMPT_FORMS = ("plain", "chat", "chat-lead-in-in-user-turn")
_FIRST_NUMBER = re.compile(r"\d+")


_CONTENT = "\x00rope-patch-user-turn\x00"  # stands in for the user turn while the template is rendered
CHAT_TEMPLATE_MODES = ("auto", "on", "off")


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat_template(tokenizer, mode: str | bool | None) -> bool:
    """Resolve ``--chat-template auto|on|off`` (or a bool) for this tokenizer: auto is on when it has a template.

    Raises ValueError for an unknown mode, and for "on" with a tokenizer that has no template."""
    if isinstance(mode, bool):
        mode = "on" if mode else "off"
    mode = "auto" if mode is None else str(mode).lower()
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"chat_template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {mode!r}.")
    if mode == "on" and not has_chat_template(tokenizer):
        raise ValueError("chat_template='on' was asked for, but this tokenizer has no chat template "
                         "(tokenizer.chat_template is empty): use 'auto' or 'off', or a tokenizer that ships one.")
    return mode == "on" or (mode == "auto" and has_chat_template(tokenizer))


def prompt_form(chat_template: bool) -> str:
    """The `PROMPT_FORMS` entry of the prompts `make_passkey_sample` builds with this `chat_template` flag."""
    return "chat" if chat_template else "plain"


def chat_wrap(tokenizer) -> tuple[list[int], list[int]]:
    """Token ids before and after the user turn in the tokenizer's chat template, with the assistant prefix
    (``apply_chat_template([{"role": "user", ...}], add_generation_prompt=True)``), each part tokenized on its
    own so that the user turn's ids are exactly the haystack's."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _CONTENT}], add_generation_prompt=True,
                                         tokenize=False)
    if text.count(_CONTENT) != 1:
        raise ValueError("The tokenizer's chat template does not render the user turn's content once; it cannot "
                         "frame a passkey prompt. Use chat_template='off'.")
    before, after = text.split(_CONTENT)
    return _encode(tokenizer, before), _encode(tokenizer, after)


def make_passkey_sample(
    tokenizer,
    filler: str | Sequence[int],
    length_tokens: int,
    depth: float,
    rng: random.Random,
    *,
    add_bos: bool = True,
    chat_template: bool = False,
    filler_start: int | None = None,
) -> dict:
    """Build one passkey prompt of exactly ``length_tokens`` tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``encode(text, add_special_tokens=False)`` and
            ``bos_token_id``).
        filler: the haystack, as text or as token ids of that text. A random contiguous stretch of it (chosen by
            ``rng``) fills the prompt; pass token ids when building many samples, to tokenize the text only once.
        length_tokens: total prompt length in tokens, BOS and question included.
        depth: where the needle goes, as a fraction of the filler: 0.0 puts it right after BOS, 1.0 right before
            the question.
        rng: the only source of randomness (the passkey and the filler offset).
        add_bos: start the prompt with ``tokenizer.bos_token_id`` (when the tokenizer has one), as the model saw
            at the start of its training documents (with ``chat_template`` the template decides).
        chat_template: frame the prompt with the tokenizer's chat template (module docstring): its tokens count
            in ``length_tokens``; ``depth`` stays a fraction of the haystack.
        filler_start: take the haystack from this offset of the filler instead of a random one (``rng`` then
            draws only the key): prompts of one cell built with one offset share the haystack before the needle.

    Returns:
        ``prompt_ids`` (list of ``length_tokens`` ids), ``answer`` (the key as a 5-digit string), ``answer_ids``
        (the tokens of `` <answer>``, i.e. what a model should generate after the prompt, for training targets),
        ``passkey`` (int), ``depth``, ``needle_start`` and ``needle_end`` (token span of the needle in the prompt),
        ``haystack_start`` / ``haystack_end`` (the span of the haystack with the needle in it, i.e. the user turn
        without the question) and ``filler_start``.

    Raises:
        ValueError: when ``depth`` is outside [0, 1], or when ``length_tokens`` cannot hold the needle and the
            question, or the filler is shorter than the stretch needed.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    filler_ids = _encode(tokenizer, filler) if isinstance(filler, str) else filler
    passkey = rng.randint(10000, 99999)
    if chat_template:
        bos, header = chat_wrap(tokenizer)
        # the lead-in opens the assistant turn (module docstring); tokenized on its own, as the model's first words
        question, tail = _encode(tokenizer, QUESTION), header + _encode(tokenizer, LEAD_IN.lstrip())
    else:
        bos = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
        question, tail = _encode(tokenizer, QUESTION + LEAD_IN), []
    needle = _encode(tokenizer, NEEDLE.format(passkey=passkey))

    n_filler = length_tokens - len(bos) - len(needle) - len(question) - len(tail)
    if n_filler < 0:
        raise ValueError(
            f"length_tokens={length_tokens} is too short: the needle and question alone take "
            f"{len(bos) + len(needle) + len(question) + len(tail)} tokens"
            + (" with the chat template" if chat_template else "")
        )
    if n_filler > len(filler_ids):
        raise ValueError(f"filler has {len(filler_ids)} tokens, a {length_tokens}-token prompt needs {n_filler}")

    if filler_start is None:
        start = rng.randint(0, len(filler_ids) - n_filler)
    else:
        start = min(int(filler_start), len(filler_ids) - n_filler)
    haystack = list(filler_ids[start : start + n_filler])
    # The needle lands on a token boundary of the filler, possibly inside a word; at these lengths that shifts
    # the depth by less than one token, and it keeps the prompt length exact.
    at = round(depth * n_filler)
    prompt_ids = bos + haystack[:at] + needle + haystack[at:] + question + tail
    needle_start = len(bos) + at
    return {
        "prompt_ids": prompt_ids,
        "answer": str(passkey),
        "answer_ids": _encode(tokenizer, f" {passkey}"),
        "passkey": passkey,
        "depth": depth,
        "needle_start": needle_start,
        "needle_end": needle_start + len(needle),
        "haystack_start": len(bos),
        "haystack_end": len(bos) + n_filler + len(needle),
        "filler_start": start,
    }


def noise_filler(tokenizer, n_tokens: int) -> list[int]:
    """At least `n_tokens` token ids of NOISE repeated, tokenized as one text (what the repeated lines are in a
    prompt, token merges across the line breaks included)."""
    copies = n_tokens // max(1, len(_encode(tokenizer, NOISE))) + 2
    ids = _encode(tokenizer, NOISE * copies)
    while len(ids) < n_tokens:  # tokens that merge across copies make a copy shorter in the repetition
        copies *= 2
        ids = _encode(tokenizer, NOISE * copies)
    return ids


def check_haystack(haystack: str) -> None:
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown passkey haystack {haystack!r}: use one of {', '.join(HAYSTACKS)} (prose: the "
                         "held-out text; noise: the paper's repeated lines).")


def haystack_filler(tokenizer, haystack: str, prose_ids: Sequence[int], n_tokens: int) -> Sequence[int]:
    """The filler a passkey prompt takes its haystack from: the held-out text's `prose_ids`, or `n_tokens` (the
    longest prompt) of NOISE."""
    check_haystack(haystack)
    return prose_ids if haystack == "prose" else noise_filler(tokenizer, n_tokens)


def score_passkey(generated_text: str, answer: str) -> bool:
    """True when the first number in ``generated_text`` is exactly ``answer``.

    Only the first number counts, so a model that rambles on after the key is not penalised, and one that
    names a different number first is not rewarded for mentioning the right one later. ``"482130"`` is wrong for
    ``"48213"``: the whole number must match.
    """
    match = _FIRST_NUMBER.search(generated_text)
    return match is not None and match.group() == answer
