"""The apply-time plumbing check: an attention-side scheme runs side by side with the model's own layers, at an
identity setting, before it is accepted on an architecture; a difference refuses it and leaves the model as it was.

A scheme that replaces the attention function relies on the architecture's code: that its layers call transformers'
attention interface with what their own attention would get, and, for the re-positioning schemes, that a layer
computes its queries and keys at whatever positions it is handed (attention/copies.py). That is decided by running
the code, not by model name.

What runs: the model patched with the scheme's rule at an identity setting (`AttentionRule.probe`) and every position
copy at the tokens' own positions, plus one extra copy at p + SHIFT, on a 2-row batch (row 0 left-padded) of
`length(model)` tokens: (1) a prefill without cache, (2) a prefill of all but the last two tokens into the model's
cache, then two one-token steps. Every attention layer call also runs
    - the layer's own forward with the model's own attention function on the same input (a cache of its own for the
      cached steps): the outputs must agree within the dtype's tolerance;
    - the layer's own forward at p + SHIFT with a capturing attention function: the extra copy's queries (and keys,
      where the copies reach attention stacked) must agree with it;
and the layer must have called rope_patch's attention function without raising (e.g. `NotProven`). The cache
hand-back (`CacheView` SEQUENTIAL, HEADS, ROWS; SPLIT where the values move with the positions) is the first that
passes. A `Layout.chosen` layout keeps every key set instead where a layer reads keys another layer stored
(`SharedKeys`).

Cost: about 3 + c forwards of a `length`-token input per mode tried (48 ≤ `length` ≤ 1040, past every sliding window,
attention chunk and sparse top-k the config or layers declare), in the model's dtype and device; once per
architecture, scheme family and backend per process. `rope_patch.apply(..., check=False)` skips it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from collections.abc import MutableMapping

import torch
import transformers
from torch import nn

from ..discovery import execution_device
from ..rotary import embed, recover, source
from ..undo import UndoLog
from .copies import (
    CACHE_ARGS,
    HEADS,
    ROWS,
    SEQUENTIAL,
    SPLIT,
    Identity,
    Layout,
    MemoryPositions,
    NotProven,
    SharedKeys,
    forward_signature,
    memory_rotaries,
)
from .protocol import module_state

SHIFT = 3  # the extra copy's positions: p + SHIFT
CAPTURE = "rope_patch_capture"  # an attention function that keeps q, k and v (registered under our own name)
MIN_LENGTH, MAX_LENGTH = 48, 1040
# architecture key -> (the cache mode that passed, whether layers read others' keys), or why the check did not hold
# (a refusal, said again without running it), in this process
CHECKED: dict = {}


SHIFTED = functools.partial(torch.add, other=SHIFT)  # p ↦ p + SHIFT: the extra copy's position map


def length(model: nn.Module, modules: list[nn.Module]) -> int:
    """Input length of the check: past every window-like size the config or the layers declare (sliding windows,
    attention chunks, sparse-attention top-k), so the paths that only run beyond them run."""
    sizes = [MIN_LENGTH - 16]
    for obj in [model.config, *modules]:
        for key, value in vars(obj).items():
            if isinstance(value, int) and not isinstance(value, bool) and "expert" not in key and any(
                    w in key for w in ("window", "chunk", "topk", "top_k")):
                sizes.append(value)
    return min(max(sizes) + 16, MAX_LENGTH)


def all_sets(layouts: dict) -> dict:
    """The layouts with every key set kept in the cache (`Layout.chosen` off): for a model whose layers read keys
    another layer stored (KV sharing), each in its own order."""
    return {m: dataclasses.replace(v, chosen=False) if v is not None else None for m, v in layouts.items()}


@dataclasses.dataclass
class Finding:
    layer: int
    module: str
    what: str
    size: float | None
    step: str
    values: bool = False  # the values move with the positions (K = V): the SPLIT hand-over serves that
    shared: bool = False  # a layer reads keys another layer stored (KV sharing): every key set is kept (`all_sets`)
    raised: bool = False  # an exception, not a difference: perhaps of the moment (memory), so the refusal is not kept


class Recorder:
    """On a layer's AttnState during the check: what rope_patch's attention function received."""

    def __init__(self):
        self.calls, self.query, self.key, self.value = 0, None, None, None
        self.chooses: set = set()  # layers that hand attention a sparse-attention indexer's choice of keys
        self.rereads: set = set()  # layers handed every cached key's position embeddings at a decoding step

    def seen(self, query, key, value, module=None, indices=None):
        self.calls, self.query, self.key, self.value = self.calls + 1, query, key, value
        self.placed = False  # keys beyond the tokens (memory entries) placed at the positions the layer made them at
        if indices is not None:  # (a call that hands indices names its module)
            self.chooses.add(module)


def _capture(module, query, key, value, attention_mask, *args, **kwargs):
    """The attention function of the check's moved-position runs: keeps q, k and v, returns zeros."""
    module._rope_patch_captured = (query, key, value)
    b, h, n, _ = query.shape
    return query.new_zeros(b, n, h, value.shape[-1]), None


