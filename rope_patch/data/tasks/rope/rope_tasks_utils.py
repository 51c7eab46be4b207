"""Offline, deterministic long-context tasks for lm-eval: `rope_passkey_{L}`, `rope_ppl_{L}`, `rope_niah_{L}`.

Shipped as package data; `rope-patch-lm-eval` adds `--include_path` for them when it is missing. Every
document is generated here from the held-out text and a seed, measured in the model's own tokens: the tokenizer
comes from the model arguments (`pretrained`: `tiny`, `smollm2` or a folder), or from `--metadata tokenizer=...`.

Settings (`--metadata key=value ...` or a JSON object; defaults are those of `rope-patch compare`):

| key | default | meaning |
| --- | --- | --- |
| `depths` | compare's ([0.1, 0.5, 0.9]) | needle depths (passkey, niah) |
| `samples` | compare's (4) | prompts per (length, depth) cell (passkey, niah) |
| `seed` | compare's (0) | passkey / niah seed (the cell seeds of `rope_patch.evaluation.retrieval.cell_seed`) |
| `heldout` | rope_patch/data/heldout.txt | the text: filler, haystack, perplexity windows |
| `haystack` | prose | passkey / niah haystack: `prose` (the held-out text) or `noise` (the passkey paper's repeated lines, `passkey.NOISE`), as `rope-patch compare --haystack` |
| `ppl_tokens` | `windows` x max(L, 2048) | tokens of the text read at length L, as `rope-patch compare` reads them (`perplexity.scored_tokens`) |
| `windows` | compare's `windows_at_longest` | perplexity windows (of 2048 tokens' worth, or of L beyond) when `ppl_tokens` is not given |
| `niah_keys` | 4 | needles per niah prompt (one asked, the others distractors) |
| `chat_template` | false | passkey / niah prompts framed by the tokenizer's chat template, the template's tokens counted in the length, as `rope-patch compare --chat-template on`; for lm-eval's `--apply_chat_template` (`rope-patch-lm-eval` and `rope-patch sweep` set it with the flag) |
| `lengths` | - | only read by `rope-patch-lm-eval`, which expands `rope_passkey` / `rope_ppl` / `rope_niah` into these lengths |

Passkey prompts come from `rope_patch.evaluation.passkey.make_passkey_sample` through `retrieval.make_cell`: the
samples of `rope-patch compare` with the same seed, depths and sample count. Perplexity windows are
`rope_patch.evaluation.perplexity.windows`. Documents carry their token ids (`prompt_ids` / `input_ids`): the
`rope_patch` model evaluates those ids (see rope_patch/integrations/lm_eval/model.py); other models read `text`.

The answer's lead-in ("The pass key is", "The special magic number for KEY is") is lm-eval's `gen_prefix` (the
`lead_in` field), not part of `text`: lm-eval joins them with a space in a plain prompt, which gives back exactly the
prompt the ids spell, and with `--apply_chat_template` opens the assistant turn with it, where RULER's tasks put
theirs and where `rope-patch compare --chat-template on` puts it (`rope_patch.evaluation.passkey`).

Chat templates: lm-eval renders the template around `text` after the documents are built, so a plain document
(`chat_template` false) read under `--apply_chat_template` is the length in the task's name *plus* the template's
tokens (about 29 more on SmolLM2). With `chat_template` true the documents are compare's chat prompts: `prompt_ids`
is the whole templated prompt, exactly the stated length (the haystack is shortened by the template's tokens), and
`text` is its user turn, so lm-eval's templated prompt is the text of those ids. Give both or neither.
"""  # noqa: E501 (markdown table rows cannot wrap)

from __future__ import annotations

import functools
import random
from pathlib import Path

import datasets

from rope_patch.evaluation.passkey import LEAD_IN, chat_wrap, haystack_filler, score_passkey, use_chat_template
from rope_patch.evaluation.retrieval import cell_seed, make_cell, new_tokens
from rope_patch.integrations.lm_eval.tasks import metadata_flag

NIAH_KEYS = ("apple", "river", "garden", "window", "letter", "carriage", "horse", "candle", "mirror", "ribbon",
             "orchard", "compass", "lantern", "meadow", "violin", "harbour", "feather", "teacup", "bonnet", "saddle")
