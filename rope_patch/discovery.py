"""Model discovery: find the one rotary module of a loaded model and describe its RoPE layout.

transformers 5 gives every RoPE model one rotary module (`model.model.rotary_emb`, `gpt_neox.rotary_emb`, ...) that
computes cos/sin once per forward for all layers. Models with per-layer-type RoPE (Gemma 3) keep one set of
buffers per layer type (`{layer_type}_inv_freq`) and a dict `rope_type`.

Some rotate from a table instead (GPT-J, CodeGen): a module whose `forward(x, position_ids)` indexes a buffer of
sin/cos rows, built once at init from a base its config does not record. Such a module is recognised by what it holds
and returns (`sincos_table`), never by its model type: row p of the buffer is sin(p·θ_i), cos(p·θ_i) for
θ_i = b^(−2i/d), and the forward gives those rows at the positions it is called with.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import weakref
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class RopeContext:
    """What a scheme needs to know about one (layer type's) rotary embedding, read from the unpatched model."""

    head_dim: int
    rotary_dim: int  # 2 × number of rotated pairs (head_dim × partial_rotary_factor)
    rope_theta: float
    max_position_embeddings: int  # the unpatched model's window (config.max_position_embeddings as loaded)
    rope_parameters: dict  # the unpatched model's rope_parameters for this layer type (a copy)
    layer_type: str | None = None
    # The window the model was pre-trained on, where the loaded config records one (checkpoints that ship with
    # scaling: Llama 3.1 `llama3` 8192 of 131072, gpt-oss `yarn` 4096, Phi-3 `longrope` 4096); None: the window.
    original_max_position_embeddings: int | None = None

    @property
    def pretraining_window(self) -> int:
        """L: what a scheme's `factor` multiplies and what `original_max_position_embeddings` defaults to."""
        return self.original_max_position_embeddings or self.max_position_embeddings

    @property
    def shipped_scaling(self) -> str | None:
        """The rope_type the checkpoint ships with when it is a scaling (not plain RoPE), else None."""
        rope_type = self.rope_parameters.get("rope_type", "default")
        return None if rope_type == "default" else rope_type


@dataclass
class PatchSite:
    """Where a patch goes: the model, its rotary module and config. A model may have several rotary modules (one
    per block kind or base: Blt's encoder / global / decoder, Granite-SWA's per-theta rotaries, Moshi's per-layer
    ones, DeepSeek-V4's compressors); `rotary` is the primary one (built from `config` itself, where one is; the patch
    state lives on it) and `rotaries` all of them, which a scheme patches alike (`site(r)`: the site of one)."""

    model: nn.Module  # the unwrapped PreTrainedModel that was passed (ForCausalLM or bare decoder)
    rotary: nn.Module
    config: object  # model.config; the rotary module's own config is this object until a patch swaps it
    check: bool = True  # run the apply-time plumbing check of the attention-side schemes (attention/plumbing.py)
    rotaries: tuple = ()  # every rotary module (the primary first); () means (rotary,)

    # a rotary that is a sin/cos table (GPT-J, CodeGen): its layout and the RoPE it holds; None for inv_freq rotaries
    table: SinCosTable | None = None

    def __post_init__(self):
        if not self.rotaries:
            self.rotaries = (self.rotary,)

    def site(self, rotary: nn.Module) -> PatchSite:
        """The site of one rotary module: its own config (a sub-config, or a config derived for it), else the
        model's."""
        config = vars(rotary).get("config")
        config = config if getattr(config, "rope_parameters", None) is not None else self.config
        return PatchSite(self.model, rotary, config, self.check, (rotary,), self.table)

    @property
    def layer_types(self) -> list[str | None]:
        """Per-layer-type keys of the rotary module, or [None] for a single rotary."""
        if self.table is not None:
            return [None]
        rope_type = self.rotary.rope_type
        return sorted(rope_type) if isinstance(rope_type, dict) else [None]

    @property
    def pretraining_window(self) -> int:
        """The window the loaded model was pre-trained on (the shipped `original_max_position_embeddings` of a
        checkpoint that ships with scaling, else `max_position_embeddings`)."""
        return next(iter(self.contexts().values())).pretraining_window

    @property
    def model_type(self) -> str:
        return getattr(self.config, "model_type", type(self.model).__name__)

    def contexts(self) -> dict[str | None, RopeContext]:
        """RopeContext per layer type, from the model's current (unpatched) state."""
        cfg = self.config
        if self.table is not None:
            return {None: self.table.context(cfg)}
        out = {}
        for lt in self.layer_types:
            params = cfg.rope_parameters[lt] if lt is not None else cfg.rope_parameters
            prefix = f"{lt}_" if lt else ""
            n_pairs = getattr(self.rotary, f"{prefix}inv_freq").numel()
            try:
                head_dim = head_size(layer_config(cfg, lt))
            except AttributeError:  # a composite config (Blt's top level): the rotary's own config has the sizes
                own = vars(self.rotary).get("config")
                head_dim = head_size(layer_config(own, lt)) if own is not None and own is not cfg else 2 * n_pairs
            if getattr(cfg, "max_position_embeddings", None) is None:
                raise ValueError(
                    f"{self.model_type}'s config records no max_position_embeddings, the window a frequency scheme's "
                    "factor and defaults are relative to (transformers' own scaled RoPE types read it too, so a model "
                    "configured with one fails the same way). The attention-side schemes that need no window "
                    "(self_extend, rerope, leaky_rerope, string, alibi, nope) apply.")
            window = int(cfg.max_position_embeddings)
            original = (params.get("original_max_position_embeddings")
                        or getattr(cfg, "original_max_position_embeddings", None))
            out[lt] = RopeContext(
                head_dim=head_dim,
                rotary_dim=2 * n_pairs,
                rope_theta=float(params["rope_theta"]),
                max_position_embeddings=window,
                rope_parameters=dict(params),
                layer_type=lt,
                original_max_position_embeddings=int(original) if original and int(original) < window else None,
            )
        return out


def layer_config(config, layer: str | int | None):
    """The config a layer (a layer type or index) is built from. Heterogeneous configs (Gemma 4, dots3: head_dim or
    head counts per layer) refuse the global value of a per-layer attribute; transformers' own accessor
    `config.per_layer_config[layer]` resolves it (a view of the current config, so patched rope_parameters show)."""
    if layer is None or not getattr(config, "is_heterogeneous", False):
        return config
    return config.per_layer_config[layer]


def head_size(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def query_heads(config) -> int:
    """The most query heads any layer has (heterogeneous configs may vary them per layer)."""
    if not getattr(config, "is_heterogeneous", False):
        return int(config.num_attention_heads)
    return max(int(c.num_attention_heads) for c in config.per_layer_config)


def unwrap(model) -> nn.Module:
    """Strip peft / DDP / compile wrappers down to the transformers model."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):  # peft PeftModel
            model = model.get_base_model()
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ == "DataParallel":
            model = model.module
    return model


def is_rotary(module: nn.Module) -> bool:
    """A rotary embedding module of transformers: a `rope_type` and its inverse frequencies (one set per layer type
    where `rope_type` is a dict)."""
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, str):
        return "inv_freq" in module._buffers
    if isinstance(rope_type, dict):
        return all(f"{lt}_inv_freq" in module._buffers for lt in rope_type)
    return False


@dataclass(frozen=True)
class SinCosTable:
    """A rotary module that rotates from a table (GPT-J, CodeGen: `embed_positions`, built at init by
    `create_sinusoidal_positions`): buffer `buffer` holds, for positions 0 … rows − 1, sin(p·θ_i) and cos(p·θ_i) of the
    `pairs` rotated pairs side by side (`sin_first`: [sin | cos], else [cos | sin]), θ_i = rope_theta^(−2i/(2·pairs));
    its forward returns the two halves at the given position ids (`returns_sin_first`: in the order (sin, cos)). The
    attention layers rotate interleaved pairs of the first 2·pairs coordinates with them; their own code does that, so
    nothing here depends on it."""

    buffer: str
    rows: int
    pairs: int
    rope_theta: float
    sin_first: bool
    returns_sin_first: bool

    def context(self, config) -> RopeContext:
        """The RoPE this table holds, as a scheme sees it: transformers' `default` with the table's base over its
        rotated pairs (`partial_rotary_factor` where they are fewer than the head's), and the config's window."""
        head_dim = head_size(config)
        rotary_dim = 2 * self.pairs
        params = {"rope_type": "default", "rope_theta": self.rope_theta}
        if rotary_dim < head_dim:
            params["partial_rotary_factor"] = rotary_dim / head_dim
        window = getattr(config, "max_position_embeddings", None) or self.rows
        return RopeContext(head_dim=head_dim, rotary_dim=rotary_dim, rope_theta=self.rope_theta,
                           max_position_embeddings=int(window), rope_parameters=params)

    def build(self, inv_freq: torch.Tensor, scaling: float, rows: int, device=None,
              wavelengths: torch.Tensor | None = None) -> torch.Tensor:
        """The table of these frequencies (fp32) for positions 0 … rows − 1, in this layout, times `scaling` (the
        cos/sin scale a rotary module multiplies its output by): row p as `create_sinusoidal_positions` computes it.
        With `wavelengths` (Resonance RoPE's integer λ̃_i), pair i's position is reduced modulo λ̃_i first, so its
        rows repeat exactly every λ̃_i (rotary.Resonance)."""
        inv_freq = inv_freq.float().to(device)
        positions = torch.arange(rows, dtype=torch.int64, device=device).float()[:, None]
        if wavelengths is not None:
            positions = torch.fmod(positions, wavelengths.to(device=device, dtype=torch.float32))
        angles = positions * inv_freq
        sin, cos = torch.sin(angles), torch.cos(angles)
        if scaling != 1.0:
            sin, cos = sin * scaling, cos * scaling
        return torch.cat((sin, cos) if self.sin_first else (cos, sin), dim=1)


def default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    """θ_i = b^(−2i/d) as transformers' default RoPE (and GPT-J's table) computes it, fp32."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def sincos_table(module: nn.Module) -> SinCosTable | None:
    """The layout of a table rotary (see SinCosTable), read from the module's buffers and forward; None for any other
    module. The base is read from the table's rows (θ_1 from row 1, refined on rows 2, 4, 8, … so that it is exact to
    float precision) and taken as the shortest decimal that rebuilds the table bit for bit."""
    params = list(inspect.signature(type(module).forward).parameters)
    if params[1:3] != ["x", "position_ids"] or is_rotary(module):
        return None
    for name, table in module._buffers.items():
        if table is None or table.dim() != 2 or not table.is_floating_point() or table.device.type == "meta":
            continue
        rows, width = table.shape
        if rows < 2 or width < 2 or width % 2:
            continue
        # read once per tensor and version (find_target runs at every apply / remove / current)
        key = (id(module), name, table._version)
        address = id(table)
        known = _READ.get(address)
        if known is None or known[0]() is not table or known[1] != key:
            ref = weakref.ref(table, functools.partial(_forget, address))
            known = (ref, key, _read_table(module, name, table.detach().cpu()))
            _READ[address] = known
        if known[2] is not None:
            return known[2]
    return None


_READ: dict = {}  # id(buffer) -> (weak reference to it, (module id, name, version), its layout or None)


def _forget(address: int, _ref) -> None:
    _READ.pop(address, None)


def _read_table(module: nn.Module, name: str, stored: torch.Tensor) -> SinCosTable | None:
    """`stored` in its own dtype: a model cast to bf16 holds its table rounded, which is compared as such."""
    table = stored.float()
    rows, width = table.shape
    pairs = width // 2
    first, second = table[0, :pairs], table[0, pairs:]
    if torch.all(first == 0) and torch.all(second == 1):
        sin_first = True
    elif torch.all(first == 1) and torch.all(second == 0):
        sin_first = False
    else:
        return None
    sin, cos = (table[:, :pairs], table[:, pairs:]) if sin_first else (table[:, pairs:], table[:, :pairs])
    ladder = [2**k for k in range(rows.bit_length()) if 2**k < rows]  # rows 1, 2, 4, …
    angle = dict(zip(ladder, torch.atan2(sin[ladder].double(), cos[ladder].double()), strict=True))  # p·θ_i mod 2π
    theta = angle[1]
    for p in ladder[1:]:  # unwrap p·θ with the current estimate, p doubling: the error shrinks as 1/p
        turns = torch.round((p * theta - angle[p]) / (2 * math.pi))
        theta = (angle[p] + 2 * math.pi * turns) / p
    if not math.isclose(float(theta[0]), 1.0, rel_tol=1e-3):  # θ_0 = b^0 = 1 for every base
        return None
    tolerance = max(1e-4, 4 * torch.finfo(stored.dtype).eps)  # what one rounding of |sin|, |cos| ≤ 1 moves
    base = 10000.0
    if pairs > 1:
        estimate = math.exp(-math.log(float(theta[1])) * pairs)  # θ_1 = b^(−1/pairs)
        candidates = [float(f"{estimate:.{n}g}") for n in range(1, 10)] + [estimate]
        exact = next((b for b in candidates if b > 1
                      and torch.equal(_default_table(b, pairs, rows, sin_first).to(stored.dtype), stored)), None)
        if exact is not None:
            base = exact
        elif estimate > 1 and (_default_table(estimate, pairs, rows, sin_first) - table).abs().max() <= tolerance:
            base = estimate
        else:
            return None
    elif (_default_table(base, 1, rows, sin_first) - table).abs().max() > tolerance:
        return None
    returns = _returns_sin_first(module, table, pairs, sin_first)
    if returns is None:
        return None
    return SinCosTable(name, rows, pairs, base, sin_first, returns)


def _default_table(base: float, pairs: int, rows: int, sin_first: bool) -> torch.Tensor:
    layout = SinCosTable("", rows, pairs, base, sin_first, sin_first)
    return layout.build(default_inv_freq(base, 2 * pairs), 1.0, rows)


def _returns_sin_first(module: nn.Module, table: torch.Tensor, pairs: int, sin_first: bool) -> bool | None:
    """Whether the module's forward returns (sin, cos) rows of its table at the positions it is given (None: it does
    not return its table's rows, so it is not a table rotary)."""
    device = module._buffers[next(n for n, b in module._buffers.items() if b is not None)].device
    ids = torch.tensor([[0, 1, table.shape[0] - 1]], device=device)
    try:
        with torch.no_grad():
            out = type(module).forward(module, torch.zeros(1, 3, 1, device=device), ids)
    except Exception:  # noqa: BLE001 (a module this forward does not fit is simply not a table rotary)
        return None
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(o, torch.Tensor) for o in out)):
        return None
    rows = table[[0, 1, table.shape[0] - 1]]
    sin, cos = (rows[:, :pairs], rows[:, pairs:]) if sin_first else (rows[:, pairs:], rows[:, :pairs])
    got = [o.detach().float().cpu().reshape(3, -1) for o in out]
    if any(g.shape != (3, pairs) for g in got):
        return None
    if torch.equal(got[0], sin) and torch.equal(got[1], cos):
        return True
    if torch.equal(got[0], cos) and torch.equal(got[1], sin):
        return False
    return None


class NoRotary(TypeError):
    """A transformers model without a rotary module: nothing to patch (and nothing a patch could have left)."""


def find_target(model) -> PatchSite:
    """The model's rotary module, or a TypeError saying what was found and what is supported."""
    base = unwrap(model)
    if not isinstance(base, nn.Module) or not hasattr(base, "config"):
        raise TypeError(
            f"rope_patch.apply expects a transformers PreTrainedModel (or a peft PeftModel wrapping one), got "
            f"{type(model).__name__}. Load the model with AutoModelForCausalLM.from_pretrained(...) first."
        )
    rotaries = [m for m in base.modules() if is_rotary(m)]
    # A rotary module may be shared (ForCausalLM and its decoder both reach it): keep distinct objects only.
    rotaries = list({id(m): m for m in rotaries}.values())
    model_type = getattr(base.config, "model_type", "?")
    if not rotaries:
        tables = _table_rotaries(base)
        if len(tables) == 1:
            (module, layout), = tables
            return PatchSite(model=base, rotary=module, config=base.config, table=layout)
    if not rotaries:
        raise NoRotary(
            f"{type(base).__name__} (model_type={model_type!r}) has no rotary position embedding module: "
            "rope_patch patches the RoPE of LLaMA-family models (llama, mistral, qwen2/3, gemma, phi3, olmo2, "
            "granite, ...), which keep one `*RotaryEmbedding` module with an `inv_freq` buffer (or a table of sin/cos "
            "rows at integer positions, as GPT-J and CodeGen). Models with absolute or learned position embeddings "
            "(gpt2, bert, ...) are not supported; rope_patch.list_schemes() names the schemes."
        )
    # the primary rotary: one built from the model's config itself, else the first (the state of a patch lives there)
    primary = next((m for m in rotaries if vars(m).get("config") is base.config), rotaries[0])
    config = base.config
    if getattr(config, "rope_parameters", None) is None:
        # a composite model (Gemma 3's image-text model) whose RoPE lives in a sub-model with its own config: the
        # language model is what a patch applies to
        sub = vars(primary).get("config")
        if getattr(sub, "rope_parameters", None) is None:
            raise TypeError(f"{type(base).__name__} has a rotary module but its config has no `rope_parameters`.")
        owner = next((name for name, m in base.named_modules() if name and vars(m).get("config") is sub
                      and not is_rotary(m)), None)
        where = f"model.{owner}" if owner else "its language model"
        raise TypeError(
            f"rope_patch.apply: {type(base).__name__} keeps its RoPE in a sub-model's config ({type(sub).__name__}), "
            f"not in its own ({type(config).__name__}): apply the patch to the language model, "
            f"rope_patch.apply({where}, ...); the rest of the model has no rotary position embedding.")
    return PatchSite(model=base, rotary=primary, config=base.config,
                     rotaries=(primary, *(m for m in rotaries if m is not primary)))


def _table_rotaries(base: nn.Module) -> list[tuple[nn.Module, SinCosTable]]:
    """The table rotaries of a model without inv_freq rotaries: a patched one is known by its patch (its table may hold
    scaled rows by now; the patch keeps the layout it found), any other by its contents."""
    found = {}
    for m in base.modules():
        if id(m) in found:
            continue
        layout = getattr(m._modules.get("rope_patch"), "table", None)
        if isinstance(layout, SinCosTable):
            found[id(m)] = (m, layout)
            continue
        layout = sincos_table(m)
        if layout is not None:
            found[id(m)] = (m, layout)
    return list(found.values())


# ---- facts beyond the rotary module -------------------------------------------------------------------------------
# Read from the modules themselves, for the schemes to consult at apply() time; what cannot be read is tested by the
# apply-time check (attention/plumbing.py).


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: accelerate's execution device when its weights are offloaded (device_map with
    offload: the parameters sit on the meta device and a hook brings them in for each forward), else the device of
    its first materialised parameter or buffer, else the CPU. A table a scheme attaches is made there."""
    for m in module.modules():
        device = getattr(getattr(m, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def has_sinks(module: nn.Module) -> bool:
    """gpt-oss attention: a learned sink logit per head (`self.sinks`), passed to attention as `s_aux`."""
    return isinstance(getattr(module, "sinks", None), nn.Parameter)


def attention_function_limits(target: PatchSite, modules: list[nn.Module], backend: str | None = None) -> str | None:
    """Why an attention function registered with transformers' AttentionInterface cannot stand in for this model's
    attention exactly (None: it can), on `backend` (the model's attention implementation). For the schemes that run
    their own attention function (alibi, relative_bias, self_extend, rerope, leaky_rerope, string, dca);
    nope/sinusoidal/learned_absolute keep the model's own."""
    model_type = target.model_type
    if backend in ("flex_attention", "flash_attention_2") and any(has_sinks(m) for m in modules):
        # gpt-oss: every head has a learned sink logit that joins the softmax denominator (its eager function cats it to
        # the scores, transformers' flex renormalises by log-sum-exp). rope_patch's eager/sdpa functions add it; its
        # flex and flash functions have no sink term, so they would drop it and change every output.
        return (f"{model_type} attention sinks: each head adds a learned sink logit (`self.sinks`) to the softmax "
                f"denominator, which rope_patch's {backend} function does not compute (its eager and sdpa ones do)")
    return None


def init_scaling(module: nn.Module, rope_parameters: dict) -> float | None:
    """The attention-logit scale that this attention module computes at init from `rope_parameters`, for the given
    `rope_parameters` (None: the module's scale does not depend on them). DeepSeek-V2/V3 & co.: `self.scaling =
    yarn_apply_mscale(config.rope_parameters, qk_head_dim ** -0.5)`, i.e. YaRN's mscale(factor, mscale_all_dim)²
    folded into the softmax scale when a non-default rope type sets `mscale_all_dim`. A frequency scheme changes
    `rope_parameters` after init, so it must set `scaling` as a model built with them would have it."""
    fn = getattr(sys.modules.get(type(module).__module__), "yarn_apply_mscale", None)
    qk_head_dim = getattr(module, "qk_head_dim", None)
    if fn is None or qk_head_dim is None or not hasattr(module, "scaling"):
        return None
    return float(fn(rope_parameters, qk_head_dim ** (-0.5)))
