"""The `rope_patch` model for lm-evaluation-harness (0.4.x): Hugging Face `HFLM` + a position-encoding patch.

    rope-patch-lm-eval --model rope_patch \
        --model_args pretrained=tiny,scheme=yarn,factor=4 \
        --tasks rope_passkey --output_path out/   # rope_* tasks ship with the package

`--model_args` (all optional):

| key | meaning |
| --- | --- |
| `pretrained` | `tiny`, `smollm2`, `gemma3`, a local model folder, or a folder written by `rope_patch.save_pretrained` (its recorded patch is re-applied) |
| `scheme` | a registered scheme name or alias (`rope-patch list`); applied with `rope_patch.apply` after loading |
| any scheme parameter | `factor`, `original_max_position_embeddings`, `beta_fast`, `group_size`, `window_size`, ... (lists: `short_factor=1/1.5/2`) |
| `adapter` | a peft adapter folder, or an adapter saved by `rope_patch.save_pretrained` (its recorded patch is re-applied; an explicit `scheme` replaces it) |
| `max_length` | default: the patched window (`config.max_position_embeddings` after the patch), not HFLM's pre-patch fallback |
| `exact_tokens` | default true: documents of the `rope_*` tasks that carry token ids are fed as those ids (see below) |
| anything else | HFLM's own arguments (`dtype` (default float32 here), `batch_size`, `device`, `add_bos_token`, ...) and, beyond those, `from_pretrained` keyword arguments |

Bad arguments fail before any model is loaded, with the errors of `rope_patch.apply` (unknown scheme or parameter,
with "Did you mean"; bad values), or a `FileNotFoundError` naming a missing `pretrained` / `adapter` folder.

Exact tokens. The `rope_passkey_*`, `rope_ppl_*` and `rope_niah_*` documents (rope_patch/data/tasks/rope) carry the
token ids they were built from (`prompt_ids` / `input_ids`). Decoding ids to text and encoding the text again does not
give the same ids in general (a filler stretch that starts inside a word, a needle spliced at a token boundary), so this
model evaluates those documents from the ids themselves, with exactly the procedure of `rope-patch compare`
(`rope_patch.evaluation`): greedy decoding with a KV cache for `max_new_tokens` tokens, the dynamic-RoPE base set
for the final length, and non-overlapping windows scored from position 0. That makes the numbers equal to
`rope-patch compare` on the same samples. Such documents are evaluated at their full length even beyond
`max_length` (they are length tests: truncating would delete the needle), with a loud warning. Any other model
(`hf`, vLLM, ...) reads the `text` field like any lm-eval task. `exact_tokens=false` turns this off. Under
`--apply_chat_template` the passkey / niah documents built with `--metadata chat_template=true` (which
`rope-patch-lm-eval` and `rope-patch sweep` set with the flag) spell the templated prompt, the template's tokens
counted in the task's length, and are read from their ids too; documents built for the other layout get a loud
warning naming the prompt's length.

Prompts longer than `max_length` on the ordinary (text) path are truncated from the left by HFLM, as always, but
with a loud warning here instead of a silent cut.

Data parallel: `ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 -m rope_patch.integrations.lm_eval.cli ...` on CPU,
`accelerate launch -m rope_patch.integrations.lm_eval.cli ...` on GPUs. HFLM sets rank and world size only when more
than one GPU is visible; this class takes them from the accelerator in every case.
"""  # noqa: E501 (markdown table rows cannot wrap)

from __future__ import annotations

import copy
import functools
import inspect
import logging
import warnings
from pathlib import Path

import torch
from lm_eval.api.model import CacheHook
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import get_dtype

import rope_patch

from ...api import context_window
from ...discovery import unwrap
from ...evaluation import common, perplexity, retrieval
from ...evaluation.passkey import chat_wrap, has_chat_template
from ...persistence import read_manifest
from ...registry import canonical_name, did_you_mean, get_scheme_class, list_schemes
from ...schemes.base import UNBOUNDED
from ...specs import parse_value
from ...zoo import resolve_model_path

logger = logging.getLogger("rope_patch.lm_eval")

MODEL_NAME = "rope_patch"
_OWN_ARGS = ("pretrained", "scheme", "adapter", "max_length", "exact_tokens")
_BANNER = "!" * 100


def _hflm_args() -> set[str]:
    return {n for n, p in inspect.signature(HFLM.__init__).parameters.items()
            if p.kind is p.POSITIONAL_OR_KEYWORD} - {"self"}