NIAH_NEEDLE = " The special magic number for {key} is {value}."
NIAH_QUESTION = " What is the special magic number for {key}?"
NIAH_LEAD_IN = " The special magic number for {key} is"
_NIAH_SALT = 7919  # keeps niah cells independent of the passkey cells of the same seed


@functools.cache
def compare_defaults() -> dict:
    """`rope-patch compare`'s defaults (read from `run_compare`, so the two cannot drift apart)."""
    import inspect

    from rope_patch.evaluation.compare import run_compare

    p = inspect.signature(run_compare).parameters
    return {"samples": p["passkey_samples"].default, "windows": p["windows_at_longest"].default,
            "seed": p["seed"].default, "depths": list(p["depths"].default)}


# ---- settings ------------------------------------------------------------------------------------------------------
def _list(value, cast):
    if isinstance(value, str):
        value = [v for v in value.replace("/", ",").replace("[", "").replace("]", "").split(",") if v.strip()]
    if isinstance(value, (int, float)):
        value = [value]
    return [cast(v) for v in value]


def tokenizer_spec(kw: dict) -> str:
    spec = kw.get("tokenizer") or kw.get("pretrained")
    if not isinstance(spec, str) or not spec:
        raise ValueError("The rope_* tasks build their prompts in the model's tokens and need a tokenizer: pass "
                         "--model_args pretrained=tiny|smollm2|PATH, or --metadata tokenizer=PATH.")
    return spec


@functools.cache
def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    from rope_patch.zoo import MODELS, resolve_model_path

    path = resolve_model_path(spec) if spec in MODELS or Path(spec).expanduser().exists() else spec
    return AutoTokenizer.from_pretrained(str(path))


@functools.cache
def _heldout(spec: str, heldout: str | None) -> tuple:
    from rope_patch.evaluation.common import read_tokens

    ids, _ = read_tokens(load_tokenizer(spec), heldout)
    return tuple(ids)


def _setup(kw: dict):
    spec = tokenizer_spec(kw)
    heldout = kw.get("heldout")
    return load_tokenizer(spec), list(_heldout(spec, str(heldout) if heldout else None))


def _haystack(kw: dict, tokenizer, prose_ids: list[int], length: int):
    """The passkey / niah filler: the held-out text's ids, or (metadata haystack=noise) the repeated lines."""
    return haystack_filler(tokenizer, str(kw.get("haystack", "prose")), prose_ids, length)


def _dataset(rows: list[dict]) -> dict:
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def _chat(kw: dict, tokenizer) -> bool:
    """metadata `chat_template`: build chat prompts (module docstring). "on" without a template is a ValueError."""
    return use_chat_template(tokenizer, "on") if metadata_flag(kw.get("chat_template", False)) else False


def _prompt_text(tokenizer, ids: list[int], lead_in: str, chat: bool) -> tuple[str, str | None]:
    """(`text`, `lead_in`) of a prompt: `split_lead_in` for a plain one; for a chat one (the template's opening, the
    user turn, the template's assistant prefix, the lead-in without its space), the user turn's text."""
    if not chat:
        return split_lead_in(tokenizer, ids, lead_in)
    before, header = chat_wrap(tokenizer)
    tail = header + tokenizer.encode(lead_in.lstrip(), add_special_tokens=False)
    if ids[: len(before)] != before or ids[len(ids) - len(tail):] != tail:
        raise ValueError("a chat prompt does not start with the template's opening and end with its assistant "
                         "prefix and the lead-in")
    return tokenizer.decode(ids[len(before): len(ids) - len(tail)], skip_special_tokens=False), lead_in.lstrip()


def _length(kw: dict) -> int:
    if "length" not in kw:
        raise ValueError("rope_* task YAMLs set metadata.length; this one does not.")
    return int(kw["length"])


