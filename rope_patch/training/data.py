"""Datasets for transformers' Trainer: documents packed into fixed-length rows or sampled as windows of a token
stream, and the sample index on every example.

The collators of this package draw per sample from (seed, index) (`seeding.py`), so each example must carry its
index in the dataset: `PackedDataset` rows do; wrap any other map-style dataset (a torch `Dataset`, a `datasets`
table) in `IndexedDataset`, or add the column yourself (`ds.map(lambda ex, i: {"index": i}, with_indices=True)`).
Trainer drops the columns its model's `forward` does not take before the collator sees them: set
`TrainingArguments(remove_unused_columns=False)`, or the collators raise an error that says so.

Packing is a dataset, not a collator: a collator sees one batch of documents and cannot cut the whole corpus into
rows of exactly `seq_len` tokens without dropping or padding, and Trainer needs the number of rows up front
(epochs, `max_steps`, skipping on resume). `PackedDataset` is deterministic (no random draw), so a resume sees the
same rows; Trainer's sampler shuffles them.

`TextWindows` is the other common sampling (the old recipe loop, most long-context fine-tunes): `num_samples`
windows at offsets drawn from (seed, sample index). Its indices never repeat within a run, so neither do the
collators' per-index draws; over packed rows, a second epoch replays every passkey row and PoSE skip of the first
(the same index, the same draw), which halves what a multi-epoch fine-tune sees of them.

`training_samples` picks one of the two for a run and cuts it to whole global batches (the same samples per step
for any process count). `token_stream(texts, tokenizer, cache_dir, ...)` tokenises documents once into that stream and
caches it on disk under a hash of what it is made of (the source files' names and bytes, other source facts, the
tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from .seeding import as_index, sample_rng

INDEX = "index"


class IndexedDataset(Dataset):
    """`dataset[i]` (a mapping, e.g. {"input_ids": [...]}) with `"index": i` added; length and items otherwise as
    they are. Works for torch map-style datasets and `datasets.Dataset`."""

    def __init__(self, dataset, key: str = INDEX):
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(f"IndexedDataset needs a map-style dataset (with __getitem__ and __len__), got "
                            f"{type(dataset).__name__}: an iterable dataset has no stable sample index to seed from.")
        self.dataset, self.key = dataset, key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        example = self.dataset[i]
        if not isinstance(example, Mapping):
            raise TypeError(f"IndexedDataset: item {i} is a {type(example).__name__}, expected a mapping such as "
                            '{"input_ids": [...]}.')
        if self.key in example and example[self.key] != i:
            raise ValueError(f"IndexedDataset: item {i} already has a {self.key!r} field ({example[self.key]!r}); "
                             "pass key= another name or drop the field.")
        return {**example, self.key: int(i)}


def _item(i, n: int, what: str) -> int:
    """Item `i` of a dataset of `n` (negative from the end, as a list): an int in [0, n); TypeError for a non-integer
    (a bool too), IndexError outside [-n, n) (`what` names the dataset, with {n})."""
    i = as_index(i)
    if not -n <= i < n:
        raise IndexError(f"{what.format(n=n)}, index {i} is out of range.")
    return i % n


class PackedDataset(Dataset):
    """Documents packed into rows of exactly `seq_len` tokens, as the recipe packs them.

    The documents (token-id sequences) are joined into one stream `[BOS] doc [EOS] [BOS] doc [EOS] ...`
    (`bos_token_id` / `eos_token_id` None: no such token) and cut into consecutive rows: row i is
    `stream[i * seq_len : (i + 1) * seq_len]`. Every token of the stream is in exactly one row, in order; the tail
    shorter than one row is dropped (`dropped_tokens`). Rows cross document boundaries (one causal sequence per row,
    as in the recipe and most long-context fine-tunes). Item i: {"input_ids": LongTensor[seq_len], "index": i}.

    `stream` (int64) is also the haystack for `PasskeyMixer(filler_ids=...)`.
    """

    def __init__(self, documents: Iterable[Sequence[int]], seq_len: int, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"PackedDataset: seq_len must be a positive integer, got {seq_len!r}.")
        bos = [bos_token_id] if bos_token_id is not None else []
        eos = [eos_token_id] if eos_token_id is not None else []
        ids: list[int] = []
        n_docs = 0
        for doc in documents:
            if isinstance(doc, str):
                raise TypeError("PackedDataset takes token ids, got a str: tokenize first, or use "
                                "PackedDataset.from_texts(texts, tokenizer, seq_len).")
            ids += bos + [int(t) for t in doc] + eos
            n_docs += 1
        self.stream = torch.tensor(ids, dtype=torch.long)
        self.seq_len, self.n_documents = seq_len, n_docs
        self.n_rows = len(ids) // seq_len
        self.dropped_tokens = len(ids) - self.n_rows * seq_len
        if self.n_rows == 0:
            raise ValueError(f"PackedDataset: {n_docs} document(s) give {len(ids)} tokens, fewer than one row of "
                             f"seq_len={seq_len}.")

    @classmethod
    def from_texts(cls, texts: Iterable[str], tokenizer: Any, seq_len: int) -> PackedDataset:
        """Tokenize each text (no special tokens) and frame it with the tokenizer's BOS / EOS."""
        docs = (tokenizer.encode(t, add_special_tokens=False) for t in texts)
        return cls(docs, seq_len, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)

    def __len__(self) -> int:
        return self.n_rows

    def __getitem__(self, i: int) -> dict:
        i = _item(i, self.n_rows, "PackedDataset has {n} rows")
        return {"input_ids": self.stream[i * self.seq_len : (i + 1) * self.seq_len].clone(), INDEX: i}


