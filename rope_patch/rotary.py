"""The forward that a patched model's rotary module runs: the one place where every patch runs on every forward.

`PatchedRotaryForward` is installed as the instance attribute `forward` of the rotary module (through the undo
log). It is an object of a module-level class, not a closure, so a patched model deep-copies and pickles. Per call:

1. Frequencies stay float32. `model.to(torch.bfloat16)` / `.half()` cast every floating buffer, the patch's
   `inv_freq` too; a bf16 `inv_freq` shifts the angles m·θ_i by up to m·θ_i·2⁻⁸ (whole turns at long context). The
   patch keeps an fp32 master of each buffer it installed and puts it back (on the buffer's current device) when it
   finds the buffer replaced since the last forward: a cast, also one and back (`.to(bf16).float()` leaves fp32
   buffers with rounded values), or a move. Replacements the forward itself makes (dynamic NTK) are kept.
2. Attention-side schemes that run through their own attention function check that the model still uses it: after
   `model.set_attn_implementation("sdpa")` the rotation is gone but the bias/regrouping would not run, i.e. the
   model would silently be NoPE. The next forward raises instead.
3. Length-dependent schemes that transformers has no rope type for (`dynamic_yarn`) carry an `update`: an object
   of a module-level class, called as `update(rotary, x, position_ids, layer_type)` before the class forward, that
   installs the frequencies and `attention_scaling` for the current length on the rotary module (as transformers'
   `dynamic_rope_update` does for its own dynamic types, without registering anything global).
4. The model's own rotary forward (the class's, with `dynamic_rope_update`; with Resonance RoPE's `Resonance` on the
   module, on positions reduced modulo each pair's integer wavelength: `class_forward`), then for the position-free
   attention-side schemes (ALiBi, NoPE, T5 bias, ...) and `cache_rotation="consistent"` the identity rotation
   cos = 1, sin = 0 (q·1 + rotate_half(q)·0 = q exactly): attention layers and the KV cache see un-rotated queries
   and keys.
5. With `tagged`, the output remembers how it was made (`attention.copies.tag`): the re-positioning schemes embed
   other positions with the same rotary module and arguments (and the apply-time check computes the true rotation
   of an identity-patched model from it).
"""

from __future__ import annotations

import torch
from torch import nn


class BackendChanged(RuntimeError):
    """The attention implementation of a patched model was changed behind the patch's back."""