def _all_scheme_params() -> set[str]:
    return {p for name in list_schemes() for p in get_scheme_class(name).param_names()}


def _value(v):
    """model_args values arrive as str/int/float/bool; `1/1.5/2` is a list (longrope factors), as in the CLI."""
    if isinstance(v, str):
        return parse_value(v)
    return v


# `from_pretrained` keyword arguments that `--model_args` may pass through HFLM (anything else unknown is an error:
# transformers would silently store it in the config).
PASSTHROUGH = ("attn_implementation", "device_map", "low_cpu_mem_usage", "load_in_8bit", "load_in_4bit",
               "cache_dir", "local_files_only", "use_safetensors", "variant", "token", "offload_state_dict")


def split_model_args(scheme, kwargs: dict) -> tuple[dict, dict]:
    """(scheme parameters, HFLM / from_pretrained kwargs) out of the remaining `--model_args`.

    HFLM's own arguments and `PASSTHROUGH` (plus `bnb_*`) go to HFLM. With a scheme, every other key is a scheme
    parameter, so that a typo or another scheme's parameter fails exactly as `apply(model, scheme, **params)`.
    Without one, scheme parameters are an error (they would be ignored), and so is any other unknown key.
    """
    hflm = _hflm_args()
    params, rest = {}, {}
    for key, val in kwargs.items():
        if key in hflm or key in PASSTHROUGH or key.startswith("bnb_"):
            rest[key] = val
        elif scheme is not None or key in _all_scheme_params():
            params[key] = _value(val)
        else:
            known = sorted(hflm | set(PASSTHROUGH) | _all_scheme_params() | set(_OWN_ARGS))
            raise TypeError(f"rope_patch model: unknown model_arg {key!r}.{did_you_mean(key, known)} It is neither "
                            "an HFLM argument nor a scheme parameter (scheme parameters need scheme=NAME).")
    return params, rest


def _manifest(path) -> dict | None:
    """The checked rope_patch.json of a folder (None: none there); a damaged one raises, naming the file."""
    return read_manifest(path)


def _check_adapter(adapter) -> Path:
    path = Path(str(adapter)).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"adapter={str(adapter)!r}: no such folder. Pass a peft adapter folder or one written "
                                "by rope_patch.save_pretrained.")
    manifest = _manifest(path)
    if not (path / "adapter_config.json").is_file():
        if manifest is not None:
            raise ValueError(f"adapter={str(adapter)!r} holds a full model saved by rope_patch.save_pretrained, not an "
                             "adapter: pass it as pretrained= instead.")
        raise FileNotFoundError(f"adapter={str(adapter)!r} is not an adapter folder (no adapter_config.json).")
    return path


