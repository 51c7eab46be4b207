"""PackedDataset packs exactly (every token once, in order, rows of seq_len); TextWindows samples windows at offsets
drawn from (seed, index); IndexedDataset adds the sample index; training_samples cuts either to whole global batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.training import documents, packed

from rope_patch.training import IndexedDataset, PackedDataset, TextWindows, training_samples


@pytest.mark.parametrize("seq_len", [1, 7, 64, 128, 525])
@pytest.mark.parametrize("bos,eos", [(1, 2), (None, 2), (1, None), (None, None)])
def test_packing_is_exact(seq_len, bos, eos):
    docs = [list(range(10 + 3 * i, 10 + 3 * i + n)) for i, n in enumerate([5, 130, 1, 77, 300, 12])]
    ds = PackedDataset(docs, seq_len, bos_token_id=bos, eos_token_id=eos)
    stream = [t for d in docs for t in ([bos] if bos is not None else []) + d + ([eos] if eos is not None else [])]
    rows = [ds[i] for i in range(len(ds))]
    assert all(r["input_ids"].shape == (seq_len,) and r["input_ids"].dtype == torch.long for r in rows)
    assert [r["index"] for r in rows] == list(range(len(ds)))
    joined = torch.cat([r["input_ids"] for r in rows]).tolist() if rows else []
    assert len(ds) == len(stream) // seq_len and ds.dropped_tokens == len(stream) % seq_len
    assert joined == stream[: len(ds) * seq_len]  # every token once, in order; only the short tail is dropped
    assert ds.stream.tolist() == stream and ds.n_documents == len(docs)


def test_from_texts_frames_documents_with_bos_and_eos():
    tok, ds = packed(seq_len=128)
    texts = documents()
    expected = [t for text in texts for t in [tok.bos_token_id, *tok.encode(text, add_special_tokens=False),
                                              tok.eos_token_id]]
    assert ds.stream.tolist() == expected
    assert ds[-1]["index"] == len(ds) - 1 and torch.equal(ds[-1]["input_ids"], ds[len(ds) - 1]["input_ids"])


@pytest.mark.parametrize("args,error,match", [
    (([[1, 2, 3]], 0), ValueError, "seq_len must be a positive integer"),
    (([[1, 2, 3]], 8), ValueError, "fewer than one row"),
    ((["some text"], 8), TypeError, "tokenize first"),
])
def test_packing_errors(args, error, match):
    with pytest.raises(error, match=match):
        PackedDataset(*args)


def test_packed_index_out_of_range():
    ds = PackedDataset([list(range(20))], 5)
    with pytest.raises(IndexError, match="4 rows"):
        ds[4]


def test_indexed_dataset_adds_the_index():
    base = [{"input_ids": [i] * 4} for i in range(5)]
    ds = IndexedDataset(base)
    assert len(ds) == 5 and ds[3] == {"input_ids": [3] * 4, "index": 3}
    assert "index" not in base[3]  # the wrapped examples are not modified


@pytest.mark.parametrize("dataset,error,match", [
    (iter([{"input_ids": [1]}]), TypeError, "map-style"),
    ([[1, 2, 3]], TypeError, "expected a mapping"),
    ([{"input_ids": [1], "index": 7}], ValueError, "already has a 'index' field"),
])
def test_indexed_dataset_errors(dataset, error, match):
    with pytest.raises(error, match=match):
        IndexedDataset(dataset)[0]


def test_text_windows_are_slices_at_offsets_drawn_from_the_index():
    stream = torch.arange(1000)
    ds = TextWindows(stream, 64, 300, seed=3)
    items = [ds[i] for i in range(len(ds))]
    assert [r["index"] for r in items] == list(range(300)) and ds[-1]["index"] == 299
    for r in items:  # a window of consecutive tokens of the stream, inside it
        start = int(r["input_ids"][0])
        assert torch.equal(r["input_ids"], stream[start:start + 64]) and start + 64 <= 1000
    again = TextWindows(stream.clone(), 64, 300, seed=3)
    assert all(torch.equal(again[i]["input_ids"], items[i]["input_ids"]) for i in (0, 17, 299))  # pure of (seed, index)
    other = TextWindows(stream, 64, 300, seed=4)
    assert sum(other.offset(i) != ds.offset(i) for i in range(300)) > 290  # the seed changes the draws
    assert len({ds.offset(i) for i in range(300)}) > 250  # offsets spread over the 937 possible starts
    assert {ds.offset(i) for i in range(300)} <= set(range(937))
    assert TextWindows(torch.arange(64), 64, 5)[4]["input_ids"].tolist() == list(range(64))  # the one possible window


@pytest.mark.parametrize("args,error,match", [
    ((torch.arange(10), 0, 5), ValueError, "seq_len must be a positive integer"),
    ((torch.arange(10), 4, 0), ValueError, "num_samples must be a positive integer"),
    ((torch.arange(10), 11, 5), ValueError, "fewer than one window"),
    ((torch.zeros(3, 4, dtype=torch.long), 2, 5), TypeError, "1-d tensor of token ids"),
    ((torch.rand(10), 2, 5), TypeError, "1-d tensor of token ids"),
])
def test_text_windows_errors(args, error, match):
    with pytest.raises(error, match=match):
        TextWindows(*args)


def test_text_windows_index_out_of_range():
    with pytest.raises(IndexError, match="5 samples"):
        TextWindows(torch.arange(10), 4, 5)[5]


@pytest.mark.parametrize("make",
                         [lambda: PackedDataset([list(range(20))], 5), lambda: TextWindows(torch.arange(20), 5, 4)],
                         ids=["packed", "windows"])
@pytest.mark.parametrize("index, expected", [(1, 1), (-1, 3), (torch.tensor(2), 2), (np.int64(3), 3),
                                             (True, TypeError), (1.0, TypeError), (4, IndexError), (-5, IndexError)])
def test_items_by_index_as_a_list_takes_them(make, index, expected):
    ds = make()
    if isinstance(expected, type):
        with pytest.raises(expected):
            ds[index]
    else:
        item = ds[index]
        assert item["index"] == expected and torch.equal(item["input_ids"], ds[expected]["input_ids"])


@pytest.mark.parametrize("sampling", ["windows", "rows"])
def test_training_samples_are_whole_global_batches(sampling):
    stream = torch.arange(1000)
    ds = training_samples(stream, 64, 4, steps=3, sampling=sampling, seed=0)
    assert len(ds) == (3 * 4 if sampling == "windows" else 1000 // 64 // 4 * 4)  # 15 rows -> 12: three batches of 4
    assert [ds[i]["index"] for i in range(len(ds))] == list(range(len(ds)))
    if sampling == "rows":
        assert torch.equal(torch.cat([ds[i]["input_ids"] for i in range(len(ds))]), stream[: len(ds) * 64])
    with pytest.raises(ValueError, match="fewer than one global batch of 16"):
        training_samples(stream, 100, 16, steps=1, sampling="rows")
    with pytest.raises(ValueError, match="fewer than one"):
        training_samples(stream[:10], 64, 4, steps=1, sampling=sampling)
    with pytest.raises(ValueError, match="sampling must be 'windows' or 'rows'"):
        training_samples(stream, 64, 4, steps=1, sampling="epochs")