class Stop(Exception):
    """A layer failed during the check (its finding is noted): the run stops."""


def _raised(e: Exception) -> str:
    text = str(e).splitlines()[0][:300] if str(e) else ""
    return text if isinstance(e, NotProven) else f"raised {type(e).__name__}: {text}"


class Check:
    """One run of the check on a model (see the module docstring)."""

    def __init__(self, model: nn.Module, rotate_reference: bool, mode: str):
        self.rotate_reference, self.mode = rotate_reference, mode
        self.dtype = next(model.parameters()).dtype
        # the relative max difference allowed between two computations of one layer: kernels differ in summation order
        self.tol = 1e-3 if self.dtype in (torch.float32, torch.float64) else 3e-2
        self.findings: list[Finding] = []
        self.step = ""
        self.cached = False  # the current model call runs with a cache (keys come from it, not from the copies)
        self.rows: torch.Tensor | None = None  # (b, q) real query tokens of the current model call
        self.shadows: dict[int, object] = {}

    def shadow(self, obj, run: str = "native"):
        """The layers' own state for the reference runs: a copy of the model's cache, or of a dict the decoder hands
        every layer (Gemma 4's shared_kv_states: a producing layer stores its keys there, later layers read them),
        taken when first seen, before any layer wrote; one per kind of run, so the native and moved-position runs
        chain through their own producers."""
        if (id(obj), run) not in self.shadows:
            self.shadows[(id(obj), run)] = copy.copy(obj) if isinstance(obj, MutableMapping) else copy.deepcopy(obj)
        return self.shadows[(id(obj), run)]

    def note(self, module, what: str, size: float | None = None, values: bool = False, shared: bool = False,
             raised: bool = False):
        self.findings.append(Finding(getattr(module, "layer_idx", -1), type(module).__name__, what, size, self.step,
                                     values, shared, raised))

    def compare(self, module, what: str, got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor | None,
                values: bool = False):
        """got/want (b, n, ...) or (b, H, n, d) with `rows` (b, n) the real tokens, compared on those; `values`: what
        is compared are values that move with the positions (`Finding.values`)."""
        if got.shape != want.shape:
            self.note(module, f"{what}: shape {tuple(got.shape)} where the model has {tuple(want.shape)}", None, values)
            return
        seq = got.shape[1] if got.dim() == 3 else got.shape[2]
        if rows is not None and tuple(rows.shape) == (got.shape[0], seq):  # (a layer over other units than the
            keep = rows.to(got.device)                                     # tokens, Blt's patches: every row)
            keep = keep if got.dim() == 3 else keep[:, None, :].expand(got.shape[0], got.shape[1], -1)
            got, want = got[keep.bool()], want[keep.bool()]
        got, want = got.float(), want.float()
        size = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
        if not size <= self.tol:
            self.note(module, what, size, values)


def _held(call: dict, extra: dict) -> list[tuple[dict, str]]:
    """Where a layer call's state is, as (dict, name): its cache, and any mapping the decoder hands every layer."""
    return [(where, name) for where in (call, extra) for name, value in where.items()
            if (name in CACHE_ARGS and value is not None) or isinstance(value, MutableMapping)]


