"""`rope-patch export DIR`: the native `rope_parameters` of a saved model or adapter, and the vLLM argument.

DIR is what `rope_patch.save_pretrained` (or the fine-tuning recipe) wrote: a full or merged model (config.json)
or a peft adapter (adapter_config.json), each with rope_patch.json. Prints the `rope_parameters` dict, the
`max_position_embeddings` that goes with it, and the matching `vllm serve ... --hf-overrides '...'` argument; for
schemes without a native form (dynamic_yarn, attention schemes) it fails with the reason and what to do instead.
"""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="print the native rope_parameters and vLLM --hf-overrides of a saved model")
    p.add_argument("dir", help="a folder written by rope_patch.save_pretrained (model, merged model or adapter)")
    p.add_argument("--base", default=None, help="the adapter's base model (default: the path recorded in adapter_config.json)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_export)


def export_info(directory, base=None) -> dict:
    """{"scheme", "rope_parameters", "max_position_embeddings", "vllm"} for a saved folder; ValueError when the
    scheme has no native form, FileNotFoundError when the folder is not a saved model."""
    from .export import MANIFEST, vllm_overrides

    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is not a directory (expected a folder written by rope_patch.save_pretrained).")
    manifest = json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).is_file() else None
    config_path, adapter_path = path / "config.json", path / "adapter_config.json"
    if manifest is None and not config_path.is_file():
        raise FileNotFoundError(f"{path} holds neither rope_patch.json nor config.json: not a saved model.")
    scheme_name = manifest["scheme"] if manifest else None

    if manifest and scheme_name and not manifest["native"]:
        import rope_patch

        # Raises the library's error: why there is no native form and what to use instead.
        rope_patch.to_rope_parameters(rope_patch.as_scheme(scheme_name, **manifest["params"]))
        raise ValueError(f"{scheme_name} has no native rope_parameters form.")  # pragma: no cover

    if config_path.is_file():
        # A full or merged model: save_pretrained wrote the native form into config.json already.
        cfg = json.loads(config_path.read_text())
        rope, window = cfg.get("rope_parameters") or cfg.get("rope_scaling"), cfg.get("max_position_embeddings")
        if rope is None:
            raise ValueError(f"{config_path} has no rope_parameters: not a RoPE model.")
    elif adapter_path.is_file():
        rope, window = _adapter_native(path, manifest, base)
    else:
        raise FileNotFoundError(f"{path} has rope_patch.json but neither config.json nor adapter_config.json.")
    return {"scheme": scheme_name, "rope_parameters": rope, "max_position_embeddings": window,
            "vllm": vllm_overrides(rope, window)}


def _adapter_native(path: Path, manifest: dict | None, base) -> tuple[dict, int]:
    """Adapter folders carry no config.json: rebuild the base model's skeleton on the meta device (no weights),
    apply the recorded scheme and read its native config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import rope_patch

    recorded = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    src = base or recorded
    if not src:
        raise ValueError(f"{path} is an adapter without a recorded base model: pass --base PATH.")
    try:
        config = AutoConfig.from_pretrained(src)
    except OSError as err:
        raise FileNotFoundError(f"The adapter's base model {src!r} cannot be read ({err}); pass --base PATH.") from None
    if manifest and manifest.get("original"):
        config.rope_parameters = manifest["original"]["rope_parameters"]
        config.max_position_embeddings = manifest["original"]["max_position_embeddings"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if manifest and manifest["scheme"]:
        rope_patch.apply(model, manifest["scheme"], **manifest["params"])
    native = rope_patch.native_config(model)
    return native["rope_parameters"], native["max_position_embeddings"]


def _export(args) -> int:
    info = export_info(args.dir, args.base)  # errors: one line from cli.main
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"scheme: {info['scheme'] or 'none (unpatched)'}")
    print(f"rope_parameters: {json.dumps(info['rope_parameters'])}")
    print(f"max_position_embeddings: {info['max_position_embeddings']}")
    print(f"vLLM: vllm serve {args.dir} {info['vllm']}")
    return 0
