"""The undo log: every change a patch makes to a model goes through it, so `remove()` (and a failed `apply()`) replays
the inverse operations in reverse order and restores the very objects that were there (peft keeps the original
module for `unload()` in the same spirit). Nothing is recomputed on undo, so logits come back bit-identical.

The log is data, not closures. Each record names the object it changed (a module or config object of the patched
model) and holds the old and new values; the log itself is an `nn.Module` attached inside the model. So:

- `copy.deepcopy(model)` copies the log with the model, and deepcopy's memo points every record of the copy at the
  copy's own modules: the copy is an independent patched model that `remove()` restores on its own.
- `pickle` / `torch.save(model)` store the log like any other module (every record and hook is a module-level
  class); `torch.load(..., weights_only=False)` gives back a patched model.
- The tensors a patch replaced are registered as (non-persistent) buffers of the log, so `model.to(dtype/device)`
  and `model.half()` convert them exactly as they convert the model's own buffers: `remove()` after a move gives
  the tensors that a never-patched model moved the same way would have.

Records can also be replayed forwards (`redo`), which puts a patch back exactly (the same learned tables, the same
hooks) after it was undone: how `apply()` restores the old patch when a replacement fails, and how `patched()`
restores the scheme that was there before.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

import torch
from torch import nn


@dataclasses.dataclass
class SetAttr:
    """`setattr(obj, name, new)`; undo restores the instance attribute, or deletes it when there was none (so a class
    attribute such as a method shows through again)."""

    obj: object
    name: str
    had: bool
    old: object
    new: object

    def undo(self, log: UndoLog) -> None:
        # what is there now is what redo puts back: run-time state the model changed since (dynamic NTK's
        # max_seq_len_cached and attention_scaling after a long input) survives patched() and a failed replacement
        self.new = getattr(self.obj, self.name, self.new)
        if self.had:
            setattr(self.obj, self.name, self.old)
        elif self.name in vars(self.obj):
            delattr(self.obj, self.name)

    def redo(self, log: UndoLog) -> None:
        setattr(self.obj, self.name, self.new)


@dataclasses.dataclass
class SetBuffer:
    """A replaced (or added) buffer. The old tensor is kept as a buffer of the log (`saved`), so model moves and casts
    reach it; the new one (`new`, float32 frequencies) is kept as given, for `redo`."""

    module: nn.Module
    name: str
    saved: str | None  # name of the log buffer holding the old tensor; None: the buffer did not exist
    persistent: bool
    new: torch.Tensor
    current: torch.Tensor | None = None  # the tensor there when undone, for redo

    def undo(self, log: UndoLog) -> None:
        self.current = self.module._buffers.get(self.name)  # redo puts this very tensor back (see SetAttr.undo)
        if self.saved is None:
            self.module._buffers.pop(self.name, None)
            self.module._non_persistent_buffers_set.discard(self.name)
        else:
            self.module.register_buffer(self.name, log._buffers[self.saved], persistent=self.persistent)

    def redo(self, log: UndoLog) -> None:
        current = self.current
        if current is None:
            device = log._buffers[self.saved].device if self.saved is not None else self.new.device
            current = self.new.to(device, copy=True)
        self.module.register_buffer(self.name, current, persistent=False)


@dataclasses.dataclass
class AddModule:
    """A module the patch attached (learned position or bias tables): optimizers and `state_dict` see it."""

    parent: nn.Module
    name: str
    child: nn.Module

    def undo(self, log: UndoLog) -> None:
        self.parent._modules.pop(self.name, None)

    def redo(self, log: UndoLog) -> None:
        self.parent.add_module(self.name, self.child)


@dataclasses.dataclass
class AddHook:
    """A forward pre-hook, or with `after` a forward hook (an object of a module-level class, so it pickles). Kept by
    its id in the module's own hook dicts rather than through a `RemovableHandle`, which holds a weak reference and
    does not survive a copy."""

    module: nn.Module
    hook: object
    hook_id: int
    with_kwargs: bool
    after: bool = False

    def _dicts(self) -> tuple[dict, dict]:
        if self.after:
            return self.module._forward_hooks, self.module._forward_hooks_with_kwargs
        return self.module._forward_pre_hooks, self.module._forward_pre_hooks_with_kwargs

    def undo(self, log: UndoLog) -> None:
        hooks, with_kwargs = self._dicts()
        hooks.pop(self.hook_id, None)
        with_kwargs.pop(self.hook_id, None)

    def redo(self, log: UndoLog) -> None:
        hooks, with_kwargs = self._dicts()
        hooks[self.hook_id] = self.hook
        if self.with_kwargs:
            with_kwargs[self.hook_id] = True


PATCH_ONLY_PREFIX = "rope_patch_"  # rope_patch's own attention-function names (rope_patch.attention)


@dataclasses.dataclass
class PrivateConfig:
    """The patched model's modules get a private copy of their config object (transformers shares one object between
    every model built from it, and with the caller). The patch then writes to the copy freely. Undo points the modules
    back at the original object and carries over the fields the user changed while patched (those that differ from
    what the patch left there, `baseline`), so a user's own edit of `model.config` survives `remove()`."""

    holders: list  # (module, its original config object): model.config, or a sub-config of it (Blt's encoder/...)
    shared: object
    private: object
    baseline: dict | None = None
    copies: dict = dataclasses.field(default_factory=dict)  # id(original config object) -> its private copy

    def undo(self, log: UndoLog) -> None:
        if self.baseline is None:  # undone before the patch was complete (a failed apply): no user edits to keep
            return self._restore()
        base = self.baseline
        for key, value in vars(self.private).items():
            if key not in base or not _same(base[key], value):
                if isinstance(value, str) and value.startswith(PATCH_ONLY_PREFIX):
                    continue  # one of rope_patch's own attention functions: it only runs under a patch
                setattr(self.shared, key, value)
        self._restore()

    def _restore(self) -> None:
        for holder, original in self.holders:
            holder.config = original

    def redo(self, log: UndoLog) -> None:
        # The undo this follows (patched(), a failed replacement) carried the user's edits to the shared config
        # already: what the private config holds now is the new baseline, or a later edit back to an old value
        # would count as "unchanged" and the carried value would win on the next undo.
        if self.baseline is not None:
            self.baseline = copy.deepcopy(vars(self.private))
        for holder, original in self.holders:
            holder.config = self.copies.get(id(original), self.private)


