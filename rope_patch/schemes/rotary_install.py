"""How a frequency scheme reaches a model (schemes/frequency.py holds the schemes): every rotary module gets the
scheme's frequencies as transformers' own init function computes them from the patched `rope_parameters`, on a
private copy of its config, and the model's config announces the patched form; a sin/cos table rotary (GPT-J,
CodeGen) gets a new table. Before anything is touched the model's config class may veto the scheme, the frequency
count must match what the attention layers rotate, and a rotary that reads its config at every forward runs once;
after install, Resonance RoPE is proven to drive the rotary's own forward, and attention scales computed at init from
`rope_parameters` (DeepSeek) are written as a natively configured model has them."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from typing import TYPE_CHECKING

import torch
import transformers
from packaging.version import Version
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .. import attention, discovery, notices
from ..discovery import PatchSite, RopeContext
from ..registry import did_you_mean
from ..rotary import RESONANCE, ForwardLength, PatchedRotaryForward, Resonance, TableGrowth, angle_forward
from ..undo import UndoLog
from .base import InstallStep
from .cached import prepare as _prepare_consistent
from .common import attention_modules

if TYPE_CHECKING:
    from .frequency import FrequencyScheme

# transformers before 5.21 keeps longrope's long frequencies under `{layer_type}_long_inv_freq` and, once that attribute
# exists, fails on the next forward past the window: longrope on a model with RoPE per layer type is refused there
_OLD_LONGROPE = Version(transformers.__version__) < Version("5.21")


def prepare(scheme: FrequencyScheme, target: PatchSite) -> InstallStep:
    """Every rotary module of the model (one in most; one per block kind or base in Blt, Granite-SWA, Moshi,
    DeepSeek-V4) gets the scheme applied to its own RoPE, as a model built with the patched rope_parameters would
    compute it from its config; the model's config announces the patched form."""
    if scheme.layer_types is not None:
        check_layer_types(scheme, target)
    if target.table is not None:
        return _prepare_table(scheme, target)
    if getattr(scheme, "cache_rotation", None) and len(target.rotaries) > 1:
        raise ValueError(
            f"{scheme.name}: cache_rotation='consistent' re-rotates cached keys inside attention with the model's one "
            f"rotary module; {target.model_type} has {len(target.rotaries)} rotary modules. Use the default "
            "cache_rotation='native'.")
    # Memory rotaries (held by a part of an attention layer: DeepSeek-V4's compressor and indexer) rotate entries at
    # positions of their own making, whose largest is not the sequence's: a scheme whose frequencies follow the
    # sequence length (dynamic_yarn) takes ℓ there from the rotaries that rotate the tokens (rotary.ForwardLength)
    memory = {id(r) for m in attention_modules(target.model) for r in attention.memory_rotaries(m)}
    shared = ForwardLength()
    unshared = _unshared_length(target, memory)
    installs = [_prepare_site(scheme, target, target.site(r), primary=r is target.rotary, shared=shared,
                              follows=id(r) in memory, unshared=unshared)
                for r in target.rotaries]

    def install(log: UndoLog) -> None:
        for step in installs:
            step(log)

    return install


def _unshared_length(target: PatchSite, memory: set) -> str | None:
    """Why the rotaries of the model cannot be shown to run one sequence length ℓ per forward (None: they can): no
    rotary rotates the tokens (all are memory rotaries, `memory`), or the token rotaries are built from different
    sub-configs of the model's config, i.e. belong to separate transformers inside the model, which may number other
    sequences (Blt's global transformer numbers patches, its local encoder and decoder bytes)."""
    tokens = [r for r in target.rotaries if id(r) not in memory]
    if not tokens:
        return (f"every rotary module of {target.model_type} rotates memory entries at positions of its own making "
                "(inside an attention layer), none the tokens at their position ids, so no rotary measures ℓ")
    subs = {id(c): type(c).__name__ for r in tokens if (c := vars(r).get("config")) is not None
            and c is not target.config and _in_tree(c, target.config)}
    if len(tokens) > 1 and subs:
        return (f"{target.model_type}'s rotary modules are built from sub-configs of its config "
                f"({', '.join(sorted(subs.values()))}): separate transformers inside the model, which may number other "
                "sequences than the tokens (Blt's global transformer numbers patches), so one ℓ per forward cannot be "
                "shown")
    return None