def _served_window(model) -> int | None:
    """The context the patched model serves (rope_patch.api.context_window; dynamic NTK's config keeps L). An
    unbounded scheme (rerope, alibi, ...) keeps the config's window: lm-eval's rolling perplexity windows are
    max_length long, and one window of a whole document would be a forward of any size."""
    try:
        served = context_window(model)
    except TypeError:  # not a RoPE model rope_patch can read: whatever its config announces
        served = UNBOUNDED
    if served < UNBOUNDED:
        return served
    cfg = getattr(unwrap(model), "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    value = getattr(cfg, "max_position_embeddings", None)
    return int(value) if value else None


def validate_model_args(pretrained=None, scheme=None, adapter=None, **kwargs):
    """Check `--model_args` without loading anything: (Scheme or None, adapter folder or None, HFLM kwargs).

    Raises the errors of `rope_patch.apply` for the scheme and its parameters, FileNotFoundError / ValueError for a
    missing model or adapter folder.
    """
    if scheme is not None and not isinstance(scheme, rope_patch.Scheme):
        scheme = canonical_name(str(scheme))  # ValueError with "Did you mean" for unknown names
    params, rest = split_model_args(None if isinstance(scheme, rope_patch.Scheme) else scheme, kwargs)
    if scheme is None and params:
        raise TypeError(f"Scheme parameters {sorted(params)} were given without scheme=: add scheme=NAME to "
                        "--model_args (rope-patch list shows the schemes).")
    scheme_obj = rope_patch.as_scheme(scheme, **params) if scheme is not None else None
    if rest.get("peft") is not None:  # HFLM's own name for it: same handling (rope_patch manifests included)
        if adapter is not None:
            raise ValueError("Pass the adapter either as adapter= or as peft=, not both.")
        adapter = rest.pop("peft")
    adapter_path = _check_adapter(adapter) if adapter is not None else None
    if isinstance(pretrained, str):
        resolve_model_path(pretrained)
    return scheme_obj, adapter_path, rest


def _as_text(req):
    """A copy of an lm-eval request without its document (so it takes the text path)."""
    clone = copy.copy(req)
    clone.doc = None
    return clone


@register_model(MODEL_NAME, "rope-patch")
class RopePatchLM(HFLM):
    """`HFLM` whose model carries a rope_patch scheme (see the module docstring for `--model_args`)."""

    def __init__(self, pretrained="tiny", scheme=None, adapter=None, max_length=None, exact_tokens=True,
                 dtype="float32", device=None, **kwargs):
        if device is None:  # HFLM wants a string; "cuda" without a GPU would fail later
            device = "cuda" if torch.cuda.is_available() else "cpu"

        # ---- validate everything before loading anything -------------------------------------------------------
        self._scheme, adapter, rest = validate_model_args(scheme=scheme, adapter=adapter, **kwargs)
        self._adapter = adapter
        self._spec = pretrained
        self.exact_tokens = bool(_value(exact_tokens))
        self._warned: set = set()
        if isinstance(pretrained, str):
            pretrained = str(resolve_model_path(pretrained))
            self._pretrained_manifest = _manifest(pretrained)
        else:
            self._pretrained_manifest = None

        super().__init__(pretrained=pretrained, max_length=max_length, dtype=dtype, device=device, **rest)

        if not isinstance(pretrained, str):  # a model object: HFLM skipped _create_model
            self._patch_model()
        self._setup_distributed()
        if not self._max_length:
            self._max_length = _served_window(self.model)
        applied = rope_patch.current(self.model)
        logger.info("rope_patch: %s, scheme %s, max_length %s", self._spec, applied, self._max_length)

    # ---- loading -----------------------------------------------------------------------------------------------
    def _create_model(self, pretrained, **kwargs):
        if self._pretrained_manifest is not None:
            # A folder written by rope_patch.save_pretrained: rebuild it with its patch (config.json of a native
            # scheme already holds the scaled rope_parameters; the patch is defined relative to the original).
            dtype = kwargs.get("dtype")
            extra = {"dtype": get_dtype(dtype)} if dtype not in (None, "auto") else {}
            self._model = rope_patch.from_pretrained(pretrained, **extra)
        else:
            super()._create_model(pretrained, **kwargs)
        self._patch_model()

    def _patch_model(self):
        if self._adapter is not None:
            if _manifest(self._adapter) is not None:
                self._model = rope_patch.from_pretrained(self._adapter, base_model=self._model)
            else:
                from peft import PeftModel  # peft (~1.5 s to import) only for a plain peft adapter

                self._model = PeftModel.from_pretrained(self._model, str(self._adapter))
        if self._scheme is not None:
            recorded = rope_patch.current(self._model)
            if recorded is not None:
                logger.warning("rope_patch: the loaded model carries %s; scheme= replaces it with %s.", recorded,
                               self._scheme)
            rope_patch.apply(self._model, self._scheme)
        self._model.eval()

    def _setup_distributed(self):
        """HFLM sets rank / world size only with >1 GPU; on CPU (torchrun) or 1 GPU per process take them from the
        accelerator, so that each process evaluates its own share of the documents."""
        acc = getattr(self, "accelerator", None)
        if acc is None or acc.num_processes <= 1:
            return
        if getattr(self, "_world_size", 1) != acc.num_processes:
            self._rank = acc.process_index
            self._world_size = acc.num_processes
            self._device = acc.device
            if isinstance(self._model, torch.nn.Module) and next(self._model.parameters()).device != acc.device:
                self._model.to(acc.device)
            logger.info("rope_patch: data parallel rank %d of %d on %s", self._rank, self._world_size, self._device)

    # ---- loud warnings instead of silent truncation -------------------------------------------------------------
    def _warn_long(self, length: int, limit: int, truncated: bool) -> None:
        key = (length, limit, truncated)
        if key in self._warned:
            return
        self._warned.add(key)
        what = ("HFLM TRUNCATES IT FROM THE LEFT (the beginning of the prompt, e.g. a needle, is lost)" if truncated
                else "it is evaluated in full (an exact-token rope_* document), i.e. beyond the patched window")
        window = _served_window(self.model)
        origin = " (the patched window)" if limit == self.max_length == window else ""
        msg = (f"rope_patch: a prompt of {length} tokens is longer than max_length={limit}{origin}; {what}. "
               "Pass --model_args max_length=N (or a scheme whose window covers it) to change this.")
        logger.warning("\n%s\n%s\n%s", _BANNER, msg, _BANNER)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
        ids, mask = super().tok_batch_encode(strings, padding_side=padding_side, left_truncate_len=None,
                                             truncation=truncation)
        if left_truncate_len and ids.shape[1] > left_truncate_len:
            self._warn_long(ids.shape[1], left_truncate_len, truncated=True)
            ids, mask = ids[:, -left_truncate_len:], mask[:, -left_truncate_len:]
        return ids, mask

    def tok_encode(self, string, add_special_tokens=None, left_truncate_len=None, **kwargs):
        ids = super().tok_encode(string, add_special_tokens=add_special_tokens, **kwargs)
        if left_truncate_len and len(ids) > left_truncate_len:
            self._warn_long(len(ids), left_truncate_len, truncated=True)
            ids = ids[-left_truncate_len:]
        return ids

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        long = {}  # request index -> its model input: from WINDOWED_FROM tokens on, one request at a time
        for i, (_, context_enc, continuation_enc) in enumerate(requests):
            total = len(context_enc) + len(continuation_enc)
            if total > self.max_length + 1:
                self._warn_long(total - 1, self.max_length, truncated=True)
            if self.backend == "causal" and min(total, self.max_length + 1) - 1 >= common.WINDOWED_FROM:
                long[i] = (context_enc + continuation_enc)[-(self.max_length + 1):-1]  # lm-eval's input
        if not long:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        short = [i for i in range(len(requests)) if i not in long]
        answers = dict(zip(short, super()._loglikelihood_tokens(
            [requests[i] for i in short], disable_tqdm=disable_tqdm, override_bs=override_bs) if short else [],
            strict=True))
        groups: dict[tuple, list[int]] = {}  # one input, several continuations (one-token options): one forward
        for i, ids in long.items():
            groups.setdefault(tuple(ids), []).append(i)
        for ids, members in groups.items():
            # lm-eval's answers with the logits a slice of positions at a time: its own path holds every position's
            # (and their log-softmax), about 69 GB each at 64k for a 262k vocabulary
            inputs = torch.tensor([ids], dtype=torch.long, device=self.device)
            with common.windowed_from(self.model, len(ids)), torch.autocast(
                    device_type=self.device.type, dtype=getattr(self, "mixed_precision_dtype", None),
                    enabled=getattr(self, "mixed_precision_dtype", None) is not None):
                got = common.continuation_loglikelihoods(self.model, inputs, [requests[i][2] for i in members],
                                                         getattr(self, "softmax_dtype", None))
            for i, answer in zip(members, got, strict=True):
                answers[i] = answer
                if requests[i][0] is not None:  # as lm-eval's: rolling windows (no key) are cached per document
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return [answers[i] for i in range(len(requests))]

    # ---- chat templates ----------------------------------------------------------------------------------------
    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """lm-eval's templated prompt, with no BOS inside a turn: the text of a rope_* document is its token ids', BOS
        first (so that a plain prompt is exactly compare's), and a template opens each turn with its own tokens; a BOS
        left at the start of the user's turn (SmolLM2: `<|im_start|>user\n<|im_start|>...`) is no prompt a chat model
        was trained on."""
        bos = getattr(self.tokenizer, "bos_token", None)
        if bos:
            chat_history = [{**m, "content": m["content"][len(bos):]}
                            if isinstance(m.get("content"), str) and m["content"].startswith(bos) else m
                            for m in chat_history]
        return super().apply_chat_template(chat_history, add_generation_prompt)

    # ---- exact-token documents -------------------------------------------------------------------------------------
    def _exact_ids(self, req, key: str, text: str):
        """The document's token ids when this request can be evaluated from them, else None."""
        doc = getattr(req, "doc", None)
        if not isinstance(doc, dict) or key not in doc:
            return None
        if key == "prompt_ids":
            self._check_chat_layout(req, text)
        if not self.exact_tokens:
            return None
        ids = list(doc[key])
        if self.tokenizer.decode(ids, skip_special_tokens=False) != text:
            if "tokenizer-mismatch" not in self._warned:
                self._warned.add("tokenizer-mismatch")
                logger.warning("rope_patch: the prompts of %s differ from their documents' token ids (built with "
                               "another tokenizer, or changed by a chat template, system instruction or few-shot "
                               "examples); evaluating the prompt text instead of the ids.", req.task_name)
            return None
        return ids

    def _chat_marks(self) -> tuple[str, str]:
        """The text of the chat template's opening and of its assistant prefix (`passkey.chat_wrap`); ("", "") for a
        tokenizer without a template. Read from the tokenizer, which a model object keeps."""
        if getattr(self, "_marks", None) is None:
            marks = ("", "")
            if has_chat_template(self.tokenizer):
                try:
                    before, after = chat_wrap(self.tokenizer)
                except ValueError:  # a template that cannot frame one user turn: no prompt is read as templated
                    pass
                else:
                    decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
                    marks = (decode(before), decode(after))
            self._marks = marks
        return self._marks

    def _is_templated(self, text: str) -> bool:
        """Whether lm-eval rendered this prompt with the chat template, read from the prompt itself (not from a call
        of `apply_chat_template`: `--cache_requests` loads rendered prompts without one, and one model object may
        serve several runs): it opens with the template's opening, or holds its assistant prefix. A mark that is
        blank or the bare BOS would match plain prompts too, and is not used."""
        opening, header = self._chat_marks()
        bos = getattr(self.tokenizer, "bos_token", None) or ""
        return bool((opening.strip() and opening != bos and text.startswith(opening))
                    or (header.strip() and header != bos and header in text))

    def _check_chat_layout(self, req, text: str) -> None:
        """A loud warning when a rope_* prompt is not the length in its task's name because the documents were
        built for the other layout: plain documents under --apply_chat_template (the template's tokens come on top
        of the stated length), or documents built with metadata chat_template=true read without a template. Decided
        per prompt (`_is_templated`)."""
        doc = req.doc
        if "length" not in doc:
            return
        templated = self._is_templated(text)
        if bool(doc.get("chat_template")) == templated:
            return
        key = ("chat-layout", req.task_name, templated)
        if key in self._warned:
            return
        self._warned.add(key)
        n = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        what = ("was built without the chat template (metadata chat_template) and lm-eval wrapped it in one"
                if templated else
                "was built for a chat template (metadata chat_template=true) and lm-eval applied none")
        msg = (f"rope_patch: a {req.task_name} prompt is {n} tokens, not the task's {doc['length']}: the document "
               f"{what}. Pass --metadata chat_template=true exactly when you pass --apply_chat_template "
               "(rope-patch-lm-eval and rope-patch sweep do it for you; lm-eval's --cache_requests keys ignore "
               "--metadata: pass --cache_requests refresh after changing it).")
        logger.warning("\n%s\n%s\n%s", _BANNER, msg, _BANNER)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _chunk_size(self, default: int) -> int:
        bs = self.batch_size
        return int(bs) if str(bs).isdigit() and int(bs) > 1 else default

    # ---- lm-eval's own paths (text documents: RULER, any task), windowed as rope_patch's evaluation is ---------------
    def _model_call(self, inps, attn_mask=None, labels=None):
        with common.windowed_from(self.model, inps.shape[1]):
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        mask = generation_kwargs.get("attention_mask")
        pads = None if mask is None else (mask == 0).sum(-1)
        left = pads is not None and bool(pads.any()) and torch.equal(  # some row padded, every row on its left
            mask.bool(), torch.arange(mask.shape[1], device=mask.device) >= pads[:, None])
        if left and context.shape[1] >= common.WINDOWED_FROM and common.square_masks(self.model):
            return self._generate_rows(context, max_length, stop, pads.tolist(), generation_kwargs)
        # a long prompt of a hybrid model: its sliding layers over their window only, where transformers' sdpa path
        # builds an L x L mask and a float copy of it (about 21 GB at 64k)
        with common.windowed_from(self.model, context.shape[1]):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def _generate_rows(self, context, max_length, stop, pads: list[int], generation_kwargs):
        """A left-padded batch of long prompts, one prompt at a time without its padding: with padding every layer
        gets a (b, 1, L, L) mask (`common.square_masks`; windowed sliding layers too, transformers' mask sliced per
        block). The rows come back as generate returns a batch: left-padded as they went in, and right-padded with
        the pad token where a row stopped sooner. Greedy decoding gives the batch's tokens."""
        rows = []
        for ids, pad in zip(context, pads, strict=True):
            row = dict(generation_kwargs, attention_mask=torch.ones_like(ids[None, pad:]))
            rows.append(torch.cat([ids[:pad], self._model_generate(ids[None, pad:], max_length - pad, stop, **row)[0]]))
        width = max(len(r) for r in rows)
        return torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=self.tokenizer.pad_token_id)
                            for r in rows])

    def generate_until(self, requests, disable_tqdm: bool = False):
        results: list = [None] * len(requests)
        exact, other = [], []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            ids = self._exact_ids(req, "prompt_ids", context)
            if ids is not None and not (gen_kwargs or {}).get("do_sample"):
                exact.append((i, req, ids, int(req.doc["max_new_tokens"])))
            else:
                other.append(i)
        # Same batches as rope-patch compare: consecutive prompts of one length, at most 16 (or --batch_size) each.
        groups: list[list] = []
        for item in exact:
            key = (len(item[2]), item[3], item[1].doc.get("depth"))
            if groups and groups[-1][0] == key and len(groups[-1][1]) < self._chunk_size(16):
                groups[-1][1].append(item)
            else:
                groups.append([key, [item]])
        model = self.model
        for (length, new, _), items in groups:
            if length > self.max_length:
                self._warn_long(length, self.max_length, truncated=False)
            ids = torch.tensor([it[2] for it in items], dtype=torch.long, device=self.device)
            out = retrieval.greedy_generate(model, ids, new)  # (module attribute: tests swap the decoder)
            for (i, req, _, _), g in zip(items, out, strict=True):
                text = self.tokenizer.decode(g.tolist(), skip_special_tokens=True)
                results[i] = text
                self.cache_hook.add_partial("generate_until", req.args, text)
        if other:
            texts = super().generate_until([requests[i] for i in other], disable_tqdm=disable_tqdm)
            for i, text in zip(other, texts, strict=True):
                results[i] = text
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        results: list = [None] * len(requests)
        exact, other = [], []
        for i, req in enumerate(requests):
            ids = self._exact_ids(req, "input_ids", req.args[0])
            (exact if ids is not None else other).append((i, req, ids))
        # Same procedure and batches as rope-patch compare: windows scored from position 0, 8192 tokens a batch.
        by_len: dict[int, list] = {}
        for item in exact:
            by_len.setdefault(len(item[2]), []).append(item)
        model = self.model
        for length, items in by_len.items():
            if length > self.max_length:
                self._warn_long(length, self.max_length, truncated=False)
            step = self._chunk_size(perplexity.batch_size_for(length))
            with common.at_length(model, length), common.windowed_from(model, length):  # as perplexity.window_nll
                for s in range(0, len(items), step):
                    chunk = items[s : s + step]
                    ids = torch.tensor([it[2] for it in chunk], dtype=torch.long, device=self.device)
                    nll = common.token_nll(model, ids)
                    for (i, req, _), row in zip(chunk, nll, strict=True):
                        results[i] = -row.double().sum().item()
                        self.cache_hook.add_partial("loglikelihood_rolling", req.args, results[i])
        # HFLM's rolling path gathers window counts across ranks: every rank must enter it when any rank does.
        need = bool(other)
        if self.world_size > 1:
            counts = self.all_gather(torch.tensor([len(other)], device=self.device))
            need = int(counts.max()) > 0
        if need and other:
            lls = super().loglikelihood_rolling([requests[i] for i, _, _ in other], disable_tqdm=disable_tqdm)
            for (i, _, _), ll in zip(other, lls, strict=True):
                results[i] = ll
        elif need and requests:  # nothing of ours on this rank: a stand-in, neither returned nor cached
            hook, self.cache_hook = self.cache_hook, CacheHook(None)
            try:
                super().loglikelihood_rolling([_as_text(requests[0])], disable_tqdm=True)
            finally:
                self.cache_hook = hook
        return results

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        applied = rope_patch.current(self.model)
        info["rope_patch"] = {"model": str(self._spec), "scheme": None if applied is None else applied.name,
                              "params": {} if applied is None else {k: list(v) if isinstance(v, tuple) else v
                                                                    for k, v in applied.params().items()},
                              "adapter": None if self._adapter is None else str(self._adapter),
                              "max_length": self.max_length, "exact_tokens": self.exact_tokens}
        return info
