"""Pieces shared by the perplexity and passkey evaluations: held-out text, chunked loss, dynamic-RoPE state, the
thread count."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import platform
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, flex_attention_mask

from .. import resources
from .._version import __version__
from ..api import current
from ..attention.windowed import maybe_windowed
from ..discovery import find_target
from ..lengths import fix_length, rope_types
from .defaults import WINDOWED_FROM

# Bytes of fp32 logits materialised at once when computing a loss (the full 16k x 49152 logits are 3.2 GB).
LOGITS_BUDGET_BYTES = 256 << 20


def find_heldout(path: str | Path | None = None) -> Path:
    """The held-out text: `path` if given, else the one shipped with the package (rope_patch/data/heldout.txt)."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"Held-out text {p} does not exist.")
        return p
    p = resources.heldout_text()
    if p.is_file():
        return p
    raise FileNotFoundError(f"The held-out text shipped with rope_patch ({p}) is missing from this install; "
                            "pass --heldout PATH.")


def read_tokens(tokenizer, path: str | Path | None = None, max_tokens: int | None = None) -> tuple[list[int], dict]:
    """Token ids of the held-out text (no special tokens) and a provenance dict (path, sha256, sizes)."""
    p = find_heldout(path)
    data = p.read_bytes()
    ids = tokenizer.encode(data.decode("utf-8"), add_special_tokens=False)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    info = {"path": str(p), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "tokens": len(ids)}
    return ids, info


def windowed_from(model, length: int):
    """The context a forward of `length` tokens runs in: from WINDOWED_FROM on, a hybrid model's sliding layers over
    their window only (attention.windowed: no L × L mask), else the model as it is."""
    return maybe_windowed(model) if length >= WINDOWED_FROM else contextlib.nullcontext(model)


def square_masks(model) -> bool:
    """Whether a padded batch hands `model`'s layers a (b, 1, q, k) mask: under every attention implementation whose
    mask function is not flash's (a 2-D padding mask) or flex's (a block mask), rope_patch's stand-ins included. At
    64k that is 4 GB of bool per row, and sdpa's float copy of it 17 GB."""
    mask = AttentionMaskInterface._global_mapping.get(model.config._attn_implementation)
    return mask not in (flash_attention_mask, flex_attention_mask)


def versions() -> dict:
    return {"rope_patch": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0], "platform": platform.platform(), "threads": torch.get_num_threads(),
            "commit": source_commit()}


def source_commit(root: Path | None = None) -> str | None:
    """The git commit of the rope_patch source that runs (`+dirty` when its files differ from it or it has untracked
    ones), or None where the package is not the root of a git checkout that tracks it (an installed wheel, also one
    inside another project's repository): what a result records of the code that produced it. `root`: the folder
    holding `rope_patch/` (default: this package's)."""
    root = Path(root).resolve() if root is not None else Path(__file__).resolve().parents[2]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode or Path(top.stdout.strip()).resolve() != root:
            return None
        if git("ls-files", "--error-unmatch", "rope_patch/__init__.py").returncode:
            return None
        head = git("rev-parse", "HEAD")
        changes = git("status", "--porcelain", "--", "rope_patch")
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode or changes.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if changes.stdout.strip() else "")


def auto_threads() -> int:
    """torch's thread count, reduced to the cores that the 1-minute load average leaves free (at least 1): on a
    busy machine extra threads wait for cores and slow small models down several-fold."""
    n = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return n
    free = (os.cpu_count() or n) - load
    return max(1, min(n, int(free + 0.5)))


# ---- chunked loss -----------------------------------------------------------------------------------------------
def _head(model):
    """hidden states -> logits, with the output post-processing some families apply (scale, soft-capping)."""
    lm_head = model.get_output_embeddings()
    cfg = model.config
    scale = getattr(cfg, "logit_scale", None)  # Cohere multiplies
    divide = getattr(cfg, "logits_scaling", None)  # Granite divides
    cap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2/3

    def head(h):
        logits = lm_head(h).float()
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return head


