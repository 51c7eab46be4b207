"""Saving and reloading patched models, and exporting a scheme's native `rope_parameters`.

A saved directory holds what `save_pretrained` of transformers (or peft, for an adapter) writes, plus
`rope_patch.json` (scheme, parameters, the unpatched RoPE config, versions) and, when the scheme owns learned
parameters (relative-bias or position tables), `rope_patch.safetensors`. For a scheme with a native transformers
form, config.json carries it, so plain `transformers.AutoModelForCausalLM.from_pretrained` reproduces the logits without
rope_patch installed; for the others config.json keeps the unpatched RoPE and `rope_patch.from_pretrained`
re-applies the scheme.

Nothing is lost silently: a missing, corrupt, truncated or future-format file raises an error that names the file
and says what to do. `save_pretrained` writes the manifest last (after the model and the learned parameters, each
through a temporary file and `os.replace`), so a crash mid-save never leaves a manifest pointing at files that are
not there; the manifest records the learned parameters' keys and sha256, so a weights file from another save is
caught. Manifest formats: 1 (no "weights" entry), 2 (one scheme) and 3 (a stack of schemes, `"scheme": "stack"`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from . import schema
from ._version import __version__
from .api import SchemeLike, apply, as_scheme, current, original_config, patch_modules
from .discovery import RopeContext, find_target, unwrap
from .files import sha256_file, write_text_atomic
from .schemes.base import Scheme, without_native_form
from .schemes.rotary_install import check_layer_types
from .specs import parse_scheme_spec

logger = logging.getLogger("rope_patch")
MANIFEST = "rope_patch.json"
PATCH_WEIGHTS = "rope_patch.safetensors"
# 3: a stack ("scheme": "stack", "params": {"schemes": [{"scheme", "params"}, ...]}), written only for stacks, so a
# single scheme's save stays readable by rope_patch versions that read format 2; 2: records the learned parameters
# ("weights": {"file", "keys", "sha256"}); 1 (no "weights") is still read. The file's schema: schema.MANIFEST.
FORMAT = schema.MANIFEST_FORMAT
SINGLE_FORMAT = schema.MANIFEST_SINGLE_FORMAT  # what a save of one scheme (or none) writes
_FIX = schema.MANIFEST_FIX
PEFT_KWARGS = ("is_trainable", "adapter_name")  # what from_pretrained passes to PeftModel.from_pretrained


def native_config(model: nn.Module) -> dict:
    """{"rope_parameters", "max_position_embeddings"} that make a plain transformers model equal the patched one.

    Raises ValueError for schemes without a native form (dynamic_yarn and the attention schemes). The patched config
    holds that form already (the scheme's `rope_parameters` and `public_window`: dynamic NTK's announces L, where
    transformers' dynamic scaling starts)."""
    scheme = current(model)
    if scheme is None:
        return original_config(model)
    _require_native(scheme)
    cfg = find_target(model).config
    return {"rope_parameters": copy.deepcopy(cfg.rope_parameters),
            "max_position_embeddings": cfg.max_position_embeddings}


def to_rope_parameters(scheme: SchemeLike | None, *, model: nn.Module | None = None, head_dim: int | None = None,
                       rope_theta: float | None = None) -> dict:
    """The transformers / vLLM `rope_parameters` dict of a scheme, or a ValueError where none exists.

    `scheme` is a Scheme, a name or a spec ("yarn:4"); or pass only `model=` for the scheme applied to it. Without a
    model, `rope_theta` and `head_dim` fill in what the scheme needs (the result omits rope_theta when unknown). For a
    model with RoPE per layer type (Gemma 3) the dict is keyed by layer type, as `apply()` writes the config.
    """
    if scheme is None:
        if model is None:
            raise TypeError("to_rope_parameters needs a scheme or a patched model=.")
        return native_config(model)["rope_parameters"]
    if isinstance(scheme, str):
        scheme = parse_scheme_spec(scheme)
    scheme = as_scheme(scheme)
    _require_native(scheme)
    chosen = getattr(scheme, "layer_types", None)
    if model is not None:
        target = find_target(model)
        if target.table is not None:
            _require_native(scheme.resolve(target).on_table(target))
        if chosen is not None:
            check_layer_types(scheme, target)
        if chosen is not None or (target.layer_types != [None] and len(target.rotaries) == 1):
            # keyed by layer type, as apply() writes it: the chosen types' entries (all without layer_types), the
            # others the model's own
            resolved, contexts = scheme.resolve(target), target.contexts()
            chosen = chosen or tuple(contexts)
            # the kept types' entries as the unpatched model has them, not as a patch on the model may have rewritten
            # them (apply() removes that patch first)
            own = original_config(model)["rope_parameters"]
            return {lt: None if entry is None else resolved.rope_parameters(contexts[lt]) if lt in chosen
                    else copy.deepcopy(own[lt]) for lt, entry in target.config.rope_parameters.items()}
        ctx = next(iter(target.contexts().values()))
        return scheme.resolve(target).rope_parameters(ctx)
    if chosen is not None:
        raise ValueError(f"{scheme.name}: with layer_types={'/'.join(chosen)} the rope_parameters are keyed by layer "
                         "type, the other layer types keeping the model's own entries: pass model=.")
    theta = rope_theta or scheme.params().get("rope_theta")
    scheme.check_export(head_dim, theta)  # what the scheme needs that only a model would give
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


def export_info(directory: str | os.PathLike, base: str | os.PathLike | None = None) -> dict:
    """{"scheme", "rope_parameters", "max_position_embeddings", "vllm"} for a folder written by `save_pretrained` (a
    full or merged model, or an adapter: `base` overrides its recorded base model); what `rope-patch export` prints.

    Raises ValueError when the scheme has no native form, FileNotFoundError when the folder is not a saved model."""
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is not a directory (expected a folder written by "
                                "rope_patch.save_pretrained).")
    manifest = read_manifest(path)
    config_path, adapter_path = path / "config.json", path / "adapter_config.json"
    if manifest is None and not config_path.is_file():
        raise FileNotFoundError(f"{path} holds neither rope_patch.json nor config.json: not a saved model.")
    scheme_name = manifest["scheme"] if manifest else None

    if manifest and scheme_name and not manifest["native"]:
        file = path / MANIFEST
        try:
            scheme = as_scheme(scheme_name, **manifest["params"])
        except (ValueError, TypeError) as err:
            raise type(err)(f"{file}: the recorded scheme {scheme_name!r} with "
                            f"params {_short(manifest['params'], 200)} cannot be read: {err} If it is a scheme of your "
                            "own, call rope_patch.register_scheme first.") from None
        try:  # the library's error: why there is no native form and what to use instead
            to_rope_parameters(scheme)
        except ValueError as err:
            raise ValueError(f"{file} records {scheme}: {err}") from None
        raise ValueError(f"{file}: 'native' is false, but {scheme} has a native form: the file was edited. {_FIX}")

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
    recorded = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    src = base or recorded
    if not src:
        raise ValueError(f"{path} is an adapter without a recorded base model: pass --base PATH.")
    try:
        config = transformers.AutoConfig.from_pretrained(src)
    except OSError as err:
        raise FileNotFoundError(f"The adapter's base model {src!r} cannot be read ({err}); pass --base PATH.") from None
    if manifest and manifest.get("original") and manifest["original"]["rope_parameters"] is not None:
        config.rope_parameters = manifest["original"]["rope_parameters"]
        config.max_position_embeddings = manifest["original"]["max_position_embeddings"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    # apply() needs real frequencies: the rotary modules alone are materialised, by the model's own weight init
    # (which recomputes their buffers from the config, as from_pretrained does for a meta-loaded model)
    for rotary in find_target(model).rotaries:
        rotary.to_empty(device="cpu")
        model._init_weights(rotary)
    if manifest and manifest["scheme"]:
        apply(model, manifest["scheme"], **manifest["params"])
    native = native_config(model)
    return native["rope_parameters"], native["max_position_embeddings"]


def _require_native(scheme: Scheme) -> None:
    if scheme.kind == "stack":
        parts = " + ".join(p.name for p in scheme.schemes)
        other = [p.name for p in scheme.schemes if not _is_native(p)]
        raise ValueError(
            f"the stack {parts} has no native transformers/vLLM `rope_parameters` form: {', '.join(other)} "
            f"{'is' if len(other) == 1 else 'are'} not expressible there, and a native config would silently drop "
            f"{'it' if len(other) == 1 else 'them'}. Save with rope_patch.save_pretrained and load with "
            "rope_patch.from_pretrained instead"
            + (f" (to_rope_parameters({scheme.frequency.name!r}, ...) exports the frequency part alone)."
               if scheme.frequency is not None and _is_native(scheme.frequency) else "."))
    if not scheme.native:
        raise ValueError(
            f"{scheme.name} has no native transformers/vLLM `rope_parameters` form (it changes {scheme.changes}). "
            "Save with rope_patch.save_pretrained and load with rope_patch.from_pretrained instead."
        )


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *, tokenizer: Any = None,
                    **kwargs: Any) -> Path:
    """Save `model` (a patched model, or a peft model: then the adapter) plus `rope_patch.json`.

    Args:
        model: the patched model (or peft model) to save.
        save_directory: the folder; created where missing.
        tokenizer: the model's tokenizer (anything with `save_pretrained`, e.g. a transformers tokenizer or
            processor), saved into the same folder: a serving engine (`vllm serve DIR`, SGLang) loads it from there
            and cannot start without one, and `rope-patch export DIR --engine ...` refuses a folder that lacks it.
        **kwargs: passed to transformers' (or peft's) `save_pretrained`. Two of them matter here, as in accelerate's
            distributed save (`save_pretrained(dir, is_main_process=..., state_dict=accelerator.get_state_dict(m))`):
            `state_dict` (a full model's: the learned tables are taken from it where it holds them, gathered under
            DeepSpeed ZeRO-3, and written to `rope_patch.safetensors` rather than beside the model's weights) and
            `is_main_process=False` (transformers' save is still called, for its collectives; rope_patch writes
            nothing on that process).

    Order: everything is computed first (a failure leaves the folder as it was); then the previous manifest is
    removed, the model, config, tokenizer and learned parameters are written, and the manifest comes last. A crash
    mid-save therefore leaves no manifest (or a complete save), never one that points at missing or foreign weights."""
    out = Path(save_directory)
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"rope_patch.save_pretrained: tokenizer= takes a tokenizer with a save_pretrained method (a "
                        f"transformers tokenizer or processor); got {type(tokenizer).__name__}. Nothing was written.")
    base, manifest, tables = _patch_record(model)
    main = kwargs.get("is_main_process", True)
    given = kwargs.pop("state_dict", None) if not manifest["adapter"] else None  # peft takes its own state_dict=
    if given is not None:
        tables = {k: given[k].detach().contiguous().cpu() if k in given else v for k, v in tables.items()}

    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / MANIFEST).unlink(missing_ok=True)  # a manifest describes one complete save: the old one goes first
    if manifest["adapter"]:
        model.save_pretrained(out, **kwargs)
    else:
        state = {k: v for k, v in (base.state_dict() if given is None else given).items() if k not in tables}
        # transformers' own method: the instance's NoticedSave (undo.py) would log the plain-save notice, which says
        # to save with rope_patch instead
        type(base).save_pretrained(base, out, state_dict=state, **kwargs)
        if main:
            _rewrite_config(out / "config.json", saved_config(base))
    if not main:
        return out
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    _write_patch_files(out, manifest, tables)
    _log_notice(base, out, manifest)
    return out