logger = logging.getLogger("rope_patch")


class NoticedSave:
    """`model.save_pretrained` of a model whose patch has no native transformers form (see `Scheme.save_notice`):
    transformers' own save (the class's method, called unchanged), then a logged warning that the written
    config.json reloads the unpatched model and how to keep the patch (once per folder; a Trainer run's checkpoints
    say it once). Without it a plain save of such a model would
    lose the patch without a word. Set on the instance through the undo log (remove() gives the class's method back);
    an object of a module-level class holding the model and the log, so copies and pickles carry it."""

    def __init__(self, model: nn.Module, log: UndoLog):
        self.model, self.log = model, log
        self.told: set[str] = set()  # folders warned about (a run's checkpoints: their parent folder)

    def __call__(self, save_directory, *args, **kwargs):
        out = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        scheme = getattr(self.log, "scheme", None)
        if kwargs.get("is_main_process", True) and scheme is not None:
            notice = scheme.save_notice(save_directory, manifest=False)
            if notice:  # once per folder, once for a run's checkpoints (Trainer's PREFIX_CHECKPOINT_DIR-N), then info
                folder = os.path.abspath(os.fspath(save_directory))
                if os.path.basename(folder).startswith("checkpoint-"):
                    folder = os.path.dirname(folder)
                logger.log(logging.INFO if folder in self.told else logging.WARNING, notice)
                self.told.add(folder)
        return out

    def __getstate__(self):  # a copy or a reloaded pickle has said nothing yet
        return {"model": self.model, "log": self.log}

    def __setstate__(self, state):
        self.__dict__.update(state, told=set())


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a bool (tensors) or raises: judged by identity
        return a is b


