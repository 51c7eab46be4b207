"""The model an evaluation runs, as saved: `rope-patch compare`, `sweep` and `tune` load a folder with the patch its
rope_patch.json records (what `rope_patch.from_pretrained` and the lm-eval model do), and say so.

A folder written by `rope_patch.save_pretrained` (or the LoRA recipe's `--merge`) holds the patched model only
together with its rope_patch.json: transformers alone loads the unpatched model (for a patch without a native form)
or the native form alone. Loading it plainly would measure another model than the one saved, without a word.
"""

from __future__ import annotations

import os
from pathlib import Path

import transformers
from torch import nn

from .. import zoo
from ..api import current
from ..persistence import MANIFEST, from_pretrained, read_manifest
from ..schemes.base import Scheme


def load_model(spec: str | os.PathLike = "tiny", dtype="float32", device: str = "cpu"):
    """(model, tokenizer) of `tiny`, `smollm2`, `gemma3` or a local folder, in eval mode; a folder's rope_patch.json is
    honoured (checked before any weights are read: a damaged one raises, naming the file and what to do)."""
    path = zoo.resolve_model_path(spec)
    manifest = read_manifest(path)
    if manifest is None or manifest["scheme"] is None:
        return zoo.load_model(spec, dtype=dtype, device=device)
    model = from_pretrained(path, dtype=zoo.torch_dtype(dtype)).to(device).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path)


def patch_label(scheme: Scheme) -> str:
    """`yarn(factor=4.0)`, `yarn(factor=4.0) + self_extend(group_size=4, window_size=16)`: the parameters as given
    (the window L, which every scheme fills in from the model, left out)."""
    parts = getattr(scheme, "schemes", None) or (scheme,)
    return " + ".join(f"{p.name}(" + ", ".join(f"{k}={v!r}" for k, v in p.params().items()
                                               if k != "original_max_position_embeddings") + ")" for p in parts)


def loaded_patch(model: nn.Module, path: str | os.PathLike | None = None) -> dict | None:
    """{"scheme", "label", "file"} of the patch the model carries as loaded (None: none). `file`: the rope_patch.json
    of `path` it came from, where there is one."""
    scheme = current(model)
    if scheme is None:
        return None
    file = Path(path) / MANIFEST if path and (Path(path) / MANIFEST).is_file() else None
    return {"scheme": scheme.name, "label": patch_label(scheme), "file": str(file) if file else None}