def save_patch(model: nn.Module, save_directory: str | os.PathLike) -> Path:
    """Write only the patch's files (`rope_patch.json`, plus `rope_patch.safetensors` for learned tables) into a
    folder that already holds the model's own save: a transformers Trainer checkpoint, or a folder written by
    transformers' or peft's `save_pretrained`. The folder then loads with `from_pretrained` as if `save_pretrained`
    had written it. The model's weight files are left as they are; for a full model (not an adapter) config.json,
    where present, is rewritten as `save_pretrained` writes it (native `rope_parameters` where they exist, else the
    unpatched RoPE). Same order as `save_pretrained`: the old manifest goes first, the new one comes last."""
    out = Path(save_directory)
    if not out.is_dir():
        raise FileNotFoundError(f"rope_patch.save_patch: {str(out)!r} is not a directory; save_patch adds the patch's "
                                "files to a folder that holds a saved model "
                                "(use rope_patch.save_pretrained otherwise).")
    base, manifest, tables = _patch_record(model)
    (out / MANIFEST).unlink(missing_ok=True)
    if not manifest["adapter"] and (out / "config.json").is_file():
        _rewrite_config(out / "config.json", saved_config(base))
    _write_patch_files(out, manifest, tables)
    return out


def saved_config(model: nn.Module) -> dict:
    """{"rope_parameters", "max_position_embeddings"} that every save of `model` writes to config.json (the one rule,
    `schemes.base.without_native_form`): the native form where the whole patch has one, else the unpatched RoPE. A
    patched model's own config already holds this, so transformers' plain save_pretrained writes the same."""
    scheme = current(model)
    return native_config(model) if scheme is not None and _is_native(scheme) else original_config(model)


