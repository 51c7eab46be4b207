"""Warnings rope_patch gives its user, attributed to the user's own line: the first frame outside rope_patch (and
outside contextlib, through which `rope_patch.patched` runs), whichever path (apply, patched, from_pretrained, the
CLI) led there, so the warning names the call that caused it and Python's once-per-line filter counts the user's
lines."""

from __future__ import annotations

import contextlib
import sys
import warnings


def _outside(frame) -> bool:
    name = frame.f_globals.get("__name__", "")
    return not (name == "rope_patch" or name.startswith("rope_patch.")) and frame.f_code.co_filename != \
        contextlib.__file__


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` at the first caller outside rope_patch."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: warn's caller
    while frame is not None and not _outside(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
