"""File writes that a crash cannot leave half done, and checksums (used by saves, results and model fetching)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a temporary file beside `path`, fsync it, then rename it over `path`: a reader (and an
    interrupted run) sees the old file or the whole new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


PACKAGE = Path(__file__).resolve().parent


def portable_path(path: str | os.PathLike) -> str:
    """`path` as a result file records it, naming no machine's folders: a file shipped with rope_patch as
    `rope_patch/...` (the held-out text, rope-tiny, the lm-eval tasks: the same file wherever the package is
    installed), a path inside the home directory as `~/...` (`Path.expanduser` reads it back); any other path as it
    is."""
    text = str(path)
    for root, prefix in ((str(PACKAGE), "rope_patch"), (str(Path.home()).rstrip("/"), "~")):
        if root and (text == root or text.startswith(root + "/")):
            return prefix + text[len(root):]
    return text


def portable(obj):
    """`obj` (parsed JSON: dicts, lists, strings) with every string that is a path of the package or the home
    directory written as `portable_path` does; for settings recorded in result files."""
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v) for v in obj]
    return portable_path(obj) if isinstance(obj, str) else obj