class TextWindows(Dataset):
    """`num_samples` windows of `seq_len` consecutive tokens of `stream` (a 1-d int tensor, e.g.
    `PackedDataset.stream`), window k starting at an offset drawn uniformly from [0, len(stream) - seq_len] by
    `sample_rng(seed, k, "window")`. Item k: {"input_ids": LongTensor[seq_len], "index": k}. Set `num_samples` = steps ×
    global batch for one epoch in which every sample index (and so every collator draw) is new; windows overlap and may
    repeat text, as random crops do."""

    def __init__(self, stream: torch.Tensor, seq_len: int, num_samples: int, *, seed: int = 0):
        for name, value in (("seq_len", seq_len), ("num_samples", num_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TextWindows: {name} must be a positive integer, got {value!r}.")
        stream = torch.as_tensor(stream)
        if stream.dim() != 1 or stream.is_floating_point():
            raise TypeError(f"TextWindows: stream must be a 1-d tensor of token ids, got {stream.dtype} of shape "
                            f"{tuple(stream.shape)}.")
        if len(stream) < seq_len:
            raise ValueError(f"TextWindows: the stream has {len(stream)} tokens, fewer than one window of "
                             f"seq_len={seq_len}.")
        self.stream, self.seq_len, self.num_samples = stream.long(), seq_len, num_samples
        self.seed = as_index(seed, "seed")

    def __len__(self) -> int:
        return self.num_samples

    def offset(self, i: int) -> int:
        return sample_rng(self.seed, i, "window").randint(0, len(self.stream) - self.seq_len)

    def __getitem__(self, i: int) -> dict:
        i = _item(i, self.num_samples, "TextWindows has {n} samples")
        start = self.offset(i)
        return {"input_ids": self.stream[start : start + self.seq_len].clone(), INDEX: i}


def training_samples(stream: torch.Tensor, seq_len: int, global_batch_size: int, *, steps: int,
                     sampling: str = "windows", seed: int = 0) -> Dataset:
    """The samples of a run of `steps` optimizer steps over one framed token stream, each with its index, a whole
    number of global batches: one process with gradient accumulation and N processes then see the same samples at
    every step. "windows": steps x global_batch_size windows at offsets drawn from (seed, index) (`TextWindows`),
    every sample new; "rows": the packed rows (`PackedDataset`, no BOS/EOS added) cut to whole global batches, a
    run past one epoch replaying them (draws included). ValueError when the stream holds less than that."""
    if sampling == "windows":
        return TextWindows(stream, seq_len, steps * global_batch_size, seed=seed)
    if sampling != "rows":
        raise ValueError(f"sampling must be 'windows' or 'rows', got {sampling!r}.")
    packed = PackedDataset([stream.tolist()], seq_len)
    n = len(packed) // global_batch_size * global_batch_size
    if n == 0:
        raise ValueError(f"{len(stream):,} tokens make {len(packed)} rows of {seq_len}, fewer than one global batch "
                         f"of {global_batch_size}.")
    return packed if n == len(packed) else Subset(packed, range(n))


def token_stream(texts: Iterable[str], tokenizer: Any, cache_dir: str | os.PathLike, *, files: Sequence[Path] = (),
                 source: Any = None) -> torch.Tensor:
    """`texts` (documents) as one int64 stream `[BOS] doc [EOS] [BOS] doc [EOS] ...` (`PackedDataset.stream`), cached
    in `cache_dir` under a hash of `source` (JSON: where the texts come from), the names and bytes of `files` (the
    files they are read from) and the tokenizer; `texts` is only consumed when the cache misses (pass a generator).
    Call it on the main process first (`TrainingArguments.main_process_first`): the others then read the cache."""
    h = hashlib.sha256(json.dumps(source).encode())
    for path in files:
        h.update(Path(path).name.encode())
        h.update(hashlib.sha256(Path(path).read_bytes()).digest())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))).encode())
    h.update(repr((tokenizer.bos_token_id, tokenizer.eos_token_id)).encode())
    cache = Path(cache_dir) / f"{h.hexdigest()[:24]}.pt"
    if cache.is_file():
        return torch.load(cache).long()
    docs = (tokenizer.encode(text, add_special_tokens=False) for text in texts)
    stream = PackedDataset(docs, 1, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).stream
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    torch.save(stream.to(torch.int32), tmp)
    os.replace(tmp, cache)  # atomic: a concurrent reader sees no file or the whole file
    return stream
