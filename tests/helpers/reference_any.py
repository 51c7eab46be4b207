"""A reference for the attention-side schemes on any architecture, independent of rope_patch.

`helpers.reference` writes a whole llama-layout forward in plain math. Other architectures differ from it in
everything around attention (q/k norms before or after RoPE, partial / interleaved / one-tensor rotary, MLA, global
NoPE layers, gated attention, sinks, per-position temperatures), so here the model's own code runs everything, and
only the positions are the reference's:

- The schemes that move positions (self_extend, rerope, leaky_rerope, string, dca; "rope" = the identity, the
  reference's sanity check): every pair (i, j) gets the query and key positions the paper gives it
  (`helpers.reference.pair_positions`, `helpers.reference_dca.pair_positions`, from the tokens' true positions). Each
  attention layer is then run by its own class forward several times with position embeddings made by its own rotary
  module at a whole array of positions (one position per token: every (token, position) that some pair needs), with a
  capturing attention function: so q and k are exactly what the layer computes at those positions — rotation, norms,
  scales and everything the layer does after RoPE included, "RoPE where the model applies it". The scores of pair
  (i, j) are q_i at its pair position · k_j at its pair position, materialised (b, H, L, L), masked with transformers'
  eager mask, one softmax (sinks and softcapping as the model has them), times the values. A last run of the layer's
  own forward (at the true positions) turns that attention output into the layer output (o_proj, output gates, norms).
- ALiBi / T5 bias: the rotary is made the identity by a forward hook (the layers then run without rotation: NoPE) and
  the bias of true positions is added in a materialised attention function.
- sinusoidal / learned absolute tables are added to the input embeddings, which are passed as `inputs_embeds`.

Nothing here uses rope_patch: not its copies, caches, attention functions or position maps.
"""

from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from helpers.reference import alibi_slopes, pair_positions, sinusoid_table, t5_bucket, true_positions
from helpers.reference_dca import pair_positions as dca_pair_positions

NAME = "rope_patch_tests_reference"
POSITIONAL = ("rope", "self_extend", "rerope", "leaky_rerope", "string", "dca")  # pairs at the papers' positions
BIAS = ("alibi", "relative_bias")
OWN_ATTENTION = (*BIAS, *POSITIONAL)


class _Run:
    """The reference forward in progress (what the attention function and the layer wrappers need)."""

    current: _Run | None = None

    def __init__(self, model, patched, scheme, params, pos):
        self.model, self.patched, self.scheme, self.params, self.pos = model, patched, scheme, params, pos
        self.made = {}  # id(position embeddings) -> (rotary module, its call args, kwargs)
        self.mode, self.captured, self.emit = None, None, None