_OWN_LOGITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its logits' dtype, or None


def sliced_head(model, input_ids: torch.Tensor) -> torch.dtype | None:
    """The dtype of `model`'s own logits where its decoder and `_head` give them (checked once per model, on the
    first 8 tokens of `input_ids`, against the model's forward), else None: an output step `_head` does not know
    (FalconH1's lm_head_multiplier, RecurrentGemma's logits_soft_cap) or a decoder that does not run alone (Llama 4,
    Mllama, Blt: wrappers), where the callers run the model's own forward instead."""
    if model not in _OWN_LOGITS:
        ids = input_ids[:1, :8]
        try:
            with torch.no_grad():
                want = model(input_ids=ids).logits
                got = _head(model)(model.get_decoder()(input_ids=ids).last_hidden_state)
            tol = 1e-4 * max(1.0, float(want.float().abs().max()))
            same = got.shape == want.shape and bool(((got - want.float()).abs() <= tol).all())
        except Exception:  # noqa: BLE001 (a decoder that cannot run alone: the model's own forward then)
            same = False
        _OWN_LOGITS[model] = want.dtype if same else None
    return _OWN_LOGITS[model]


def _logit_slices(model, hidden: torch.Tensor, start: int, end: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(a, logits [b, n, vocab] float32 of positions a … a + n − 1) over positions [start, end) of `hidden`
    [b, T, hidden], LOGITS_BUDGET_BYTES of logits at a time."""
    head = _head(model)
    vocab = model.get_output_embeddings().weight.shape[0]
    step = max(1, LOGITS_BUDGET_BYTES // (4 * vocab * hidden.shape[0]))
    for a in range(start, end, step):
        yield a, head(hidden[:, a:min(a + step, end)])


def _positions_logits(model, input_ids: torch.Tensor, start: int, end: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(a, logits) over positions [start, end) of `input_ids`: the decoder once, then the output projection a slice
    at a time (`_logit_slices`); the model's own forward, all at once, where that differs (`sliced_head`)."""
    if sliced_head(model, input_ids) is not None:
        yield from _logit_slices(model, model.get_decoder()(input_ids=input_ids).last_hidden_state, start, end)
        return
    keep = {"logits_to_keep": input_ids.shape[1] - start} if "logits_to_keep" in inspect.signature(
        model.forward).parameters else {}
    logits = model(input_ids=input_ids, **keep).logits.float()
    yield start, logits[:, logits.shape[1] - (input_ids.shape[1] - start):][:, :end - start]


@torch.no_grad()
def token_nll(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood [batch, T-1] of `input_ids` [batch, T] (position t predicts t+1).

    The decoder runs once; the output projection and the loss run over slices of positions so that at most
    LOGITS_BUDGET_BYTES of logits exist at a time.
    """
    b, t = input_ids.shape
    out = torch.empty(b, t - 1, dtype=torch.float32)
    for a, logits in _positions_logits(model, input_ids, 0, t - 1):
        targets = input_ids[:, a + 1:a + 1 + logits.shape[1]].to(logits.device)
        out[:, a:a + logits.shape[1]] = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").cpu()
    return out


@torch.no_grad()
def continuation_loglikelihoods(model, input_ids: torch.Tensor, continuations: list[list[int]],
                                softmax_dtype: torch.dtype | None = None) -> list[tuple[float, bool]]:
    """lm-eval's answers to log-likelihood requests that share their input `input_ids` [1, T] (a one-token option
    each, after one context; or one request): per continuation, the sum of log p over its tokens, which the last
    len(continuation) positions predict, and whether each is the greedy choice. The logits exist LOGITS_BUDGET_BYTES
    at a time (lm-eval's own path holds all T × vocab: 69 GB at 64k for Gemma 3), in the dtype the model's own
    forward gives them, as lm-eval's log-softmax takes them."""
    t, longest = input_ids.shape[1], max(map(len, continuations))
    dtype = sliced_head(model, input_ids) or torch.float32
    totals, greedy = [0.0] * len(continuations), [True] * len(continuations)
    for a, logits in _positions_logits(model, input_ids, t - longest, t):
        logp = F.log_softmax(logits.to(dtype), dim=-1, dtype=softmax_dtype)
        best = logp.argmax(-1)
        for k, continuation in enumerate(continuations):
            first = t - len(continuation)  # the position that predicts its first token
            lo, hi = max(a, first), min(a + logits.shape[1], t)
            if lo >= hi:
                continue
            want = torch.tensor(continuation[lo - first:hi - first], device=logp.device)[None]
            totals[k] += float(logp[:, lo - a:hi - a].gather(-1, want[..., None]).sum())
            greedy[k] = greedy[k] and bool((best[:, lo - a:hi - a] == want).all())
    return list(zip(totals, greedy, strict=True))


# ---- length-dependent RoPE --------------------------------------------------------------------------------------
@contextlib.contextmanager
def at_length(model, total_length: int) -> Iterator[None]:
    """Run the block with a length-dependent RoPE (dynamic, dynamic_yarn, longrope) frozen at the frequencies of a
    `total_length`-token forward (`rope_patch.fix_length`), whatever ran before; a no-op for every other scheme.

    For generation pass prompt + new tokens: the prompt's cached keys and the generated tokens' queries then share
    one set of frequencies (the one a full recompute of the final sequence uses) instead of mixing them in the KV
    cache (transformers issue #25104). The fix that was there before (usually none) is put back afterwards. An
    unpatched model whose own RoPE is dynamic NTK (a checkpoint that ships it) gets `prepare_rotary` instead."""
    if current(model) is None:
        prepare_rotary(model, total_length)
        yield
        return
    fix = fix_length(model, total_length)
    try:
        yield
    finally:
        if fix.fixed or fix.previous is not None:
            fix_length(model, fix.previous)


# ---- dynamic RoPE -----------------------------------------------------------------------------------------------
def _rotary(model):
    try:
        return find_target(model).rotary
    except Exception:  # a model without a rotary module (e.g. pure ALiBi architectures): nothing to prepare
        return None


def prepare_rotary(model, total_length: int) -> None:
    """Make a dynamic RoPE (transformers' `dynamic`, rope_patch's `dynamic`) independent of what ran before, with
    the base of a `total_length`-token sequence; a no-op for every other scheme. The evaluations use `at_length`
    (`rope_patch.fix_length`, which also covers dynamic_yarn and longrope and holds the frequencies when a prompt
    shorter than the window is decoded past it); this reset serves unpatched models (through at_length).

    transformers' dynamic NTK grows its base with the longest sequence seen and never shrinks it while sequences
    stay beyond the window, so a 1024-token evaluation after a 2048-token one would silently use the 2048 base.
    Here the rotary is reset to its original frequencies and grown to `total_length` before each evaluation. For
    generation, pass prompt + new tokens: the prompt's cached keys and the generated tokens' queries then share
    one base (the one a full recompute of the final sequence uses) instead of mixing bases in the KV cache
    (transformers issue #25104).
    """
    rot = _rotary(model)
    if rot is None:
        return
    for lt, rt in rope_types(rot).items():  # a table rotary (GPT-J, CodeGen) reads as "default": nothing to prepare
        if "dynamic" not in str(rt):
            continue
        prefix = f"{lt}_" if lt else ""
        original = getattr(rot, f"{prefix}original_inv_freq")
        rot.register_buffer(f"{prefix}inv_freq", original.clone(), persistent=False)
        setattr(rot, f"{prefix}max_seq_len_cached", rot.original_max_seq_len)
        if lt is None:
            rot.max_seq_len_cached = rot.original_max_seq_len
        if total_length > rot.original_max_seq_len:
            x = torch.zeros(1, dtype=torch.float32, device=original.device)
            pos = torch.tensor([[total_length - 1]], device=original.device)
            with torch.no_grad():
                rot(x, pos) if lt is None else rot(x, pos, layer_type=lt)
