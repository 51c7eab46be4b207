"""The one tiny-model builder: random models for every architecture the tests cover, built from configs (no hub)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import io
import pickle
import re
from pathlib import Path

import torch
import transformers
from packaging.version import Version
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
                        topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32,
                        max_position_embeddings=4 * WINDOW,
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
                       linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16),
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
    """The tiny config of a key of ARCHS or, for any other folder of `rope_folders()`, `folder_config(arch)`."""
    if arch not in ARCHS:
        return folder_config(arch, **overrides)
    kw = {**_BASE, **ARCHS[arch], **overrides}
    kw = {k: v for k, v in kw.items() if v is not None}
    return AutoConfig.for_model(arch, **kw)


def tiny_model(arch: str = "llama", seed: int = 0, attn_implementation: str = "eager", perturbed: bool | None = None,
               **overrides):
    """A random tiny model of a key of ARCHS (as always) or of any folder of `rope_folders()` (its own causal LM).
    `perturbed` adds `perturb(model, seed)`'s noise to the parameters initialised to a constant; by default only the
    folders outside ARCHS get it (ARCHS' weights stay what they were)."""
    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    if arch in ARCHS:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation).eval()
    else:
        model = causal_lm_class(arch)._from_config(cfg, attn_implementation=attn_implementation).eval()
    if perturbed if perturbed is not None else arch not in ARCHS:
        perturb(model, seed)
    return model


def tiny_hybrid(**overrides):
    """A tiny Gemma 3 as the long-input paths meet it: one sliding layer (window 8) and one global layer, sdpa."""
    kw = dict(initializer_range=0.1, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
              sliding_window=8)
    return tiny_model("gemma3_text", attn_implementation="sdpa", **{**kw, **overrides})


def record_implementations(monkeypatch, model) -> list[str]:
    """The list each forward of `model`'s decoder class (every path: generate, logits, chunked loss) appends the
    model's attention implementation to, from now on."""
    seen: list[str] = []
    decoder = type(model.get_decoder())
    forward = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda m, *a, **k: seen.append(model.config._attn_implementation)
                        or forward(m, *a, **k))
    return seen


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


# ---------------------------------------------------------------------------------------------------------------------
# Every RoPE folder of the installed transformers
# ---------------------------------------------------------------------------------------------------------------------
# `rope_folders()` lists the folders of transformers/models whose modeling file defines a `*RotaryEmbedding` and a
# `*ForCausalLM` class, read from the installed package (a new release shows up by itself). `tiny_model(folder)` builds
# the folder's own causal LM (the text decoder of a multimodal folder) from its `config_class`:
#   1. SMALL's size for every key that is a field of the config (directly or through its attribute_map), recursively
#      for the sub-configs; multi-head latent attention gets as many KV heads as query heads;
#   2. every kind of layer of the default config (each value of the LAYER_KIND_KEYS lists: sliding/full/linear/indexed
#      attention, dense/sparse MLP, NoPE layers, ...) at least once: the config's own pattern for that many layers if
#      it has them all, else the kinds in their order of first appearance, cycled;
#   3. the folder's row of FOLDER_OVERRIDES, then the caller's overrides;
# with initializer_range 0.1 and `perturb`'s noise, so that positions visibly move the logits and operations after
# RoPE (q/k norms, per-channel scales) are not the identity. Folders that are also ARCHS keys keep ARCHS' model.
# tests/test_tiny_models.py runs every folder (forward, left padding, positions, generate) and tables what
# transformers itself cannot do.

MODELS_DIR = Path(transformers.__file__).parent / "models"

SMALL = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=VOCAB, max_position_embeddings=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    initializer_range=0.1,  # larger than the usual 0.02, so that positions visibly move the logits
    # mixture of experts: 2 experts, 1 per token, one shared expert, one group
    num_experts=2, num_local_experts=2, n_routed_experts=2, moe_num_experts=2, num_experts_per_tok=1, moe_topk=1,
    top_k_experts=1, num_experts_per_token=1, moe_k=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    shared_intermediate_size=32, shared_experts_intermediate_size=32, expert_ffn_hidden_size=32, n_shared_experts=1,
    num_shared_experts=1, moe_num_shared_experts=1, n_group=1, topk_group=1, num_expert_group=1, zero_expert_num=1,
    # multi-head latent attention
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, qk_head_dim=32,
    # sparse-attention indexers
    index_n_heads=2, index_head_dim=16, index_topk=8,
    # linear attention / state-space layers
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_heads=2, linear_head_dim=16, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=1,
    mamba_chunk_size=16, mamba_expand=2, mamba_d_ssm=128,
    # per-layer input embeddings (Gemma 3n / 4) and LAuReL blocks
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, laurel_rank=16,
    # windows and chunks shorter than the 40-token test input
    sliding_window=8, attention_chunk_size=16, attention_window_size=8,
    # GPT-J / CodeGen names
    n_embd=64, n_layer=2, n_head=4, n_inner=96, n_positions=WINDOW, n_ctx=WINDOW,
)
# Per-layer lists whose every kind (of the default config) must appear in the tiny model.
LAYER_KIND_KEYS = ("layer_types", "mlp_layer_types", "indexer_types", "no_rope_layers", "layers_block_type")