def _made_at(embeddings, shift: int):
    """Position embeddings (or a dict of them: DeepSeek-V4's {"main", "compress"}) made again by their rotary module
    at their positions + shift; others as they are."""
    if type(embeddings) is dict:
        return {k: _made_at(v, shift) for k, v in embeddings.items()}
    return embed(embeddings, embeddings.position_ids + shift) if source(embeddings) is not None else embeddings


class SideBySide:
    """The forward of an attention module during the check: the scheme's, then the layer's own on the same input."""

    def __init__(self, check: Check, layouts: dict, module: nn.Module, inner):
        self.check, self.module, self.inner, self.layout = check, module, inner, layouts[module]

    def __call__(self, *args, **kwargs):
        check, module = self.check, self.module
        call = dict(forward_signature(type(module)).bind(module, *args, **kwargs).arguments)
        call.pop("self", None)
        extra = call.pop("kwargs", {})  # the layer's **kwargs, passed on as keywords beside its other arguments
        for where, name in _held(call, extra):  # the layer's state as it was before the scheme's run wrote to it
            check.shadow(where[name])
            check.shadow(where[name], "moved")
        embeddings = call.get("position_embeddings")
        if embeddings is not None and source(embeddings) is None:  # sliced by the decoder (Gemma 4's shared layers)
            call["position_embeddings"] = recover(embeddings, module_state(module).rotaries) or embeddings
        recorder = module_state(module).recorder
        before = recorder.calls
        try:
            out = self.inner(*args, **kwargs)
        except Stop:
            raise
        except Exception as e:  # NotProven, or a layer that cannot run the copies: the run stops, the check refuses
            check.note(module, _raised(e), shared=isinstance(e, SharedKeys), raised=not isinstance(e, NotProven))
            raise Stop from e
        if recorder.calls == before:
            check.note(module, "rope_patch's attention function never ran (the layer computes attention in its own "
                               "code, so a scheme that replaces the attention function has no effect)")
            return out
        if not check.cached and recorder.key.shape[2] != recorder.query.shape[2] and not recorder.placed:
            # the schemes place keys by their slot (a token at a position), or memory entries appended to the keys at
            # the positions the layer rotated them at (DeepSeek-V4's compressor): keys that are neither have none
            check.note(module, f"it attends to {recorder.key.shape[2]} keys for {recorder.query.shape[2]} tokens (keys "
                               "that are not tokens, and that no rotation inside the layer made at positions, have no "
                               "position a scheme can place)")
        got = out[0] if isinstance(out, tuple) else out
        try:
            want = self._native(call, extra)
        except Exception as e:  # the layer's own run with the copies' inputs: what the copies changed, it rejects
            check.note(module, f"its own forward on the same input {_raised(e)}", raised=True)
            raise Stop from e
        check.compare(module, "its output", got, want[0] if isinstance(want, tuple) else want, check.rows)
        if self.layout is not None:
            self._moved(call, extra, recorder)
        return out

    def _inputs(self, call: dict, extra: dict, run: str, shift: int | None) -> tuple[dict, dict]:
        """The call's input for a reference run: the layer's state of that `run` (`Check.shadow`), the positions
        moved by `shift` (None: the position embeddings as they were handed)."""
        call, extra = dict(call), dict(extra)
        if shift is not None and "position_embeddings" in call:
            call["position_embeddings"] = _made_at(call["position_embeddings"], shift)
        for where, name in _held(call, extra):
            where[name] = self.check.shadow(where[name], run)
        for where in (call, extra):
            if shift and where.get("position_ids") is not None:
                where["position_ids"] = where["position_ids"] + shift
        return call, extra

    def _native(self, call: dict, extra: dict):
        """The layer's own forward with the model's own attention function and its own cache."""
        call, extra = self._inputs(call, extra, "native", 0 if self.check.rotate_reference else None)
        hidden = call[next(iter(call))]
        for where in (call, extra):
            if "attention_mask" in where:
                where["attention_mask"] = eager_mask(where["attention_mask"], hidden, self.check.dtype)
        return self._with_backend("eager", call, extra)  # the modeling file's own (eager_mask says why)

    def _moved(self, call: dict, extra: dict, recorder: Recorder):
        """The extra copy against the layer's own forward at p + SHIFT."""
        check, module = self.check, self.module
        b = check.rows.shape[0]
        if recorder.query.shape[0] != b * self.layout.copies:  # the layer ran once: no positions reached it
            return
        copy = slice((self.layout.copies - 1) * b, self.layout.copies * b)  # the extra copy's rows
        shared = {name: value for where in (call, extra) for name, value in where.items()
                  if isinstance(value, MutableMapping)}
        # the moved run keeps its own cache and shared state, fed by the moved runs of every step and layer (a layer
        # whose queries depend on cached state, as Zaya's convolved projections, needs its own past)
        call, extra = self._inputs(call, extra, "moved", SHIFT)
        # memory entries the layer rotates at positions of its own making move with the positions too (the copies
        # make them at map_t(p): copies.MemoryPositions)
        given = call.get("position_ids", extra.get("position_ids"))
        memory = MemoryPositions(memory_rotaries(module), (SHIFTED,), b, given, [])
        try:
            self._with_backend(CAPTURE, call, extra)
        except Exception as e:
            # shared state only the model's own run holds was stored by a layer without the side-by-side run: one
            # this scheme leaves as it is (skip_layers), whose keys this layer would read at the model's positions
            unfed = [f"{name}[{k!r}]" for name, value in shared.items()
                     for k in value if k not in check.shadow(value, "moved")]
            if not unfed:
                raise
            check.note(module, f"it reads keys another layer stored ({', '.join(unfed)}: KV sharing), and that layer "
                               "is one the scheme leaves as it is, so this layer would read them at the model's "
                               "positions, not the scheme's: patch both layers or neither (skip_layers)")
            raise Stop from e
        finally:
            memory.close()
        q, k, value = module.__dict__.pop("_rope_patch_captured")
        check.compare(module, f"its queries at moved positions (p + {SHIFT})", recorder.query[copy], q, check.rows)
        if check.cached:  # with a cache the keys come from it; without, they reach attention stacked like the queries
            return
        check.compare(module, f"its keys at moved positions (p + {SHIFT})", recorder.key[copy][:, :, -k.shape[2]:], k,
                      check.rows)
        values = recorder.value
        if check.mode == SPLIT:  # values read per key set: the copy's must be the layer's own at p + SHIFT too
            check.compare(module, f"its values at moved positions (p + {SHIFT})",
                          values[copy][:, :, -k.shape[2]:], value, check.rows)
        elif values is not None and values.shape[0] == recorder.query.shape[0]:
            # a key's value is read from copy 0 whatever copy its key comes from: values must not move with positions
            check.compare(module, f"its values, which move with the positions (p + {SHIFT}: a rotated value, as "
                                  "DeepSeek-V4's K = V)", values[copy], values[:b], None, values=True)

    def _with_backend(self, backend: str, call: dict, extra: dict):
        config = self.module.config
        before = config._attn_implementation_internal
        config._attn_implementation_internal = backend
        try:
            return type(self.module).forward(self.module, **call, **extra)  # under run's no_grad
        finally:
            config._attn_implementation_internal = before