def _prepare_site(scheme: FrequencyScheme, model_site: PatchSite, target: PatchSite, primary: bool,
                  shared: ForwardLength | None = None, follows: bool = False,
                  unshared: str | None = None) -> InstallStep:
    """One rotary module (`target`: its site, `model_site`: the model's). The primary one also writes the model's
    config and the attention scales; a rotary built from a sub-config of the model's (Blt) writes that
    sub-config; one built from a config derived for it (Granite-SWA's per-theta copies) only its own copy. A scheme's
    length update reads ℓ through `shared`, the model's one `rotary.ForwardLength` (`follows`: a memory rotary, which
    reads the ℓ the token rotaries record); `unshared`: why no ℓ can be shared (`_unshared_length`)."""
    contexts = target.contexts()
    layered = target.layer_types != [None]
    # the layer types the scheme applies to (all but those `layer_types` leaves, whose entry stays the model's own)
    chosen = [lt for lt in contexts if scheme.applies_to(lt)]
    params = {lt: scheme.rope_parameters(ctx) if lt in chosen else copy.deepcopy(ctx.rope_parameters)
              for lt, ctx in contexts.items()}
    # per layer type; a layer type whose entry is None uses no RoPE (Beam, Cohere Compass) and keeps its None
    public = {lt: params.get(lt) for lt in target.config.rope_parameters} if layered else params[None]
    any_ctx = contexts[chosen[0]]
    _check_derived_base(scheme, model_site, target, {lt: params[lt] for lt in chosen}, contexts)
    if layered and _OLD_LONGROPE and any(p["rope_type"] == "longrope" for p in params.values()):
        raise ValueError(
            f"{scheme.name}: transformers {transformers.__version__}'s longrope update fails on a model with RoPE "
            f"per layer type ({target.model_type}) from the second forward past the original window "
            "(UnboundLocalError: it caches the long frequencies per layer type, then loses them), on a natively "
            "configured model too. "
            "It needs transformers 5.21 or later: pip install -U 'transformers>=5.21', or use yarn.")

    # The rotary module runs with a private copy of the config: transformers' dynamic NTK reads the window
    # where scaling starts from `config.max_position_embeddings`, while the public config must announce the
    # extended window to generate/lm-eval. The copy is per instance; the public config stays the user's object.
    rotary_config = copy.deepcopy(target.config)
    rotary_config.rope_parameters = copy.deepcopy(public)
    rotary_config.max_position_embeddings = scheme.init_window(any_ctx)
    kept = [lt for lt in contexts if lt not in chosen]
    moved = rotary_config.max_position_embeddings != target.config.max_position_embeddings
    for lt in kept:
        own = params[lt]["rope_type"]
        if moved and ("dynamic" in own or own == "longrope"):
            raise ValueError(
                f"{scheme.name}: the {lt} layers that layer_types leaves keep {target.model_type}'s own {own!r} RoPE, "
                "which transformers recomputes at run time from the model's window (max_position_embeddings), and "
                f"{scheme.name} changes that window to {rotary_config.max_position_embeddings}. Apply it to every "
                "layer type, or use a scheme that keeps the window (default with rope_theta, p_rope).")
    if not getattr(rotary_config, "is_heterogeneous", False) and getattr(rotary_config, "head_dim", None) is None:
        # Mixtral & co. set head_dim=None, which breaks transformers' non-default init functions
        rotary_config.head_dim = any_ctx.head_dim
    _validate_with_transformers(scheme, target, rotary_config)
    shipped, new_window = any_ctx.shipped_scaling, scheme.public_window(any_ctx)
    if primary and shipped and new_window is not None and new_window < any_ctx.max_position_embeddings:
        notices.warn(
            f"rope_patch: {scheme.name} replaces the {shipped!r} scaling this checkpoint ships with and serves "
            f"{new_window} tokens, fewer than the shipped window of {any_ctx.max_position_embeddings} "
            f"(factors are relative to the pre-training window {any_ctx.pretraining_window}).")

    scales = _attention_scales(scheme, model_site, public) if primary else []
    device = next(iter(target.rotary.buffers())).device
    buffers, scalings, wavelengths = {}, {}, {}
    update = scheme.rotary_update(target, rotary_config)
    if update is not None and unshared is not None:
        raise ValueError(
            f"{scheme.name}: its frequencies follow the sequence length ℓ of each forward, one scale for every rotary "
            f"module of the model, and {unshared}. Use the static yarn with factor = N/L for your length N.")
    if update is not None and shared is not None:
        update.shared, update.follows = shared, follows
    # cache_rotation="consistent" (dynamic, dynamic_yarn, longrope): keys cached un-rotated, rotated in attention
    consistent = _prepare_consistent(scheme.name, model_site) if getattr(scheme, "cache_rotation", None) else None
    for lt, ctx in contexts.items():
        if lt not in chosen:  # the model's own RoPE, as transformers computed it from the unpatched config at init
            fn = init_fn(params[lt]["rope_type"], type(target.rotary))
            inv_freq, scaling = fn(discovery.layer_config(copy.deepcopy(target.config), lt), layer_type=lt)
            buffers[lt], scalings[lt] = inv_freq.float().to(device), float(scaling)
            continue
        if update is not None:  # the frequencies at ℓ ≤ L, i.e. before the first forward
            inv_freq, scaling = update.start[lt]
            _check_width(scheme, target, lt, inv_freq)
            # Past L the update computes them per length with transformers' own function (dynamic_yarn: yarn ×s):
            # computed here once at the cap, so that a config it fails on, or frequencies of another width than the
            # attention rotates, are refused now and not at the first forward past L (the width and the failures
            # do not depend on s)
            longest, _ = _computed(scheme, target, lt, params[lt]["rope_type"], update.frequencies, update.cap, lt,
                                   at_run_time=True)
            _check_width(scheme, target, lt, longest)
            buffers[lt], scalings[lt] = inv_freq.to(device, copy=True), scaling
            continue
        fn = init_fn(params[lt]["rope_type"], type(target.rotary))
        kwargs = {"layer_type": lt} if layered else {}
        inv_freq, scaling = _computed(scheme, target, lt, params[lt]["rope_type"], fn,
                                      discovery.layer_config(rotary_config, lt), **kwargs)
        buffers[lt] = scheme.adjust(inv_freq.float(), ctx).to(device)
        scalings[lt] = float(scaling)
        if scheme.resonance:
            wavelengths[lt] = resonance_wavelengths(inv_freq).double().cpu()
        _check_width(scheme, target, lt, buffers[lt])
    def install(log: UndoLog) -> None:
        rot = target.rotary
        # the config this rotary was built from, as the patch found it: the model's private config (api.apply) or
        # its private sub-config; a config derived for the rotary alone is not part of what a save writes
        built_from = vars(rot).get("config", model_site.config)
        written = [c for c in (model_site.config if primary else None, built_from)
                   if c is not None and _in_tree(c, model_site.config)]
        log.setattr(rot, "config", rotary_config)
        # not native: the public config keeps the unpatched RoPE, so a plain save reloads the unpatched model
        if scheme.native:
            for cfg in {id(c): c for c in written}.values():
                cfg.rope_parameters = copy.deepcopy(public) if cfg is built_from else _public_of(scheme, cfg)
                cfg.max_position_embeddings = scheme.public_window(any_ctx) or cfg.max_position_embeddings
        for module, value in scales:  # DeepSeek: the softmax scale a model built with `public` has
            log.setattr(module, "scaling", value)
        rope_types = {lt: p["rope_type"] for lt, p in params.items()}
        log.setattr(rot, "rope_type", rope_types if layered else rope_types[None])
        if not layered and "rope_init_fn" in vars(rot):
            # a rotary whose forward computes its frequencies again (PhiMoE: `scheme.ropeinit_fn(scheme.config)`)
            # uses the patched type's function, as a model built with `public` does
            log.setattr(rot, "rope_init_fn", init_fn(rope_types[None], type(rot)))
        log.setattr(rot, "max_seq_len_cached", rotary_config.max_position_embeddings)
        log.setattr(rot, "original_max_seq_len", rotary_config.max_position_embeddings)
        # Single-rotary models keep one `attention_scaling`; per-layer-type ones one per prefix (and the
        # dynamic update also writes the unprefixed one).
        log.setattr(rot, "attention_scaling", scalings[any_ctx.layer_type])
        masters = {}
        for lt, inv_freq in buffers.items():
            prefix = f"{lt}_" if lt else ""
            for name in (f"{prefix}inv_freq", f"{prefix}original_inv_freq"):
                log.set_buffer(rot, name, inv_freq)  # a fresh copy: longrope's update writes `inv_freq` in place
                masters[name] = inv_freq
            log.setattr(rot, f"{prefix}long_inv_freq", None)  # longrope's cache of the long set
            if lt:
                log.setattr(rot, f"{prefix}attention_scaling", scalings[lt])
                log.setattr(rot, f"{prefix}max_seq_len_cached", rotary_config.max_position_embeddings)
        if consistent is not None:
            consistent(log, masters, update)
        else:
            log.setattr(rot, "forward", PatchedRotaryForward(rot, masters, identity=False, update=update))
        _runs(scheme, model_site, rot, device, list(contexts) if layered else [None])
        if wavelengths:  # positions reduced modulo λ̃_i before the multiply, as the authors' code does
            log.setattr(rot, RESONANCE, Resonance(wavelengths))
            _check_resonance(scheme, model_site, rot, list(wavelengths))

    return install