# RoPE folders (`rope_folders()`) that a release after the oldest supported one (5.19, pyproject.toml) adds -> that
# release. On an older release they are absent: not collected (skipped, not failed), and their rows in the tables of
# the tests stay out of its checks. codegen and gptj are folders of 5.19 already, RoPE folders from 5.24 (their sin/cos
# table became a `*RotaryEmbedding` module). Read from the releases' wheels (`pip download --no-deps transformers==X`).
NEWER_FOLDERS = {
    **dict.fromkeys(["bailing_hybrid", "kolibri1"], "5.20"),
    **dict.fromkeys(["beam", "flint"], "5.21"),
    **dict.fromkeys(["dots3_note", "inkling2", "lfm3"], "5.23"),
    **dict.fromkeys(["apertus1p5", "codegen", "dory", "gptj", "lara_mini"], "5.24"),
    **dict.fromkeys(["ergo", "kolibri1_1", "minicpm5_moe"], "5.25"),
}


def absent_folders() -> set[str]:
    """NEWER_FOLDERS' folders that the installed transformers does not have yet (their rows are allowed anyway)."""
    installed = Version(transformers.__version__)
    return {f for f, release in NEWER_FOLDERS.items() if installed < Version(release)}


# folder -> config overrides where SMALL alone does not build, runs too little of the architecture, or stays large;
# one comment per row says why (the sizes follow SMALL's)
FOLDER_OVERRIDES: dict[str, dict] = {
    # all-Mamba unless attention layers are named: one Mamba layer, then an attention layer
    "bamba": dict(attn_layer_indices=[1]),
    # byte-level: hash n-gram embeddings (500002 buckets per function), a 512-byte local window, and the local
    # encoder/decoder's view of the global width (2048)
    "blt": dict(encoder_hash_byte_group_vocab=64, local_attention_window_len=8,
                encoder_config=dict(hidden_size_global=64), decoder_config=dict(hidden_size_global=64)),
    # the rotary is a sin/cos table of max_position_embeddings rows indexed by position (nothing past it runs), and
    # it rotates the first rotary_dim coordinates of each head (64 by default, wider than the head)
    "codegen": dict(max_position_embeddings=4 * WINDOW, rotary_dim=8),
    "gptj": dict(max_position_embeddings=4 * WINDOW, rotary_dim=8),
    # RoPE parameters per layer type with no default (a None entry is a NoPE layer type): sliding layers with M-RoPE
    # (sections 4/2/2 of the 8 frequencies), global layers without position encoding, as in Cohere2
    "cohere_compass": dict(layer_types=["sliding_attention", "full_attention"], rope_parameters={
        "sliding_attention": dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2]),
        "full_attention": None}),
    # the depth decoder's position i reads codebook i (num_codebooks × vocab embeddings): 48 codebooks so that 40
    # tokens and 4 generated ones fit; its input embeddings are backbone-sized (2048 by default)
    "csm": dict(num_codebooks=48, backbone_hidden_size=64),
    # two transformers bugs: DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig no longer defines
    # (given as an extra key), and hands clip_qkv (default None) to clamp (8, as in DBRX's checkpoints); 2 KV heads
    # and small experts live in the sub-configs
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, kv_n_heads=2, clip_qkv=8.0), ffn_config=dict(ffn_hidden_size=32)),
    # low-rank grouped output projection (8 groups of rank 1024) and the two compression rates (4 and 128 tokens per
    # entry): 4 and 8, so that 40 tokens compress to 10 and 5 entries and the indexer's top-8 selects among them
    "deepseek_v4": dict(o_groups=2, o_lora_rank=16,
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}),
    # one input, one recurrent (looped) and one output layer (8 + 20 + 8 by default)
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),
    # the sliding layers' MLA sizes are swa_* keyword arguments (64 heads of 256 by default); head_dim = nope + rope
    "dots3_note": dict(head_dim=32, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16,
                       swa_kv_lora_rank=16, swa_head_dim=32, swa_qk_nope_head_dim=16, swa_v_head_dim=16),
    # the first two layers are dense MLPs by default (mlp_only_layers): layer 1 is a mixture of experts here
    "flint": dict(mlp_only_layers=[0]),
    # KV sharing: the last num_kv_shared_layers layers reuse the KV of the last earlier layer of their type, so one
    # producing and one consuming layer of each type (sliding, full); gemma4's global layers are wider (global_head_dim,
    # 512 by default)
    "gemma3n": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                    num_kv_shared_layers=2),
    "gemma4": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                   global_head_dim=32),
    "gemma4_unified": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                           num_kv_shared_layers=2, global_head_dim=32),
    # all-Mamba by default, and RoPE off (position_embedding_type None): a Mamba layer, then a RoPE attention layer
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], position_embedding_type="rope"),
    # the text decoder has no RoPE: a learned relative-position bias over rel_extent tokens (1024 by default) and
    # query/bias scaling by log(position / log_scaling_n_floor) past 128000 tokens, both 16 so that 40 tokens reach
    # past them; a head-sized unpadded vocabulary; sizes of its own for the sliding-window layers
    "inkling2": dict(unpadded_vocab_size=VOCAB, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                     rel_extent=16, log_scaling_n_floor=16),
    # conv + attention hybrids whose default is all attention layers (lfm2) or no layer_types at all (lfm2_moe)
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # LongcatFlashExperts squeezes the top-k axis of its expert mask, which breaks with 1 expert per token; each
    # layer holds two attention blocks (num_hidden_layers = 2 × num_layers, the field)
    "longcat_flash": dict(num_experts_per_tok=2, num_layers=1),
    # a cross-attention layer (to the image; skipped on text) between two self-attention layers
    "mllama": dict(num_hidden_layers=3, cross_attention_layers=[1]),
    # the sliding window is local_attention / 2 (64 by default)
    "modernbert_decoder": dict(local_attention=16),
    # the config needs its audio codec's config (for the audio vocabulary); the text decoder's MLP is ffn_dim / 2 wide
    "moshi": dict(audio_encoder_config={"model_type": "mimi"}, ffn_dim=192),
    # the causal LM embeds audio and images too: a 1-block audio encoder with 64 channels (24 blocks of 1024)
    # as Phi-3.5-MoE ships: LongRoPE (here 4× of a 8-token pre-training window) with the cos/sin scales its rotary
    # reads from rope_parameters beside any scaling type (short_mscale / long_mscale: its config requires them)
    "phimoe": dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, factor=4.0,
                                        original_max_position_embeddings=WINDOW // 4, short_factor=[1.0] * 8,
                                        long_factor=[1.0 + i / 2 for i in range(8)], short_mscale=1.1,
                                        long_mscale=1.2)),
    # (transformers 5.25) a 32768-wide first dense MLP; global attention every 4th layer: every 2nd, so two layers
    # hold both kinds
    "ergo": dict(first_dense_intermediate_size=96, global_attention_every_n_layers=2),
    # (transformers 5.25) its indexer's heads are bounded by the query heads per key head (2 of SMALL's); a 3584-wide
    # dense MLP
    "kolibri1_1": dict(index_num_heads=2, mlp_only_intermediate_size=96),
    "phi4_multimodal": dict(audio_config=dict(num_blocks=1, ext_pw_out_channel=64, depthwise_separable_out_channel=64,
                                              nemo_conv_channels=64)),
    # the indexed-attention layers build the QSA token indexer, whose sizes default to None: a budget of 8 tokens in
    # blocks of 4; hyper-connection rank 16 (320 by default)
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                      indexer_compress_ratio=4, hc_lowrank=16),
    # block_types is a cycle (recurrent, recurrent, attention) cut to the layer count: 2 layers would be recurrent only
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    # RoPE in the shared attention blocks is off by default (use_mem_rope); Mamba chunks of 16 (256)
    "zamba2": dict(use_mem_rope=True, chunk_size=16),
}


