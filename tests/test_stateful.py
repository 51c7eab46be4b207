"""Stateful property tests: random sequences of apply / replace / remove / patched / copies / saves / casts / backend
switches / generate over one tiny llama model (sdpa), checked after every step against

- a *bystander* built from the SAME config object as the model (transformers shares it between them), same weights:
  its logits, its config and the shared config's `to_dict()` never change because of a patch;
- a never-patched *twin* (its own config, same weights) that receives the same dtype moves and backend switches:
  whenever the model is unpatched its logits are bit-identical to the twin's;
- the model itself: `rope_patch.current()` names the last applied scheme (None after remove), and applying it to a
  fresh model with the same weights gives the model's logits bit for bit (`check_reproduces`).

The one field of the shared config that a user of the model does change is its backend: `set_attn_implementation`
on an unpatched model writes the shared config (plain transformers), and a switch made while patched is carried back
to it by `remove()` (the user's switch is kept, see test_ownership). The machine tracks that value (`shared_backend`)
and compares the bystander with its start-up logits for the backend the shared config names.

What "exact" means after casts (`exact()`): frequency schemes compute fp32 frequencies from the config and keep
them fp32 through casts; the deferred-RoPE schemes (self_extend, rerope, ...) rotate with the model's own frequency
buffers as they were at apply time, so after `.to(bf16)` before apply they rotate with bf16-rounded frequencies, as
the unpatched cast model does (with a frequency scheme under them, they rotate with its fp32 frequencies); logn
alone leaves the rotary module as it is, so its buffers round with every cast; an unpatched cast model keeps its rounded
buffers (plain transformers: a fresh load computes them anew). Only exact states are compared with fresh models /
reloads.

Bounded in CI (`derandomize=True`, no shrinking, under a minute on 2 cores); `ROPE_PATCH_STATEFUL_LONG=1` runs 10x
the examples, randomised, and shrinks a failure to a minimal sequence. `test_stateful_counts` prints how many
examples / states / rules ran (shown by pytest's terminal even when output is captured).

Patches are single schemes or stacks (a frequency scheme under a rotating attention-side scheme and/or logn; see
`STACKS`), given as a list of schemes, a list of spec strings, one "a+b" string or a Stack object.

The plain tests at the end pin what the machine found.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import os
import tempfile
import time
import warnings

import pytest
import torch
from helpers.models import VOCAB, WINDOW, logits, roundtrip, tiny_config
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import rope_patch
from rope_patch.registry import get_scheme_class
from rope_patch.rotary import BackendChanged
from rope_patch.schemes.base import without_native_form
from rope_patch.tuning.objective import spec_of

LONG = os.environ.get("ROPE_PATCH_STATEFUL_LONG") == "1"
CI_EXAMPLES, CI_STEPS = 45, 30

_factors8 = st.lists(st.sampled_from([1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]), min_size=8, max_size=8)
# scheme -> strategy of its keyword parameters (head_dim 16: longrope takes head_dim/2 = 8 factors per list)
SCHEMES = {
    "default": st.fixed_dictionaries({"rope_theta": st.sampled_from([5_000.0, 10_000.0, 500_000.0])}),
    "linear": st.fixed_dictionaries({"factor": st.sampled_from([1.0, 2.0, 4.0])}),
    "ntk": st.fixed_dictionaries({"factor": st.sampled_from([2.0, 4.0, 8.0])}),
    "dynamic": st.fixed_dictionaries({"factor": st.sampled_from([2.0, 4.0])}),
    "yarn": st.fixed_dictionaries({"factor": st.sampled_from([2.0, 4.0, 8.0])}),
    "llama3": st.fixed_dictionaries({"factor": st.sampled_from([2.0, 4.0, 8.0])}),
    "longrope": st.fixed_dictionaries({"factor": st.sampled_from([2.0, 4.0]), "short_factor": _factors8,
                                       "long_factor": _factors8}),
    "p_rope": st.fixed_dictionaries({"partial_rotary_factor": st.sampled_from([0.25, 0.5, 0.75])}),
    "alibi": st.just({}) | st.fixed_dictionaries({"max_bias": st.sampled_from([4.0, 8.0])}),
    "nope": st.just({}),
    "self_extend": st.sampled_from([2, 4]).flatmap(lambda g: st.fixed_dictionaries(
        {"group_size": st.just(g), "window_size": st.sampled_from([w for w in (4, 8, 16) if w > g])})),
    "rerope": st.fixed_dictionaries({"window_size": st.sampled_from([4, 8, 16])}),
    "leaky_rerope": st.fixed_dictionaries({"window_size": st.sampled_from([4, 8]),
                                           "factor": st.sampled_from([2.0, 4.0, 16.0])}),
    "relative_bias": st.fixed_dictionaries({"init": st.sampled_from(["zeros", "alibi"])}),
    "sinusoidal": st.just({}),
    "learned_absolute": st.just({"max_position_embeddings": 4 * WINDOW}),
}
NEWER = {  # schemes added after this file was written
    "dynamic_yarn": st.fixed_dictionaries({"factor": st.sampled_from([2.0, 4.0])}),
    "string": st.sampled_from([4, 8]).flatmap(lambda w: st.fixed_dictionaries(
        {"window_size": st.just(w), "shift_size": st.sampled_from([s for s in (8, 16, 24) if s > w])})),
    "dca": st.sampled_from([16, 24]).flatmap(lambda c: st.fixed_dictionaries(
        {"chunk_size": st.just(c), "local_size": st.sampled_from([4, 8])})),
    "self_extend_logistic": st.fixed_dictionaries({"group_size": st.sampled_from([3, 6]),
                                                   "window_size": st.sampled_from([8, 16]),
                                                   "growth_rate": st.sampled_from([0.02, 0.5])}),
    "dpe": st.fixed_dictionaries({"group_sizes": st.lists(st.sampled_from([1, 2, 3, 4]), min_size=4, max_size=4),
                                  "window_size": st.sampled_from([8, 16])}),
    "ms_poe": st.fixed_dictionaries({"min_ratio": st.sampled_from([1.0, 1.2]),
                                     "max_ratio": st.sampled_from([1.8, 2.5])}),
    "sink": st.fixed_dictionaries({"window_size": st.sampled_from([4, 8, 16]),
                                   "sink_size": st.sampled_from([0, 1, 4])}),
}
SCHEMES.update(NEWER)
SCHEMES["logn"] = st.just({}) | st.fixed_dictionaries({"kind": st.just("llama4"),
                                                       "attn_scale": st.sampled_from([0.1, 0.5]),
                                                       "floor_scale": st.sampled_from([4, 8])})
# attention schemes that run through their own attention function: a backend switch makes the next forward raise
OWN_FUNCTION = {"alibi", "self_extend", "self_extend_logistic", "rerope", "leaky_rerope", "relative_bias", "string",
                "dca", "logn", "dpe", "ms_poe", "sink"}
# they rotate q/k inside attention with the model's frequency buffers as they were at apply time
ROTATING = {"self_extend", "self_extend_logistic", "rerope", "leaky_rerope", "string", "dca", "dpe", "ms_poe", "sink"}
# transformers' dynamic NTK keeps the frequencies of the longest input seen (until an input shorter than the window)
LENGTH_STATEFUL = {"dynamic"}
# frequencies that follow the longest position of each input (dynamic NTK, dynamic YaRN, LongRoPE's two sets)
LENGTH_DEPENDENT = {"dynamic", "dynamic_yarn", "longrope"}
# stacks (schemes/stack.py): a frequency scheme under a rotating attention-side scheme and/or logn; dynamic and
# longrope are refused under the rotating ones (test_composition), so they stack with logn only
STACK_FREQUENCY = ["default", "linear", "ntk", "yarn", "llama3", "p_rope", "dynamic_yarn"]
STACK_ATTENTION = sorted(ROTATING)


def _stack(parts: list) -> st.SearchStrategy:
    """("stack", {"parts": ((name, params), ...)}) for the parts' names; each part's parameters drawn as above."""
    return st.tuples(*(st.tuples(st.just(n), SCHEMES[n]) for n in parts)).map(lambda ps: ("stack", {"parts": ps}))


STACKS = st.one_of(
    st.tuples(st.sampled_from(STACK_FREQUENCY), st.sampled_from(STACK_ATTENTION), st.booleans()).flatmap(
        lambda t: _stack([t[0], t[1]] + (["logn"] if t[2] else []))),
    st.sampled_from(STACK_FREQUENCY + ["dynamic", "longrope"]).flatmap(lambda f: _stack([f, "logn"])),
    st.sampled_from(STACK_ATTENTION).flatmap(lambda a: _stack([a, "logn"])),
)
SPEC = st.sampled_from(sorted(SCHEMES)).flatmap(lambda n: st.tuples(st.just(n), SCHEMES[n])) | STACKS


def parts(scheme) -> tuple:
    """The names of a scheme's parts: a stack's in order, a single scheme's own."""
    return tuple(p.name for p in scheme.schemes) if scheme.name == "stack" else (scheme.name,)


