"""Saving and reloading patched models, and exporting a scheme's native `rope_parameters`.

A saved directory holds what `save_pretrained` of transformers (or peft, for an adapter) writes, plus
`rope_patch.json` (scheme, parameters, the unpatched RoPE config, versions) and, when the scheme owns learned
parameters (relative-bias or position tables), `rope_patch.safetensors`. For a scheme with a native transformers
form, config.json carries it, so plain `AutoModelForCausalLM.from_pretrained` reproduces the logits without
rope_patch installed; for the others config.json keeps the unpatched RoPE and `rope_patch.from_pretrained`
re-applies the scheme.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from .api import apply, as_scheme, current, original_config, patch_modules
from .schemes.base import Scheme
from .specs import parse_scheme_spec
from .target import RopeContext, find_target, unwrap

MANIFEST = "rope_patch.json"
PATCH_WEIGHTS = "rope_patch.safetensors"
FORMAT = 1


def native_config(model) -> dict:
    """{"rope_parameters", "max_position_embeddings"} that make a plain transformers model equal the patched one.

    Raises ValueError for schemes without a native form (p_rope and the attention schemes)."""
    scheme = current(model)
    if scheme is None:
        return original_config(model)
    _require_native(scheme)
    cfg = find_target(model).config
    window = cfg.max_position_embeddings
    if scheme.name == "dynamic":  # transformers' dynamic NTK starts scaling at max_position_embeddings
        window = scheme.original_max_position_embeddings
    return {"rope_parameters": copy.deepcopy(cfg.rope_parameters), "max_position_embeddings": window}


def to_rope_parameters(scheme, *, model=None, head_dim: int | None = None, rope_theta: float | None = None) -> dict:
    """The transformers / vLLM `rope_parameters` dict of a scheme, or a ValueError where none exists.

    `scheme` is a Scheme, a name or a spec ("yarn:4"); or pass only `model=` for the scheme applied to it. Without a
    model, `rope_theta` and `head_dim` fill in what the scheme needs (the result omits rope_theta when unknown).
    """
    if scheme is None:
        if model is None:
            raise TypeError("to_rope_parameters needs a scheme or a patched model=.")
        return native_config(model)["rope_parameters"]
    if isinstance(scheme, str):
        scheme = parse_scheme_spec(scheme)
    scheme = as_scheme(scheme)
    _require_native(scheme)
    if model is not None:
        target = find_target(model)
        ctx = next(iter(target.contexts().values()))
        return scheme.resolve(target).rope_parameters(ctx)
    theta = rope_theta or scheme.params().get("rope_theta")
    if scheme.name == "ntk" and (head_dim is None or theta is None):
        lacking = " and ".join(k for k, v in (("head_dim=", head_dim), ("rope_theta=", theta)) if v is None)
        raise ValueError(f"ntk's native form is a base change b′ = b·s^(d/(d−2)), which needs the model's head_dim and "
                         f"rope_theta: pass {lacking} (or model=).")
    if getattr(scheme, "original_max_position_embeddings", 0) is None:
        raise ValueError(f"{scheme.name}: pass original_max_position_embeddings (or model=) to export it.")
    ctx = RopeContext(head_dim=head_dim or 128, rotary_dim=head_dim or 128, rope_theta=theta or 10000.0,
                      max_position_embeddings=0, rope_parameters={})
    params = scheme.rope_parameters(ctx)
    if theta is None:
        params.pop("rope_theta")
    return params


def vllm_overrides(rope_parameters: dict, max_position_embeddings: int | None = None) -> str:
    """The matching vLLM `--hf-overrides` argument."""
    overrides = {"rope_parameters": rope_parameters}
    if max_position_embeddings:
        overrides["max_position_embeddings"] = max_position_embeddings
    return "--hf-overrides '" + json.dumps(overrides, separators=(",", ":")) + "'"


def _require_native(scheme: Scheme) -> None:
    if scheme.kind != "frequency" or not getattr(scheme, "native", False):
        raise ValueError(
            f"{scheme.name} has no native transformers/vLLM `rope_parameters` form (it changes "
            f"{'attention' if scheme.kind == 'attention' else 'frequencies in a way transformers cannot express'}). "
            "Save with rope_patch.save_pretrained and load with rope_patch.from_pretrained instead."
        )


def save_pretrained(model, save_directory, **kwargs) -> Path:
    """Save `model` (a patched model, or a peft model: then the adapter) plus `rope_patch.json`."""
    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    base = unwrap(model)
    scheme = current(base)
    own = patch_modules(base)
    own_keys = {f"{name}.{k}" for name, mod in own.items() for k in mod.state_dict()}
    is_adapter = model is not base and hasattr(model, "peft_config")

    if is_adapter:
        model.save_pretrained(out, **kwargs)
    else:
        state = {k: v for k, v in base.state_dict().items() if k not in own_keys}
        base.save_pretrained(out, state_dict=state, **kwargs)
        _rewrite_config(out / "config.json", native_config(base) if scheme is not None and _is_native(scheme) else original_config(base))
    if own:
        from safetensors.torch import save_file

        save_file({f"{n}.{k}": v.detach().contiguous().cpu() for n, m in own.items() for k, v in m.state_dict().items()}, out / PATCH_WEIGHTS)
    manifest = {
        "format": FORMAT,
        "scheme": None if scheme is None else scheme.name,
        "params": {} if scheme is None else _jsonable(scheme.params()),
        "native": scheme is not None and _is_native(scheme),
        "original": original_config(base),
        "adapter": is_adapter,
        "versions": _versions(),
    }
    _atomic_write(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return out


def from_pretrained(path, *, base_model=None, model_class=None, **kwargs):
    """Rebuild what `save_pretrained` wrote: base model (+ adapter) + patch (+ the patch's learned parameters).

    `base_model` (a path or a loaded model) overrides the adapter's recorded base. `kwargs` go to transformers'
    `from_pretrained` (dtype, device_map, ...).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"rope_patch.from_pretrained: {str(path)!r} is not a directory saved by rope_patch.save_pretrained.")
    manifest = json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).exists() else None
    model_class = model_class or AutoModelForCausalLM
    original = manifest["original"] if manifest else None

    def load_base(src):
        if not isinstance(src, (str, os.PathLike)):
            return src
        config = AutoConfig.from_pretrained(src)
        if original:  # the scheme is defined relative to the unpatched model
            config.rope_parameters = original["rope_parameters"]
            config.max_position_embeddings = original["max_position_embeddings"]
        return model_class.from_pretrained(src, config=config, **kwargs)

    if (path / "adapter_config.json").exists():
        from peft import PeftModel

        recorded = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        src = base_model if base_model is not None else recorded
        if src is None:
            raise ValueError(f"{path} holds an adapter without a recorded base model: pass base_model=.")
        model = PeftModel.from_pretrained(load_base(src), path)
    else:
        model = load_base(str(path))
    if manifest and manifest["scheme"]:
        apply(model, manifest["scheme"], **manifest["params"])
        if (path / PATCH_WEIGHTS).exists():
            from safetensors.torch import load_file

            weights = load_file(path / PATCH_WEIGHTS)
            for name, module in patch_modules(model).items():
                prefix = f"{name}."
                module.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
    return model


def _is_native(scheme: Scheme) -> bool:
    return scheme.kind == "frequency" and getattr(scheme, "native", False)


def _rewrite_config(path: Path, rope: dict) -> None:
    config = json.loads(path.read_text())
    config.update(copy.deepcopy(rope))
    _atomic_write(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonable(params: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


def _versions() -> dict:
    import transformers

    from . import __version__

    return {"rope_patch": __version__, "transformers": transformers.__version__, "torch": torch.__version__}
