"""Built-in schemes; importing this package registers them."""

from . import absolute, bias, chunked, frequency, logn, positions, stack  # noqa: F401
from .base import Scheme

__all__ = ["Scheme"]
