"""The one filler text and the tokenizers the tiny random models use."""

from __future__ import annotations

import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CHARS = "abcdefghijklmnopqrstuvwxyzTWPRK0123456789 .?"


def filler_text(n_words: int = 3000, seed: int = 0) -> str:
    """Deterministic pseudo-words (2-7 letters, a full stop after ~10%): text a character tokenizer covers."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
             for _ in range(n_words)]
    return " ".join(w + ("." if rng.random() < 0.1 else "") for w in words)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A real PreTrainedTokenizerFast with one token per character (vocab < 97) for tiny random models."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


BOS, EOS = "<|bos|>", "<|eos|>"


def bpe_tokenizer(text: str, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (digits split, BOS prepended) trained on `text` in about a second."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, BOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([text], trainer=trainer)
    tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                      special_tokens=[(BOS, tk.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=EOS)
