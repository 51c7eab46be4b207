"""The project's scripts (recipes/, bench/, eval/) as modules: they are files, not part of the package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(path: str, register: bool = False) -> ModuleType:
    """ROOT/`path` executed as a fresh module named after the file; `register` puts it in sys.modules first (and
    returns the one already there), for scripts whose dataclasses or pickles look their module up by name."""
    name = Path(path).stem
    if register and name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