def _rotaries(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    run = _Run.current
    if run.mode == "capture":  # a positional layer run: keep q, k, v, return nothing useful
        run.captured = dict(q=query, k=key, v=value, scaling=scaling, softcap=kwargs.get("softcap"),
                            sinks=kwargs.get("s_aux"), mask=attention_mask)
        b, h, n, _ = query.shape
        return query.new_zeros(b, n, h, value.shape[-1]), None
    if run.mode == "emit":  # the layer's last run: the reference attention output
        return run.emit, None
    return _bias_attention(module, query, key, value, attention_mask, scaling, **kwargs)


def _softmax_out(s, value, attention_mask, softcap, sinks):
    """(b, H, n, k) float scores → (b, n, H, dv): softcap, eager mask, softmax (with sinks), times the values."""
    b, h, n, _ = s.shape
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if attention_mask is not None:
        s = s + attention_mask[:, :, :, : value.shape[-2]]
    if sinks is not None:  # gpt-oss: a per-head logit in the denominator (a key with value 0)
        sink = sinks.view(1, h, 1, 1).expand(b, h, n, 1).float()
        attn = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        attn = torch.softmax(s, dim=-1)
    return (attn.to(value.dtype) @ value).transpose(1, 2).contiguous()


def _expand_kv(x, h):
    return x.repeat_interleave(h // x.shape[1], 1)


def _bias_attention(module, query, key, value, attention_mask, scaling, **kwargs):
    run = _Run.current
    b, h, n, d = query.shape
    key, value = _expand_kv(key, h), _expand_kv(value, h)
    scaling = d**-0.5 if scaling is None else scaling
    s = (query @ key.transpose(-1, -2)).float() * scaling
    pos = run.pos
    dist = (pos[:, :, None] - pos[:, None, :]).clamp(min=0)
    if run.scheme == "alibi":
        slopes = torch.tensor(alibi_slopes(h, run.params.get("max_bias", 8.0)))
        s = s - slopes[None, :, None, None] * dist[:, None].float()
    elif run.scheme == "relative_bias":
        p = run.params
        w = run.patched.rope_patch_relative_bias.weight[module.layer_idx]  # (H, buckets)
        buckets = torch.tensor([t5_bucket(t, p.get("num_buckets", 32), p.get("max_distance", 128)) for t in range(n)])
        s = s + w[:, buckets[dist]].permute(1, 0, 2, 3)
    return _softmax_out(s, value, attention_mask, kwargs.get("softcap"), kwargs.get("s_aux")), None


def _identity(module, args, out):
    if isinstance(out, torch.Tensor) and out.is_complex():  # Llama 4's freqs_cis: rotation by e^{i·0} = 1
        return torch.ones_like(out)
    cos, sin = out
    return torch.ones_like(cos), torch.zeros_like(sin)


def _record(module, args, kwargs, out):
    _Run.current.made[id(out)] = (module, args, kwargs)


def _tables(pq: torch.Tensor, valid: torch.Tensor, dim: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Position arrays P_0 … P_{m−1} (b, L) and, per pair, which array holds its position: for every token (row i of
    `pq` for queries, dim=2; column j for keys, dim=1) its distinct pair positions over the valid pairs, the t-th of
    them in P_t (the last repeated when a token has fewer)."""
    b, n, _ = pq.shape
    values = [[sorted({float(v) for v in (pq[r, t, :] if dim == 2 else pq[r, :, t])[(valid[r, t, :] if dim == 2 else valid[r, :, t])]}) or [0.0]
               for t in range(n)] for r in range(b)]
    m = max(len(v) for row in values for v in row)
    arrays = [torch.tensor([[v[min(t, len(v) - 1)] for v in row] for row in values]) for t in range(m)]
    index = torch.zeros(b, n, n, dtype=torch.long)
    for r in range(b):
        for t in range(n):
            v = values[r][t]
            line = pq[r, t, :] if dim == 2 else pq[r, :, t]
            idx = torch.tensor([v.index(float(x)) if float(x) in v else 0 for x in line])
            if dim == 2:
                index[r, t, :] = idx
            else:
                index[r, :, t] = idx
    return arrays, index


class _Layer:
    """The forward of an attention layer during a positional reference run (see the module docstring)."""

    def __init__(self, module):
        self.module = module
        self.signature = inspect.signature(type(module).forward)

    def _run(self, call: dict, extra: dict, positions: torch.Tensor | None, made):
        """The layer's own forward with every token at `positions` (None: as given)."""
        call, extra = dict(call), dict(extra)
        if positions is not None:
            if made is not None:
                rotary, args, kwargs = made
                given = inspect.signature(type(rotary).forward).bind(rotary, *args, **kwargs).arguments
                given = {**given, "position_ids": positions}
                call["position_embeddings"] = type(rotary).forward(**given)
            for where in (call, extra):
                if where.get("position_ids") is not None:
                    where["position_ids"] = positions
        for name in ("cache", "past_key_values", "layer_past"):
            for where in (call, extra):
                if name in where:
                    where[name] = None
        return type(self.module).forward(self.module, **call, **extra)

    def __call__(self, *args, **kwargs):
        run = _Run.current
        bound = self.signature.bind(self.module, *args, **kwargs)
        call = dict(bound.arguments)
        call.pop("self")
        extra = call.pop("kwargs", {}) if "kwargs" in self.signature.parameters else {}
        made = run.made.get(id(call.get("position_embeddings")))
        pos = run.pos
        b, n = pos.shape
        if run.scheme == "dca":
            p = run.params
            pq_table, pk_table = dca_pair_positions(int(pos.max()) + 1, p["chunk_size"], p["local_size"])
            pq, pk = pq_table[pos[:, :, None], pos[:, None, :]], pk_table[pos[:, :, None], pos[:, None, :]]
        else:
            pq, pk = pair_positions(run.scheme, run.params, pos[:, :, None], pos[:, None, :])
        slot = torch.arange(n)
        valid = (slot[:, None] >= slot[None, :]).expand(b, n, n)  # causal pairs; the mask handles the rest
        q_arrays, q_index = _tables(pq, valid, dim=2)
        k_arrays, k_index = _tables(pk, valid, dim=1)
        run.mode = "capture"
        qs, ks = [], []
        for arr in q_arrays:
            self._run(call, extra, arr.to(pq.dtype if run.scheme == "leaky_rerope" else torch.long), made)
            qs.append(run.captured["q"])
        info = None
        for arr in k_arrays:
            self._run(call, extra, arr.to(pk.dtype if run.scheme == "leaky_rerope" else torch.long), made)
            ks.append(run.captured["k"])
            info = run.captured
        h = qs[0].shape[1]
        q_all = torch.stack(qs)  # (m, b, H, n, d)
        k_all = torch.stack([_expand_kv(k, h) for k in ks])  # (m', b, H, n, d)
        bi = torch.arange(b)[:, None, None]
        ii, jj = slot[None, :, None], slot[None, None, :]
        q_pair = q_all[q_index, bi, :, ii].permute(0, 3, 1, 2, 4)  # (b, H, n, n, d): q_i at pair (i, j)'s position
        k_pair = k_all[k_index, bi, :, jj].permute(0, 3, 1, 2, 4)
        scaling = info["scaling"] if info["scaling"] is not None else qs[0].shape[-1] ** -0.5
        s = (q_pair.float() * k_pair.float()).sum(-1) * scaling
        value = _expand_kv(info["v"], h)
        run.emit = _softmax_out(s, value, info["mask"], info["softcap"], info["sinks"]).to(value.dtype)
        run.mode = "emit"
        try:
            return self._run(call, extra, None, None)
        finally:
            run.mode = None


def _attention_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


@torch.no_grad()
def forward(model, patched, ids, scheme, params, mask=None, **kw):
    """Reference logits (b, L, vocab) of `scheme` on `model`, an unpatched model with the weights of `patched` (whose
    learned tables are read); rows that are padding are garbage (compare real tokens only). `kw` goes to the model."""
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    b, n = ids.shape
    pos = true_positions(mask, b, n)
    embeds = model.get_input_embeddings()(ids)
    if scheme == "sinusoidal":
        embeds = embeds + sinusoid_table(n, model.config.hidden_size, params.get("rope_theta", 10000.0))[pos]
    if scheme == "learned_absolute":
        embeds = embeds + patched.rope_patch_position_embeddings.weight[pos]
    backend = model.config._attn_implementation
    _Run.current = _Run(model, patched, scheme, params, pos)
    hooks, layers = [], []
    if scheme in POSITIONAL:
        hooks = [r.register_forward_hook(_record, with_kwargs=True) for r in _rotaries(model)]
        for m in _attention_modules(model):
            m.forward = _Layer(m)
            layers.append(m)
    else:
        hooks = [r.register_forward_hook(_identity) for r in _rotaries(model)]
    try:
        if scheme in OWN_ATTENTION:
            model.set_attn_implementation(NAME)
        return model(inputs_embeds=embeds, attention_mask=mask, **kw).logits
    finally:
        for hook in hooks:
            hook.remove()
        for m in layers:
            del m.forward
        _Run.current = None
        model.set_attn_implementation(backend)
