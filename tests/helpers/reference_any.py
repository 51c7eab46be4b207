"""A reference for the attention-side schemes on any architecture, independent of rope_patch.

`helpers.reference` writes a whole llama-layout forward in plain math. Other architectures differ from it in
everything around attention (q/k norms before or after RoPE, partial / interleaved / one-tensor rotary, MLA, global
NoPE layers, gated attention, sinks, per-position temperatures), so here the model's own code runs everything, and
only the positions are the reference's:

- The schemes that move positions (self_extend, self_extend_logistic, rerope, leaky_rerope, string, dca; "rope" = the
  identity, the reference's sanity check): every pair (i, j) gets the query and key positions the paper gives it
  (`helpers.reference.pair_positions`, `helpers.reference_dca.pair_positions`, from the tokens' true positions). Each
  attention layer is then run by its own class forward several times with position embeddings made by its own rotary
  module at a whole array of positions (one position per token: every (token, position) that some pair needs), with a
  capturing attention function: so q and k are exactly what the layer computes at those positions — rotation, norms,
  scales and everything the layer does after RoPE included, "RoPE where the model applies it". The scores of pair
  (i, j) are q_i at its pair position · k_j at its pair position, materialised (b, H, L, L), masked with transformers'
  eager mask, one softmax (sinks and softcapping as the model has them), times the values. A last run of the layer's
  own forward (at the true positions) turns that attention output into the layer output (o_proj, output gates, norms).
- DPE: the same with a position per frequency group: the layer's embeddings are its rotary's at group g's positions
  for the elements of pair k, k·G/(d/2) = g (k the index of the rotary's `inv_freq` whose angle the element turns by
  at position 1: the code's index grouping, read from the buffer), each group Self-Extend with its own size.
- ALiBi / T5 bias: the rotary is made the identity by a forward hook (the layers then run without rotation: NoPE) and
  the bias of true positions is added in a materialised attention function.
- sinusoidal / learned absolute tables are added to the input embeddings, which are passed as `inputs_embeds`.

Nothing here uses rope_patch: not its copies, caches, attention functions or position maps.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import MutableMapping

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from helpers.reference import alibi_slopes, hidden, pair_positions, sinusoid_table, t5_bucket, true_positions
from helpers.reference_dca import pair_positions as dca_pair_positions

NAME = "rope_patch_tests_reference"
# pairs at the papers' positions
POSITIONAL = ("rope", "self_extend", "self_extend_logistic", "rerope", "leaky_rerope", "string", "dca", "dpe",
              "ms_poe", "sink", "lm_infinite")
BIAS = ("alibi", "relative_bias")
OWN_ATTENTION = (*BIAS, *POSITIONAL)
MODEL_ATTENTION = ("nope", "sinusoidal", "learned_absolute")  # the model's own attention (no rotation, embeddings)


class _Run:
    """The reference forward in progress (what the attention function and the layer wrappers need)."""

    current: _Run | None = None

    def __init__(self, model, patched, scheme, params, pos):
        self.model, self.patched, self.scheme, self.params, self.pos = model, patched, scheme, params, pos
        self.made = {}  # id(position embeddings) -> (rotary module, its call args, kwargs)
        self.mode, self.captured, self.emit = None, [], []
        self.shared = {}  # (id(mapping), positions) -> the copy a layer run at those positions reads and writes
        self.outputs, self.outputs_by_id = {}, {}  # the rotary outputs of the forward, for embeddings cut from them
        self.inner = {}  # rotary module -> the position ids of its last call (bias schemes: memory entries' positions)


def _rotaries(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    run = _Run.current
    if run.mode == "capture":  # a positional layer run: keep q, k, v of every call, return nothing useful
        run.captured.append(dict(q=query, k=key, v=value, scaling=scaling, softcap=kwargs.get("softcap"),
                                 sinks=kwargs.get("s_aux"), mask=attention_mask, indices=kwargs.get("indices")))
        b, h, n, _ = query.shape
        return query.new_zeros(b, n, h, value.shape[-1]), None
    if run.mode == "emit":  # the layer's last run: the reference attention output of each call in turn
        return run.emit.pop(0), None
    if module not in run.layers:  # cross-attention (Blt's): not a layer the scheme moves, attention as it is
        b, h, n, d = query.shape
        s = _softcapped((query @ _expand_kv(key, h).transpose(-1, -2)).float() * (scaling or d**-0.5),
                        kwargs.get("softcap"))
        return _softmax_out(s, _expand_kv(value, h), attention_mask, kwargs.get("s_aux")), None
    return _bias_attention(module, query, key, value, attention_mask, scaling, **kwargs)


def _softcapped(s, softcap):
    """Gemma 2: c·tanh(s / c) on the scaled q·k, before any bias or mask (as the model's eager function)."""
    return s if softcap is None else torch.tanh(s / softcap) * softcap


def _probabilities(s, attention_mask, sinks):
    """(b, H, n, k) float scores (softcapped, biased) → attention probabilities: eager mask, softmax (with sinks)."""
    b, h, n, k = s.shape
    if attention_mask is not None:
        s = s + attention_mask[:, :, :, :k]
    if sinks is not None:  # gpt-oss: a per-head logit in the denominator (a key with value 0)
        sink = sinks.view(1, h, 1, 1).expand(b, h, n, 1).float()
        return torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.softmax(s, dim=-1)


def _softmax_out(s, value, attention_mask, sinks):
    """(b, H, n, k) float scores (softcapped, biased) → (b, n, H, dv): eager mask, softmax (with sinks), values."""
    attn = _probabilities(s[..., : value.shape[-2]], attention_mask, sinks)
    return (attn.to(value.dtype) @ value).transpose(1, 2).contiguous()


def _expand_kv(x, h):
    return x.repeat_interleave(h // x.shape[1], 1)


def _bias_attention(module, query, key, value, attention_mask, scaling, **kwargs):
    run = _Run.current
    b, h, n, d = query.shape
    key, value = _expand_kv(key, h), _expand_kv(value, h)
    scaling = d**-0.5 if scaling is None else scaling
    s = _softcapped((query @ key.transpose(-1, -2)).float() * scaling, kwargs.get("softcap"))
    pos, k_len = run.pos, key.shape[-2]
    entries = _entries(module, k_len - n) if k_len > n == pos.shape[-1] else None
    if entries is not None:  # memory entries after the tokens (DeepSeek-V4): keys at the positions they are made at
        key_pos = torch.cat([pos, entries.expand(b, -1).to(pos.dtype)], dim=-1)
    else:
        if k_len != pos.shape[-1] or n != pos.shape[-1]:  # a layer over other units than the tokens (Blt's patches)
            pos = torch.arange(k_len).expand(b, -1)  # its own slots, the queries the last n of them
        key_pos = pos
    dist = (pos[:, -n:, None] - key_pos[:, None, :]).clamp(min=0)
    if run.scheme == "alibi":
        slopes = torch.tensor(alibi_slopes(h, run.params.get("max_bias", 8.0)))
        s = s - slopes[None, :, None, None] * dist[:, None].float()
    elif run.scheme == "relative_bias":
        p = run.params
        w = run.patched.rope_patch_relative_bias.weight[module.layer_idx]  # (H, buckets)
        buckets = torch.tensor([t5_bucket(t, p.get("num_buckets", 32), p.get("max_distance", 128))
                                for t in range(int(dist.max()) + 1)])
        s = s + w[:, buckets[dist]].permute(1, 0, 2, 3)
    if kwargs.get("indices") is not None:  # a sparse-attention indexer's choice of keys: the others are masked
        keep = torch.zeros(b, n, key.shape[-2], dtype=torch.bool).scatter(-1, kwargs["indices"].long(), True)
        s = s.masked_fill(~keep[:, None], float("-inf"))
    return _softmax_out(s, value, attention_mask, kwargs.get("s_aux")), None


def _entries(module, memory: int):
    """The positions (b|1, memory) of the memory entries a layer appends to its keys: the last call of its first inner
    rotary that made `memory` positions (DeepSeek-V4's compressor, w·m; its indexer's last call rotates the queries),
    recorded by `_last_call`; None if there is none."""
    calls = _Run.current.inner
    return next((calls[r] for r in _inner_rotaries(module) if r in calls and calls[r].shape[-1] == memory), None)


def _last_call(rotary, args, kwargs):
    bound = inspect.signature(type(rotary).forward).bind(rotary, *args, **kwargs)
    _Run.current.inner[rotary] = bound.arguments["position_ids"]


def _identity(module, args, kwargs, out):
    if isinstance(out, torch.Tensor) and out.is_complex():  # Llama 4's freqs_cis: rotation by e^{i·0} = 1
        return torch.ones_like(out)
    # the rotation by angle 0: cos = 1, sin = 0, in the order the module returns them ((cos, sin), or GPT-J's table
    # rotary (sin, cos)): at position 0 the cos slot is the non-zero one (cos 0 = 1, times any scale) and sin 0 = 0
    call = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
    call["position_ids"] = torch.zeros_like(call["position_ids"])
    at_zero = type(module).forward(**call)
    return tuple(torch.ones_like(o) if bool(z.ne(0).any()) else torch.zeros_like(o)
                 for o, z in zip(out, at_zero, strict=True))


def _record(module, args, kwargs, out):
    run = _Run.current
    run.made[id(out)] = (module, args, kwargs)
    run.outputs[id(out)] = (module, args, kwargs)
    run.outputs_by_id[id(out)] = out


def _tables(pp: torch.Tensor, valid: torch.Tensor, dim: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Position arrays P_0 … P_{m−1} and, per pair, which array holds its position. `pp` (b, nq, nk) holds every
    pair's query (dim=2: per query row t, pp[r, t, :]) or key (dim=1: per key column t, pp[r, :, t]) position; each
    query or key gets its distinct positions over the valid pairs, the t-th of them in P_t (the last repeated when it
    has fewer). P_t is (b, nq) for queries, (b, nk) for keys; the index is (b, nq, nk)."""
    b = pp.shape[0]
    units = pp.shape[1] if dim == 2 else pp.shape[2]

    def line(x, r, t):
        return x[r, t, :] if dim == 2 else x[r, :, t]

    values = [[sorted({float(v) for v in line(pp, r, t)[line(valid, r, t)]}) or [0.0] for t in range(units)]
              for r in range(b)]
    m = max(len(v) for row in values for v in row)
    arrays = [torch.tensor([[v[min(t, len(v) - 1)] for v in row] for row in values]) for t in range(m)]
    index = torch.zeros(pp.shape, dtype=torch.long)
    for r in range(b):
        for t in range(units):
            v = values[r][t]
            idx = torch.tensor([v.index(float(x)) if float(x) in v else 0 for x in line(pp, r, t)])
            if dim == 2:
                index[r, t, :] = idx
            else:
                index[r, :, t] = idx
    return arrays, index


def _element_groups(rotary, given: dict, count: int) -> torch.Tensor:
    """DPE's group of each element of the rotary's output: the index k of the `inv_freq` entry (of the layer type's
    buffer where there is one) nearest to the element's angle at position 1, grouped k·count // (d/2)."""
    out = type(rotary).forward(**{**given, "position_ids": torch.ones_like(given["position_ids"][..., :1])})
    angle = torch.atan2(out[1].float(), out[0].float()) if isinstance(out, tuple) else torch.angle(out)
    angle = angle.reshape(-1, angle.shape[-1])[0]
    layer_type = given.get("layer_type")
    inv = getattr(rotary, f"{layer_type}_inv_freq", None) if layer_type else None
    inv = (inv if inv is not None else rotary.inv_freq).float()
    k = (angle[:, None] - inv[None, :]).abs().argmin(-1)
    return k * count // inv.numel()


def _grouped_embeddings(rotary, given: dict, positions: list[torch.Tensor]):
    """The rotary's embeddings with the elements of group g at positions[g]."""
    parts = [type(rotary).forward(**{**given, "position_ids": p}) for p in positions]
    groups = _element_groups(rotary, given, len(positions))
    if isinstance(parts[0], tuple):
        return tuple(torch.stack([part[i] for part in parts], -1).gather(
            -1, groups.expand(*parts[0][i].shape).unsqueeze(-1)).squeeze(-1) for i in range(len(parts[0])))
    stacked = torch.stack(parts, -1)
    return stacked.gather(-1, groups.expand(*parts[0].shape).unsqueeze(-1)).squeeze(-1)


def _sliced(run, embeddings):
    """(rotary, args, kwargs) for embeddings that are the last positions of a recorded rotary output (Gemma 4 keeps
    only those for its KV-shared layers), with the position ids cut alike; None if there is no such output."""
    if not isinstance(embeddings, tuple) or not embeddings:
        return None
    first = embeddings[0]
    for out_id, (rotary, args, kwargs) in run.outputs.items():
        whole = run.outputs_by_id[out_id][0]
        n = first.shape[-2]
        if whole.shape[:-2] == first.shape[:-2] and whole.shape[-2] >= n and torch.equal(whole[..., -n:, :], first):
            bound = dict(inspect.signature(type(rotary).forward).bind(rotary, *args, **kwargs).arguments)
            bound["position_ids"] = bound["position_ids"][..., -n:]
            bound.pop("self")
            return rotary, (), bound
    return None


def _inner_rotaries(module) -> list:
    """Rotary modules inside an attention layer (DeepSeek-V4's compressor and indexer each hold one)."""
    return [m for m in module.modules() if m is not module and type(m).__name__.endswith("RotaryEmbedding")]


class _Own:
    """Forward pre-hooks on a layer's inner rotaries for one run: calls at positions of the layer's own making (not
    the position ids the layer is handed, `given`) are recorded in `seen`, and those with as many positions as
    `entries` are made at `entries` instead. DeepSeek-V4's compressor rotates memory entry w at w·m, the position of
    its block's first token: that is where the reference places the entry as a key."""

    def __init__(self, module, given, entries=None):
        self.given, self.entries, self.seen = given, entries, []
        self.hooks = [r.register_forward_pre_hook(self, with_kwargs=True) for r in _inner_rotaries(module)]

    def __call__(self, rotary, args, kwargs):
        bound = inspect.signature(type(rotary).forward).bind(rotary, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        ids = arguments.get("position_ids")
        if ids is None or ids is self.given:
            return None
        self.seen.append(ids)
        if self.entries is None or ids.shape[-1] != self.entries.shape[-1]:
            return None
        arguments["position_ids"] = self.entries.expand(ids.shape[0], -1)
        return (), arguments

    def close(self):
        for hook in self.hooks:
            hook.remove()


def _embed(made, positions, grouped=None):
    """What the rotary call `made` (rotary, args, kwargs) gives at `positions` (DPE: `grouped`, one position array per
    frequency group)."""
    rotary, args, kwargs = made
    given = dict(inspect.signature(type(rotary).forward).bind(rotary, *args, **kwargs).arguments)
    if grouped is not None:
        return _grouped_embeddings(rotary, given, grouped)
    return type(rotary).forward(**{**given, "position_ids": positions})


class _Layer:
    """The forward of an attention layer during a positional reference run (see the module docstring)."""

    def __init__(self, module):
        self.module = module
        self.signature = inspect.signature(type(module).forward)

    @staticmethod
    def _positions(call, extra, made, tokens):
        """The layer's own positions (b, n): what its rotary was called with (Blt's global layers count patches, not
        the tokens), else the position ids it gets, else the tokens' true positions."""
        pos = None
        if type(made) is dict:  # DeepSeek-V4: {"main", "compress"} embeddings, of the same positions
            made = next((m for m in made.values() if m is not None), None)
        if made is not None:
            rotary, args, kwargs = made
            pos = inspect.signature(type(rotary).forward).bind(rotary, *args, **kwargs).arguments["position_ids"]
        pos = pos if pos is not None else call.get("position_ids", extra.get("position_ids"))
        if pos is None:
            return tokens
        pos = pos[0] if pos.dim() == 3 else pos  # M-RoPE: the text section
        return pos.expand(tokens.shape[0], pos.shape[-1]).long()

    def _run(self, call: dict, extra: dict, positions: torch.Tensor | None, made, entries=None, seen=None):
        """The layer's own forward with every token at `positions` (None: as given), its memory entries (keys past
        the tokens) at `entries` (None: where the layer puts them); `seen` collects the positions of the layer's own
        making its inner rotaries were called with."""
        call, extra = dict(call), dict(extra)
        grouped = positions if isinstance(positions, list) else None  # DPE: one position array per frequency group
        if grouped is not None:
            positions = grouped[0]
        if positions is not None:
            if type(made) is dict:
                call["position_embeddings"] = {k: _embed(m, positions, grouped) if m is not None
                                               else call["position_embeddings"][k] for k, m in made.items()}
            elif made is not None:
                call["position_embeddings"] = _embed(made, positions, grouped)
            for where in (call, extra):
                if where.get("position_ids") is not None:
                    where["position_ids"] = positions
        for name in ("cache", "past_key_values", "layer_past"):
            for where in (call, extra):
                if name in where:
                    where[name] = None
        if positions is not None:
            # state the decoder hands every layer (Gemma 3n/4: a producing layer stores its keys, later layers read
            # them): each set of positions has its own copy, so a reading layer gets the keys made at its positions
            shared = _Run.current.shared
            for where in (call, extra):
                for name, value in where.items():
                    if isinstance(value, MutableMapping):
                        key = (id(value), torch.stack(grouped or [positions]).numpy().tobytes())
                        where[name] = shared.setdefault(key, copy.copy(value))
        own = _Own(self.module, positions, entries)
        try:
            return type(self.module).forward(self.module, **call, **extra)
        finally:
            own.close()
            if seen is not None:
                seen.extend(own.seen)

    def __call__(self, *args, **kwargs):
        run = _Run.current
        bound = self.signature.bind(self.module, *args, **kwargs)
        call = dict(bound.arguments)
        call.pop("self")
        extra = call.pop("kwargs", {}) if "kwargs" in self.signature.parameters else {}
        embeddings = call.get("position_embeddings")
        if type(embeddings) is dict:  # DeepSeek-V4: one per rope type, {"main", "compress"}
            made = {k: run.made.get(id(v)) or _sliced(run, v) for k, v in embeddings.items()}
        else:
            made = run.made.get(id(embeddings)) or _sliced(run, embeddings)
        pos = self._positions(call, extra, made, run.pos)
        b, n = pos.shape
        if run.scheme == "ms_poe":
            return self._ms_poe(call, extra, made, pos)
        run.mode = "capture"
        # The layer at the tokens' own positions: its mask (DeepSeek-V4 builds the causality of its memory entries
        # inside the layer), a sparse-attention indexer's choice of keys (made at the tokens' own positions, as the
        # unpatched model makes it), and the keys that are not tokens: memory entries appended after the n tokens,
        # each a key at the position the layer rotates it at (DeepSeek-V4: w·m, the first token of its block).
        run.captured, seen = [], []
        self._run(call, extra, pos, made, seen=seen)
        truth = run.captured
        memory = truth[0]["k"].shape[-2] - n if truth else 0
        key_pos = pos
        if memory > 0:
            entries = next((p for p in seen if p.shape[-1] == memory), None)
            if entries is None:
                raise ValueError(f"{type(self.module).__name__} attends to {memory} keys beyond its {n} tokens, and "
                                 "no rotation inside it placed them: the reference cannot place them")
            key_pos = torch.cat([pos, entries.expand(b, -1).to(pos.dtype)], dim=-1)
        nk = key_pos.shape[1]
        slot = torch.arange(n)
        kind = torch.long
        if run.scheme == "dpe":  # Lu et al. 2025: near pairs at true positions, far ones per group (Self-Extend, s_g)
            if memory:
                raise ValueError("the DPE reference places token keys only: this layer attends to memory entries")
            w, sizes = run.params["window_size"], run.params["group_sizes"]
            q_arrays = [[pos] * len(sizes), [torch.div(pos, s, rounding_mode="floor") + w - w // s for s in sizes]]
            k_arrays = [[pos] * len(sizes), [torch.div(pos, s, rounding_mode="floor") for s in sizes]]
            q_index = k_index = (pos[:, :, None] - pos[:, None, :] >= w).long()
        else:
            if run.scheme == "dca":
                p = run.params
                pq_table, pk_table = dca_pair_positions(int(key_pos.max()) + 1, p["chunk_size"], p["local_size"])
                pq, pk = pq_table[pos[:, :, None], key_pos[:, None, :]], pk_table[pos[:, :, None], key_pos[:, None, :]]
            else:
                pq, pk = pair_positions(run.scheme, run.params, pos[:, :, None], key_pos[:, None, :])
            valid = torch.cat([slot[:, None] >= slot[None, :], torch.ones(n, memory, dtype=torch.bool)], dim=1)
            valid = valid.expand(b, n, nk)  # causal pairs of tokens, every memory entry; the mask handles the rest
            q_arrays, q_index = _tables(pq, valid, dim=2)
            k_arrays, k_index = _tables(pk, valid, dim=1)
            kind = pq.dtype if run.scheme == "leaky_rerope" else torch.long
        qs, ks, vs, moved = [], [], [], []  # per position array, per attention call of the layer (DiffLlama makes two)
        for arr in q_arrays:
            run.captured = []
            self._run(call, extra, arr if isinstance(arr, list) else arr.to(kind), made)
            qs.append([c["q"] for c in run.captured])
            moved.append([c["v"] for c in run.captured])
        for arr in k_arrays:
            run.captured = []
            if isinstance(arr, list):  # DPE: one position array per frequency group
                self._run(call, extra, arr, made)
            else:
                arr = arr.to(kind)
                self._run(call, extra, arr[:, :n], made, entries=arr[:, n:] if memory else None)
            ks.append([c["k"] for c in run.captured])
            vs.append([c["v"] for c in run.captured])
        bi = torch.arange(b)[:, None, None]
        ii, jj = slot[None, :, None], torch.arange(nk)[None, None, :]
        # K = V (DeepSeek-V4): the value is the key tensor, rotated with it, and the layer rotates the attention output
        # back at the query's position. A pair placed at (P_q, P_k) then contributes its value at P_k rotated back at
        # P_q, as the layer treats a query at P_q and a key at P_k: the output is summed over the query position
        # arrays, each run through the layer's own code at its positions (linear after attention: rotation, o_proj).
        moves = any(not torch.equal(v[c], truth[c]["v"]) for v in vs + moved for c in range(len(truth)))
        emits = [[] for _ in q_arrays] if moves else [[]]
        for c, info in enumerate(truth):
            h = qs[0][c].shape[1]
            q_all = torch.stack([q[c] for q in qs])  # (m, b, H, n, d)
            k_all = torch.stack([_expand_kv(k[c], h) for k in ks])  # (m', b, H, nk, d)
            q_pair = q_all[q_index, bi, :, ii].permute(0, 3, 1, 2, 4)  # (b, H, n, nk, d): q_i at pair (i, j)'s position
            k_pair = k_all[k_index, bi, :, jj].permute(0, 3, 1, 2, 4)
            scaling = info["scaling"] if info["scaling"] is not None else q_all.shape[-1] ** -0.5
            s = _softcapped((q_pair.float() * k_pair.float()).sum(-1) * scaling, info["softcap"])
            gone = hidden(run.scheme, run.params, pos[:, None, :, None], key_pos[:, None, None, :])
            if gone is not None:  # StreamingLLM's evicted keys, LM-Infinite's middle ones
                s = s.masked_fill(gone, float("-inf"))
            if info["indices"] is not None:  # the keys the indexer did not choose are masked (its model's eager path)
                keep = torch.zeros(b, n, s.shape[-1], dtype=torch.bool).scatter(-1, info["indices"].long(), True)
                s = s.masked_fill(~keep[:, None], float("-inf"))
            value = _expand_kv(info["v"], h)
            if not moves:
                emits[0].append(_softmax_out(s, value, info["mask"], info["sinks"]).to(value.dtype))
                continue
            p = _probabilities(s, info["mask"], info["sinks"])
            v_all = torch.stack([_expand_kv(v[c], h) for v in vs])
            # (b, H, n, nk, dv): v_j at pair (i, j)'s position
            v_pair = v_all[k_index, bi, :, jj].permute(0, 3, 1, 2, 4)
            for t in range(len(q_arrays)):
                part = p * (q_index == t)[:, None].to(p.dtype)
                out = torch.einsum("bhij,bhijd->bhid", part.to(v_pair.dtype), v_pair)
                emits[t].append(out.transpose(1, 2).contiguous().to(value.dtype))
        run.mode = "emit"
        try:
            if not moves:
                run.emit = emits[0]
                return self._run(call, extra, None, None)
            total = None
            for t, arr in enumerate(q_arrays):
                run.emit = emits[t]
                out = self._run(call, extra, arr.to(kind), made)
                total = out if total is None else (total[0] + out[0], *total[1:])
            return total
        finally:
            run.mode = None


def _ms_poe_layer(self, call, extra, made, pos):
    """Ms-PoE (Zhang et al. 2024): the layer run at position 0 and at p/r_k for every ratio slot r_k = min + (max −
    min)·k/n (n = its KV heads); each KV head's order from the outlier scores of the last query at position 0 over the
    real keys (the share of weights above 3× the mean, averaged over the head's query heads, most first, ties in head
    order), KV head g then reads slot order[g] (the authors' `cos[head_order]`); one softmax per head."""
    run, p = _Run.current, _Run.current.params
    skip = p.get("skip_layers", 2)
    run.mode = "capture"
    if self.module.layer_idx < skip:
        arrays = [pos]
    else:
        run.captured = []
        self._run(call, extra, pos, made)
        hkv = run.captured[0]["k"].shape[1]
        lo, hi = p.get("min_ratio", 1.2), p.get("max_ratio", 1.8)
        arrays = [torch.zeros_like(pos, dtype=torch.float32)] + [pos / (lo + (hi - lo) * k / hkv) for k in range(hkv)]
    runs = []
    for arr in arrays:
        run.captured = []
        self._run(call, extra, arr, made)
        runs.append(run.captured)
    run.emit = []
    for c, info in enumerate(runs[0]):
        h, d = info["q"].shape[1], info["q"].shape[-1]
        scaling = info["scaling"] if info["scaling"] is not None else d**-0.5
        mask = info["mask"]
        if len(arrays) == 1:
            q, k = info["q"], _expand_kv(info["k"], h)
        else:
            hkv = info["k"].shape[1]
            s0 = _softcapped((info["q"][:, :, -1:] @ _expand_kv(info["k"], h).transpose(-1, -2)).float() * scaling,
                             info["softcap"])  # (b, H, 1, n)
            seen = torch.ones(s0.shape[0], s0.shape[-1], dtype=torch.bool) if mask is None else \
                mask[:, 0, -1, : s0.shape[-1]] > torch.finfo(mask.dtype).min / 2
            w = torch.softmax(s0.masked_fill(~seen[:, None, None], float("-inf")), dim=-1)[:, :, 0]
            count = seen.sum(-1, keepdim=True).float()  # (b, 1)
            share = (w > 3 / count[:, None]).sum(-1) / count  # (b, H)
            order = torch.argsort(-share.view(share.shape[0], hkv, -1).mean(-1), dim=-1, stable=True)
            slot = order.repeat_interleave(h // hkv, dim=1)  # (b, H): each query head's ratio slot
            qs = torch.stack([r[c]["q"] for r in runs[1:]])  # (n, b, H, L, d)
            ks = torch.stack([_expand_kv(r[c]["k"], h) for r in runs[1:]])
            bi, hi = torch.arange(slot.shape[0])[:, None], torch.arange(h)[None, :]
            q, k = qs[slot, bi, hi], ks[slot, bi, hi]
        s = _softcapped((q @ k.transpose(-1, -2)).float() * scaling, info["softcap"])
        value = _expand_kv(info["v"], h)
        run.emit.append(_softmax_out(s, value, mask, info["sinks"]).to(value.dtype))
    run.mode = "emit"
    try:
        return self._run(call, extra, None, None)
    finally:
        run.mode = None


_Layer._ms_poe = _ms_poe_layer


def _attention_modules(model):
    """The layers that attend with positions: a `layer_idx`, a position argument, attention through transformers'
    interface in their forward (LongCat's MLA blocks; not DeepSeek-V3.2's indexers, not linear attention)."""
    def attends(m):
        if not hasattr(m, "layer_idx"):
            return False
        params = inspect.signature(type(m).forward).parameters
        return ("position_embeddings" in params or "position_ids" in params) and \
            "attention_interface" in inspect.getsource(type(m).forward)

    found = [m for m in model.modules() if attends(m)]
    return [m for m in found if not any(c is not m and c in found for c in m.modules())]


@torch.no_grad()
def forward(model, patched, ids, scheme, params, mask=None, **kw):
    """Reference logits (b, L, vocab) of `scheme` on `model`, an unpatched model with the weights of `patched` (whose
    learned tables are read); rows that are padding are garbage (compare real tokens only). `kw` goes to the model."""
    known = (*OWN_ATTENTION, *MODEL_ATTENTION)
    if scheme not in known:  # a new scheme must say how its reference attends, not fall back to the model's own
        raise KeyError(f"the any-architecture reference knows {', '.join(known)}, not {scheme!r}: add it to "
                       "POSITIONAL, BIAS or MODEL_ATTENTION")
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    b, n = ids.shape
    pos = true_positions(mask, b, n)
    if kw.get("position_ids") is not None:  # the ids given (PoSE's gaps, packed rows): a distance is their difference
        pos = kw["position_ids"].expand(b, n).long()
    embeds = model.get_input_embeddings()(ids)
    if scheme == "sinusoidal":
        embeds = embeds + sinusoid_table(n, model.config.hidden_size, params.get("rope_theta", 10000.0))[pos]
    if scheme == "learned_absolute":
        embeds = embeds + patched.rope_patch_position_embeddings.weight[pos]
    backend = model.config._attn_implementation
    _Run.current = _Run(model, patched, scheme, params, pos)
    _Run.current.layers = _attention_modules(model)
    hooks, layers = [], []
    if scheme in POSITIONAL:
        hooks = [r.register_forward_hook(_record, with_kwargs=True) for r in _rotaries(model)]
        for m in _attention_modules(model):
            m.forward = _Layer(m)
            layers.append(m)
    else:
        hooks = [r.register_forward_hook(_identity, with_kwargs=True) for r in _rotaries(model)]
        hooks += [r.register_forward_pre_hook(_last_call, with_kwargs=True) for r in _rotaries(model)]
    try:
        if scheme in OWN_ATTENTION:
            model.set_attn_implementation(NAME)
        if scheme in ("sinusoidal", "learned_absolute"):
            return model(inputs_embeds=embeds, attention_mask=mask, **kw).logits
        # the ids themselves otherwise: some models read them beyond the embedding (Gemma 3n's per-layer inputs)
        return model(ids, attention_mask=mask, **kw).logits
    finally:
        for hook in hooks:
            hook.remove()
        for m in layers:
            del m.forward
        _Run.current = None
        model.set_attn_implementation(backend)