def eager_mask(mask, hidden: torch.Tensor, dtype: torch.dtype):
    """The mask rope_patch's function received, as the modeling file's eager function takes it: additive float
    (b|1, 1, q, k). The reference run is eager whatever the backend (the model's own eager code: softcapping, sinks
    and all; transformers' compiled flex and flash kernels need not run here): sdpa's boolean mask and flex's
    BlockMask are materialised, a 2-D padding mask (flash) or no mask (causal, skipped) become the causal mask."""
    if type(mask) is dict:  # masks per purpose (Zaya: {"causal", "conv"}): the 4-D / block masks converted, the rest
        # as given
        return {k: eager_mask(v, hidden, dtype)
                if (isinstance(v, torch.Tensor) and v.dim() == 4) or hasattr(v, "mask_mod") else v
                for k, v in mask.items()}
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        if mask.dtype != torch.bool:
            return mask
        allowed = mask
    elif mask is not None and hasattr(mask, "mask_mod"):  # flex BlockMask
        from torch.nn.attention.flex_attention import create_mask

        q_len, k_len = mask.seq_lengths
        allowed = create_mask(mask.mask_mod, mask.kv_num_blocks.shape[0], 1, q_len, k_len, device=hidden.device)
    elif mask is None and hidden.shape[1] == 1:
        return None
    else:  # bottom-right-aligned causal (and 2-D padding) mask for q new tokens over k keys
        q_len = hidden.shape[1]
        k_len = mask.shape[-1] if mask is not None else q_len
        i = torch.arange(k_len - q_len, k_len, device=hidden.device)[:, None]
        allowed = (torch.arange(k_len, device=hidden.device)[None, :] <= i)[None, None]
        if mask is not None:
            allowed = allowed & mask.bool()[:, None, None, :]
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


