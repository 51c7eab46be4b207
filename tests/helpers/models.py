"""The one tiny-model builder: random models for every architecture the tests cover, built from configs (no hub)."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

WINDOW = 32  # max_position_embeddings of the tiny models; tests run past it
VOCAB = 97

_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Per-architecture overrides: head_dim 16 everywhere so schemes have several pairs to differ on.
ARCHS = {
    "llama": {},
    "mistral": {},
    "mixtral": dict(head_dim=16, num_local_experts=2, num_experts_per_tok=1),
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16, sliding_window=8),
    "olmo2": {},
    "granite": {},
    "starcoder2": {},
    "smollm3": {},
    "phi3": {},
    "phi": {},
    "stablelm": {},
    "gpt_neox": dict(num_key_value_heads=None),
    "cohere": {},
    "glm": dict(head_dim=16),
    # Checkpoints that ship a scaling: window 4·L with the scaling from L = WINDOW, as their configs have it
    # (gpt-oss: yarn ×32 from 4096; DeepSeek-V3: yarn ×40 with mscale/mscale_all_dim 1; Ministral 3: yarn ×16 plus
    # Llama 4's attention temperature), so factors stay relative to WINDOW.
    "gpt_oss": dict(head_dim=16, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4 * WINDOW,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=WINDOW,
                                         beta_fast=32.0, beta_slow=1.0, truncate=False, rope_theta=150000.0)),
    # MLA: rope on qk_rope_head_dim = 16 of the 32 query/key coordinates (config.head_dim = qk_rope_head_dim); no GQA
    "deepseek_v3": dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=2, num_experts_per_tok=1, n_group=1,
                        topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32, max_position_embeddings=4 * WINDOW,
                        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=WINDOW,
                                             mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0,
                                             rope_theta=10000.0)),
    "ministral3": dict(head_dim=16, max_position_embeddings=4 * WINDOW,
                       rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=WINDOW,
                                            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                            llama_4_scaling_beta=0.1, rope_theta=1e6)),
    # hybrid: a gated-delta-net (linear attention) layer, then a full-attention layer rotating 1/4 of each head
    "qwen3_next": dict(head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
                       linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
    # sliding RoPE layers + global layers without any position encoding (cohere2, exaone4); olmo3: one RoPE per type
    "cohere2": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "exaone4": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "olmo3": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "ministral": dict(head_dim=16),
    "seed_oss": dict(head_dim=16),
    "ernie4_5": dict(head_dim=16),
    "falcon": dict(num_kv_heads=2, new_decoder_architecture=True, alibi=False, ffn_hidden_size=96),
    "nemotron": dict(head_dim=16),  # partial rotary 0.5
    "granitemoe": dict(num_local_experts=2, num_experts_per_tok=1),
    "glm4": dict(head_dim=16),  # partial rotary 0.5, interleaved pairs
    # complex `freqs_cis` rotary; layer 0 rotates, layer 1 is NoPE (no_rope_layer_interval 2); the rotating layers
    # attend in chunks of 16 (chunked attention); temperature tuning off (schemes/test_logn.py covers it)
    "llama4_text": dict(head_dim=16, intermediate_size_mlp=96, num_local_experts=2, num_experts_per_tok=1,
                        no_rope_layer_interval=2, attention_chunk_size=16, attn_temperature_tuning=False),
}
# Families whose config (or rotary layout) restricts the frequency schemes.
PHI3_ONLY = {"default", "longrope"}
# rotary_dim < head_dim: the config's partial_rotary_factor slices the head (longrope lists are rotary_dim/2 long,
# p_rope is refused)
PARTIAL = {"phi", "stablelm", "gpt_neox", "glm", "qwen3_next", "nemotron", "glm4"}


def tiny_config(arch: str = "llama", **overrides):
    kw = {**_BASE, **ARCHS[arch], **overrides}
    kw = {k: v for k, v in kw.items() if v is not None}
    return AutoConfig.for_model(arch, **kw)


def tiny_model(arch: str = "llama", seed: int = 0, attn_implementation: str = "eager", **overrides):
    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation).eval()


def saved_model(path: Path, tokenizer=None, **kw) -> Path:
    """`tiny_model(**kw)` (and `tokenizer`) written with save_pretrained: the `from_pretrained(local_dir)` path."""
    tiny_model(**kw).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def native_twin(model, rope_parameters: dict, max_position_embeddings: int):
    """A model built natively by transformers with this RoPE config and the same weights."""
    cfg = copy.deepcopy(model.config)
    cfg.rope_parameters = copy.deepcopy(rope_parameters)
    cfg.max_position_embeddings = max_position_embeddings
    twin = type(model)(cfg).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def token_batch(n: int, seed: int = 0, pad: int = 0):
    """Two rows of n random tokens; with `pad`, row 0 is left-padded by `pad` tokens and the kwargs carry the
    attention mask and the position ids that generate passes (pads at position 1)."""
    ids = torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))
    if not pad:
        return ids, {}
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)}


def roundtrip(model, how: str):
    """An independent copy of `model` by `how`: "deepcopy", "pickle" or "torch.save" (through a buffer)."""
    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)