class PatchedRotaryForward:
    def __init__(self, rotary: nn.Module, masters: dict[str, torch.Tensor], *, identity: bool, config=None,
                 attn_implementation: str | None = None, allowed: tuple[str, ...] = (), scheme: str = "", update=None,
                 tagged: bool = False, sin_first: bool = False):
        self.rotary = rotary
        self.masters = masters  # buffer name -> float32 tensor the patch installed
        self.identity = identity
        self.config = config  # the model's (private) config, whose backend is checked
        self.attn_implementation = attn_implementation  # the backend the patch set; None: any backend is fine
        self.allowed = allowed  # other names that run the patch too (its own functions for the other backends)
        self.scheme = scheme
        self.update = update  # None, or called with (rotary, x, position_ids, layer_type) before each forward
        self.tagged = tagged  # return attention.copies.Tagged embeddings (the re-positioning schemes read them)
        self.sin_first = sin_first  # the rotary returns (sin, cos), not (cos, sin) (a table rotary: GPT-J, CodeGen)
        self.seen = self._buffers_now()  # the buffer tensors as the patch (or the last forward) left them
        self.recent: list = []  # the tagged outputs of the current forward (run-time only: not copied or pickled)

    def __getstate__(self):
        return {**self.__dict__, "recent": []}

    def __call__(self, x, position_ids, *args, **kwargs):
        rotary = self.rotary
        for name, master in self.masters.items():
            live = rotary._buffers.get(name)
            # A buffer that is not the tensor this forward left there was replaced outside a forward: by a cast or
            # move (.to(bf16), .half(), also .to(bf16).float(), which leaves fp32 buffers with bf16-rounded values).
            # Replacements inside the forward (dynamic NTK's growth) are recorded at the end of the call.
            if live is not None and live is not self.seen.get(name):
                rotary._buffers[name] = master.to(live.device, copy=True)
                if hasattr(rotary, "original_max_seq_len"):  # dynamic NTK: recompute for the current length
                    rotary.max_seq_len_cached = rotary.original_max_seq_len
        if self.attn_implementation is not None:
            found = self.config._attn_implementation
            if found != self.attn_implementation and found not in self.allowed:
                raise BackendChanged(
                    f"rope_patch: this model is patched with {self.scheme!r}, which runs through its own attention "
                    f"function {self.attn_implementation!r}, but the model's attention implementation is now "
                    f"{found!r} (model.set_attn_implementation was called after rope_patch.apply); it would run "
                    "without any position encoding. Re-apply the scheme for the new backend with "
                    "rope_patch.apply(model, rope_patch.current(model)), or call rope_patch.remove(model)."
                )
        if self.update is not None:
            self.update(rotary, x, position_ids, args[0] if args else kwargs.get("layer_type"))
        out = class_forward(rotary, x, position_ids, *args, **kwargs)
        self.seen = self._buffers_now()
        if self.identity:
            if isinstance(out, tuple):  # broadcast views of one element: the identity costs no (L × d) tensors
                cos, sin = out[::-1] if self.sin_first else out
                cos, sin = cos.new_ones(()).expand_as(cos), sin.new_zeros(()).expand_as(sin)
                out = (sin, cos) if self.sin_first else (cos, sin)
            else:  # Llama 4: one complex tensor e^{i·m·θ}·attention_scaling, not (cos, sin)
                out = out.new_ones(()).expand_as(out)
        if self.tagged:
            out = tag(out, rotary, x, position_ids, args, kwargs)
            # a decoder calls its rotary once per layer type and forward: a few outputs are the current forward's
            self.recent = [*self.recent[-7:], out]
        return out


    def _buffers_now(self) -> dict:
        return {name: self.rotary._buffers.get(name) for name in self.masters}


class ForwardLength:
    """The sequence length ℓ = max(position_ids) + 1 of the current forward, shared by the length updates of one
    model's rotary modules. The rotaries that rotate the tokens at the position ids the model was handed (the
    decoder's, called before its layers) record it; those that rotate memory entries at positions of their own making
    (DeepSeek-V4's compressor and indexer: entry w at w·m, the first token of its block, so their largest position is
    not the sequence's) read it. So one forward has one ℓ, hence one scale, on every rotary of the model, as a model
    configured natively with that scale has. A module-level class holding one number: the updates that share it
    deep-copy and pickle with the model, still sharing it."""

    def __init__(self):
        self.length: int | None = None  # None: no token rotary has run yet (a follower measures its own positions)

    def measured(self, position_ids: torch.Tensor, follows: bool) -> int:
        """ℓ for one call: a token rotary's own (recorded), a memory rotary's the recorded one."""
        own = int(position_ids.max()) + 1
        if not follows:
            self.length = own
        elif self.length is not None:
            return self.length
        return own


RESONANCE = "rope_patch_resonance"  # the rotary module's attribute holding its `Resonance` (set through the undo log)


