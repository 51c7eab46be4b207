"""No position encoding, and additive absolute encodings in place of RoPE.

All three only remove the rotation (and add a vector to the input embeddings); attention itself is untouched, so
the model keeps its own backend (eager, sdpa, flex, flash) and any KV cache works.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import validation as check
from ..registry import register_scheme
from .base import UNBOUNDED
from .common import AttentionScheme, cache_arg, decoder, execution_device, sinusoid, table_dtype

MODULE_NAME = "rope_patch_position_embeddings"  # attribute under which learned_absolute attaches its table


@register_scheme
@dataclasses.dataclass(frozen=True)
class NoPE(AttentionScheme):
    """NoPE (Haviv et al. 2022, "Transformer Language Models without Positional Encodings Still Learn Positional
    Information", arXiv:2203.16634; Kazemnejad et al. 2023, arXiv:2305.19466): no position encoding at all; the
    causal mask alone carries order. score(i, j) = q_i·k_j / √d."""

    name = "nope"
    aliases = ("none", "no_pe", "no_position_encoding")

    def served_length(self, window):
        return UNBOUNDED  # no position enters the scores


def token_positions(kwargs: dict, n: int, device) -> torch.Tensor:
    """True positions (b|1, n) of the tokens of one forward: `position_ids` when given (generate passes
    attention_mask.cumsum − 1), else from a 2-D attention mask (left padding: the first real token is 0), else the
    cache length onwards, as the decoder itself counts."""
    pos = kwargs.get("position_ids")
    if pos is not None:
        return pos
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -n:].to(device)
    cache = cache_arg(kwargs)
    past = cache.get_seq_length() if cache is not None else 0
    return torch.arange(past, past + n, device=device)[None]


class EmbeddingHook:
    """Forward pre-hook on the decoder that adds pe(position) to the input embeddings: it embeds the ids itself and
    passes `inputs_embeds` + pe on (so user-given inputs_embeds get it too). `encode(positions (b|1, n), embeds
    (b, n, hidden)) -> (b|1, n, hidden)`."""

    def __init__(self, encode):
        self.encode = encode

    def __call__(self, module, args, kwargs):
        kwargs = dict(kwargs)
        ids = kwargs.pop("input_ids", None)
        if args:
            ids, args = args[0], args[1:]
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            embeds = module.get_input_embeddings()(ids)
        positions = token_positions(kwargs, embeds.shape[1], embeds.device)
        kwargs["inputs_embeds"] = embeds + self.encode(positions, embeds).to(embeds.dtype)
        return args, kwargs


class SinusoidalEncoding:
    def __init__(self, theta: float):
        self.theta = theta

    def __call__(self, positions, like):
        return sinusoid(positions, like.shape[-1], self.theta)


class TableEncoding:
    """Looks the table up on its owner at call time: peft's modules_to_save may have wrapped it since."""

    def __init__(self, owner: nn.Module, size: int):
        self.owner, self.size = owner, size

    def __call__(self, positions, like):
        top = int(positions.max()) if positions.numel() else 0
        if top >= self.size:
            raise ValueError(
                f"learned_absolute: position {top} is beyond the table (max_position_embeddings={self.size}). "
                f"Re-apply with a larger table: learned_absolute:max_position_embeddings={top + 1} (a spec), or "
                f"rope_patch.apply(model, 'learned_absolute', max_position_embeddings={top + 1})."
            )
        table = getattr(self.owner, MODULE_NAME)
        return table(positions.clamp(min=0).to(execution_device(table))).to(like.device)


@register_scheme
@dataclasses.dataclass(frozen=True)
class Sinusoidal(AttentionScheme):
    """Sinusoidal absolute encoding (Vaswani et al. 2017, "Attention Is All You Need", arXiv:1706.03762, §3.5):
    PE(pos, 2t) = sin(pos / θ^(2t/d_model)), PE(pos, 2t+1) = cos(pos / θ^(2t/d_model)), θ = `rope_theta` (10000),
    added to the input embeddings; no rotation. Computed from the positions on the fly: no length limit."""

    name = "sinusoidal"
    aliases = ("sinusoid", "absolute", "vaswani")
    rope_theta: float = 10000.0

    def __post_init__(self):
        self._set("rope_theta", check.rope_theta(self.name, self.rope_theta))

    def served_length(self, window):
        return UNBOUNDED  # computed from the position, no table to run out of

    def build(self, target):
        hook = EmbeddingHook(SinusoidalEncoding(self.rope_theta))
        return None, lambda log: log.add_hook(decoder(target.model), hook, with_kwargs=True)


@register_scheme
@dataclasses.dataclass(frozen=True)
class LearnedAbsolute(AttentionScheme):
    """Learned absolute position embeddings (GPT/BERT style; Gehring et al. 2017, arXiv:1705.03122): a trainable
    table P[pos] (nn.Embedding(`max_position_embeddings`, hidden), default the model's window) added to the input
    embeddings, initialised with the sinusoidal table of Vaswani et al. 2017 (θ = 10000) so the untrained patch is
    `sinusoidal`. Attached as the module `rope_patch_position_embeddings` (optimizers, peft modules_to_save,
    state_dict see it); `remove` detaches it."""

    name = "learned_absolute"
    aliases = ("learned", "learned_position_embeddings", "absolute_learned")
    max_position_embeddings: int | None = None

    def __post_init__(self):
        if self.max_position_embeddings is not None:
            self._set("max_position_embeddings", check.integer(
                self.name, "max_position_embeddings", self.max_position_embeddings, ge=1, le=check.TABLE_ROWS_MAX,
                hint="It is the number of rows of the learned table, the longest sequence it covers (default: the "
                     "model's max_position_embeddings)."))

    def resolve(self, target):
        if self.max_position_embeddings is None:
            return self.replace(max_position_embeddings=target.pretraining_window)
        return self

    def served_length(self, window):
        return self.max_position_embeddings  # the table's rows: a position past them has no embedding

    def longest_input(self):
        return self.max_position_embeddings

    def build(self, target):
        if hasattr(target.model, MODULE_NAME):
            raise ValueError(f"{self.name}: the model already has an attribute {MODULE_NAME!r}.")
        hidden = target.config.hidden_size
        check.check_table_memory(self.name, "max_position_embeddings", self.max_position_embeddings, hidden,
                                 torch.float32)
        init = sinusoid(torch.arange(self.max_position_embeddings), hidden, 10000.0)
        # where the input embeddings it is added to are made (accelerate's execution device under offloading)
        device = execution_device(target.model.get_input_embeddings())
        # _weight= skips nn.Embedding's random init: applying a patch must not consume the global RNG
        table = nn.Embedding(self.max_position_embeddings, hidden,
                             _weight=init.to(device=device, dtype=table_dtype(target.model)))
        hook = EmbeddingHook(TableEncoding(target.model, self.max_position_embeddings))

        def attach(log):
            log.add_module(target.model, MODULE_NAME, table)
            log.add_hook(decoder(target.model), hook, with_kwargs=True)

        return None, attach
