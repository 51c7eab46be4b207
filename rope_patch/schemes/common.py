"""Shared machinery of the attention-side schemes (kind = "attention").

Every attention scheme first removes the model's rotation: the rotary module runs `PatchedRotaryForward` with
`identity=True` (rope_patch/rotary.py), which returns cos = 1, sin = 0, and `apply_rotary_pos_emb` turns that into
the exact identity (q·1 + rotate_half(q)·0 = q). What a scheme adds on top:

    build(target) -> (scores, attach)
        scores  an `AttentionRule` for the attention function (ALiBi, T5 bias, ReRoPE, Self-Extend), or None when the
                model's own attention backend is kept (NoPE, sinusoidal, learned absolute)
        attach  None or `attach(undo_log)`: attaches modules and hooks (learned tables, embedding hooks)
    Both are built at prepare time, so bad input fails before the model is touched. Whatever ends up on the model
    (scores, hooks) is an object of a module-level class, never a closure, so a patched model copies and pickles.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import attention, discovery
from ..discovery import PatchSite, execution_device  # noqa: F401 (re-exported for the schemes)
from ..rotary import PatchedRotaryForward, TableGrowth
from ..undo import UndoLog
from .base import InstallStep, Scheme


def _takes_positions(module: nn.Module) -> bool:
    params = inspect.signature(type(module).forward).parameters
    return "position_embeddings" in params or "position_ids" in params


@functools.cache
def _runs_attention(cls: type) -> bool:
    """Whether the class's forward looks its attention function up in transformers' interface (or calls the modeling
    file's eager function): what a scheme that replaces the attention function can reach. Read from the source;
    where none is available, assumed (the apply-time check then has the last word)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True
    return any(name in source for name in ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "eager_attention_forward"))


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules: the modules of a decoder layer (a `layer_idx`) that receive positions (a
    `position_embeddings` or `position_ids` argument) and run their attention through transformers' attention
    interface. So LlamaAttention, LongCat's MLA, DBRX's attention inside its norm-attention-norm block; not the
    sparse-attention indexers inside DeepSeek-V3.2's attention, not linear attention (MiniMax's lightning layers,
    which are handed positions they do not use), not cross-attention. Nested matches: the innermost."""
    candidates = [m for m in model.modules()
                  if hasattr(m, "layer_idx") and _takes_positions(m) and _runs_attention(type(m))]
    ids = {id(m) for m in candidates}
    return [m for m in candidates if not any(id(c) in ids for c in m.modules() if c is not m)]


def decoder(model: nn.Module) -> nn.Module:
    """The bare decoder (LlamaModel inside LlamaForCausalLM): it owns the embeddings and receives position_ids."""
    inner = getattr(model, getattr(model, "base_model_prefix", ""), None)
    return inner if isinstance(inner, nn.Module) else model


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


class DeviceTables:
    """Small constant tensors a scheme's hot path reads (a decoding step reads them on every layer), made once per
    device by `on_device` instead of once per call. They are left out of the pickled state, so a pickle made on a GPU
    loads on a CPU (they are made again on first use)."""

    def on_device(self, device: torch.device, make: Callable[[torch.device], torch.Tensor]) -> torch.Tensor:
        made = self.__dict__.setdefault("_on_device", {})
        if device not in made:
            made[device] = make(device)
        return made[device]

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_on_device"}


def table_dtype(module: nn.Module) -> torch.dtype:
    param = next(module.parameters(), None)
    return param.dtype if param is not None and param.is_floating_point() else torch.float32


def cache_arg(kwargs: dict):
    return kwargs.get("cache", kwargs.get("past_key_values"))


@dataclasses.dataclass(frozen=True)
class AttentionScheme(Scheme):
    """A scheme that changes attention itself: it re-positions queries and keys (`layout`: the position copies a layer
    runs), hides keys or adds a bias, through a rule that rope_patch's attention functions run (`build`). Most
    re-positioning schemes declare their rule as a `Geometry` (`TwoRegion.geometry`) and build `Declared(geometry)`;
    [Add a scheme](../guides/add-a-scheme.md) walks through one."""

    kind: ClassVar[str] = "attention"
    changes: ClassVar[str] = "attention"

    # ---- what a scheme defines -------------------------------------------------------------------------------
    def build(self, target: PatchSite) -> tuple[attention.AttentionRule | None, Callable[[UndoLog], None] | None]:
        """What the scheme installs on one model.

        Args:
            target: the model's patch site (its config, rotary modules and attention layers).

        Returns:
            (rule, install): the `AttentionRule` the attention functions run (None: the model's own backend is kept),
                and a step that attaches modules or hooks through the undo log (None: nothing to attach). By default
                the rule derived from the scheme's `geometry`, if it declares one, and nothing to attach.
        """
        geometry = self.geometry()
        return (None if geometry is None else attention.Declared(geometry)), None

    # ---- shared machinery ------------------------------------------------------------------------------------
    def layout(self, module: nn.Module) -> attention.Layout | None:
        """The position copies this scheme runs one attention layer at.

        Args:
            module: an attention layer of the model.

        Returns:
            The `Layout` (attention/copies.py: each copy's position map, which copies give keys), or None: the layer
                runs once, at the positions its rotary gives (a position-free scheme, or a layer left as it is).
        """
        return None

    def repositions(self) -> bool:
        """Whether the scheme moves positions (then every rotary module tags its output and the layers run at the
        copies of `layout`) rather than removing the rotation (ALiBi, NoPE, T5 bias, additive encodings): whether it
        gives layers position copies, i.e. defines `layout`."""
        return type(self).layout is not AttentionScheme.layout

    @property
    def keeps_rotation(self) -> bool:  # type: ignore[override]  # a ClassVar on Scheme
        """Whether queries and keys are still rotated (the analysis's θ′): the schemes that re-position do, the
        position-free ones (ALiBi, NoPE, T5 bias, additive absolute encodings) do not."""
        return self.repositions()

    def geometry(self) -> attention.Geometry | None:
        """The scheme's attention, declared (attention/geometry.py), with `copies` the position maps its regions
        read; None for a scheme whose rule is its own."""
        return None

    def copies(self) -> attention.Layout | None:
        """The position copies of a layer the scheme re-positions (what `layout` gives such a layer)."""
        return None

    def relative_position(self, i, j):
        """From the declaration: the query's position minus the key's in the copies of the region the pair falls in;
        NaN for a key no region covers (hidden)."""
        copies = self.copies()  # first: a scheme missing its sizes says so here
        geometry = self.geometry() if copies is not None else None
        if geometry is None:
            return super().relative_position(i, j)
        i, j = torch.as_tensor(i), torch.as_tensor(j)
        out = torch.full(torch.broadcast_shapes(i.shape, j.shape), torch.nan, dtype=torch.float64)
        for r in geometry.regions:
            back = i - j if r.chunk is None else attention.floor_div(i, r.chunk) - attention.floor_div(j, r.chunk)
            inside = (back >= r.lo) & (back < r.hi) & (j < (r.first if r.first is not None else torch.inf))
            rel = copies.maps[r.query](i) - copies.maps[copies.key_copies[r.keys]](j)
            out = torch.where(inside, rel.to(torch.float64), out)
        return out

    def rotations(self, target: PatchSite) -> dict[int, attention.Rotation]:
        """The model's own RoPE per layer (`layer_idx` → Rotation) for re-rotating un-rotated cached keys inside
        attention (`cache_rotation="consistent"`, schemes/cached.py); or a clear error for layouts it cannot serve."""
        modules = attention_modules(target.model)
        self._check_attention_function(target, modules)
        fns = {getattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb", None) for m in modules}
        params = inspect.signature(type(target.rotary).forward).parameters
        if (len(fns) != 1 or None in fns or list(params)[:3] != ["self", "x", "position_ids"]
                or "mrope_section" in params):
            raise ValueError(
                f"{self.name}: cannot re-apply the RoPE of {target.model_type} inside attention (no module-level "
                "`apply_rotary_pos_emb(q, k, cos, sin)` / rotary `forward(x, position_ids)`). Supported: llama, "
                "mistral, mixtral, qwen2/3, gemma, gemma2, gemma3_text, phi3, olmo2, granite, starcoder2, ..."
            )
        apply_rotary = fns.pop()
        kinds = target.layer_types
        layer_types = getattr(target.config, "layer_types", None)
        if kinds != [None] and (layer_types is None or set(kinds) - set(layer_types) or "layer_type" not in params):
            raise ValueError(
                f"{self.name}: {target.model_type} keeps one RoPE per layer type ({', '.join(kinds)}) but its config's "
                f"`layer_types` ({layer_types!r}) or its rotary forward does not say which layer uses which; "
                "supported per-layer-type models: gemma3_text."
            )
        return {m.layer_idx: attention.Rotation(target.rotary, apply_rotary,
                                                None if kinds == [None] else layer_types[m.layer_idx])
                for m in modules}

    def _check_attention_function(self, target: PatchSite, modules: list[nn.Module]) -> None:
        """Refuse models whose attention a registered attention function cannot reproduce (attention sinks, MLA's
        unequal head sizes, attention computed outside transformers' AttentionInterface)."""
        why = discovery.attention_function_limits(target, modules, target.config._attn_implementation)
        if why is not None:
            raise self._not_here(target, why)

    def _not_here(self, target: PatchSite, why: str) -> ValueError:
        """The refusal of a model whose attention this scheme's own attention function cannot stand in for."""
        return ValueError(
            f"{self.name}: {why}. This scheme runs its own attention function, so it is not supported on "
            f"{target.model_type}; the schemes that keep the model's own attention (nope, sinusoidal, "
            "learned_absolute) and the frequency schemes are.")

    def _check_backend(self, target: PatchSite, scores: attention.AttentionRule) -> str:
        """The name of rope_patch's attention function standing in for the model's backend (`attention.BACKENDS`), or
        a clear error where it cannot run this scheme here (the backend, the scheme's forms, the device, the cache)."""
        impl = target.config._attn_implementation
        if impl not in attention.BACKENDS:
            raise ValueError(
                f"{self.name}: attention backend {impl!r} is not supported; supported: "
                f"{', '.join(attention.BACKENDS)}. Call model.set_attn_implementation('sdpa') (memory-lean, query "
                "blocks) or 'eager' (returns attention weights) before rope_patch.apply."
            )
        device = _device(target.model)
        flex = impl == "flex_attention"
        flash = impl == "flash_attention_2"
        if flex and not attention.flex_available():
            raise ValueError(f"{self.name}: attention backend 'flex_attention' needs torch.nn.attention.flex_attention "
                             f"(torch ≥ 2.5), not found in torch {torch.__version__}. Use "
                             "model.set_attn_implementation('sdpa').")
        if flex and type(scores).flex is attention.AttentionRule.flex:
            raise ValueError(f"{self.name}: has no flex_attention form (its scores define no `flex`). Use "
                             "model.set_attn_implementation('sdpa') before rope_patch.apply.")
        if flex and attention.settings.FLEX_COMPILE and device.type == "cpu":
            # torch 2.13's compiled CPU flex kernel refuses return_lse ("torch.compile on CPU only supports inference
            # and `return_lse` is not supported yet"), fails to compile once recompiles make shapes dynamic (C++
            # error "'cur_kvSplitSize0' was not declared", transformers' own flex backend too), and with static
            # shapes returned NaN after a few recompiles in one process. Eager flex would materialise every score.
            why = ("merges two flex_attention calls by their log-sum-exp, which torch's compiled CPU flex kernel does "
                   "not return ('return_lse is not supported yet' on CPU)" if scores.flex_lse else
                   "would run through torch's compiled CPU flex kernel, which miscompiles score_mods that change "
                   "between calls (C++ compile errors, NaN outputs after recompiles)")
            raise ValueError(
                f"{self.name}: on the 'flex_attention' backend this scheme {why}; torch {torch.__version__}, found the "
                f"model on {device}. Use model.set_attn_implementation('sdpa') on CPU (the memory-lean blocked path, "
                "exact), or run flex_attention on CUDA."
            )
        if flash and scores.flash_slopes(device) is None:
            raise ValueError(
                f"{self.name}: attention backend 'flash_attention_2' cannot run this scheme (flash-attention only adds "
                "ALiBi slopes, no other bias or rotation; supported there: alibi, nope, sinusoidal, learned_absolute). "
                "Use model.set_attn_implementation('sdpa') (or 'flex_attention' on CUDA) before rope_patch.apply."
            )
        if flash and attention.flash_module() is None:
            raise ValueError(
                f"{self.name}: attention backend 'flash_attention_2' needs the `flash_attn` package, which cannot be "
                "imported. Install flash-attn (CUDA), or use model.set_attn_implementation('sdpa')."
            )
        if flash and device.type not in attention.settings.FLASH_DEVICES:
            raise ValueError(
                f"{self.name}: attention backend 'flash_attention_2' runs "
                f"on {' / '.join(attention.settings.FLASH_DEVICES)} tensors; found the model on {device}. Move it with "
                "model.to('cuda') first, or use model.set_attn_implementation('sdpa')."
            )
        cache_impl = getattr(getattr(target.model, "generation_config", None), "cache_implementation", None)
        if cache_impl not in (None, "dynamic", "offloaded", "quantized"):
            raise ValueError(
                f"{self.name}: generation_config.cache_implementation={cache_impl!r} is not supported: a static cache "
                "pads keys to its maximum length, so key slots stop being positions. Use the default dynamic cache."
            )
        return attention.BACKENDS[impl]

    def prepare(self, target: PatchSite) -> InstallStep:
        scores, attach = self.build(target)  # everything computed here, so bad input fails before the model is touched
        modules = attention_modules(target.model)
        if scores is not None:
            self._check_attention_function(target, modules)
        impl = self._check_backend(target, scores) if scores is not None else None
        if scores is not None and not modules:
            own = [m for m in target.model.modules() if hasattr(m, "layer_idx") and _takes_positions(m)]
            if own:  # layers that take positions, none of which runs attention through transformers' interface
                raise self._not_here(target, f"{target.model_type} computes attention in its own module code ("
                                             f"{type(own[0]).__name__} does not call transformers' AttentionInterface),"
                                             " so a registered attention function never runs")
            raise ValueError(f"{self.name}: found no attention modules in {type(target.model).__name__}.")
        moves = self.repositions()
        # A layer with memory (attention.memory_rotaries: DeepSeek-V4's compressor) runs through the copies even where
        # the scheme moves no position (ALiBi, T5 bias, NoPE: one copy), so its attention learns where the memory
        # entries it appends to the keys are (the positions the layer makes them at)
        layouts = {m: self.layout(m) if moves else (attention.Layout((attention.Identity(),))
                                                    if scores is not None and attention.memory_rotaries(m) else None)
                   for m in modules}
        # The model's own frequencies, as float32 masters (a cast of the model must not round the angles), of every
        # rotary module (one per block kind or base in some models: each is patched alike).
        names = {r: [f"{lt}_inv_freq" if lt else "inv_freq" for lt in target.site(r).layer_types]
                 for r in target.rotaries}
        table = target.table  # a table rotary (GPT-J, CodeGen): its sin/cos rows are the frequencies it holds
        if table is not None:
            names = {target.rotary: [table.buffer]}
            self._check_table(target, layouts)

        def put(log: UndoLog, rule, layouts: dict, cache_mode: str, wrap=None) -> None:
            """Install `rule` with these layouts (the scheme's own, or the check's probes) through `log`."""
            for r in target.rotaries:
                masters = {n: r._buffers[n].float() for n in names[r]}
                for n, master in masters.items():
                    log.set_buffer(r, n, master)
                # The re-positioning schemes keep the model's rotation (their layers run at copies of other
                # positions); the others remove it. Either way the embeddings remember their source, for the copies
                # and the check.
                log.setattr(r, "forward", PatchedRotaryForward(
                    r, masters, identity=not moves, config=target.config, attn_implementation=impl,
                    allowed=allowed_backends(wrap), scheme=self.name, tagged=rule is not None,
                    update=_table_growth(r, table), sin_first=table is not None and table.returns_sin_first))
            if rule is not None:
                install_rule(log, target, self.name, rule, layouts, cache_mode, wrap, impl)

        def install(log: UndoLog) -> None:
            mode, chosen = attention.HEADS, layouts
            if scores is not None and target.check:
                # on the model's private config (api.apply), before anything of the scheme is on the model
                mode, chosen = attention.plumbing.verify(target, self.name, scores, layouts, impl,
                                                         rotate_reference=False, install=put)
            put(log, scores, chosen, mode)
            if attach is not None:
                attach(log)

        return install


    def _check_table(self, target: PatchSite, layouts: dict) -> None:
        """A table rotary holds rows at integer positions only: a scheme that moves queries or keys to fractional
        positions (leaky ReRoPE's j/k) has no row to read there. Read from the scheme's own position maps."""
        probe = torch.arange(0, 64, dtype=torch.int64)
        table = (f"{target.model_type} rotates from a sin/cos table of integer positions "
                 f"({type(target.rotary).__name__}.{target.table.buffer})")
        for layout in layouts.values():
            for m in layout.maps if layout is not None else ():
                if hasattr(m, "embed"):  # DPE: one position per frequency group, the groups read at a fractional probe
                    raise ValueError(f"{self.name}: places each frequency group of the rotation at positions of its "
                                     "own, reading the groups from the rotary at a fractional position, and "
                                     f"{table} whose rows are not split by frequency. Use self_extend (one group size "
                                     "for every frequency) on this architecture.")
                if m(probe).is_floating_point():
                    raise ValueError(f"{self.name}: moves queries or keys to fractional positions, and {table}, which "
                                     "has no rows between them. Use a scheme with integer positions (self_extend, "
                                     "rerope, string, dca) on this architecture.")


def allowed_backends(wrap) -> tuple:
    """The attention implementations a patched rotary accepts: rope_patch's own; during the apply-time check (`wrap`
    given) also eager and the capturing function, which its reference runs switch a layer to for one call (a rotary
    inside the layer, as Moshi's, must not take that for a user's backend change)."""
    during_check = ("eager", attention.plumbing.CAPTURE) if wrap is not None else ()
    return (*attention.BACKENDS.values(), attention.windowed.WINDOWED_BLOCKED, *during_check)


def install_rule(log: UndoLog, target: PatchSite, name: str, rule, layouts: dict, cache_mode: str, wrap, impl: str):
    """Put `rule` on every attention layer of `layouts` through `log`: the layer's state, its copies (`Reentry`, where
    it has a layout) and the check's `wrap`; the cache guard; the backend (on the model's private config only)."""
    attention.register()
    state = attention.AttnState(rule, rotaries=tuple(target.rotaries))
    for m, layout in layouts.items():
        log.setattr(m, attention.STATE, state)
        inner = attention.Reentry(m, layout, cache_mode) if layout is not None else None
        if wrap is not None:
            inner = wrap(m, inner or functools.partial(type(m).forward, m))
        if inner is not None:
            log.setattr(m, "forward", inner)
    log.add_hook(decoder(target.model), CacheGuard(name), with_kwargs=True)
    log.add_hook(decoder(target.model), CacheMark(), with_kwargs=True, after=True)
    target.model.set_attn_implementation(impl)


def _table_growth(rotary: nn.Module, table) -> TableGrowth | None:
    """A table rotary's rows past its last one, made on demand (rotary.TableGrowth) with the frequencies it holds: a
    frequency scheme's under it (a stack), else the model's own."""
    if table is None:
        return None
    installed = getattr(vars(rotary).get("forward"), "update", None)
    if isinstance(installed, TableGrowth):
        return installed
    inv_freq = discovery.default_inv_freq(table.rope_theta, 2 * table.pairs)
    return TableGrowth(table, inv_freq, 1.0)


def _gapped(position_ids, attention_mask) -> bool:
    """Whether consecutive real tokens of some row have ids that do not step by 1 (pads, 0 in a 2-D mask, ignored)."""
    if position_ids is None or position_ids.shape[-1] < 2:
        return False
    ids = position_ids.reshape(-1, position_ids.shape[-1]).long()
    step = ids.diff(dim=-1) != 1
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.shape == ids.shape:
        real = attention_mask.bool()
        step = step & real[:, 1:] & real[:, :-1]
    return bool(step.any())


# An attribute of a cache whose keys a forward wrote at position ids with gaps or restarts: the cache keeps no ids
# beside its keys, so a later step that reads them is refused (`CacheGuard`); set by `CacheMark`
GAPPED = "rope_patch_gapped_ids"


def _key_layers(cache) -> list:
    """The cache layers that hold keys (a `CacheLayerMixin`): not a hybrid model's linear-attention layers (qwen3_next's
    gated delta net caches a recurrent state), nor the empty placeholders of KV-shared layers (Gemma 4's DummyLayer)."""
    layers = getattr(cache, "layers", None) or ()
    return [layer for layer in layers if isinstance(layer, CacheLayerMixin)]


def _holds_keys(cache) -> bool:
    """Whether a cache already holds keys (a first forward gets an empty one, or none: the decoder makes it)."""
    if cache is None:
        return False
    layers = _key_layers(cache)
    if layers:
        return any(layer.get_seq_length() > 0 for layer in layers)
    try:
        return cache.get_seq_length() > 0
    except Exception:  # noqa: BLE001 (a cache that cannot say: taken as holding keys, so gapped ids are refused)
        return True


class CacheGuard:
    """Forward pre-hook on the decoder: refuse caches whose key slots are not positions (static / hybrid caches), and
    position ids with gaps or restarts where keys already in the cache would be read (the cache keeps no ids beside
    them). A first forward on an empty cache (the one an eval-mode forward makes by default) is served exactly: its
    keys are this forward's, whose ids the attention reads; `CacheMark` marks such a cache, and a later step that
    reads it is refused here."""

    def __init__(self, scheme: str):
        self.scheme = scheme

    def __call__(self, module, args, kwargs):
        cache = cache_arg(kwargs)
        layers = _key_layers(cache)
        # a static cache's layers are "compileable"; a KV-shared layer's placeholder is too, but holds no keys
        if any(getattr(layer, "is_compileable", False) for layer in layers):
            raise ValueError(
                f"{self.scheme}: a static KV cache ({type(cache).__name__}) is not supported: it pads keys to its "
                "maximum length, so key slots stop being positions. Use the default DynamicCache (generate's default)."
            )
        if not _holds_keys(cache):
            if GAPPED in getattr(cache, "__dict__", {}):
                delattr(cache, GAPPED)  # emptied (reset) since gapped keys were written: their mark goes with them
            return
        if getattr(cache, GAPPED, False):
            raise ValueError(
                f"{self.scheme}: this cache holds keys written at position ids with gaps or restarts (PoSE's skipped "
                "ids, packed rows), and a cache keeps no position ids beside its keys, so this step would place each "
                "cached key at its slot, not at its id. The forward that wrote them was exact; to go on from it, run "
                "the whole sequence again in one forward (with use_cache=False, or on an empty cache).")
        if _gapped(kwargs.get("position_ids"), kwargs.get("attention_mask")):
            raise ValueError(
                f"{self.scheme}: position ids with gaps or restarts (PoSE's skipped ids, packed rows) together with a "
                "KV cache that already holds keys are not supported: the cache keeps no position ids beside its keys, "
                "so a cached key's distance would be its slot's. Run such inputs in one forward, without a cache "
                "(use_cache=False, as training does) or on an empty one.")


class CacheMark:
    """Forward hook on the decoder: a cache a forward with gapped or restarting position ids wrote to is marked
    (`GAPPED`), so that `CacheGuard` refuses a later step that would read its keys."""

    def __call__(self, module, args, kwargs, output):
        if not _gapped(kwargs.get("position_ids"), kwargs.get("attention_mask")):
            return
        found = [getattr(output, name, None) for name in ("cache", "past_key_values")]
        if isinstance(output, tuple):  # return_dict=False
            found += [x for x in output if isinstance(x, Cache)]
        cache = next((c for c in found if isinstance(c, Cache)), cache_arg(kwargs))
        if cache is not None:
            setattr(cache, GAPPED, True)


def sinusoid(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Vaswani et al. 2017 §3.5: PE(pos, 2t) = sin(pos / θ^(2t/d)), PE(pos, 2t+1) = cos(pos / θ^(2t/d)).
    positions (...,) → (..., dim) float32; an odd `dim` drops the last cosine."""
    t = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
    angle = positions.float()[..., None] / theta ** (t / dim)
    pe = torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)
    return pe[..., :dim]