def rotates_model_buffers(names: tuple) -> bool:
    """A rotating attention-side scheme with no frequency scheme under it rotates with the model's own frequency
    buffers as they were at apply time (a frequency scheme below it computes fp32 frequencies of its own)."""
    return any(n in ROTATING for n in names) and not _has_frequency(names)


def keeps_live_buffers(names: tuple) -> bool:
    """logn alone keeps the model's rotary module as it is: its buffers go through every cast, as unpatched."""
    return names == ("logn",)


def _has_frequency(names: tuple) -> bool:
    return any(n in STACK_FREQUENCY + ["dynamic", "longrope"] for n in names)


CASTS = {"bf16": torch.bfloat16, "fp32": torch.float32, "half": torch.float16}
IGNORED_KEYS = ("architectures", "dtype")  # save_pretrained writes these into the config it saves

PROBE = torch.randint(3, VOCAB, (2, 2 * WINDOW + 8), generator=torch.Generator().manual_seed(0))
PROMPT = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))  # shorter than the window

COUNTS: collections.Counter = collections.Counter()
TIMES: collections.Counter = collections.Counter()
_CACHE: dict = {}


def _config(backend: str = "sdpa"):
    cfg = tiny_config("llama")
    cfg._attn_implementation = backend
    return cfg


def _weights() -> dict:
    if "weights" not in _CACHE:
        torch.manual_seed(0)
        _CACHE["weights"] = LlamaForCausalLM(_config()).state_dict()
    return _CACHE["weights"]