def _check_derived_base(scheme: FrequencyScheme, model_site: PatchSite, target: PatchSite, params: dict,
                        contexts: dict) -> None:
    """A rotary module built from a config that the model's code derives for it at init (a copy outside the model's
    config tree: Granite-SWA's one rotary per base of its per-layer base list, each from a copy of the config with
    that rope_theta) gets its base from the model's code, not from the rope_parameters a patch writes and a save
    keeps: a model configured natively with the patched rope_parameters gives that rotary the model's own base again,
    so a new base there has no native form, and the model's code may read the base back from the rotary's config
    (Granite-SWA looks its rotaries up by it at every forward: a KeyError at the first forward). Refused: the schemes
    that keep each rotary's base reach it as a natively configured model does."""
    built_from = vars(target.rotary).get("config")
    if built_from is None or _in_tree(built_from, model_site.config):
        return
    for lt, entry in params.items():
        own, new = contexts[lt].rope_theta, float(entry["rope_theta"])
        if new == own:
            continue
        where = f" for its {lt} layers" if lt else ""
        raise ValueError(
            f"{scheme.name}: changes the RoPE base (rope_theta {own:g} -> {new:g}), and {model_site.model_type}'s "
            f"{type(target.rotary).__name__}{where} is built from a config the model's code derives for it at init "
            f"(with its own rope_theta {own:g}), not from the rope_parameters a patch writes: a model configured "
            "natively with the patched rope_parameters keeps that rotary's base, so the change has no native form, "
            "and the model's code may look the rotary up by its base. Use a scheme that keeps each rotary's base "
            "(linear, yarn, dynamic, dynamic_yarn, llama3, longrope, p_rope; without rope_theta=), not default with "
            "rope_theta= or ntk.")