# ---- passkey -------------------------------------------------------------------------------------------------------
def passkey_dataset(**kw) -> dict:
    tokenizer, filler = _setup(kw)
    length = _length(kw)
    filler = _haystack(kw, tokenizer, filler, length)
    d = compare_defaults()
    depths = _list(kw.get("depths", d["depths"]), float)
    n, seed = int(kw.get("samples", d["samples"])), int(kw.get("seed", d["seed"]))
    chat = _chat(kw, tokenizer)
    rows = []
    for depth in depths:
        cell = make_cell(tokenizer, filler, length, depth, n, seed, chat_template=chat)
        new = new_tokens(tokenizer, cell, chat)  # as rope-patch compare: the key's tokens + 1 (+ the lead-in's)
        for k, s in enumerate(cell):
            text, lead_in = _prompt_text(tokenizer, s["prompt_ids"], LEAD_IN, chat)
            rows.append({"text": text, "lead_in": lead_in, "prompt_ids": s["prompt_ids"], "answer": s["answer"],
                         "length": length, "depth": float(depth), "sample": k, "seed": seed, "max_new_tokens": new,
                         "chat_template": chat})
    return _dataset(rows)


def split_lead_in(tokenizer, ids: list[int], lead_in: str) -> tuple[str, str | None]:
    """(`text`, `lead_in` field) of a plain prompt `ids` whose text ends with `lead_in` (" The pass key is"): the
    text before it, and the lead-in without its space (lm-eval's target delimiter " " puts it back, so the plain
    context is exactly the text of the ids). Split on the text, not on tokens: a SentencePiece tokenizer encodes
    " The" alone as two tokens and after "?" as one. A prompt whose text does not end that way keeps its whole text
    and no lead-in (None: lm-eval then adds neither the lead-in nor a delimiter)."""
    full = tokenizer.decode(ids, skip_special_tokens=False)
    if full.endswith(lead_in):
        return full[: len(full) - len(lead_in)], lead_in.lstrip()
    return full, None


def doc_text(doc: dict) -> str:
    return doc["text"]


def doc_answer(doc: dict) -> str:
    return doc["answer"]


def retrieval_results(doc: dict, results: list[str]) -> dict:
    """Exact match of the first number generated (`rope_patch.evaluation.passkey.score_passkey`)."""
    return {"acc": float(score_passkey(results[0], doc["answer"]))}


# ---- perplexity ----------------------------------------------------------------------------------------------------
def ppl_dataset(**kw) -> dict:
    from rope_patch.evaluation.perplexity import scored_tokens, windows

    tokenizer, ids = _setup(kw)
    length = _length(kw)
    n_tokens = int(kw.get("ppl_tokens") or scored_tokens(length, len(ids), int(kw.get("windows",
                                                                                     compare_defaults()["windows"]))))
    rows = []
    for k, window in enumerate(windows(ids, length, n_tokens).tolist()):
        predicted = predicted_text(tokenizer, window)
        rows.append({"text": tokenizer.decode(window, skip_special_tokens=False), "input_ids": window,
                     "length": length, "window": k, "n_predicted": length - 1,
                     "n_words": len(predicted.split()), "n_bytes": len(predicted.encode("utf-8"))})
    return _dataset(rows)


def predicted_text(tokenizer, window: list[int]) -> str:
    """The text of the tokens a window's log-likelihood covers: every token but the first (scored from position 0,
    as `rope-patch compare`, the first token is context only), i.e. the window's text after its first token's."""
    text = tokenizer.decode(window, skip_special_tokens=False)
    first = tokenizer.decode(window[:1], skip_special_tokens=False)
    return text[len(first):] if text.startswith(first) else tokenizer.decode(window[1:], skip_special_tokens=False)


def ppl_results(doc: dict, results) -> dict:
    """`token_perplexity` = exp(mean NLL per predicted token), as `rope-patch compare` (windows scored from
    position 0: L-1 predictions each); word/byte perplexity and bits per byte as lm-eval's wikitext, over the words
    and bytes of the text those L-1 predictions cover (`predicted_text`: all but the first token's), so that the
    counts and the log-likelihood are of the same text."""
    (loglik,) = results
    words, n_bytes = doc["n_words"], doc["n_bytes"]
    return {"token_perplexity": (loglik, doc["n_predicted"]), "nll": -loglik / doc["n_predicted"],
            "word_perplexity": (loglik, words), "byte_perplexity": (loglik, n_bytes),
            "bits_per_byte": (loglik, n_bytes)}


