"""Built-in schemes; importing this package registers them."""

from . import frequency  # noqa: F401
from .base import Scheme

__all__ = ["Scheme"]
