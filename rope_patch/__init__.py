"""rope_patch: swap the position encoding of a loaded Hugging Face LLaMA-family model at runtime.

    import rope_patch
    rope_patch.apply(model, "yarn", factor=4.0, original_max_position_embeddings=4096)
    rope_patch.remove(model)   # bit-identical original again

The public names are imported on first use (PEP 562): `import rope_patch` itself imports neither torch nor
transformers, so that `rope-patch --help` and an argument error answer at once (the console script imports this
package before its own module). `rope_patch.apply`, `from rope_patch import apply` and `dir(rope_patch)` work as
with eager imports; type checkers read the TYPE_CHECKING block. Submodules load on attribute access as well
(`rope_patch.api.patch_modules`, `rope_patch.plots`).
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

# public name -> the module that defines it. tests/test_lazy_api.py checks that it equals the TYPE_CHECKING block.
_EXPORTS = {
    "apply": "api", "as_scheme": "api", "context_window": "api", "current": "api", "patched": "api", "remove": "api",
    "LengthFix": "lengths", "fix_length": "lengths", "fixed_length": "lengths",
    "from_pretrained": "persistence", "native_config": "persistence", "save_pretrained": "persistence",
    "to_rope_parameters": "persistence",
    "list_schemes": "registry", "register_scheme": "registry",
    "Scheme": "schemes.base", "FrequencyScheme": "schemes.frequency", "Stack": "schemes.stack",
    "AttentionScheme": "schemes.common", "TwoRegion": "schemes.positions",
    "AttentionRule": "attention.protocol", "Declared": "attention.declared", "Geometry": "attention.geometry",
    "Region": "attention.geometry", "Bias": "attention.geometry",
    "Suggestion": "suggest", "suggest": "suggest",
}

if TYPE_CHECKING:
    from .api import apply, as_scheme, context_window, current, patched, remove
    from .attention.declared import Declared
    from .attention.geometry import Bias, Geometry, Region
    from .attention.protocol import AttentionRule
    from .lengths import LengthFix, fix_length, fixed_length
    from .persistence import from_pretrained, native_config, save_pretrained, to_rope_parameters
    from .registry import list_schemes, register_scheme
    from .schemes.base import Scheme
    from .schemes.common import AttentionScheme
    from .schemes.frequency import FrequencyScheme
    from .schemes.positions import TwoRegion
    from .schemes.stack import Stack
    from .suggest import Suggestion, suggest

__all__ = [
    "AttentionRule",
    "AttentionScheme",
    "Bias",
    "Declared",
    "FrequencyScheme",
    "Geometry",
    "LengthFix",
    "Region",
    "Scheme",
    "Stack",
    "Suggestion",
    "TwoRegion",
    "apply",
    "as_scheme",
    "context_window",
    "current",
    "fix_length",
    "fixed_length",
    "from_pretrained",
    "list_schemes",
    "native_config",
    "patched",
    "register_scheme",
    "remove",
    "save_pretrained",
    "suggest",
    "to_rope_parameters",
]


def __getattr__(name: str) -> Any:
    """A public name from its module, or a submodule (`rope_patch.api`), imported now and kept in the namespace."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    elif not name.startswith("__"):  # dunders (__path__ probes, __wrapped__, ...) are never submodules
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":  # the submodule exists but a dependency of it is missing: say so
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public API, __version__ and the submodules imported so far (not this module's own helpers)."""
    loaded = (n for n, v in globals().items() if not n.startswith("_") and isinstance(v, types.ModuleType)
              and v.__name__.startswith(f"{__name__}."))
    return sorted({*__all__, "__version__", *loaded})


class _Package(types.ModuleType):
    """`suggest` is both a public function and the submodule that defines it. Importing a submodule binds it on its
    package, which would turn `rope_patch.suggest` into the module once anything imported rope_patch.suggest; the
    function is kept instead, as the eager `from .suggest import suggest` did."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
