"""Built-in schemes: importing this package imports every module in it, and each scheme class registers itself
(`@register_scheme`) where it is defined, so a new scheme is a new module here (or a class in one), listed nowhere."""

import importlib
import pkgutil

from .base import Scheme

__all__ = ["Scheme"]


def _import_modules() -> None:
    """Every module of this package, in name order (so registration order, and what follows it, is reproducible)."""
    for name in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"{__name__}.{name}")


_import_modules()