def _build(cfg) -> LlamaForCausalLM:
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(_weights())
    return model


def _bystander_baseline(backend: str) -> torch.Tensor:
    """Logits of a never-touched model with these weights on `backend` (its own config)."""
    if backend not in _CACHE:
        _CACHE[backend] = logits(_build(_config(backend)), PROBE)
    return _CACHE[backend]


def _cfg_dict(cfg) -> dict:
    return {k: v for k, v in copy.deepcopy(cfg.to_dict()).items() if k not in IGNORED_KEYS}


def _norm(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _rounding(dtypes: tuple) -> tuple:
    """The roundings a buffer went through on these moves (fp32 moves are lossless; repeating one changes nothing)."""
    out: list = []
    for d in dtypes:
        if d != torch.float32 and (not out or out[-1] != d):
            out.append(d)
    return tuple(out)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit-identical, else a short message (not pytest's print of two tensors)."""
    __tracebackhide__ = True
    if not torch.equal(a, b):
        diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else f"shapes {a.shape} vs {b.shape}"
        raise AssertionError(f"{what}: max |difference| {diff}")


def _generate(model) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0)


class Interrupted(Exception):
    """Raised inside `with patched(...)`: the previous patch must come back anyway."""


def timed(fn):
    """Times a rule (reported by test_stateful_counts)."""

    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            TIMES[fn.__name__] += time.perf_counter() - start

    return run


class PatchingMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        COUNTS["examples"] += 1
        self.cfg = _config()
        self.model, self.bystander = _build(self.cfg), _build(self.cfg)
        self.twin = _build(_config())
        assert self.model.config is self.cfg and self.bystander.config is self.cfg
        self.cfg_before = _cfg_dict(self.cfg)
        self.shares = True  # the model's own (unpatched) config object is self.cfg (until we continue with a copy)
        self.user_backend = "sdpa"  # the backend the user chose for the model (mirrored on the twin)
        self.shared_backend = "sdpa"  # what the shared config (hence the bystander) must name
        self.dtype = torch.float32
        self.dtypes: tuple = (torch.float32,)  # every dtype the model's own buffers went through
        self.patch: dict | None = None  # what the test knows about the applied patch (None: unpatched)

    # ---- bookkeeping ---------------------------------------------------------------------------------------------
    def applied(self) -> None:
        names = parts(rope_patch.current(self.model))
        own = self.model.config._attn_implementation.startswith("rope_patch_")
        assert own == any(n in OWN_FUNCTION for n in names), (names, self.model.config._attn_implementation)
        self.patch = dict(parts=names, own=own, pending=False, dtypes=self.dtypes)
        self.synced()

    def synced(self) -> None:
        """After apply / remove: the private config of any previous patch was undone, carrying the user's backend
        back to the shared config."""
        if self.shares:
            self.shared_backend = self.user_backend

    @property
    def pending(self) -> bool:
        """set_attn_implementation was called after an own-function attention scheme: the next forward raises."""
        return self.patch is not None and self.patch["pending"]

    def exact(self) -> bool:
        """The model computes what a fresh model with its weights in its dtype (fp32 frequencies) computes."""
        if self.patch is None:
            return not _rounding(self.dtypes)
        if rotates_model_buffers(self.patch["parts"]):
            return not _rounding(self.patch["dtypes"])
        if keeps_live_buffers(self.patch["parts"]):
            return not _rounding(self.dtypes)
        return True

    def forward(self, ids=PROBE, model=None) -> torch.Tensor:
        out = logits(self.model if model is None else model, ids)
        assert out.shape == (*ids.shape, VOCAB) and torch.isfinite(out).all()
        return out

    def settle(self, *models) -> None:
        """Reset the length state of dynamic NTK (an input shorter than the window) before comparing with a fresh
        model: transformers keeps the frequencies of the longest input seen. Not while a backend switch is pending
        (the forward would raise BackendChanged; nothing is compared before the re-apply then)."""
        if self.patch is not None and not self.pending and LENGTH_STATEFUL & set(self.patch["parts"]):
            for m in models:
                logits(m, PROMPT)

    def tables(self, model=None) -> dict:
        return rope_patch.api.patch_modules(self.model if model is None else model)

    def apply_args(self, data, spec):
        """The scheme by its name, an alias, or as a Scheme object; a stack as a list of Scheme objects, a list of
        spec strings, one "a+b" string or a Stack object."""
        name, kw = spec
        if name == "stack":
            specs = [spec_of(n, p) for n, p in kw["parts"]]
            how = data.draw(st.sampled_from(["schemes", "specs", "plus", "object"]))
            if how == "object":
                return (rope_patch.as_scheme("+".join(specs)),), {}
            return ({"schemes": [rope_patch.as_scheme(n, **p) for n, p in kw["parts"]], "specs": specs,
                     "plus": "+".join(specs)}[how],), {}
        cls = get_scheme_class(name)
        how = data.draw(st.sampled_from(["name", "alias", "object"] if cls.aliases else ["name", "object"]))
        if how == "object":
            return (rope_patch.as_scheme(name, **kw),), {}
        return (name if how == "name" else data.draw(st.sampled_from(cls.aliases)),), kw

    @staticmethod
    def check_scheme(scheme, name, kw) -> None:
        assert scheme is not None and scheme.name == name, (scheme, name)
        if name == "stack":
            assert parts(scheme) == tuple(n for n, _ in kw["parts"]), (scheme, kw)
            for part, (n, p) in zip(scheme.schemes, kw["parts"], strict=True):
                PatchingMachine.check_scheme(part, n, p)
            return
        for k, v in kw.items():
            assert _norm(getattr(scheme, k)) == _norm(v), (k, getattr(scheme, k), v)

    def fresh_patched(self):
        """A fresh model with the model's weights in its dtype (fp32 frequency buffers, as from_pretrained(dtype=...)
        gives), its current() patch and its learned tables."""
        ref = _build(_config(self.user_backend))
        ref.load_state_dict(self.twin.state_dict())  # the model's weights as cast so far (exact in fp32)
        for p in ref.parameters():
            p.data = p.data.to(self.dtype)
        rope_patch.apply(ref, rope_patch.current(self.model))
        mine = self.tables()
        for path, table in self.tables(ref).items():
            table.load_state_dict(mine[path].state_dict())
        return ref

    def check_reproduces(self) -> None:
        """current() tells the truth: applied to a fresh model with the same weights in the same dtype (fp32
        frequency buffers, as from_pretrained(dtype=...) gives) and the same learned tables, it gives the model's
        logits bit for bit. After casts too: the patch keeps its frequencies fp32."""
        COUNTS["reproduces"] += 1
        ref = self.fresh_patched()
        self.settle(self.model)
        same(self.forward(model=ref), self.forward(),
             f"current() = {rope_patch.current(self.model)} applied to a fresh model vs the model, "
             f"dtypes {self.dtypes}")

    # ---- rules ---------------------------------------------------------------------------------------------------
    @rule(data=st.data(), spec=SPEC)
    @timed
    def apply_scheme(self, data, spec):
        """apply on an unpatched model, or replace the scheme of a patched one."""
        args, kw = self.apply_args(data, spec)
        COUNTS["apply" if self.patch is None else "replace"] += 1
        COUNTS[f"apply-{'stack' if spec[0] == 'stack' else 'single'}"] += 1
        before, had_tables = rope_patch.current(self.model), bool(self.tables())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rope_patch.apply(self.model, *args, **kw)
        self.applied()
        self.check_scheme(rope_patch.current(self.model), *spec)
        # replacing a scheme that owns learned tables by another one says that its tables are gone
        discarded = [w for w in caught if "learned tables of the previous patch" in str(w.message)]
        assert bool(discarded) == (had_tables and rope_patch.current(self.model) != before), (before, caught)
        self.forward()
        if self.tables() and data.draw(st.booleans(), label="train its tables"):
            self.train(0.5)

    @rule()
    @timed
    def remove_patch(self):
        COUNTS["remove"] += 1
        rope_patch.remove(self.model)
        self.patch = None
        self.synced()

    @precondition(lambda self: self.patch is not None)
    @rule()
    @timed
    def reapply(self):
        """apply(model, current(model)): what a user runs after a backend switch; otherwise it changes nothing (its
        learned tables are kept)."""
        COUNTS["reapply-pending" if self.pending else "reapply"] += 1
        scheme, was = rope_patch.current(self.model), self.patch
        self.settle(self.model)
        before = None if self.pending else self.forward()
        rope_patch.apply(self.model, scheme)
        assert rope_patch.current(self.model) == scheme
        self.applied()
        after = self.forward()
        same_frequencies = (not rotates_model_buffers(parts(scheme))
                            or _rounding(was["dtypes"]) == _rounding(self.dtypes))
        if before is not None and same_frequencies:
            same(after, before, f"re-applied {scheme} vs before; dtypes at apply {was['dtypes']}, now {self.dtypes}")

    @rule(data=st.data(), spec=SPEC, batch=st.integers(1, 2), length=st.integers(1, 3 * WINDOW),
          fail=st.booleans())
    @timed
    def forward_under_patched(self, data, spec, batch, length, fail):
        """`with patched(...)` around a forward (that may raise); afterwards the previous patch (or none) is back,
        with the logits it gave."""
        COUNTS["patched"] += 1
        args, kw = self.apply_args(data, spec)
        before = rope_patch.current(self.model)
        out_before = None if before is None or self.pending else self.forward()
        ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))
        with pytest.raises(Interrupted) if fail else contextlib.nullcontext():
            with rope_patch.patched(self.model, *args, **kw):
                self.check_scheme(rope_patch.current(self.model), *spec)
                self.forward(ids)
                if fail:
                    raise Interrupted
        assert rope_patch.current(self.model) is before
        self.synced()
        if out_before is not None:
            same(self.forward(), out_before, f"{before} after patched() vs before")

    @rule(batch=st.integers(1, 2), length=st.integers(1, 3 * WINDOW), seed=st.integers(0, 1000))
    @timed
    def forward_any(self, batch, length, seed):
        COUNTS["forward"] += 1
        ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
        if self.pending:
            with pytest.raises(BackendChanged):
                logits(self.model, ids)
        else:
            self.forward(ids)

    @rule()
    @timed
    def generate(self):
        """A short greedy generate; unpatched it equals the twin's."""
        COUNTS["generate"] += 1
        if self.pending:
            with pytest.raises(BackendChanged):
                _generate(self.model)
            return
        out = _generate(self.model)
        assert out.shape == (1, PROMPT.shape[1] + 3) and torch.equal(out[:, :PROMPT.shape[1]], PROMPT)
        if self.patch is None:
            same(out, _generate(self.twin), "generate of the unpatched model vs the twin")

    @precondition(lambda self: not self.pending)
    @rule(shape=st.sampled_from(["packed", "pose", "pose-cached"]), first=st.integers(3, 2 * WINDOW),
          second=st.integers(2, 2 * WINDOW), seed=st.integers(0, 1000))
    @timed
    def forward_positions(self, shape, first, second, seed):
        """Position ids that are not the slots (attention/protocol.py). A packed row (ids restarting at 0, no mask:
        transformers then masks across the restart) must give its second sequence the logits it gets alone, under any
        patch; PoSE's skipped ids run without a cache (finite logits, and what a fresh model with the same patch
        gives), and an attention-side scheme of our own serves them into a fresh cache as without one."""
        COUNTS[f"positions-{shape}"] += 1
        gen = torch.Generator().manual_seed(seed)
        a, b = (torch.randint(3, VOCAB, (1, n), generator=gen) for n in (first, second))
        if shape == "packed":
            if self.patch is not None and LENGTH_DEPENDENT & set(self.patch["parts"]):
                return  # their frequencies follow the longest position of the input: the packed row's, not B's
            pos = torch.cat([torch.arange(first), torch.arange(second)])[None]
            packed = logits(self.model, torch.cat([a, b], dim=1), position_ids=pos, use_cache=False)[:, first:]
            alone = logits(self.model, b, position_ids=torch.arange(second)[None], use_cache=False)
            diff = (packed - alone).abs().max().item()
            tol = 1e-5 if self.dtype == torch.float32 else 2e-2  # two computations of one half-precision model
            assert diff <= tol, f"{rope_patch.current(self.model)}: a packed row's second sequence vs alone: {diff}"
            return
        ids = torch.cat([a, b], dim=1)
        pos = torch.cat([torch.arange(first), torch.arange(first + 5 * WINDOW, first + 5 * WINDOW + second)])[None]
        kw = dict(position_ids=pos, attention_mask=torch.ones_like(ids))
        if shape == "pose-cached" and self.patch is not None and (OWN_FUNCTION - {"logn"}) & set(self.patch["parts"]):
            # a first forward into a fresh cache holds only its own keys, whose ids the attention reads
            diff = (logits(self.model, ids, **kw, use_cache=True) - logits(self.model, ids, **kw, use_cache=False)
                    ).abs().max().item()
            tol = 1e-5 if self.dtype == torch.float32 else 2e-2
            assert diff <= tol, f"{rope_patch.current(self.model)}: PoSE ids into a fresh cache vs without: {diff}"
            return
        out = logits(self.model, ids, **kw, use_cache=shape == "pose-cached")
        assert torch.isfinite(out).all()
        if self.exact() and self.patch is not None and not LENGTH_STATEFUL & set(self.patch["parts"]):
            ref = self.fresh_patched()
            same(logits(ref, ids, **kw, use_cache=False), logits(self.model, ids, **kw, use_cache=False),
                 f"PoSE ids: {rope_patch.current(self.model)} on a fresh model vs the model")

    @precondition(lambda self: not self.pending and self.dtype == torch.float32)
    @rule(data=st.data(), spec=SPEC)
    @timed
    def offloaded_copy(self, data, spec):
        """A copy of the model offloaded by accelerate (parameters on the meta device, brought in per forward by
        hooks) computes what the model computes, and takes a patch as a loaded model does (its tables where the
        layers compute, not on meta)."""
        from accelerate import cpu_offload

        COUNTS["offloaded"] += 1
        dup = copy.deepcopy(self.model)
        cpu_offload(dup, execution_device="cpu")
        same(logits(dup, PROBE), self.forward(), "an offloaded copy vs the model")
        args, kw = self.apply_args(data, spec)
        loaded = copy.deepcopy(self.model)
        rope_patch.apply(dup, *args, **kw)
        rope_patch.apply(loaded, *args, **kw)
        for table in rope_patch.api.patch_modules(dup).values():
            assert next(table.parameters()).device.type == "cpu"
        same(logits(dup, PROBE), logits(loaded, PROBE), f"{rope_patch.current(dup)} offloaded vs loaded")

    @rule(data=st.data(), spec=SPEC)
    @timed
    def meta_model(self, data, spec):
        """A model built on the meta device (no weights, no frequencies) is refused, and left as it was."""
        COUNTS["meta"] += 1
        with torch.device("meta"):
            empty = LlamaForCausalLM(_config())
        args, kw = self.apply_args(data, spec)
        with pytest.raises(ValueError, match="on the meta device: the weights are not materialised"):
            rope_patch.apply(empty, *args, **kw)
        assert rope_patch.current(empty) is None and "forward" not in vars(empty.model.rotary_emb)

    @rule(how=st.sampled_from(["deepcopy", "torch.save", "pickle"]), then=st.sampled_from(["continue", "independence"]))
    @timed
    def copy_model(self, how, then):
        """A deepcopy / torch.save+load / pickle of the model is an equal, independent model: continue with it, or
        remove its patch (and shift its learned tables) and check that the original is untouched."""
        COUNTS[f"{how}-{then}"] += 1
        before = rope_patch.current(self.model)
        out = None if self.pending else self.forward()
        dup = roundtrip(self.model, how)
        assert rope_patch.current(dup) == before
        if out is None:
            with pytest.raises(BackendChanged):
                logits(dup, PROBE)
        else:
            same(self.forward(model=dup), out, f"{how} copy vs the model")
        if then == "continue":
            self.model = dup
            self.shares = False  # the copy holds a copy of the shared config
            return
        with torch.no_grad():
            for table in self.tables(dup).values():
                next(table.parameters()).add_(1.0)
        rope_patch.remove(dup)
        assert rope_patch.current(dup) is None and rope_patch.current(self.model) == before
        same(self.forward(model=dup), self.forward(model=self.twin), f"{how} copy after remove vs the twin")
        if out is not None:
            same(self.forward(), out, f"the model after remove on its {how} copy vs before")

    @precondition(lambda self: not self.pending)
    @rule(continue_with=st.booleans())
    @timed
    def save_and_reload(self, continue_with):
        """rope_patch.save_pretrained + from_pretrained: the same current() and, in an exact state, logits within
        1e-5; saving leaves the model as it was. `continue_with`: go on with the reloaded model where it is
        interchangeable with the twin (never rounded by a cast: a fresh load has exact fp32 frequency buffers)."""
        COUNTS["save_reload"] += 1
        self.settle(self.model)
        out = self.forward()
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            with tempfile.TemporaryDirectory() as d:
                rope_patch.save_pretrained(self.model, d)
                reloaded = rope_patch.from_pretrained(d, dtype=self.dtype, attn_implementation=self.user_backend).eval()
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        assert rope_patch.current(reloaded) == rope_patch.current(self.model)
        same(self.forward(), out, "the model after save_pretrained vs before")
        again = self.forward(model=reloaded)
        if self.exact():
            COUNTS["save_reload-exact"] += 1
            diff = (again.float() - out.float()).abs().max().item()
            scheme = rope_patch.current(self.model)
            assert diff <= 1e-5, f"reloaded logits differ by {diff:.3g}; {scheme}, dtypes {self.dtypes}"
        if continue_with and not _rounding(self.dtypes):
            COUNTS["save_reload-continue"] += 1
            self.model, self.shares = reloaded, False
            if self.patch is not None:
                self.applied()

    @precondition(lambda self: not self.pending)
    @rule()
    @timed
    def plain_save_and_reload(self):
        """transformers' own model.save_pretrained, reloaded by transformers alone (the one rule of every save,
        tests/test_saving_rule.py): the patched model where the whole patch has a native form, else the unpatched
        model (the twin), never a third one (a stack's frequency part alone); saving leaves the model as it was."""
        COUNTS["plain_save"] += 1
        self.settle(self.model)
        out = self.forward()
        scheme = rope_patch.current(self.model)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the learned tables are unexpected keys for plain transformers
                self.model.save_pretrained(d)
                plain = AutoModelForCausalLM.from_pretrained(d, dtype=self.dtype,
                                                             attn_implementation=self.user_backend).eval()
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        assert rope_patch.current(plain) is None
        same(self.forward(), out, "the model after a plain save_pretrained vs before")
        native = scheme is not None and not without_native_form(scheme)
        if self.exact() and not _rounding(self.dtypes):  # a fresh load has exact fp32 frequencies
            COUNTS["plain_save-" + ("unpatched" if scheme is None else "native" if native else "non-native")] += 1
            self.settle(self.twin)
            expected = out if native else self.forward(model=self.twin)
            diff = (self.forward(model=plain).float() - expected.float()).abs().max().item()
            assert diff <= 1e-5, (f"a plain save of {scheme} reloads {diff:.3g} away from the "
                                  f"{'patched' if native else 'unpatched'} model; dtypes {self.dtypes}")

    @rule(to=st.sampled_from(["bf16", "fp32", "bf16-and-back", "bf16", "fp32", "half"]), spelling=st.booleans(),
          verify=st.booleans())
    @timed
    def cast_model(self, to, spelling, verify):
        """The same dtype move(s) on the model and the twin: `.to(dtype)` or `.float()` / `.half()`; `bf16-and-back`
        is `.to(torch.bfloat16).float()` in one statement (no forward in between). `verify`: then check that the
        patched model computes what current() says, else leave it to the next step."""
        COUNTS[f"cast-{to}"] += 1
        for step in ("bf16", "fp32") if to == "bf16-and-back" else (to,):
            dtype = CASTS[step]
            for m in (self.model, self.twin):
                if spelling and step != "bf16":
                    m.float() if step == "fp32" else m.half()
                else:
                    m.to(dtype)
            if dtype != self.dtype:
                self.dtypes = (*self.dtypes, dtype)
            self.dtype = dtype
        if verify and self.patch is not None and not self.pending and self.exact():
            self.check_reproduces()

    @rule(backend=st.sampled_from(["eager", "sdpa"]), follow_up=st.booleans())
    @timed
    def set_backend(self, backend, follow_up):
        """set_attn_implementation on the model (and the twin). After an own-function attention scheme the next
        forward raises BackendChanged; `follow_up`: check that now, then re-apply and check the model runs the scheme
        on the new backend (else leave the pending switch to the next steps)."""
        COUNTS[f"backend-{backend}"] += 1
        self.model.set_attn_implementation(backend)
        self.twin.set_attn_implementation(backend)
        self.user_backend = backend
        if self.patch is None:
            if self.shares:
                self.shared_backend = backend
        elif self.patch["own"]:
            self.patch["pending"] = True
        if follow_up and self.pending:
            COUNTS["backend-switch-then-reapply"] += 1
            with pytest.raises(BackendChanged, match=r"rope_patch\.apply\(model, rope_patch\.current\(model\)\)"):
                logits(self.model, PROMPT)
            scheme = rope_patch.current(self.model)
            rope_patch.apply(self.model, scheme)
            assert rope_patch.current(self.model) == scheme
            self.applied()
            assert self.model.config._attn_implementation.startswith("rope_patch_")
            if self.exact():
                self.check_reproduces()
            else:
                self.forward()

    @precondition(lambda self: self.patch is not None and not self.pending and self.exact())
    @rule()
    @timed
    def current_reproduces(self):
        self.check_reproduces()

    @precondition(lambda self: self.patch is not None and not self.pending and bool(self.tables()))
    @rule(step=st.sampled_from([0.5, -0.25, 1.0]))
    @timed
    def train_tables(self, step):
        self.train(step)

    def train(self, step: float) -> None:
        """Change the patch's learned tables (as training would): copies, saves, re-apply and patched() keep them."""
        COUNTS["train_tables"] += 1
        with torch.no_grad():
            for table in self.tables().values():
                for p in table.parameters():
                    p.add_(torch.linspace(-step, step, p.numel(), dtype=torch.float32).reshape(p.shape).to(p.dtype))

    # ---- invariants ----------------------------------------------------------------------------------------------
    @invariant()
    def count_step(self):
        COUNTS["states"] += 1

    @invariant()
    def current_tells_the_truth(self):
        scheme = rope_patch.current(self.model)
        assert (scheme is None) == (self.patch is None), (scheme, self.patch)
        if scheme is not None:
            assert parts(scheme) == self.patch["parts"]
        assert rope_patch.current(self.bystander) is None and rope_patch.current(self.twin) is None

    @invariant()
    def unpatched_equals_twin(self):
        if self.patch is not None:
            assert self.model.config is not self.cfg
            return
        if self.shares:
            assert self.model.config is self.cfg and self.model.model.rotary_emb.config is self.cfg
            assert all(layer.self_attn.config is self.cfg for layer in self.model.model.layers)
        assert self.model.config._attn_implementation == self.twin.config._attn_implementation == self.user_backend
        same(self.forward(), self.forward(model=self.twin), "unpatched model vs the twin")

    @invariant()
    def bystander_untouched(self):
        b = self.bystander
        assert b.config is self.cfg and b.model.rotary_emb.config is self.cfg
        assert all(layer.self_attn.config is self.cfg for layer in b.model.layers)
        assert self.cfg._attn_implementation == self.shared_backend
        assert _cfg_dict(self.cfg) == self.cfg_before
        same(logits(b, PROBE), _bystander_baseline(self.shared_backend),
             f"bystander ({self.shared_backend}) vs at start")


