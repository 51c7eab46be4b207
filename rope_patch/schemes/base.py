"""Scheme base classes.

A scheme is a frozen dataclass of its parameters (transformers' `rope_parameters` key names). Its life:

    scheme = Yarn.from_params(factor=4)      # type/range checks, unknown keys -> TypeError with "Did you mean"
    scheme = scheme.resolve(target)          # model-derived defaults filled in, model-dependent checks
    install = scheme.prepare(target)         # everything computed; still nothing touched
    install(undo_log)                        # the only step that changes the model, all through the undo log

so a bad input fails before the model is modified, and `remove()` replays the undo log.

Everything else the library knows about a scheme is on its class too, with a default here, so that a new scheme is
one class in one module of rope_patch/schemes/ (the package imports every module it holds):

    bare_param          the parameter a bare value sets (`yarn:8` -> factor; the CLI's name table records it)
    search_space()      the default grid of `rope-patch tune` (None: none, the user gives --space)
    suggestion()        the parameters its paper recommends for a target length (`rope_patch.suggest`)
    length_dependent    frequencies that follow the sequence length (plots draw it at its extended window)
    plot_style()        a fixed colour / line style in the figures (None: the colour cycle)
    label_symbols       short parameter names in figure legends (beside the shared ones of rope_patch.analysis)
    distance_bias()     an additive logit bias fixed by the parameters, per head and distance (ALiBi)
    served_length()     the longest input it serves on a model of window L (`rope_patch.context_window`, generate)
    native, changes     whether transformers' `rope_parameters` express it (export, saves), and what it changes
                        in words when they do not
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from ..discovery import PatchSite
from ..registry import did_you_mean
from ..undo import UndoLog

if TYPE_CHECKING:
    import torch

InstallStep = Callable[[UndoLog], None]  # what prepare() returns: writes the patch through the undo log

# `served_length` of a scheme that no input length exhausts (ALiBi, ReRoPE, DCA, ...): transformers' own integer for
# "no limit" (tokenizers' `model_max_length` when a model states none, `VERY_LARGE_INTEGER`), so that
# `rope_patch.context_window` stays an int and compares with lengths as they are; generate is told None.
UNBOUNDED = int(1e30)


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One scheme with the parameters its paper recommends for the target (what `rope_patch.suggest` returns).

    Attributes:
        scheme: the scheme's registered name.
        params: its parameters for the target.
        spec: the same as a spec string, what `rope_patch.apply(model, spec)` and `rope-patch compare --schemes`
            take (`"yarn:factor=4,beta_fast=2"`).
        reason: where the numbers come from (the rule and its paper), in one line.
        alone: whether the scheme serves the target on its own (False: STRING beyond the window, which needs a
            frequency scheme with it).
    """

    scheme: str
    params: dict
    spec: str
    reason: str
    alone: bool = True

    @classmethod
    def of(cls, scheme: str, params: dict, reason: str, alone: bool = True) -> Suggestion:
        """The suggestion of `scheme` with `params`, its spec written out (`yarn:factor=4,beta_fast=2`)."""
        def one(x):  # a name bare, as the spec grammar reads it (`layer_types=full_attention`)
            return x if isinstance(x, str) else repr(x)

        def text(v):  # a list as the spec grammar writes it: values separated by '/'
            return "/".join(one(x) for x in v) if isinstance(v, (list, tuple)) else one(v)

        spec = f"{scheme}:" + ",".join(f"{k}={text(v)}" for k, v in params.items())
        return cls(scheme, dict(params), spec, reason, alone)

    def __str__(self) -> str:
        return f"{self.spec}: {self.reason}"


def plain_number(x: float) -> int | float:
    """4.0 -> 4, 2.5 -> 2.5: how a suggested or searched value is written into a spec."""
    return int(x) if float(x).is_integer() else float(x)


