"""A reference for the attention-side schemes on any architecture in `helpers.models.ARCHS`, independent of rope_patch.

`helpers.reference` writes a whole llama-layout forward in plain math. The architectures added later (q/k norms,
partial or interleaved rotary, per-layer-type RoPE, global NoPE layers, gated attention, MoE, Llama 4 temperature)
differ from it in everything around attention, which is not under test. So here the model's own code runs everything
except the position encoding:

- its rotary module is made to return the identity rotation (cos = 1, sin = 0) by a forward hook, so its attention
  layers see un-rotated queries and keys;
- for the schemes that change attention, its attention function is replaced (transformers' AttentionInterface, under a
  name of this file, with transformers' eager mask: causal, padding, sliding windows) by a materialised one that
  rotates q_i by the relative position r(i, j) against key j (`helpers.reference.relative`, DCA's
  `helpers.reference_dca.relative_matrix`), with the model's own rotary module and module-level
  `apply_rotary_pos_emb` (so partial / interleaved layouts and shipped frequencies come from the model), or adds the
  ALiBi / T5 bias of true positions, and then takes one softmax over all keys;
- sinusoidal / learned absolute tables are added to the input embeddings, which are passed as `inputs_embeds`.

Layers that use no RoPE in the model (the global layers of cohere2 and exaone4, "global NoPE") are not rotated; the
attention sinks of gpt-oss (`s_aux`) join the softmax denominator as gpt-oss's own eager function has them.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from helpers.reference import alibi_slopes, relative, sinusoid_table, t5_bucket, true_positions
from helpers.reference_dca import relative_matrix

NAME = "rope_patch_tests_reference"
RELATIVE = ("rope", "self_extend", "rerope", "leaky_rerope", "string", "dca")  # q_i rotated by r(i, j)
OWN_ATTENTION = ("alibi", "relative_bias", *RELATIVE)  # run through the reference attention (rope: its sanity check)
NOPE_LAYER_TYPES = {"cohere2": "full_attention", "exaone4": "full_attention"}  # layer types without RoPE


class _Run:
    """What the attention function needs beyond its arguments, for the one reference forward in progress."""

    current: _Run | None = None

    def __init__(self, model, patched, scheme, params, pos):
        self.model, self.patched, self.scheme, self.params, self.pos = model, patched, scheme, params, pos


def _rotary(model):
    return next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))


def _layer_type(model, module):
    types = getattr(model.config, "layer_types", None)
    return types[module.layer_idx] if types is not None else None


def _relative(scheme, params, pos):
    i, j = pos[:, :, None], pos[:, None, :]
    if scheme == "dca":
        table = relative_matrix(int(pos.max()) + 1, params["chunk_size"], params["local_size"])
        return table[pos[:, :, None], pos[:, None, :]]
    return relative(scheme, params, i, j)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    run = _Run.current
    b, h, n, d = query.shape
    groups = h // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scaling = d**-0.5 if scaling is None else scaling
    pos = run.pos
    layer_type = _layer_type(run.model, module)
    rotates = layer_type is None or NOPE_LAYER_TYPES.get(run.model.config.model_type) != layer_type
    if run.scheme in RELATIVE and rotates:
        rotary = _rotary(run.model)
        apply_rotary = vars(sys.modules[type(module).__module__])["apply_rotary_pos_emb"]
        extra = (layer_type,) if isinstance(rotary.rope_type, dict) else ()
        r = _relative(run.scheme, run.params, pos).float()  # (b, n, n)
        cos, sin = type(rotary).forward(rotary, query, r.flatten(1), *extra)  # (b, n·n, d)
        qx = query[:, :, :, None, :].expand(b, h, n, n, d).reshape(b, h, n * n, d)
        q_rot = apply_rotary(qx, qx, cos, sin)[0].view(b, h, n, n, d)  # q_i rotated by r(i, j), per key j
        # k rotated by 0: the model's cos/sin scale (YaRN's temperature) and coordinate layout, no angle
        cos0, sin0 = type(rotary).forward(rotary, key, torch.zeros_like(pos), *extra)
        k0 = apply_rotary(key, key, cos0, sin0)[1]
        s = (q_rot * k0[:, :, None]).sum(-1) * scaling
    else:
        s = query @ key.transpose(-1, -2) * scaling
        dist = (pos[:, :, None] - pos[:, None, :]).clamp(min=0)
        if run.scheme == "alibi":
            slopes = torch.tensor(alibi_slopes(h, run.params.get("max_bias", 8.0)))
            s = s - slopes[None, :, None, None] * dist[:, None].float()
        elif run.scheme == "relative_bias":
            p = run.params
            w = run.patched.rope_patch_relative_bias.weight[module.layer_idx]  # (H, buckets)
            buckets = torch.tensor([t5_bucket(t, p.get("num_buckets", 32), p.get("max_distance", 128)) for t in range(n)])
            s = s + w[:, buckets[dist]].permute(1, 0, 2, 3)
    if kwargs.get("softcap") is not None:
        s = torch.tanh(s / kwargs["softcap"]) * kwargs["softcap"]
    if attention_mask is not None:
        s = s + attention_mask[:, :, :, : key.shape[-2]]
    if kwargs.get("s_aux") is not None:  # gpt-oss sinks: a per-head logit in the denominator (a key with value 0)
        sink = kwargs["s_aux"].view(1, h, 1, 1).expand(b, h, n, 1)
        attn = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        attn = torch.softmax(s, dim=-1)
    return (attn @ value).transpose(1, 2).contiguous(), None


def _identity(module, args, out):
    if isinstance(out, torch.Tensor) and out.is_complex():  # Llama 4's freqs_cis: rotation by e^{i·0} = 1
        return torch.ones_like(out)
    cos, sin = out
    return torch.ones_like(cos), torch.zeros_like(sin)


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
    hook = _rotary(model).register_forward_hook(_identity)
    _Run.current = _Run(model, patched, scheme, params, pos)
    try:
        if scheme in OWN_ATTENTION:
            model.set_attn_implementation(NAME)
        return model(inputs_embeds=embeds, attention_mask=mask, **kw).logits
    finally:
        hook.remove()
        _Run.current = None
        model.set_attn_implementation(backend)
