"""What a search minimises, and on which text: the held-out text split into a tuning part and a disjoint
acceptance part.

Split (`split_heldout`): the held-out token stream (rope_patch/data/heldout.txt by default) is cut at `fraction` of
its tokens; the search only ever reads tokens [0, cut) and the acceptance evaluation only tokens [cut, n), so the
acceptance numbers are measured on text the search never saw. Passkey prompts of the objective take their filler
from the tuning part too, or (`haystack="noise"`) from the passkey paper's repeated lines, for a model that cannot
find a key in prose even inside its window; `chat_template` frames them as `rope-patch compare` does.

Objective (lower is better): perplexity at the target length over the first `n_tokens` of the tuning part
(consecutive windows of exactly `target` tokens, as `rope-patch compare` scores them, length-dependent schemes at
the frequencies of a `target`-token forward), times exp(−w·a) when a passkey weight w > 0 is given (a: passkey
accuracy at the target length). With w = 0 the objective is the perplexity itself.

`needle=True`: LongRoPE2's needle-driven perplexity (Shang et al. 2025, arXiv:2502.20082 §3.2) in place of the
text's: perplexity over the answer tokens only of passkey prompts of `target` tokens (the key hidden at each depth in
the tuning text, the answer teacher-forced after the question), so that the search rewards what retrieval at the
target length needs rather than the local fluency that dominates a text's perplexity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..api import as_scheme, patched
from ..evaluation.passkey import haystack_filler
from ..evaluation.perplexity import window_nll
from ..evaluation.retrieval import DEFAULT_DEPTHS, evaluate_passkey, make_cell

SPLIT_FRACTION = 0.5


def split_heldout(token_ids: Sequence[int], fraction: float = SPLIT_FRACTION) -> tuple[list[int], list[int], dict]:
    """(tuning tokens, acceptance tokens, a description for the log)."""
    if not 0 < fraction < 1:
        raise ValueError(f"the tuning share of the held-out text must be in (0, 1), got {fraction}.")
    cut = int(len(token_ids) * fraction)
    info = {"tuning_tokens": [0, cut], "acceptance_tokens": [cut, len(token_ids)],
            "about": f"held-out tokens [0, {cut}) for the search, [{cut}, {len(token_ids)}) for acceptance "
                     "(disjoint; the search never reads the acceptance part)"}
    return list(token_ids[:cut]), list(token_ids[cut:]), info


def spec_of(name: str, params: dict) -> str:
    """The command-line spec of `name` with `params` (lists `/`-joined, as `parse_spec` reads them back)."""
    def text(v):
        if isinstance(v, (list, tuple)):
            return "/".join(text(x) for x in v)
        return repr(v) if isinstance(v, float) else str(v)

    return f"{name}:" + ",".join(f"{k}={text(v)}" for k, v in params.items()) if params else name


def _ppl(nll_mean: float) -> float:
    return math.exp(nll_mean) if nll_mean < 700 else math.inf


class Objective:
    """`objective(scheme_name, params)` -> {"objective", "perplexity", "passkey_accuracy"} (or {"objective":
    None, "error"} when the scheme refuses these parameters on this model)."""

    def __init__(self, model, tokenizer, token_ids: Sequence[int], target: int, n_tokens: int, *,
                 passkey_weight: float = 0.0, passkey_samples: int = 4, depths: Sequence[float] = DEFAULT_DEPTHS,
                 seed: int = 0, haystack: str = "prose", chat_template: bool = False, needle: bool = False):
        if len(token_ids) < target:
            raise ValueError(f"the tuning text has {len(token_ids)} tokens, fewer than one window of "
                             f"--target {target}.")
        if passkey_weight < 0:
            raise ValueError(f"the passkey weight must be >= 0, got {passkey_weight}.")
        self.model, self.tokenizer, self.token_ids = model, tokenizer, list(token_ids)
        self.target, self.n_tokens = target, n_tokens
        self.passkey_weight, self.passkey_samples = passkey_weight, passkey_samples
        self.depths, self.seed = list(depths), seed
        self.needle = needle
        prompts = passkey_weight > 0 or needle
        self.filler = haystack_filler(tokenizer, haystack, self.token_ids, target) if prompts else None
        self.chat_template = chat_template
        what = "--objective needle" if needle else "the passkey term (--passkey-weight)"
        for depth in self.depths if prompts else ():  # a prompt that cannot be built fails now
            try:
                make_cell(tokenizer, self.filler, target, depth, 1, seed, chat_template=chat_template)
            except ValueError as err:
                hint = f" Use a longer --target or drop {what.split(' (')[0]}." if "too short" in str(err) else ""
                raise ValueError(f"{what} cannot build a prompt at --target {self.target}: {err}.{hint}") from None
        # the needle prompts are the same for every candidate: built once
        self.needles = [sample for depth in self.depths for sample in make_cell(
            tokenizer, self.filler, target, depth, passkey_samples, seed, chat_template=chat_template)
        ] if needle else []

    def __call__(self, name: str, params: dict) -> dict:
        try:
            scheme = as_scheme(name, **params)
            context = patched(self.model, scheme)
            context.__enter__()
        except (ValueError, TypeError) as err:
            return {"objective": None, "error": " ".join(str(err).split())}
        try:
            if self.needle:
                ppl = needle_perplexity(self.model, self.needles)
            else:
                ppl = _ppl(window_nll(self.model, self.token_ids, self.target, self.n_tokens).double().mean().item())
            accuracy = None
            if self.passkey_weight > 0:
                cells = evaluate_passkey(self.model, self.tokenizer, self.filler, [self.target], self.depths,
                                         self.passkey_samples, self.seed, chat_template=self.chat_template)
                accuracy = sum(c["correct"] for c in cells) / max(1, sum(c["n"] for c in cells))
        finally:
            context.__exit__(None, None, None)
        value = ppl * math.exp(-self.passkey_weight * accuracy) if accuracy is not None else ppl
        return {"objective": value, "needle_perplexity" if self.needle else "perplexity": ppl,
                "passkey_accuracy": accuracy}


def needle_perplexity(model, samples: Sequence[dict]) -> float:
    """exp(mean NLL of the answer tokens) over passkey samples (`make_cell`'s): each prompt, then its key
    teacher-forced (LongRoPE2's needle-driven perplexity)."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for sample in samples:
        prompt, answer = sample["prompt_ids"], sample["answer_ids"]
        ids = torch.tensor([list(prompt) + list(answer)], device=device)
        with torch.no_grad():
            logits = model(ids, logits_to_keep=len(answer) + 1).logits[0, :-1].float()
        total += F.cross_entropy(logits, ids[0, len(prompt):], reduction="sum").item()
        count += len(answer)
    return _ppl(total / count)


def perplexities(model, token_ids: Sequence[int], scheme, lengths: Sequence[int], n_tokens: int) -> dict[int, float]:
    """Perplexity at each length over the same first `n_tokens` tokens (the acceptance evaluation); `scheme` None:
    the model as loaded."""
    def run():
        return {int(L): _ppl(window_nll(model, token_ids, L, n_tokens).double().mean().item()) for L in lengths}

    if scheme is None:
        return run()
    with patched(model, scheme):
        return run()
