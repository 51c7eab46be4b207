"""Scheme base classes.

A scheme is a frozen dataclass of its parameters (transformers' `rope_parameters` key names). Its life:

    scheme = Yarn.from_params(factor=4)      # type/range checks, unknown keys -> TypeError with "Did you mean"
    scheme = scheme.resolve(target)          # model-derived defaults filled in, model-dependent checks
    install = scheme.prepare(target)         # everything computed; still nothing touched
    install(undo_log)                        # the only step that changes the model, all through the undo log

so a bad input fails before the model is modified, and `remove()` replays the undo log.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import ClassVar

from ..discovery import PatchSite
from ..registry import did_you_mean
from ..undo import UndoLog

InstallStep = Callable[[UndoLog], None]  # what prepare() returns: writes the patch through the undo log


@dataclasses.dataclass(frozen=True)
class Scheme:
    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    kind: ClassVar[str] = ""  # "frequency" or "attention"
    # Whether queries and keys are still rotated (with the model's or the scheme's frequencies): False for the
    # position-free encodings (ALiBi, NoPE, T5 bias, additive absolute), whose θ′ is 0.
    keeps_rotation: ClassVar[bool] = True
    # Named by `rope-patch list`, `list_schemes()` and "Available:" messages (False: a composition such as `stack`,
    # registered so that a saved one resolves, but not a scheme to choose on its own).
    listed: ClassVar[bool] = True

    @classmethod
    def param_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_params(cls, **params) -> Scheme:
        known = cls.param_names()
        for key in params:
            if key not in known:
                raise TypeError(
                    f"{cls.name}: unknown parameter {key!r}.{did_you_mean(key, known)} "
                    f"Parameters of {cls.name!r}: {', '.join(known) or '(none)'}."
                )
        return cls(**params)

    def params(self) -> dict:
        """The parameters that are set (None means 'derive from the model')."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def replace(self, **changes) -> Scheme:
        return dataclasses.replace(self, **changes)

    def resolve(self, target: PatchSite) -> Scheme:
        """Fill defaults that depend on the model and check what only the model can tell. Default: no-op."""
        return self

    def prepare(self, target: PatchSite) -> InstallStep:
        raise NotImplementedError

    def relative_position(self, i, j):
        """The relative position the rotation sees for a query at true position i and a key at j ≤ i (tensors,
        broadcast): i − j, unless the scheme remaps positions (Self-Extend, ReRoPE, STRING, DCA)."""
        return i - j

    def served_window(self, target: PatchSite) -> int | None:
        """The context window this scheme extends the model to (None: unchanged); `target` is unpatched."""
        return None

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{self.name}({args})"

    def save_notice(self, directory, *, manifest: bool) -> str | None:
        """The warning a save of a model carrying this patch logs (None: config.json reloads the patched model).
        `manifest`: whether the save wrote rope_patch.json beside config.json (rope_patch.save_pretrained) or not
        (transformers' own save_pretrained)."""
        lacking = without_native_form(self)
        if not lacking:
            return None
        names = ", ".join(p.name for p in lacking)
        dropped = [p.name for p in getattr(self, "schemes", ()) if p not in lacking]
        config = os.path.join(os.fspath(directory), "config.json")
        how = (f"rope_patch.from_pretrained({os.fspath(directory)!r}) reads the rope_patch.json written beside it and "
               "re-applies the patch" if manifest else
               "to keep the patch, save with rope_patch.save_pretrained(model, dir) instead, which adds rope_patch.json "
               "(RopePatchCallback adds it to Trainer checkpoints), and reload with rope_patch.from_pretrained(dir)")
        return (f"rope_patch: {config} holds the unpatched RoPE, so transformers alone reloads the unpatched model: "
                f"{names} {'has' if len(lacking) == 1 else 'have'} no native transformers form"
                + (f" (a config with {' + '.join(dropped)} alone would be a third model)" if dropped else "")
                + f"; {how} ({self}).")


def without_native_form(scheme: Scheme) -> list[Scheme]:
    """The parts of `scheme` (the scheme itself, or each part of a stack) that transformers' `rope_parameters`
    cannot express: the attention-side schemes, the modifiers, and frequency schemes without a native form
    (dynamic_yarn). The one rule of every save (a plain `model.save_pretrained`, `rope_patch.save_pretrained`, a
    merged adapter): empty, config.json carries the native form and reloads the patched model without rope_patch;
    else config.json keeps the unpatched RoPE and reloads the unpatched model, never the expressible parts alone (yarn
    without the Self-Extend it was stacked with would be a third model)."""
    parts = getattr(scheme, "schemes", None) or (scheme,)
    return [p for p in parts if not (p.kind == "frequency" and getattr(p, "native", False))]
