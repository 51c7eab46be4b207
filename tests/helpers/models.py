"""The one tiny-model builder: random models for every architecture the tests cover, built from configs (no hub)."""

from __future__ import annotations

import copy
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
}
# Families whose config (or rotary layout) restricts the frequency schemes.
PHI3_ONLY = {"default", "longrope"}


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