def _computed(scheme: FrequencyScheme, target: PatchSite, layer_type, rope_type: str, fn, /, *args,
              at_run_time: bool = False, **kwargs):
    """`fn(*args, **kwargs)`, a computation of transformers' own `rope_type` RoPE function on the patched config.
    Where it fails, a model configured natively with it fails too: refused, naming what failed (`at_run_time`: the
    scheme runs it for each sequence length past the original window, where the first such forward would fail)."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as err:
        where = f" for its {layer_type} layers" if layer_type else ""
        failure = f"{target.model_type}'s config{where} ({type(err).__name__}: {err})"
        if at_run_time:
            raise ValueError(
                f"{scheme.name}: past the original window it computes {rope_type!r} frequencies for each sequence "
                f"length with transformers' own function, and that RoPE computation fails on {failure}, as it does "
                f"for a model configured natively with {rope_type!r}. Use a scheme this architecture's config "
                "supports.") from None
        raise ValueError(
            f"{scheme.name}: transformers' own {rope_type!r} RoPE computation fails on {failure}, so a model "
            "configured with this scheme cannot be built either. Use a scheme this architecture's config "
            "supports.") from None


def check_layer_types(scheme: FrequencyScheme, target: PatchSite) -> None:
    """`layer_types` names layer types of a model whose RoPE is per layer type (config.rope_parameters keyed by layer
    type, one rotary module): every name one of them, and one that rotates (a None entry is a layer without RoPE)."""
    names = ", ".join(scheme.layer_types)
    if target.table is not None or target.layer_types == [None]:
        raise ValueError(
            f"{scheme.name}: layer_types={names} picks layer types of a model with RoPE per layer type "
            "(config.rope_parameters keyed by layer type, as Gemma 3's sliding_attention / full_attention); "
            f"{target.model_type} has one RoPE (a flat rope_parameters) for all its layers. Leave layer_types unset.")
    if len(target.rotaries) > 1:
        raise ValueError(
            f"{scheme.name}: layer_types is supported on a model with one rotary module; {target.model_type} has "
            f"{len(target.rotaries)}. Leave layer_types unset.")
    rotating = target.layer_types
    without = [lt for lt, entry in target.config.rope_parameters.items() if entry is None]
    for name in scheme.layer_types:
        if name in without:
            raise ValueError(
                f"{scheme.name}: {target.model_type}'s {name} layers use no RoPE (their rope_parameters entry is "
                f"None): there is nothing to scale. Its layer types with RoPE: {', '.join(rotating)}.")
        if name not in rotating:
            raise ValueError(
                f"{scheme.name}: layer_types names {name!r}, not a layer type of {target.model_type}, whose RoPE "
                f"layer types are {', '.join(rotating)}.{did_you_mean(name, rotating)}")


def _prepare_table(scheme: FrequencyScheme, target: PatchSite) -> InstallStep:
    """A table rotary (GPT-J, CodeGen: sin/cos rows indexed by position, discovery.SinCosTable): a new table of this
    scheme's frequencies and cos/sin scale, computed by transformers' own init function on a config carrying the
    scheme's rope_parameters (`inv_freq`), for the scheme's window (and grown past it on demand, rotary.TableGrowth).
    The model's config has no `rope_parameters` to announce it: the patch is saved as a non-native one (resolve
    marks it so). Length-dependent schemes would need a table per sequence length: refused."""
    layout = target.table
    if scheme.length_dependent:
        raise ValueError(
            f"{scheme.name}: its frequencies follow the sequence length, and {target.model_type} rotates from one "
            f"fixed sin/cos table ({type(target.rotary).__name__}.{layout.buffer}, {layout.rows} positions), built "
            "once. Use a static scheme (yarn, linear, ntk, llama3, default with rope_theta), or an attention-side "
            "scheme.")
    ctx = next(iter(target.contexts().values()))
    try:
        inv_freq, scaling = scheme.inv_freq(ctx)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as err:
        raise ValueError(f"{scheme.name}: transformers' own RoPE computation fails for {target.model_type}'s rotary "
                         f"({type(err).__name__}: {err}). Use another scheme.") from None
    if inv_freq.numel() != layout.pairs:
        raise ValueError(
            f"{scheme.name}: gives {inv_freq.numel()} frequencies, and {target.model_type}'s table rotates "
            f"{layout.pairs} coordinate pairs. Use a scheme of the same width (not p_rope), or an attention-side one.")
    rot = target.rotary
    device = rot._buffers[layout.buffer].device
    rows = max(layout.rows, scheme.window(ctx) or 0)
    # Resonance: rows of positions modulo the integer wavelengths of the unrounded θ_i, as the authors build them
    waves = None
    if scheme.resonance:
        waves = resonance_wavelengths(dataclasses.replace(scheme, resonance=None).inv_freq(ctx)[0])
    table = layout.build(inv_freq, scaling, rows, device=device, wavelengths=waves)
    growth = TableGrowth(layout, inv_freq, scaling, waves)

    def install(log: UndoLog) -> None:
        log.set_buffer(rot, layout.buffer, table)
        log.setattr(rot, "forward", PatchedRotaryForward(rot, {layout.buffer: table}, identity=False,
                                                         update=growth, sin_first=layout.returns_sin_first))

    return install


def resonance_wavelengths(inv_freq: torch.Tensor) -> torch.Tensor:
    """Resonance RoPE's integer wavelengths λ̃_i = round(2π/θ_i) (inf for a pair that does not rotate), in float32 as
    the authors' `resonance_register` computes them (torch's `2π / θ` is θ⁻¹·2π, two roundings), and so θ̃_i = 2π/λ̃_i
    (`adjust`): with them the reduced angles are the authors' bit for bit. Correctly rounded float64 arithmetic gives
    θ̃ one ulp apart in about a third of the pairs and other λ̃ past 2^21, where float32 wavelengths are coarser than a
    half (head size 128, θ 1e6, YaRN ×32: 26 and 12 of the 64 pairs)."""
    return torch.round(inv_freq.float().reciprocal() * (2 * math.pi))


def _in_tree(config, root) -> bool:
    """Whether `config` is `root` or one of its sub-configs (what `save_pretrained` writes)."""
    if config is root:
        return True
    return any(_in_tree(config, value) for value in vars(root).values()
               if hasattr(value, "to_dict") and value is not root)


def _public_of(scheme: FrequencyScheme, config) -> dict:
    """The scheme's rope_parameters for a config whose own RoPE no rotary module is built from (Blt's top-level
    config beside its sub-configs'): applied to that config's own entry."""
    params = config.rope_parameters
    try:
        head_dim = discovery.head_size(config)
    except AttributeError:  # a composite config (Blt's top level) with no attention sizes of its own: unused here
        head_dim = 2
    ctx = RopeContext(head_dim=head_dim, rotary_dim=head_dim, rope_theta=float(params["rope_theta"]),
                      max_position_embeddings=int(config.max_position_embeddings), rope_parameters=dict(params))
    return scheme.rope_parameters(ctx)


def _check_width(scheme: FrequencyScheme, target: PatchSite, layer_type, inv_freq: torch.Tensor) -> None:
    """The attention layers rotate as many coordinates as the rotary module's frequencies cover: a scheme whose
    frequencies are fewer or more cannot run there. Gemma 4's global layers use `proportional` RoPE, full-width
    frequencies of which only the first quarter are non-zero; the other rope types give only that quarter's pairs for
    the same `partial_rotary_factor`, and a model configured so fails at its first forward."""
    prefix = f"{layer_type}_" if layer_type else ""
    have = getattr(target.rotary, f"{prefix}inv_freq").numel()
    if inv_freq.numel() == have:
        return
    entry = target.config.rope_parameters[layer_type] if layer_type else target.config.rope_parameters
    rope_type = entry["rope_type"]
    where = f" for its {layer_type} layers" if layer_type else ""
    raise ValueError(
        f"{scheme.name}: {target.model_type}'s rotary module{where} ({rope_type!r}) gives {have} frequencies per head, "
        f"and its attention rotates that many coordinate pairs; {scheme.name} gives {inv_freq.numel()} there, a "
        "configuration a model built by transformers cannot run either. Use a scheme of the same width for these "
        "layers (p_rope, or the attention-side schemes)."
    )


class StandaloneConfig:
    """Just enough of a PreTrainedConfig for transformers' RoPE init functions (no model needed)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def standardize_rope_params(self):
        pass


