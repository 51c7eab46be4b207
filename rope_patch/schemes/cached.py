"""`cache_rotation="consistent"`: the length-dependent frequency schemes with keys cached un-rotated.

`dynamic` (dynamic NTK, emozilla 2023), `dynamic_yarn` (YaRN §3.3 dynamic scaling) and `longrope` (Ding et al. 2024,
short/long factor sets) compute θ_i(ℓ) from the current length ℓ = max(position_ids) + 1. transformers rotates q and
k before the KV cache update, so a key written at step t keeps the rotation n·θ_i(ℓ_t) of that step, while the query
of a later step ℓ is rotated with θ_i(ℓ) (transformers issue #25104):

    native       score(m, n) = q_m R(m·θ(ℓ))ᵀ · R(n·θ(ℓ_n)) k_n       ℓ_n: the length when key n was cached
    consistent   score(m, n) = q_m R(m·θ(ℓ))ᵀ · R(n·θ(ℓ)) k_n         every key re-rotated with this step's θ(ℓ)

so under `consistent` every step's scores depend on m − n only, as RoPE requires (RoFormer: R(mθ)ᵀR(nθ) = R((n−m)θ)),
and never mix two bases. It is the deferred-RoPE pattern of the attention-side schemes (schemes/positions.py): the
model's rotary module returns the identity (cos = 1, sin = 0), so attention layers and the cache see un-rotated q and
k, and the attention function rotates q (at its true positions) and every cached key (at theirs) with the rotary's
current frequencies, through the model's own rotary forward and `apply_rotary_pos_emb` (`attention.Rotation`). The
patched rotary forward still runs the scheme's length update once per forward, so θ(ℓ) is that of the step.

What it is not: full recomputation. With one layer it is (a token's key and value depend only on its embedding); with
two or more, the cached keys and values of layer ≥ 2 are projections of hidden states that layer 1 computed for the
past tokens under the frequencies of *their* step, and recomputation would recompute those too. `consistent` makes
every step's attention a proper RoPE attention over what is cached; it does not re-run the past.

Cost: each step rotates all k_len cached keys once per layer (O(k_len·d), like Self-Extend's far keys), and the
attention runs through rope_patch's own functions (eager → rope_patch_dense, sdpa → rope_patch_blocked, flex on CUDA);
flash-attention-2 and static caches are refused at apply() time, as for the other deferred-RoPE schemes.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import attention
from ..discovery import PatchSite
from ..rotary import PatchedRotaryForward
from ..undo import UndoLog
from .common import AttentionScheme, allowed_backends, attention_modules, install_rule

NATIVE, CONSISTENT = "native", "consistent"
MODES = (NATIVE, CONSISTENT)


def cache_rotation(scheme: str, value) -> str | None:
    """The validated `cache_rotation` parameter: None for transformers' native behaviour ("native" or unset), or
    "consistent"."""
    if value is None or value == NATIVE:
        return None
    if value == CONSISTENT:
        return CONSISTENT
    raise (ValueError if isinstance(value, str) else TypeError)(
        f"{scheme}: parameter `cache_rotation` must be one of {', '.join(repr(m) for m in MODES)}, got {value!r}. "
        f"{NATIVE!r} (the default) is transformers' behaviour: cached keys keep the rotation of the step that wrote "
        f"them; {CONSISTENT!r} caches keys un-rotated and rotates them with each step's frequencies (transformers "
        "#25104)."
    )


class CurrentRotation(attention.AttentionRule):
    """q at its true positions i and every key at its true position j, both rotated with the rotary's current
    frequencies (this step's θ(ℓ)): plain RoPE attention, computed on un-rotated cached keys."""

    def __init__(self, rotations: dict[int, attention.Rotation]):
        self.rotations = rotations

    def begin(self, call):
        rotate = self.rotations[call.module.layer_idx]
        b, hkv, g, q_len, d = call.query.shape
        # (b|1, k) true positions of the keys (left padding skipped via the row offset; gapped ids as they are)
        k_pos = call.ids if call.gapped else torch.arange(call.key.shape[2], device=call.key.device) + call.offset
        call.scratch["k"] = rotate(call.key, k_pos)
        q = call.query.reshape(b, hkv * g, q_len, d)
        call.scratch["q"] = rotate(q, k_pos[:, -q_len:]).view(b, hkv, g, q_len, d)  # the queries: the last keys

    def logits(self, call, rows, start, end):
        return call.qk(call.scratch["q"][:, :, :, rows], call.scratch["k"][:, :, start:end])

    def fused(self, call, rows, end):
        return attention.causal_parts(call, call.scratch["q"][:, :, :, rows], call.scratch["k"], rows, end)

    def flex(self, call, block_mask):
        return attention.flex_call(call, call.scratch["q"].flatten(1, 2), call.scratch["k"], call.value, block_mask)


@dataclasses.dataclass(frozen=True)
class _Deferral(AttentionScheme):
    """Not a registered scheme: the attention-side machinery (the model's rotations per layer, the backend checks)
    under the name of the frequency scheme it serves, so errors name that scheme."""

    scheme_name: str = ""

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.scheme_name


def prepare(name: str, target: PatchSite):
    """Everything `consistent` needs, computed and checked before the model is touched (backend, cache type, rotary
    layout); returns `install(log, masters, update)`, which the frequency scheme's install calls instead of putting
    its plain patched forward on the rotary module."""
    helper = _Deferral(scheme_name=name)
    rule = CurrentRotation(helper.rotations(target))
    impl = helper._check_backend(target, rule)
    modules = attention_modules(target.model)  # not empty: `rotations` refuses a model without them
    rotary = target.rotary

    def install(log: UndoLog, masters: dict, update) -> None:
        def put(log: UndoLog, rule, layouts, cache_mode, wrap=None) -> None:
            # The check holds the frequencies installed at apply time (no length update): it checks where the
            # rotation happens, and its input may pass the window, where a length-dependent scheme's frequencies
            # would change from step to step, and the layer's own cache (the reference) keeps each step's rotation.
            log.setattr(rotary, "forward", PatchedRotaryForward(
                rotary, masters, identity=True, config=target.config, attn_implementation=impl,
                allowed=allowed_backends(wrap), scheme=name, update=update if wrap is None else None, tagged=True))
            install_rule(log, target, name, rule, layouts, cache_mode, wrap, impl)

        if target.check:
            # The rotation moves inside attention here (the deferred design): a layer that does something after its
            # RoPE (HunYuan's q/k norms, Dory's query scale) or no RoPE at all gets another model. Checked against
            # the layer's own rotation at the frequencies just installed (within the window: one set of them).
            attention.plumbing.verify(target, name, rule, dict.fromkeys(modules), impl, rotate_reference=True,
                                      install=put)
        put(log, rule, dict.fromkeys(modules), attention.HEADS)

    return install
