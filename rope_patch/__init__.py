"""rope_patch: swap the position encoding of a loaded Hugging Face LLaMA-family model at runtime.

    import rope_patch
    rope_patch.apply(model, "yarn", factor=4.0, original_max_position_embeddings=4096)
    rope_patch.remove(model)   # bit-identical original again
"""

from . import schemes  # noqa: F401  (registers the built-in schemes)
from ._version import __version__ as __version__
from .api import apply, as_scheme, context_window, current, patched, remove
from .lengths import LengthFix, fix_length, fixed_length
from .persistence import from_pretrained, native_config, save_pretrained, to_rope_parameters
from .registry import list_schemes, register_scheme
from .schemes.base import Scheme
from .schemes.frequency import FrequencyScheme
from .schemes.stack import Stack
from .suggest import Suggestion, suggest

__all__ = [
    "FrequencyScheme",
    "LengthFix",
    "Scheme",
    "Stack",
    "Suggestion",
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