def extension_ratio(window: int, target: int) -> float:
    """s = N/L, at least 1: how far a target length N reaches beyond the pre-training window L."""
    return max(1.0, target / window)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A position-encoding scheme: a frozen dataclass of its parameters, with everything the library knows about it
    on the class (the module docstring lists it; docs/guides/add-a-scheme.md walks through one).

    Subclass `FrequencyScheme` for a scheme that changes only the rotary frequencies (implement `rope_parameters`,
    and `adjust` where transformers' rope types cannot express it); subclass `Scheme` itself (in practice
    rope_patch.schemes.common's `AttentionScheme`) for one that changes the attention computation (implement
    `prepare`). Register it with `rope_patch.register_scheme`.

    Attributes:
        name: the registered name (`rope-patch list`, specs, saved files).
        aliases: more names that resolve to it.
        kind: `"frequency"`, `"attention"` or `"modifier"`.
        bare_param: the parameter that the bare value of a spec `name:VALUE` sets (`yarn:8` is factor=8).
        length_dependent: whether the frequencies follow the sequence length (dynamic NTK, dynamic YaRN, LongRoPE).
        native: whether transformers' `rope_parameters` alone reproduce it (then plain saves, `to_rope_parameters`
            and serving engines take it).
        changes: what it changes, in words, where it has no native form (used in save warnings and export errors).
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    kind: ClassVar[str] = ""  # "frequency" or "attention"
    # Whether queries and keys are still rotated (with the model's or the scheme's frequencies): False for the
    # position-free encodings (ALiBi, NoPE, T5 bias, additive absolute), whose θ′ is 0.
    keeps_rotation: ClassVar[bool] = True
    # Named by `rope-patch list`, `list_schemes()` and "Available:" messages (False: a composition such as `stack`,
    # registered so that a saved one resolves, but not a scheme to choose on its own).
    listed: ClassVar[bool] = True
    # The parameter that the bare VALUE of the spec `name:VALUE` sets (`yarn:8` is factor=8, `self_extend:4`
    # group_size=4). A scheme without that parameter takes no bare value (`nope:3` is an error).
    bare_param: ClassVar[str] = "factor"
    # Whether the frequencies follow the sequence length (dynamic NTK, dynamic YaRN, LongRoPE's two sets): figures
    # draw such a scheme at its extended window and name the length they drew it at.
    length_dependent: ClassVar[bool] = False
    # Short names of parameters in figure legends, beside rope_patch.analysis's shared ones (factor -> s, ...).
    label_symbols: ClassVar[dict[str, str]] = {}
    # Whether transformers' `rope_parameters` alone reproduce the scheme (then a plain save reloads it, and
    # `to_rope_parameters` / vLLM / SGLang take it), and, where they do not, what the scheme changes, in words.
    native: ClassVar[bool] = False
    changes: ClassVar[str] = "frequencies in a way transformers cannot express"

    @classmethod
    def param_names(cls) -> list[str]:
        """The scheme's parameter names, in the dataclass's field order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def search_space(cls, window: int, target: int) -> dict[str, list] | None:
        """The default grid of `rope-patch tune` for a target length N = `target` on a model of pre-training window
        L = `window`: parameter -> values (a small grid around the paper's recommendation). None: no default, the
        search needs an explicit space."""
        return None

    @classmethod
    def suggestion(cls, n: int, window: int) -> Suggestion | None:
        """The parameters the scheme's paper recommends for serving N = `n` tokens on a model of pre-training window
        L = `window` (`rope_patch.suggest`), with the reason; None where the paper gives no rule or the scheme does
        not serve N (the extension schemes for N ≤ L; the schemes that need training)."""
        return None

    @classmethod
    def from_params(cls, **params) -> Scheme:
        """The scheme with these parameters, validated (what `rope_patch.apply(model, name, **params)` builds).

        Args:
            **params: the scheme's parameters by name; missing ones take the class's defaults (None: from the model).

        Returns:
            The scheme object (not yet resolved against a model).

        Raises:
            TypeError: an unknown parameter (with "Did you mean" and the list of the scheme's parameters), or a value
                of the wrong type.
            ValueError: a value out of its range, or parameters that contradict each other.
        """
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

    def _set(self, key, value):
        """Store a validated (normalised) parameter on the frozen instance, in `__post_init__`."""
        object.__setattr__(self, key, value)

    def replace(self, **changes) -> Scheme:
        """A copy with some parameters changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def resolve(self, target: PatchSite) -> Scheme:
        """Fill defaults that depend on the model and check what only the model can tell. Default: no-op."""
        return self

    def prepare(self, target: PatchSite) -> InstallStep:
        """Compute everything the patch needs and check it against the model, touching nothing.

        Args:
            target: where the patch goes (the model, its rotary and attention modules, its config).

        Returns:
            The install step: a function of the undo log that writes the patch (every change through the log, so
                `remove()` can replay it backwards).

        Raises:
            ValueError: the scheme cannot run on this model or backend (the model is still untouched).
        """
        raise NotImplementedError

    def relative_position(self, i, j):
        """The relative position the rotation sees for a query at true position i and a key at j ≤ i (tensors,
        broadcast): i − j, unless the scheme remaps positions (Self-Extend, ReRoPE, STRING, DCA)."""
        return i - j

    def distance_bias(self, distances: torch.Tensor, num_heads: int | None) -> torch.Tensor | None:
        """The additive logit bias [num_heads, len(distances)] at each distance Δ = i − j when the scheme's
        parameters fix it (ALiBi's −m_h·Δ); None for no bias or a learned one (relative_bias)."""
        return None

    def plot_style(self) -> dict | None:
        """A fixed matplotlib colour / line style for this scheme in every figure (vanilla RoPE is black); None: the
        next colour of the cycle."""
        return None

    def served_length(self, window: int) -> int | None:
        """The longest input this scheme serves on a model whose rotation serves `window` = L tokens (its
        max_position_embeddings; in a stack, the frequency part's window): the largest N for which every relative
        position the scheme rotates with stays below L, so the model meets no distance it was not trained on.
        `UNBOUNDED` where no length exhausts it (ReRoPE's capped distances, DCA's chunk positions, ALiBi's bias);
        None: the model's own L (the default: a scheme that moves no position, or one that does not extend, Ms-PoE)."""
        return None

    def longest_input(self) -> int | None:
        """The most positions a model patched with this (resolved) scheme can run at all, past which its forward
        fails: a learned table's rows. None: no such limit (past its window a scheme degrades, it does not fail)."""
        return None

    def served_window(self, target: PatchSite) -> int | None:
        """The context window this scheme extends the model to (None: unchanged); `target` is unpatched. By default
        `served_length` of the model's `max_position_embeddings`."""
        window = getattr(target.config, "max_position_embeddings", None)
        served = self.served_length(int(window)) if window else None
        return None if served == window else served

    def on_table(self, target: PatchSite) -> Scheme:
        """This scheme as applied to a model that rotates from a sin/cos table (GPT-J, CodeGen: `target.table`), whose
        config has no `rope_parameters` to hold it: a scheme with a native form elsewhere has none there (saved with
        rope_patch.json, refused by the export). A copy: the scheme object the caller passed stays as it was."""
        if not self.native:
            return self
        copied = copy.copy(self)
        object.__setattr__(copied, "native", False)
        object.__setattr__(copied, "changes", f"the sin/cos table {target.model_type} rotates from "
                                              f"({type(target.rotary).__name__}.{target.table.buffer}), "
                                              "which its config has no rope_parameters to describe")
        return copied

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
               "to keep the patch, save with rope_patch.save_pretrained(model, dir) instead, "
               "which adds rope_patch.json (RopePatchCallback adds it to Trainer checkpoints), and reload with "
               "rope_patch.from_pretrained(dir)")
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
    return [p for p in parts if not p.native]