# ---- multi-key needle in a haystack ---------------------------------------------------------------------------------
def make_niah_sample(tokenizer, filler_ids, length: int, depth: float, rng: random.Random, n_keys: int = 4,
                     chat_template: bool = False) -> dict:
    """One prompt of exactly `length` tokens: BOS, prose with `n_keys` needles "The special magic number for KEY is
    N." (distinct keys, 7-digit values), and a question about one of them, whose needle sits at `depth`; the others
    (distractors) at random depths. `chat_template`: the prose and the question are the user turn of the tokenizer's
    chat template and the lead-in opens the assistant turn, the template's tokens counted in `length` (as
    `passkey.make_passkey_sample`); the same draws from `rng`."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    if not 1 <= n_keys <= len(NIAH_KEYS):
        raise ValueError(f"niah_keys must be in [1, {len(NIAH_KEYS)}], got {n_keys}")
    enc = functools.partial(tokenizer.encode, add_special_tokens=False)
    keys = rng.sample(NIAH_KEYS, n_keys)
    values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
    asked = rng.randrange(n_keys)
    depths = [depth if j == asked else rng.random() for j in range(n_keys)]
    needles = [enc(NIAH_NEEDLE.format(key=k, value=v)) for k, v in zip(keys, values, strict=True)]
    if chat_template:
        bos, header = chat_wrap(tokenizer)
        question = enc(NIAH_QUESTION.format(key=keys[asked]))
        question += header + enc(NIAH_LEAD_IN.format(key=keys[asked]).lstrip())
    else:
        question = enc(NIAH_QUESTION.format(key=keys[asked]) + NIAH_LEAD_IN.format(key=keys[asked]))
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    n_filler = length - len(bos) - sum(map(len, needles)) - len(question)
    if n_filler < 0:
        raise ValueError(f"length {length} is too short for {n_keys} needles and the question "
                         f"({length - n_filler} tokens)")
    if n_filler > len(filler_ids):
        raise ValueError(f"the haystack text has {len(filler_ids)} tokens, a {length}-token prompt needs {n_filler}")
    start = rng.randint(0, len(filler_ids) - n_filler)
    hay = list(filler_ids[start : start + n_filler])
    order = sorted(range(n_keys), key=lambda j: (round(depths[j] * n_filler), j))
    ids, prev = list(bos), 0
    for j in order:
        at = round(depths[j] * n_filler)
        ids += hay[prev:at] + needles[j]
        prev = at
    ids += hay[prev:] + question
    return {"prompt_ids": ids, "answer": values[asked], "answer_ids": enc(f" {values[asked]}"), "key": keys[asked],
            "distractors": [k for j, k in enumerate(keys) if j != asked], "depth": depth}


def niah_dataset(**kw) -> dict:
    tokenizer, filler = _setup(kw)
    length = _length(kw)
    filler = _haystack(kw, tokenizer, filler, length)
    d = compare_defaults()
    depths = _list(kw.get("depths", d["depths"]), float)
    n, seed, n_keys = int(kw.get("samples", d["samples"])), int(kw.get("seed", d["seed"])), int(kw.get("niah_keys", 4))
    chat = _chat(kw, tokenizer)
    rows = []
    for depth in depths:
        rng = random.Random(cell_seed(seed, length, depth) * _NIAH_SALT + 1)
        cell = [make_niah_sample(tokenizer, filler, length, depth, rng, n_keys, chat) for _ in range(n)]
        new = new_tokens(tokenizer, cell, chat, lambda s: NIAH_LEAD_IN.format(key=s["key"]))  # as passkey's
        for k, s in enumerate(cell):
            text, lead_in = _prompt_text(tokenizer, s["prompt_ids"], NIAH_LEAD_IN.format(key=s["key"]), chat)
            rows.append({"text": text, "lead_in": lead_in, "prompt_ids": s["prompt_ids"], "answer": s["answer"],
                         "key": s["key"], "distractors": s["distractors"], "length": length, "depth": float(depth),
                         "sample": k, "seed": seed, "max_new_tokens": new, "chat_template": chat})
    return _dataset(rows)


LADDER = tuple(2**k for k in range(6, 18))  # 64 ... 131072: the lengths that have task YAMLs
DEFAULT_GROUP_LENGTHS = (256, 512, 1024, 2048)  # what the groups rope_passkey / rope_ppl / rope_niah run