@dataclasses.dataclass
class Inputs:
    """The check's input: 2 rows of n tokens, row 0 left-padded by 3 (the mask and the position ids generate passes),
    and whether the cached steps run. What the model itself cannot run is left out (`native_inputs`)."""

    ids: torch.Tensor
    mask: torch.Tensor | None
    positions: torch.Tensor
    cached: bool = True

    def forward(self, model: nn.Module, rows: slice, use_cache: bool, cache=None):
        """One model call of the check on these tokens (going on from `cache` where one is given); returns the cache
        the model returned (None: none)."""
        kwargs = {"attention_mask": self.mask[:, : rows.stop] if self.mask is not None else None,
                  "position_ids": self.positions[:, rows]}
        if cache is not None:
            kwargs["cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"] = cache
        out = model(self.ids[:, rows], **kwargs, use_cache=use_cache)
        # by the output class's own field: `past_key_values` is a deprecated alias where the field is `cache` (5.25;
        # asking for it, or whether the output holds it, logs a warning)
        fields = getattr(type(out), "__dataclass_fields__", {})
        return getattr(out, "cache" if "cache" in fields else "past_key_values", None)

    def real(self, rows: slice) -> torch.Tensor:
        return (self.mask if self.mask is not None else torch.ones_like(self.ids))[:, rows]