def _runs(scheme: FrequencyScheme, target: PatchSite, rotary: torch.nn.Module, device, layer_types: list) -> None:
    """Run the patched rotary once on two positions (per layer type): a rotary that reads its config at every forward
    (PhiMoE reads `original_max_position_embeddings` from rope_parameters for any type but default, which `linear`
    does not have) fails there as a natively configured model would at its first forward; refused at apply()
    instead. Rotaries whose forward takes more than (x, position_ids[, layer_type]) are called by their model only
    (the attention-side check runs them)."""
    params = list(inspect.signature(type(rotary).forward).parameters.values())[1:]
    if len(params) < 2 or any(p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
                              for p in params[2:]):
        return
    if layer_types != [None] and "layer_type" not in {p.name for p in params}:
        return
    x, ids = torch.zeros(1, 2, 2, device=device), torch.arange(2, device=device)[None]
    for layer_type in layer_types:
        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        try:
            with torch.no_grad():
                rotary(x, ids, **kwargs)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as err:
            raise ValueError(
                f"{scheme.name}: {target.model_type}'s rotary module fails under this RoPE configuration "
                f"({type(err).__name__}: {err}), as a model configured natively with it would at its first forward. "
                "Choose a scheme whose rope_parameters this architecture's code reads (its config's rope_type and "
                "keys).") from None
        if scheme.resonance and _ignores_buffers(rotary, x, ids, kwargs):
            raise ValueError(
                f"{scheme.name}: {target.model_type}'s rotary module computes its frequencies again from the config "
                "at every forward (not from its inv_freq buffer), so the rounded wavelengths of resonance=True would "
                "never reach attention. Use the scheme without resonance on this architecture.")


