"""Package data (rope_patch/data/): the embedded model rope-tiny, the held-out text and the offline lm-eval tasks.

Found with `importlib.resources`, so the commands work the same from a wheel install as from a checkout; a user's
own paths (command-line options, `$ROPE_PATCH_TINY`) always win over these.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def data_path(*parts: str) -> Path:
    """A file or folder under rope_patch/data. Installed packages are plain directories (wheels unpack), and the
    consumers need real paths: transformers' from_pretrained, lm-eval's --include_path."""
    return Path(str(resources.files("rope_patch").joinpath("data", *parts)))


def tiny_model_dir() -> Path:
    return data_path("rope-tiny")


def heldout_text() -> Path:
    """Persuasion (Austen), never trained on by rope-tiny: the default text of every evaluation."""
    return data_path("heldout.txt")


def tasks_dir() -> Path:
    """The folder to pass to lm-eval's --include_path for the rope_* tasks."""
    return data_path("tasks")