class Resonance:
    """Resonance RoPE's angles (Wang et al. 2024, arXiv:2403.00071; the authors' `compute_freqs`,
    sheryc/resonance_rope): pair i at position p turns by (p mod λ̃_i)·θ̃_i, where λ̃_i is the integer wavelength and
    θ̃_i = 2π/λ̃_i the frequency in the rotary module's buffer. The product p·θ̃_i that the class forward computes in
    float32 is off by up to p·θ̃_i·2⁻²⁴ (6e-5 rad at p = 1024 for θ̃ = 1), so its tables would not repeat; reduced
    first, every product has a factor below λ̃_i and the angles of a pair repeat bit for bit every λ̃_i positions.

    Called in place of the class forward (`class_forward`), it hands the class forward the reduced angles as its
    "frequencies" (`_AngleView`) and positions of 1: the class's own code (cat or interleave, partial or 3-D rope,
    complex output, scale, dtype cast) turns them into its output, 1·a = a exactly. The frequency scheme checks at
    apply time that the class forward reads angles that way (`dtype`: the precision it multiplies in).
    Positions are reduced with `fmod` (exact in IEEE arithmetic): [0, λ̃_i) for p ≥ 0, as the authors' tables."""

    def __init__(self, wavelengths: dict, dtype: torch.dtype = torch.float32):
        # layer type (None: the module's one set) -> float64 λ̃_i, integers; inf for a pair that does not rotate
        self.wavelengths = wavelengths
        self.dtype = dtype  # the precision the class forward multiplies positions by frequencies in
        self._on: dict = {}  # (layer type, device, dtype) -> the wavelengths there (run time only: not copied)

    def __getstate__(self):
        return {**self.__dict__, "_on": {}}

    @staticmethod
    def buffer(layer_type) -> str:
        return f"{layer_type}_inv_freq" if layer_type else "inv_freq"

    def angles(self, inv_freq: torch.Tensor, positions: torch.Tensor, layer_type=None) -> torch.Tensor:
        """(…, n, pairs) angles (p mod λ̃_i)·θ̃_i of positions (…, n), in `self.dtype`."""
        key = (layer_type, inv_freq.device, self.dtype)
        wavelengths = self._on.get(key)
        if wavelengths is None:
            wavelengths = self._on[key] = self.wavelengths[layer_type].to(device=inv_freq.device, dtype=self.dtype)
        reduced = torch.fmod(positions[..., None].to(device=inv_freq.device, dtype=self.dtype), wavelengths)
        return reduced * inv_freq.to(self.dtype)

    def __call__(self, rotary: nn.Module, x, position_ids, *args, **kwargs):
        layer_type = args[0] if args else kwargs.get("layer_type")
        if layer_type not in self.wavelengths:  # a layer type the scheme leaves (`layer_types`): the model's own RoPE
            return type(rotary).forward(rotary, x, position_ids, *args, **kwargs)
        name = self.buffer(layer_type)
        angles = self.angles(rotary._buffers[name], position_ids, layer_type)
        return angle_forward(rotary, x, angles, name, position_ids, *args, **kwargs)


class _AngleView:
    """The rotary module as its class forward sees it, with the frequency buffer `name` replaced by a tensor of angles
    (…, n, pairs): with positions of 1, `position_ids[..., None].float() * inv_freq` gives those angles. A view, not
    a change to the module: nothing on the model moves during the call."""

    def __init__(self, rotary: nn.Module, name: str, angles: torch.Tensor):
        object.__setattr__(self, "_rotary", rotary)
        object.__setattr__(self, name, angles)

    def __getattr__(self, name):
        return getattr(self._rotary, name)


def angle_forward(rotary: nn.Module, x, angles: torch.Tensor, name: str, position_ids, *args, **kwargs):
    """The rotary class's forward on `angles` (…, n, pairs) in place of position × buffer `name`."""
    ones = torch.ones_like(position_ids)
    return type(rotary).forward(_AngleView(rotary, name, angles), x, ones, *args, **kwargs)


def class_forward(rotary: nn.Module, x, position_ids, *args, **kwargs):
    """The rotary module's class forward (what the model computes without a patch), through its `Resonance` where a
    patch put one on the module (positions reduced modulo each pair's wavelength)."""
    resonance = vars(rotary).get(RESONANCE)
    if resonance is None:
        return type(rotary).forward(rotary, x, position_ids, *args, **kwargs)
    return resonance(rotary, x, position_ids, *args, **kwargs)


