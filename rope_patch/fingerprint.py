"""A content fingerprint of a model folder, so that `--resume` never reuses results measured on other weights.

What a resumed run compared before (the path, model type, window, parameter count and dtype) stays the same when new
weights of the same shapes are saved into the same folder, and safetensors headers hold only dtype, shape and offsets,
so neither the header nor the file size tells two checkpoints apart. The fingerprint is therefore a sha256 over the
contents of every file `from_pretrained` reads to build the model an evaluation runs: the weights (*.safetensors,
*.bin, *.pt, *.pth, *.gguf and their index), config.json and generation_config.json, the saved patch (rope_patch.json,
rope_patch.safetensors), an adapter's files, and the tokenizer's (which decide the prompts).

Whole files, not sampled byte ranges: a sample misses an edit outside it (a fine-tune that moves a few rows of the
embedding, a merged adapter on some layers), and loading the model reads every byte of the weights anyway, so hashing
them costs at most one more read (about a second per GB on a local disk). And only once: each file's digest is cached
by (resolved path, size, modification time in ns) in `$ROPE_PATCH_CACHE/fingerprints.json` (default
~/.cache/rope_patch), so a 70B checkpoint is hashed the first time it is evaluated and then looked up. A write that
keeps size and mtime_ns (a copy with preserved times of different content of the same size) is the one change this
misses; rewriting a file in place updates its mtime. An unwritable cache is not an error: the digests are recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from . import schema
from .files import sha256_file, write_text_atomic
from .zoo import cache_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".model")  # .model: sentencepiece tokenizers
MODEL_FILES = ("config.json", "generation_config.json", "rope_patch.json", "adapter_config.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
               "chat_template.jinja", "chat_template.json")
CACHE_FILE = "fingerprints.json"


def model_files(folder: str | os.PathLike) -> list[Path]:
    """The files of `folder` (top level, as from_pretrained reads it) that make up the model, sorted by name."""
    folder = Path(folder)
    return sorted((p for p in folder.iterdir() if p.is_file() and (
        p.name in MODEL_FILES or p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".index.json"))),
        key=lambda p: p.name)


def model_fingerprint(folder: str | os.PathLike, cache: str | os.PathLike | None = None) -> str | None:
    """"sha256:<hex>" over the (name, sha256) of `model_files(folder)`; None when `folder` is not a directory (a model
    passed in memory). `cache`: the digest cache file (default `$ROPE_PATCH_CACHE/fingerprints.json`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    store = _Cache(Path(cache) if cache is not None else cache_dir() / CACHE_FILE)
    outer = hashlib.sha256()
    for path in model_files(folder):
        outer.update(f"{path.name}\0{store.digest(path)}\n".encode())
    store.save()
    return f"sha256:{outer.hexdigest()}"


class _Cache:
    """{resolved path: {"size", "mtime_ns", "sha256"}}; read once, written once (atomically) if anything was added."""

    def __init__(self, path: Path):
        self.path, self.changed = path, False
        try:
            self.entries = schema.read(path, schema.FINGERPRINTS)
        except (OSError, ValueError):  # none yet, or damaged: a cache, so start afresh (and rewrite it)
            self.entries = {}

    def digest(self, file: Path) -> str:
        stat = file.stat()
        key = str(file.resolve())
        entry = self.entries.get(key)
        if isinstance(entry, dict) and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns \
                and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        digest = sha256_file(file)
        self.entries[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        self.changed = True
        return digest

    def save(self) -> None:
        if not self.changed:
            return
        # entries of files that are gone (deleted runs, temporary folders) would only grow the cache
        self.entries = {k: v for k, v in self.entries.items() if os.path.exists(k)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps(self.entries, indent=0, sort_keys=True) + "\n")
        except OSError:  # a read-only home: the fingerprint is right, only not cached
            pass