@functools.cache
def rope_folders() -> dict[str, tuple[str, str]]:
    """folder -> (modeling module, `*ForCausalLM` class name) for every folder of the installed transformers whose
    modeling file defines a `*RotaryEmbedding` class and a `*ForCausalLM` class (the shortest name if several)."""
    out = {}
    for path in sorted(MODELS_DIR.glob("*/modeling_*.py")):
        src = path.read_text()
        lms = re.findall(r"^class (\w*ForCausalLM)\b", src, re.M)
        if lms and re.search(r"^class \w*RotaryEmbedding", src, re.M):
            out[path.parent.name] = (path.stem, min(lms, key=len))
    return out


def causal_lm_class(folder: str):
    """The folder's own causal LM: for composite (multimodal, audio) folders, the text decoder's class."""
    module, name = rope_folders()[folder]
    return getattr(importlib.import_module(f"transformers.models.{folder}.{module}"), name)


def _fields(config_class) -> set[str]:
    return {f.name for f in dataclasses.fields(config_class)}


def _kinds(config) -> dict[str, list]:
    """The distinct values, in order of first appearance, of each per-layer list of LAYER_KIND_KEYS in `config`."""
    out = {}
    for key in LAYER_KIND_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, list | tuple) and value:
            out[key] = list(dict.fromkeys(value))
    return out