class TableGrowth:
    """The `update` of a table rotary (GPT-J, CodeGen: sin/cos rows indexed by position): before a forward reaches a
    position past the table's last row, the table is extended with the rows of the same frequencies and scale, the
    existing rows kept as they are. The model as built stops at its `max_position_embeddings` rows (an index error
    past them); a patch serves the positions its scheme is for (Self-Extend past the window, YaRN's extended window,
    the positions a re-positioned copy is moved to)."""

    def __init__(self, layout, inv_freq: torch.Tensor, scaling: float, wavelengths: torch.Tensor | None = None):
        self.layout = layout  # discovery.SinCosTable
        self.inv_freq = inv_freq.float()
        self.scaling = scaling
        self.wavelengths = wavelengths  # Resonance RoPE: rows built from positions modulo these (None: plain)

    def __call__(self, rotary: nn.Module, x, position_ids, layer_type=None) -> None:
        table = rotary._buffers[self.layout.buffer]
        need = int(position_ids.max()) + 1 if position_ids.numel() else 0
        if need <= table.shape[0]:
            return
        rows = max(need, 2 * table.shape[0])  # doubling: a generation step does not rebuild it every token
        grown = self.layout.build(self.inv_freq, self.scaling, rows, device=table.device, wavelengths=self.wavelengths)
        rotary._buffers[self.layout.buffer] = torch.cat((table, grown[table.shape[0]:].to(table.dtype)))


class Tagged(tuple):
    """A rotary module's (cos, sin), remembering how it was made (`rotary`, `x`, `position_ids`, `args`, `kwargs`), so
    other positions can be embedded alike; `memo` holds the stacked copies made from it (the decoder passes the same
    object to every layer)."""


def tag(out, rotary: nn.Module, x, position_ids, args: tuple, kwargs: dict):
    """`out` (a tuple, or Llama 4's complex tensor) with its source attached."""
    tagged = Tagged(out) if isinstance(out, tuple) else out
    tagged.rotary, tagged.x, tagged.position_ids, tagged.args, tagged.kwargs = rotary, x, position_ids, args, kwargs
    tagged.memo = {}
    return tagged


def recover(embeddings, rotaries) -> object | None:
    """Position embeddings a decoder sliced from a rotary's tagged output (Gemma 4 keeps only the last positions for
    its KV-shared layers, as new tensors without the tag), tagged again: the recent output of one of `rotaries` whose
    last positions they equal, with those positions. None when there is none."""
    if not isinstance(embeddings, tuple) or not embeddings or not isinstance(embeddings[0], torch.Tensor):
        return None
    first = embeddings[0]
    n = first.shape[-2]
    for rotary in rotaries:
        for made in reversed(getattr(vars(rotary).get("forward"), "recent", ())):
            whole = made[0] if isinstance(made, tuple) else None
            if (whole is None or whole.shape[:-2] != first.shape[:-2] or whole.shape[-2] < n
                    or whole.shape[-1] != first.shape[-1] or not torch.equal(whole[..., -n:, :], first)):
                continue
            return tag(tuple(embeddings), made.rotary, made.x, made.position_ids[..., -n:], made.args, made.kwargs)
    return None


def source(embeddings) -> nn.Module | None:
    """The rotary module that made these position embeddings (None: not a patched rotary's output)."""
    return getattr(embeddings, "rotary", None) if embeddings is not None else None


def embed(embeddings, positions: torch.Tensor):
    """The embeddings that the rotary module which made `embeddings` gives at `positions`, the same way (its class
    forward: the frequencies it holds now, its attention scaling, its layer type, Resonance RoPE's reduction)."""
    rotary = embeddings.rotary
    patched = vars(rotary).get("forward")
    # a table rotary: the moved positions' rows must exist
    if isinstance(getattr(patched, "update", None), TableGrowth):
        patched.update(rotary, embeddings.x, positions)
        patched.seen = patched._buffers_now()  # grown by the patch, not replaced by a cast
    return class_forward(rotary, embeddings.x, positions, *embeddings.args, **embeddings.kwargs)


def unpatched_forward(rotary: nn.Module, x, position_ids, *args):
    """The rotary module's own forward (its class's, with a frequency scheme's Resonance reduction), whatever is
    installed on the instance: the deferred-RoPE schemes rotate q and k inside attention with it."""
    return class_forward(rotary, x, position_ids, *args)