def _log_notice(base: nn.Module, out: Path, manifest: dict) -> None:
    """A full-model save of a patch without a native form says what config.json reloads to, and how to get the patch
    back (adapters write no config.json: they reload through rope_patch.from_pretrained or a re-applied patch)."""
    scheme = current(base)
    if scheme is not None and not manifest["adapter"]:
        notice = scheme.save_notice(out, manifest=True)
        if notice:
            logger.warning(notice)


def _patch_record(model: nn.Module) -> tuple[nn.Module, dict, dict]:
    """(unwrapped model, manifest without its "weights" entry, learned tables) of what a save must record."""
    base = unwrap(model)
    scheme = current(base)
    tables = _patch_tables(base, patch_modules(base))
    manifest = {
        "format": FORMAT if scheme is not None and scheme.kind == "stack" else SINGLE_FORMAT,
        "scheme": None if scheme is None else scheme.name,
        "params": {} if scheme is None else _jsonable(scheme.params()),
        "native": scheme is not None and _is_native(scheme),
        "original": original_config(base),
        "adapter": model is not base and hasattr(model, "peft_config"),
        "weights": None,
        "versions": _versions(),
    }
    json.dumps(manifest)  # not serialisable -> TypeError now, before anything is written
    return base, manifest, tables


def _write_patch_files(out: Path, manifest: dict, tables: dict) -> None:
    """The learned tables (through a temporary file + fsync + rename), then the manifest that records them."""
    if tables:
        tmp = out / (PATCH_WEIGHTS + ".tmp")
        save_file(tables, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        manifest["weights"] = {"file": PATCH_WEIGHTS, "keys": sorted(tables), "sha256": sha256_file(tmp)}
        os.replace(tmp, out / PATCH_WEIGHTS)
    else:
        (out / PATCH_WEIGHTS).unlink(missing_ok=True)  # a previous save's tables would be foreign to this one
    write_text_atomic(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def read_manifest(directory: str | os.PathLike) -> dict | None:
    """The checked `rope_patch.json` of a folder written by `save_pretrained`, or None where there is none.

    Raises ValueError (schema.FileFormatError, naming the file, the field and what to do) for a file that is empty,
    binary or not valid JSON (corrupt, truncated), lacks a required key, has a value of the wrong type or range, or has
    a format newer than this rope_patch reads (`schema.MANIFEST`)."""
    file = Path(directory) / MANIFEST
    if not file.is_file():
        return None
    return schema.read(file, schema.MANIFEST)


def from_pretrained(path: str | os.PathLike, *, base_model: str | os.PathLike | nn.Module | None = None,
                    model_class: Any = None, **kwargs: Any) -> nn.Module:
    """Rebuild what `save_pretrained` wrote: base model (+ adapter) + patch (+ the patch's learned parameters).

    `base_model` (a path or a loaded model) overrides the adapter's recorded base. `kwargs` go to transformers'
    `from_pretrained` (dtype, device_map, ...), except peft's `is_trainable` and `adapter_name`, which go to
    `PeftModel.from_pretrained` for an adapter folder (`is_trainable=True` to train the adapter further: peft loads
    it frozen, for inference, by default). A folder without rope_patch.json loads as the plain model (an adapter whose
    modules_to_save trains a rope_patch table is refused instead: its patch was not recorded).
    Raises FileNotFoundError for a missing config.json / adapter_config.json / rope_patch.safetensors and
    ValueError for a corrupt, mismatched or future-format file (see `read_manifest`), naming the file.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"rope_patch.from_pretrained: {str(path)!r} is not a directory saved by "
                                "rope_patch.save_pretrained.")
    peft_kwargs = {k: kwargs.pop(k) for k in PEFT_KWARGS if k in kwargs}
    manifest = read_manifest(path)
    if manifest is None and (path / PATCH_WEIGHTS).is_file():
        raise FileNotFoundError(f"{path / MANIFEST} is missing, though {path / PATCH_WEIGHTS} is there: the save was "
                                "interrupted (save_pretrained writes the manifest last) or the manifest was deleted, "
                                f"and loading would silently drop the patch. {_FIX}")
    is_adapter = (path / "adapter_config.json").is_file()
    if manifest is not None and manifest.get("adapter") and not is_adapter:
        raise FileNotFoundError(f"{path / 'adapter_config.json'} is missing, though {path / MANIFEST} "
                                f"records an adapter: the save is incomplete or the folder was copied in part. {_FIX}")
    asked = [k for k, v in peft_kwargs.items() if v not in (None, False)]  # is_trainable=False: as a full model is
    if asked and not is_adapter:
        raise TypeError(f"rope_patch.from_pretrained: {', '.join(f'{k}=' for k in asked)} applies to an "
                        f"adapter folder (with adapter_config.json), but {path} holds a full model, whose parameters "
                        "all load trainable: leave it out.")
    if not is_adapter and not (path / "config.json").is_file():
        if manifest is not None:
            raise FileNotFoundError(f"{path / 'config.json'} is missing, though {path / MANIFEST} is "
                                    f"there: the save is incomplete or the folder was copied in part. {_FIX}")
        raise FileNotFoundError(f"{path} holds no config.json (nor rope_patch.json or "
                                "adapter_config.json): not a saved model. Pass a folder written by "
                                "rope_patch.save_pretrained or by transformers' save_pretrained.")
    recorded_weights = manifest.get("weights") if manifest else None
    if recorded_weights and recorded_weights["keys"] and not (path / recorded_weights["file"]).is_file():
        # before loading
        _missing_weights(path / recorded_weights["file"], manifest["scheme"], recorded_weights["keys"])
    model_class = model_class or transformers.AutoModelForCausalLM
    original = manifest["original"] if manifest else None

    def load_base(src):
        if not isinstance(src, (str, os.PathLike)):
            return src
        config = transformers.AutoConfig.from_pretrained(src)
        if original and original["rope_parameters"] is not None:  # the scheme is relative to the unpatched model
            config.rope_parameters = copy.deepcopy(original["rope_parameters"])
            config.max_position_embeddings = original["max_position_embeddings"]
        return model_class.from_pretrained(src, config=config, **kwargs)

    if is_adapter:
        from peft import PeftModel  # peft (~1.5 s to import) only for adapters

        adapter_config = json.loads((path / "adapter_config.json").read_text())
        if manifest is None:
            _refuse_adapter_of_a_lost_patch(path, adapter_config)
        recorded = adapter_config.get("base_model_name_or_path")
        src = base_model if base_model is not None else recorded
        if src is None:
            raise ValueError(f"{path} holds an adapter without a recorded base model: pass base_model=.")
        base = load_base(src)
        if manifest and manifest["scheme"]:  # before peft: the tables it keeps a trained copy of (modules_to_save)
            reapply_manifest(base, manifest, path / MANIFEST)  # must exist when it loads the adapter, as in training
        model = PeftModel.from_pretrained(base, path, **peft_kwargs)
    else:
        model = load_base(str(path))
        if manifest and manifest["scheme"]:
            reapply_manifest(model, manifest, path / MANIFEST)
    if manifest and manifest["scheme"]:
        load_patch_weights(model, manifest, path)
    return model


def _refuse_adapter_of_a_lost_patch(path: Path, adapter_config: dict) -> None:
    """An adapter folder without rope_patch.json whose `modules_to_save` trains a rope_patch table (the attribute
    names of the tables begin with "rope_patch_") was trained under a patch that its save did not record: loading it
    as a plain adapter would drop the patch and its trained table (peft only warns of "unexpected adapter keys")."""
    saved = adapter_config.get("modules_to_save") or []
    tables = sorted({name for name in ([saved] if isinstance(saved, str) else saved)
                     if str(name).split(".")[-1].startswith("rope_patch_")})
    if tables:
        raise FileNotFoundError(
            f"{path / MANIFEST} is missing, though {path / 'adapter_config.json'} trains the rope_patch table(s) "
            f"{', '.join(tables)}: the adapter was saved by peft's save_pretrained (or Trainer.save_model), which does "
            "not record the patch it was trained with, and loading it would drop the patch and its trained table. "
            "Apply that scheme to the base model (rope_patch.apply(base, scheme, ...), as in training) and load the "
            "adapter with peft.PeftModel.from_pretrained(base, dir); save with rope_patch.save_pretrained next time.")


def reapply_manifest(model, manifest: dict, file: Path) -> None:
    """Apply the scheme a manifest records (`file`: the manifest, named in errors); a scheme that cannot be re-applied
    raises its error with the file, the recorded parameters and what to do (register a scheme of one's own, upgrade)."""
    name, params = manifest["scheme"], manifest["params"]
    try:
        apply(model, name, **params)
    except (ValueError, TypeError) as err:
        versions = manifest.get("versions")
        writer = versions.get("rope_patch") if isinstance(versions, dict) else None
        msg = (f"{file}: the recorded scheme {name!r} with params {_short(params, 200)} cannot be re-applied: {err} "
               "If it is a scheme of your own, call rope_patch.register_scheme before loading"
               + (f"; it was saved by rope_patch {writer}: if that is newer, upgrade rope_patch." if writer else "."))
        raise (TypeError if isinstance(err, TypeError) else ValueError)(msg) from err


def load_patch_weights(model, manifest: dict, path: Path) -> None:
    """Load the learned parameters of the re-applied patch with `load_state_dict(strict=True)` semantics."""
    own = patch_modules(model)
    recorded = manifest.get("weights")  # format 2: {"file", "keys", "sha256"} or None; format 1: absent
    file = path / (recorded["file"] if recorded else PATCH_WEIGHTS)
    scheme = manifest["scheme"]
    if not own:
        if recorded and recorded["keys"]:
            raise ValueError(f"{path / MANIFEST} records learned parameters {recorded['keys']} in {file}, but {scheme} "
                             f"with params {_short(manifest['params'], 200)} attaches no modules here. {_FIX}")
        return
    expected = {f"{n}.{k}": t for n, m in own.items() for k, t in m.state_dict().items()}
    if not file.is_file():
        _missing_weights(file, scheme, expected)
    if recorded and recorded.get("sha256"):
        got = sha256_file(file)
        if got != recorded["sha256"]:
            raise ValueError(f"{file} does not match {path / MANIFEST} (sha256 {got[:12]}…, recorded "
                             f"{recorded['sha256'][:12]}…): it was modified, truncated, or comes from another save. "
                             f"Copy the matching file from the original save. {_FIX}")
    try:
        weights = load_file(file)
    except Exception as err:  # safetensors raises its own SafetensorError / OSError, naming no file
        raise ValueError(f"{file} cannot be read as safetensors ({type(err).__name__}: {err}): the file is corrupt or "
                         f"truncated. {_FIX}") from err
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = [f"{k} (file {tuple(weights[k].shape)}, model {tuple(expected[k].shape)})"
              for k in sorted(set(expected) & set(weights)) if weights[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        parts = [f"{label}: {', '.join(keys)}" for label, keys in
                 (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", shapes)) if keys]
        raise ValueError(f"{file} does not match the learned parameters of the {scheme} patch "
                         f"({'; '.join(parts)}): it holds tables of another scheme, parameters or model than "
                         f"{path / MANIFEST} records. {_FIX}")
    for name, module in own.items():
        module.load_state_dict({k: weights[f"{name}.{k}"] for k in module.state_dict()}, strict=True)


def _patch_tables(base, own: dict) -> dict:
    """{"name.key": tensor} of the patch's learned parameters as the model uses them now (`patch_modules` gives the
    tables in effect, peft's trained `modules_to_save` copies included)."""
    return {f"{name}.{k}": v.detach().contiguous().cpu() for name, module in own.items()
            for k, v in module.state_dict().items()}


def _missing_weights(file: Path, scheme: str, keys) -> None:
    raise FileNotFoundError(
        f"{file} is missing: the {scheme} patch owns learned parameters ({', '.join(sorted(keys))}) that "
        "rope_patch.save_pretrained wrote there; loading without it would give freshly initialised tables, not the "
        f"saved ones. Copy the file back beside {MANIFEST} from the original save, or re-save the model with "
        "rope_patch.save_pretrained(model, dir).")


def _is_native(scheme: Scheme) -> bool:
    return not without_native_form(scheme)


def _rewrite_config(path: Path, rope: dict) -> None:
    config = json.loads(path.read_text())
    # a table rotary's model (GPT-J) has no rope_parameters: none are written for it
    config.update({k: copy.deepcopy(v) for k, v in rope.items() if v is not None})
    write_text_atomic(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _short(value, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 1] + "…"


def _jsonable(params: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


def _versions() -> dict:
    return {"rope_patch": __version__, "transformers": transformers.__version__, "torch": torch.__version__}
