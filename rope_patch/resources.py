"""Package data (rope_patch/data/): the embedded model rope-tiny, the held-out text and the offline lm-eval tasks.

Found with `importlib.resources`, so the commands work the same from a wheel install as from a checkout; a user's
own paths (command-line options, `$ROPE_PATCH_TINY`) always win over these.

A folder named `rope_patch` without an `__init__.py` (the repository checkout itself, in the folder a script runs from)
that comes before the installed package on `sys.path` makes `import rope_patch` a namespace package of that folder:
its submodules still load (an editable install finds them), but the package holds none of the API, and its data is
looked up in the wrong folder. That is said, with the folder and what to do, instead of a TypeError from deep inside
importlib (`MultiplexedPath.joinpath() takes 2 positional arguments`).
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

PACKAGE = "rope_patch"


class ShadowedPackage(ImportError):
    """`rope_patch` was imported from a folder that is not the package (see the module docstring)."""


def package_root():
    """The package's own folder as an importlib Traversable; `ShadowedPackage` when a namespace folder shadows it."""
    package = sys.modules.get(PACKAGE)
    if package is not None and getattr(package, "__file__", None) is None:  # a namespace package: no __init__.py
        folders = [str(p) for p in getattr(package, "__path__", [])]
        real = Path(__file__).resolve().parent
        raise ShadowedPackage(
            f"`import rope_patch` found {' and '.join(folders) or 'a namespace package'}, a folder without "
            f"__init__.py that comes before the installed package ({real}) on sys.path (Python puts the folder of "
            "the script, or the current folder, first), so the package has none of its functions and no data. Run "
            f"the script from another folder (the checkout's root is fine), or rename that folder.", name=PACKAGE)
    return resources.files(PACKAGE)


def data_path(*parts: str) -> Path:
    """A file or folder under rope_patch/data. Installed packages are plain directories (wheels unpack), and the
    consumers need real paths: transformers' from_pretrained, lm-eval's --include_path. One part per `joinpath`:
    Python 3.11's MultiplexedPath (a namespace package's files) takes a single one."""
    node = package_root().joinpath("data")
    for part in parts:
        node = node.joinpath(part)
    return Path(str(node))


def tiny_model_dir() -> Path:
    return data_path("rope-tiny")


def heldout_text() -> Path:
    """Persuasion (Austen), never trained on by rope-tiny: the default text of every evaluation."""
    return data_path("heldout.txt")


def tasks_dir() -> Path:
    """The folder to pass to lm-eval's --include_path for the rope_* tasks."""
    return data_path("tasks")