# Positions where the float32 products p·θ̃_i carry rounding (past every wavelength of the low pairs): the check's probe
_PROBE = (0, 1, 5, 6, 7, 100, 1000, 4097, 65537)


def _check_resonance(scheme: FrequencyScheme, target: PatchSite, rotary: torch.nn.Module, layer_types: list) -> None:
    """Resonance (rotary.Resonance) hands the class forward its angles in place of the frequency buffer, with positions
    of 1. Proof that this is how the forward computes, per layer type: given the unreduced products p·θ̃_i as angles it
    returns its own output bit for bit, and other angles change it. Which precision the products are in is found the
    same way (float32; float64 where the class multiplies in double, Ergo). Else the reduction cannot be applied
    there: refused (the undo log takes the patch back)."""
    params = list(inspect.signature(type(rotary).forward).parameters.values())[1:]
    names = [p.name for p in params]
    if (len(params) < 2 or (layer_types != [None] and "layer_type" not in names)
            or any(p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "layer_type"
                   for p in params[2:])):
        _resonance_refused(scheme, target, rotary, f"its forward takes ({', '.join(names)})")
    resonance = vars(rotary)[RESONANCE]
    for layer_type in layer_types:
        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        name = resonance.buffer(layer_type)
        buffer = rotary._buffers.get(name)
        if buffer is None:
            _resonance_refused(scheme, target, rotary, f"it has no buffer {name}")
        ids = torch.tensor([_PROBE], device=buffer.device)
        x = torch.zeros(1, len(_PROBE), 2, device=buffer.device)
        with torch.no_grad():
            own = type(rotary).forward(rotary, x, ids, **kwargs)
            products = {dtype: ids[..., None].to(dtype) * buffer.to(dtype) for dtype in (torch.float32, torch.float64)}
            found = [dtype for dtype, plain in products.items()
                     if _same(own, angle_forward(rotary, x, plain, name, ids, **kwargs))
                     and not _same(own, angle_forward(rotary, x, plain + 0.5, name, ids, **kwargs))]
        if not found:
            _resonance_refused(scheme, target, rotary, f"its forward does not turn position × {name} into its output")
        resonance.dtype = found[0]  # one precision per module: the layer types share the forward's code