Record = SetAttr | SetBuffer | AddModule | AddHook | PrivateConfig


class UndoLog(nn.Module):
    """The records of one patch, in the order they were made."""

    def __init__(self):
        super().__init__()
        self.records: list[Record] = []  # a plain list: records are not submodules
        self._saved = 0

    # ---- changes ---------------------------------------------------------------------------------------------------
    def setattr(self, obj, name: str, value) -> None:
        own = name in vars(obj)
        self._push(SetAttr(obj, name, own, vars(obj)[name] if own else None, value))
        setattr(obj, name, value)

    def set_buffer(self, module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        """Replace (or add) a non-persistent buffer; undo puts the original tensor back (moved/cast like the model)."""
        saved = None
        if name in module._buffers:
            saved = f"saved_{self._saved}"
            self._saved += 1
            self.register_buffer(saved, module._buffers[name], persistent=False)
        persistent = name in module._buffers and name not in module._non_persistent_buffers_set
        self._push(SetBuffer(module, name, saved, persistent, tensor))
        module.register_buffer(name, tensor.clone(), persistent=False)

    def add_module(self, parent: nn.Module, name: str, child: nn.Module) -> None:
        if name in parent._modules or hasattr(parent, name):
            raise RuntimeError(f"{type(parent).__name__} already has an attribute {name!r}")
        parent.add_module(name, child)
        self._push(AddModule(parent, name, child))

    def add_hook(self, module: nn.Module, hook, *, with_kwargs: bool = False, after: bool = False) -> None:
        """A forward pre-hook on `module`, or with `after` a forward hook (it sees the output)."""
        if after:
            handle = module.register_forward_hook(hook, with_kwargs=with_kwargs)
        else:
            handle = module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
        self._push(AddHook(module, hook, handle.id, with_kwargs, after))

    def private_config(self, model: nn.Module):
        """Give every module of `model` that holds `model.config` a private deep copy of it; returns the copy.

        The private config is what `model.save_pretrained` writes: where the log's scheme (a PatchState's) says a
        save cannot carry it (`Scheme.save_notice`), the model's save_pretrained also says so (`NoticedSave`)."""
        shared = model.config
        memo: dict = {}
        private = copy.deepcopy(shared, memo)
        # every config object of the model's config tree (sub-configs too: Blt's rotary modules hold its encoder /
        # global / decoder configs) -> its copy inside the private tree
        copies = {key: value for key, value in memo.items() if hasattr(value, "to_dict") and key != id(memo)}
        holders = [(m, vars(m)["config"]) for m in model.modules() if id(vars(m).get("config")) in copies]
        self._push(PrivateConfig(holders, shared, private, copies=copies))
        for holder, original in holders:
            holder.config = copies[id(original)]
        scheme = getattr(self, "scheme", None)  # duck-typed: the undo log sits below the schemes
        if callable(getattr(scheme, "save_notice", None)) and scheme.save_notice(".", manifest=False) is not None:
            self.setattr(model, "save_pretrained", NoticedSave(model, self))
        return private

    def seal(self) -> None:
        """Call once the patch is installed: what the patch left in the private config is its own; any later change
        there is the user's and is carried back on undo."""
        for record in self.records:
            if isinstance(record, PrivateConfig):
                record.baseline = copy.deepcopy(vars(record.private))

    # ---- replay ------------------------------------------------------------------------------------------------------
    def undo(self) -> None:
        for record in reversed(self.records):
            record.undo(self)

    def redo(self) -> None:
        for record in self.records:
            record.redo(self)

    @property
    def added_modules(self) -> list[tuple[nn.Module, str, nn.Module]]:
        """(parent, name, child) of the modules the patch attached."""
        return [(r.parent, r.name, r.child) for r in self.records if isinstance(r, AddModule)]

    def _push(self, record: Record) -> None:
        self.records.append(record)

    def extra_repr(self) -> str:
        return f"{len(self.records)} changes"