TestStatefulPatching = PatchingMachine.TestCase
TestStatefulPatching.settings = settings(
    max_examples=CI_EXAMPLES * (10 if LONG else 1),
    stateful_step_count=CI_STEPS,
    deadline=None,
    derandomize=not LONG,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
    # CI: a failure is reported as found (shrinking a 30-step case reruns it hundreds of times: minutes); the long
    # run shrinks it to a minimal sequence
    phases=list(Phase) if LONG else [p for p in Phase if p != Phase.shrink],
)


@pytest.mark.parametrize("scheme,params", [("yarn", dict(factor=4.0)), ("rerope", dict(window_size=4))])
def test_cast_and_back_keeps_the_patch_frequencies_fp32(scheme, params):
    """Found by the machine above (shrunk: apply_scheme(rerope, window_size=4); cast_model('bf16-and-back')):
    `model.to(torch.bfloat16).float()` with no forward in between left bf16-rounded frequencies in the patch's
    float32 buffers, while the patch restored its fp32 masters only on a dtype mismatch (fixed in 4e07a7d).
    docs/guarantees.md:
    "While patched, the frequencies stay fp32 ... also after model.to(torch.bfloat16)"."""
    model, ref = _build(_config()), _build(_config())
    rope_patch.apply(model, scheme, **params)
    model.to(torch.bfloat16).float()
    for p in ref.parameters():  # the same rounded weights, never-cast fp32 frequencies
        p.data = p.data.to(torch.bfloat16).float()
    rope_patch.apply(ref, scheme, **params)
    same(logits(model, PROBE), logits(ref, PROBE),
         f"{scheme} patched, then .to(bf16).float(), vs patched on the same weights")


