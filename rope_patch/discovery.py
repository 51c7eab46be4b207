"""Model discovery: find the one rotary module of a loaded model and describe its RoPE layout.

transformers 5 gives every RoPE model one rotary module (`model.model.rotary_emb`, `gpt_neox.rotary_emb`, ...) that
computes cos/sin once per forward for all layers. Models with per-layer-type RoPE (Gemma 3) keep one set of
buffers per layer type (`{layer_type}_inv_freq`) and a dict `rope_type`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from .registry import list_schemes


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

    def __post_init__(self):
        if not self.rotaries:
            self.rotaries = (self.rotary,)

    def site(self, rotary: nn.Module) -> PatchSite:
        """The site of one rotary module: its own config (a sub-config, or a config derived for it), else the
        model's."""
        config = vars(rotary).get("config")
        config = config if getattr(config, "rope_parameters", None) is not None else self.config
        return PatchSite(self.model, rotary, config, self.check, (rotary,))

    @property
    def layer_types(self) -> list[str | None]:
        """Per-layer-type keys of the rotary module, or [None] for a single rotary."""
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
            original = params.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
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


def _is_rotary(module: nn.Module) -> bool:
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, str):
        return "inv_freq" in module._buffers
    if isinstance(rope_type, dict):
        return all(f"{lt}_inv_freq" in module._buffers for lt in rope_type)
    return False


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
    rotaries = [m for m in base.modules() if _is_rotary(m)]
    # A rotary module may be shared (ForCausalLM and its decoder both reach it): keep distinct objects only.
    rotaries = list({id(m): m for m in rotaries}.values())
    model_type = getattr(base.config, "model_type", "?")
    if not rotaries:
        raise NoRotary(
            f"{type(base).__name__} (model_type={model_type!r}) has no rotary position embedding module: "
            "rope_patch patches the RoPE of LLaMA-family models (llama, mistral, qwen2/3, gemma, phi3, olmo2, "
            "granite, ...), which keep one `*RotaryEmbedding` module with an `inv_freq` buffer. Models with "
            f"absolute or learned position embeddings (gpt2, bert, ...) are not supported. Schemes: {', '.join(list_schemes())}."
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
                      and not _is_rotary(m)), None)
        where = f"model.{owner}" if owner else "its language model"
        raise TypeError(
            f"rope_patch.apply: {type(base).__name__} keeps its RoPE in a sub-model's config ({type(sub).__name__}), "
            f"not in its own ({type(config).__name__}): apply the patch to the language model, "
            f"rope_patch.apply({where}, ...); the rest of the model has no rotary position embedding.")
    return PatchSite(model=base, rotary=primary, config=base.config,
                     rotaries=(primary, *(m for m in rotaries if m is not primary)))


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