def _same(a, b) -> bool:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _resonance_refused(scheme: FrequencyScheme, target: PatchSite, rotary: torch.nn.Module, why: str) -> None:
    raise ValueError(
        f"{scheme.name}: resonance=True reduces each position modulo its pair's integer wavelength before the angle is "
        "computed (so that the angles repeat exactly, as in the authors' code), which rope_patch does through the "
        f"rotary module's own forward; {target.model_type}'s {type(rotary).__name__} cannot be driven that way "
        f"({why}). Use the scheme without resonance on this architecture.")


def _ignores_buffers(rotary: torch.nn.Module, x, ids, kwargs: dict) -> bool:
    """Whether the rotary class's own forward gives the same output when its frequency buffers change (PhiMoE
    recomputes them from the config). The class's forward, not the patch's: that one re-installs its masters."""
    saved = {n: b for n, b in rotary._buffers.items() if n.endswith("inv_freq") and b is not None}
    with torch.no_grad():
        out = type(rotary).forward(rotary, x, ids, **kwargs)
        try:
            for n, b in saved.items():
                rotary._buffers[n] = b * 1.5
            moved = type(rotary).forward(rotary, x, ids, **kwargs)
        finally:
            rotary._buffers.update(saved)
    return all(torch.equal(a, b) for a, b in zip(out, moved, strict=True))