def native_inputs(model: nn.Module, n: int) -> Inputs:
    """The check's input, simplified where the unpatched model itself cannot run it: without left padding (a model
    that takes no 2-D padding mask, as Blt's patcher), without the cached steps (a model whose default cache does not
    build, as Blt's)."""
    device = execution_device(model.get_input_embeddings())  # not the meta device of offloaded weights
    vocab = int(getattr(model.config, "vocab_size", 0) or model.get_input_embeddings().num_embeddings)
    ids = torch.randint(min(3, vocab - 1), vocab, (2, n), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    inputs = Inputs(ids.masked_fill(mask == 0, 0), mask, positions)
    with torch.no_grad():
        try:
            inputs.forward(model, slice(0, n), use_cache=False)
        except Exception:  # noqa: BLE001 (what the model cannot run is left out, not a finding)
            inputs = Inputs(ids, None, torch.arange(n, device=device).expand(2, n))
        try:
            cache = inputs.forward(model, slice(0, n - 2), use_cache=True)
            if cache is None:  # a model that keeps its cache to itself (RecurrentGemma): no cached steps to check
                raise LookupError("no cache returned")
            inputs.forward(model, slice(n - 2, n - 1), use_cache=True, cache=cache)
        except Exception:  # noqa: BLE001 (CSM's depth decoder decodes only under its parent model)
            inputs.cached = False
    return inputs


def run(check: Check, model: nn.Module, inputs: Inputs) -> None:
    """The two steps of the check on the patched model (its layers wrapped by SideBySide)."""
    n = inputs.ids.shape[1]

    def step(name: str, rows: slice, cache=None):
        check.step, check.rows = name, inputs.real(rows)
        try:
            return inputs.forward(model, rows, use_cache=check.cached, cache=cache)
        finally:  # the mappings the decoder hands its layers are this call's: their shadows go (a cache's live on)
            check.shadows = {k: v for k, v in check.shadows.items() if not isinstance(v, MutableMapping)}

    with torch.no_grad():
        step("a prefill without cache", slice(0, n))
        if not inputs.cached:
            return
        check.cached = True
        cache = step("a prefill into the model's cache", slice(0, n - 2))
        for t in (n - 2, n - 1):
            step("cached decoding", slice(t, t + 1), cache)


def architecture(model: nn.Module, layouts: dict, rule, backend: str, rotate_reference: bool):
    """What the check's verdict depends on: the model class, its attention layer kinds (class and scalar attributes),
    the copies each layer runs in order (which layers a scheme leaves alone matters where layers read each other's
    keys: Ms-PoE's `skip_layers` on Gemma 3n), the scheme's rule class, the backend, the dtype (its tolerance, and
    kernels that differ by dtype: a float64 eager mask once gave NaN) and the device type (kernels differ by device)."""
    kinds = set()
    for m in layouts:
        scalars = tuple(sorted((k, v) for k, v in vars(m).items() if k not in ("layer_idx", "training")
                               and isinstance(v, (int, float, str, bool, type(None)))))
        kinds.add((type(m).__qualname__, scalars))
    copies = tuple(None if v is None else (v.copies, v.key_copies, v.query_copies, v.chosen) for v in layouts.values())
    rule_kind = getattr(rule, "check_key", None) or type(rule).__qualname__  # a declared rule: its regions' kind
    weight = next(model.parameters())
    return (type(model).__qualname__, frozenset(kinds), copies, rule_kind, backend, rotate_reference, weight.dtype,
            weight.device.type)


def describe(findings: list[Finding], tol: float) -> str:
    first = findings[0]
    size = f" ({first.size:.1e} relative, tolerance {tol:g})" if first.size is not None else ""
    layers = sorted({f.layer for f in findings})
    more = f"; {len(layers)} layers differ ({', '.join(map(str, layers[:8]))}{', ...' if len(layers) > 8 else ''})" \
        if len(layers) > 1 else ""
    return f"{first.module} (layer {first.layer}): {first.what}{size}, in {first.step}{more}"


def verify(target, name: str, rule, layouts: dict, backend: str, rotate_reference: bool, install) -> tuple[str, dict]:
    """Run the check; return the cache mode that passed and the layouts to install (`all_sets` of them where a layer
    reads another layer's keys), or raise ValueError naming the layer and the difference.
    `install(log, rule, layouts, mode, wrap)` installs the scheme through `log` (a scratch undo log, undone here)."""
    model = target.model
    modules = list(layouts)
    key = architecture(model, layouts, rule, backend, rotate_reference)
    if isinstance(CHECKED.get(key), str):
        raise ValueError(f"{name}: {CHECKED[key]}")
    if key in CHECKED:
        mode, shared = CHECKED[key]
        return mode, all_sets(layouts) if shared else layouts
    transformers.AttentionInterface.register(CAPTURE, _capture)
    n = length(model, modules)
    inputs = native_inputs(model, n)
    probe = rule.probe(n)
    # every copy at the true positions, plus the extra copy at p + SHIFT (which no rule reads)
    probes = {m: None if v is None else Layout((Identity(),) * v.copies + (SHIFTED,), v.key_copies, chosen=v.chosen)
              for m, v in layouts.items()}
    # the copies one after another first (the layer's activations held once), stacked where they must share state
    modes = [SEQUENTIAL, HEADS, ROWS] if any(v is not None for v in layouts.values()) else [HEADS]
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())  # the model's own first
               if hasattr(c, "_attn_implementation_internal")}
    backends = [(c, c._attn_implementation_internal) for c in configs.values()]
    # the check compares two computations of each layer: dropout (a model in training mode) would make them differ
    training = [(m, m.training) for m in model.modules()]
    failures, shared = {}, False
    while modes:
        mode = modes.pop(0)
        check = Check(model, rotate_reference, mode)
        log = UndoLog()
        recorder = Recorder()
        try:
            install(log, probe, probes, mode, functools.partial(SideBySide, check, probes))
            for m in modules:
                module_state(m).recorder = recorder
            model.eval()
            run(check, model, inputs)
        except Stop:
            pass
        except Exception as e:  # outside any attention layer (the decoder, a cache the copies changed, ...)
            check.note(model, _raised(e), raised=True)
        finally:
            log.undo()
            for m, was in training:
                m.training = was
            for c, impl in backends:  # as it was (set_attn_implementation would re-check e.g. flash_attn)
                c._attn_implementation_internal = impl
        check.step = "the layers' structure"
        if recorder.chooses and getattr(getattr(rule, "geometry", None), "hides", False):
            m = min(recorder.chooses, key=lambda m: getattr(m, "layer_idx", -1))
            CHECKED[key] = (
                f"{type(m).__name__} (layer {getattr(m, 'layer_idx', '?')}) attends only to the keys its "
                "sparse-attention indexer chose for each query, and this scheme hides every key between the first "
                "tokens and its window: a query whose chosen keys all lie there has no key left, and its output is "
                "undefined (cached decoding and recomputation differ). The pair is refused and the model is left as it "
                "was; on this model use a scheme that keeps every key (rerope, self_extend, ...).")
            raise ValueError(f"{name}: {CHECKED[key]}")
        for m in recorder.chooses:  # a sparse-attention indexer chooses keys at copy 0's positions
            layout = layouts.get(m)
            if layout is not None and not isinstance(layout.maps[0], Identity):
                check.note(m, "it hands attention a sparse-attention indexer's choice of keys, made at copy 0's "
                              "positions; this scheme moves every copy (DCA: chunk positions), so none is the tokens' "
                              "own for the indexer to choose at")
        for m in recorder.rereads - recorder.chooses:
            layout = layouts.get(m)
            if layout is not None and not isinstance(layout.maps[0], Identity):
                check.note(m, "at a decoding step it receives the position embeddings of every cached key, not only "
                              "of its new tokens: something inside it (a sparse-attention indexer: Qwen4-Exp) reads "
                              "every key's position, at copy 0's; this scheme moves every copy (DCA: chunk positions, "
                              "Ms-PoE: 0 and p/r), so none is the tokens' own for it to read")
        if not check.findings:
            CHECKED[key] = mode, shared
            return mode, layouts
        if any(f.shared for f in check.findings):  # KV sharing: keep every key set, and try the modes again
            shared, layouts, probes = True, all_sets(layouts), all_sets(probes)
            modes = [SEQUENTIAL, HEADS, ROWS]
            continue
        failures.setdefault(mode, check)
        if mode in (HEADS, ROWS) and any(f.values for f in check.findings):
            modes = [SPLIT]  # values rotate with the keys: read them per key set, the output split by query copy
            continue
        if mode not in (SEQUENTIAL, SPLIT) and any(f.step == "a prefill without cache" for f in check.findings):
            break  # the stacked prefill without cache failed: another cache mode will not help
    # reported: the first stacked mode's findings (a sequential failure only says the copies must run stacked)
    failure = next((failures[m] for m in (HEADS, ROWS, SPLIT) if m in failures), failures.get(SEQUENTIAL))
    refusal = (
        f"the apply-time check ran the scheme side by side with {target.model_type}'s own attention layers "
        f"(at an identity setting, which must reproduce the model) and it does not hold: "
        f"{describe(failure.findings, failure.tol)}. rope_patch cannot show this scheme correct on this architecture, "
        "so it is refused and the model is left as it was. The frequency schemes and the schemes that keep the "
        "model's own attention (nope, sinusoidal, learned_absolute) are not affected; rope_patch.apply(..., "
        "check=False) skips the check at your own risk.")
    if not any(f.raised for f in failure.findings):  # differences are the architecture's; an exception may pass
        CHECKED[key] = refusal
    raise ValueError(f"{name}: {refusal}")