def _tiny_kwargs(config_class, extra: dict) -> dict:
    """SMALL's sizes for the keys `config_class` has, then `extra` (recursively for the sub-configs, as dicts); with
    as many layers as the default config has kinds of layers in a per-layer list, every kind present."""
    default = config_class()
    fields = _fields(config_class)

    def field(key):  # the field a key sets: itself, or what attribute_map redirects it to
        return key if key in fields else config_class.attribute_map.get(key, key)

    # keys that are not fields are derived in __post_init__ (or set after it): left to the config
    kw = {field(k): v for k, v in SMALL.items() if field(k) in fields}
    extra = {field(k): v for k, v in extra.items()}
    if "kv_lora_rank" in fields and "num_key_value_heads" in kw:
        # multi-head latent attention: the keys are expanded to every query head (no GQA)
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    for name, sub in config_class.sub_configs.items():
        if inspect.isclass(sub) and sub is not AutoConfig and getattr(default, name, None) is not None:
            kw[name] = _tiny_kwargs(sub, extra.get(name, {}))
    kw.update({k: v for k, v in extra.items() if k not in kw or not isinstance(kw[k], dict)})
    kinds = {k: v for k, v in _kinds(default).items() if k in fields and k not in extra}
    if kinds and "num_hidden_layers" in kw:
        if "num_hidden_layers" not in extra:
            kw["num_hidden_layers"] = max(kw["num_hidden_layers"], *map(len, kinds.values()))
        n = kw["num_hidden_layers"]
        try:  # the config's own pattern for n layers, when it has every kind
            natural = _kinds(config_class(**kw))
        except Exception:  # e.g. a default list of the wrong length for n layers: the explicit one below
            natural = {}
        for key, want in kinds.items():
            if not set(want) <= set(natural.get(key, ())):
                kw[key] = [want[i % len(want)] for i in range(n)]
    return kw


def folder_config(folder: str, **overrides):
    """The tiny config of a folder of `rope_folders()`: SMALL's sizes, FOLDER_OVERRIDES[folder] and `overrides` on
    top (sub-config overrides as dicts)."""
    config_class = causal_lm_class(folder).config_class
    extra = {**FOLDER_OVERRIDES.get(folder, {}), **overrides}
    return config_class(**_tiny_kwargs(config_class, extra))


def perturb(model, seed: int = 0, std: float = 0.2):
    """Add N(0, std) noise to every parameter that an initialiser sets to a constant: norm weights, biases, and any
    other scalar or per-channel parameter holding one value (query scales, gates, ...). Then operations after RoPE
    (q/k norms, per-channel scales) are not the identity. In place; returns the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().flatten()
            constant = flat.numel() <= 1 or bool((flat == flat[0]).all())
            if constant or "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * std)
    return model


# ---- what transformers itself cannot do with a folder (tests/test_tiny_models.py checks each row still holds) -------
# folder -> extra arguments of forward and generate
INPUTS = {
    # BltModel builds DynamicCache(config=BltConfig), and BltConfig has no num_hidden_layers: with the default cache
    # (use_cache=True) neither forward nor generate runs (test_default_cache_fails)
    "blt": dict(use_cache=False),
}
# folder -> extra arguments of generate
GENERATE_INPUTS = {
    # the depth decoder is driven by CsmForConditionalGeneration, which passes the backbone's last hidden state;
    # generate without it raises KeyError (test_generate_needs_its_inputs)
    "csm": lambda: dict(backbone_last_hidden_state=torch.zeros(2, 64)),
}
# folder -> why position_ids do not reach the position encoding
POSITION_IDS_IGNORED = {
    "csm": "the depth decoder numbers its positions itself (position i is codebook i) and warns that position_ids are "
           "ignored",
}
# folder -> why a left-padded row does not get the logits it gets alone
PADDING_INEXACT = {
    **dict.fromkeys(
        ["axk2", "deepseek_v32", "dots3_note", "glm_moe_dsa", "hy_v4"],
        "DeepSeek sparse attention: the indexer keeps the top index_topk keys by a sum of ReLU scores, which ties at "
        "exactly 0 in a random model, and ties go by key index, which the padding shifts (exact with index_topk ≥ 40)"),
    "deepseek_v4": "keys are compressed in blocks of compress_rate tokens counted from the first token of the row, "
                   "pads included, so padding moves the block boundaries (and pads are compressed into the first "
                   "entries)",
    "recurrent_gemma": "the recurrent blocks' causal conv1d reads the pads before the first real token",
    "blt": "the patch-level (global) transformer runs with no attention mask and numbers the patches from the row's "
           "first byte, pads included, and the patcher cuts patches over the pads too",
    "csm": "each position has its own codebook head and embedding offset (codebook i), so a shifted row is another "
           "input",
}
