"""An undo log: every change a patch makes goes through it, so `remove()` (and a failed `apply()`) replays the
inverse operations in reverse order and restores the very objects that were there (peft keeps the original
module for `unload()` in the same spirit). Nothing is recomputed on undo, so logits come back bit-identical."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class UndoLog:
    def __init__(self):
        self._undo: list[Callable[[], None]] = []
        self.added_modules: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, name, child): the patch's own

    def push(self, undo: Callable[[], None]) -> None:
        """Register the inverse of a change the caller has just made."""
        self._undo.append(undo)

    def setattr(self, obj, name: str, value) -> None:
        """`setattr(obj, name, value)`; undo restores the instance attribute or deletes it if it was not one
        (so a class attribute such as a method shows through again)."""
        own = name in vars(obj)
        old = vars(obj)[name] if own else None

        def undo():
            if own:
                setattr(obj, name, old)
            elif name in vars(obj):
                delattr(obj, name)

        setattr(obj, name, value)
        self._undo.append(undo)

    def set_buffer(self, module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        """Replace (or add) a non-persistent buffer; undo puts the original tensor object back."""
        old = module._buffers.get(name)
        existed = name in module._buffers
        persistent = name not in module._non_persistent_buffers_set

        def undo():
            if existed:
                module.register_buffer(name, old, persistent=persistent)
            else:
                module._buffers.pop(name, None)
                module._non_persistent_buffers_set.discard(name)

        module.register_buffer(name, tensor, persistent=False)
        self._undo.append(undo)

    def add_module(self, parent: nn.Module, name: str, child: nn.Module) -> None:
        """Attach a module (learned position tables, biases) so optimizers and state_dict see it."""
        if name in parent._modules or hasattr(parent, name):
            raise RuntimeError(f"{type(parent).__name__} already has an attribute {name!r}")
        parent.add_module(name, child)
        self.added_modules.append((parent, name, child))

        def undo():
            parent._modules.pop(name, None)
            self.added_modules.remove((parent, name, child))

        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