@pytest.mark.parametrize("edit", ["use_cache", "backend"])
def test_a_config_edit_made_after_a_patched_block_survives_remove(edit):
    """Found by the machine above (shrunk: apply_scheme(longrope); set_backend('eager'); forward_under_patched(nope);
    set_backend('sdpa'); reapply() -> the model ran eager). patched() undoes the outer patch, which carries the user's
    edit (eager / use_cache=False) into the model's own config, then put the outer patch back with its old baseline;
    an edit back to the baseline value was taken for "unchanged" and the stale carried value won on remove (fixed in
    4e07a7d)."""
    model = _build(_config())
    rope_patch.apply(model, "yarn", factor=4.0)
    if edit == "backend":
        model.set_attn_implementation("eager")
    else:
        model.config.use_cache = False
    with rope_patch.patched(model, "nope"):
        pass
    if edit == "backend":
        model.set_attn_implementation("sdpa")
    else:
        model.config.use_cache = True
    rope_patch.remove(model)
    found = model.config._attn_implementation if edit == "backend" else model.config.use_cache
    assert found == ("sdpa" if edit == "backend" else True), f"the user's last edit was lost: {edit} = {found!r}"


def test_a_patched_block_keeps_the_dynamic_ntk_length_state():
    """patched() must put the previous patch back as it was. transformers' dynamic NTK keeps the frequencies of the
    longest input seen (until an input shorter than the window); redo() re-installs the patch as first applied
    (`max_seq_len_cached` = window, the un-grown `inv_freq`), so after the block a 72-token input gets other logits
    than before it (frequencies for 72 instead of 96 tokens)."""
    model = _build(_config())
    rope_patch.apply(model, "dynamic", factor=4.0)
    logits(model, torch.randint(3, VOCAB, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(2)))  # grows to 96
    before = logits(model, PROBE)  # 72 tokens: between the window and the longest input, the 96-token frequencies
    with rope_patch.patched(model, "nope"):
        pass
    same(logits(model, PROBE), before, "dynamic after a patched() block vs before it")


def test_stateful_counts(capsys):
    """Reports how much the machine above ran (it runs first: pytest keeps the file's order)."""
    if not COUNTS["examples"]:
        pytest.skip("the state machine did not run in this session")
    rules = ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items()) if k not in ("examples", "states"))
    times = ", ".join(f"{k}={v:.1f}s" for k, v in TIMES.most_common())
    with capsys.disabled():
        print(f"\nstateful ({'long' if LONG else 'bounded'} run): {COUNTS['examples']} examples, {COUNTS['states']} "
              f"checked states\n  rules: {rules}\n  time in rules: {times}")
    assert COUNTS["states"] >= COUNTS["examples"]
    assert COUNTS["apply-stack"] > 0 and COUNTS["apply-single"] > 0  # both kinds of patch were exercised