def _attention_scales(scheme: FrequencyScheme, target: PatchSite, public: dict) -> list[tuple]:
    """(attention module, softmax scale) for the modules whose scale transformers computes at init from
    `rope_parameters` (DeepSeek-V3: YaRN's mscale(factor, mscale_all_dim)² folded into `scaling`): the scale a model
    built natively with the patched `public` rope_parameters has. Without this the patched model would keep the scale
    of the RoPE it was loaded with (a checkpoint shipping yarn with mscale_all_dim keeps its temperature under
    `default`, and yarn with mscale_all_dim given gets none). A non-native, length-dependent scheme (dynamic_yarn)
    would need the scale to follow the current factor, which lives in the attention layers: refused there."""
    out = []
    for module in attention_modules(target.model):
        try:
            value = discovery.init_scaling(module, public)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
            # transformers before 5.21: DeepSeek's yarn_apply_mscale reads `factor` under every non-default rope type
            # (p_rope's `proportional` has none), so a natively configured model fails at init too
            raise ValueError(
                f"{scheme.name}: {target.model_type}'s {type(module).__name__} computes its softmax scale at init from "
                f"rope_parameters, and transformers {transformers.__version__}'s computation fails on the ones this "
                f"scheme writes ({type(err).__name__}: {err}), so a model configured with them cannot be built either. "
                "Upgrade transformers (pip install -U 'transformers>=5.21': from 5.21 it reads `factor` only where "
                "`mscale_all_dim` is set), or use a scheme that sets a factor (linear, yarn).") from None
        if value is None:
            continue
        unscaled = discovery.init_scaling(module, {"rope_type": "default"})
        if not scheme.native and value != unscaled:
            raise ValueError(
                f"{scheme.name}: {target.model_type} folds YaRN's mscale (mscale_all_dim) into its attention scale at "
                "init, which a factor that follows the sequence length cannot change per forward. Leave "
                "`mscale_all_dim` unset, or use the static `yarn`."
            )
        out.append((module, value))
    return out


def _default_init(config, device=None, layer_type=None, **_):
    """transformers' default RoPE (each model's `compute_default_rope_parameters`): θ_i = b^(−2i/d)."""
    params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
    head_dim = discovery.head_size(config)
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return discovery.default_inv_freq(params["rope_theta"], dim), 1.0


def init_fn(rope_type: str, rotary_cls=None):
    if rope_type == "default":
        return getattr(rotary_cls, "compute_default_rope_parameters", None) or _default_init
    return ROPE_INIT_FUNCTIONS[rope_type]


def _validate_with_transformers(scheme: FrequencyScheme, target: PatchSite, rotary_config) -> None:
    """Let the model's own config class veto the scheme (Phi-3 accepts only default/longrope)."""
    validate = getattr(rotary_config, "validate_rope", None)
    if validate is None:
        return
    try:
        validate()
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{scheme.name}: {type(target.config).__name__} (model_type={target.model_type!r}) rejects this RoPE "
            f"configuration: {err}. Choose a scheme that this architecture's config accepts."
        ) from None
