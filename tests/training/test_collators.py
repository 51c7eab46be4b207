"""Collators: every draw a pure function of (seed, sample index); PoSE ids' properties; passkey mixing fraction; the
loss weights of WeightedCollator."""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np
import pytest
import torch
from helpers.training import packed

from rope_patch.evaluation.passkey import LEAD_IN, NEEDLE, QUESTION
from rope_patch.training import (
    CausalLMCollator,
    PasskeyMixer,
    PoSECollator,
    WeightedCollator,
    sample_generator,
    sample_rng,
    sample_seed,
)

SEQ, TARGET = 256, 2048
MIN = 110  # the needle and question take 98 characters (tokens of the char tokenizer)


@pytest.fixture(scope="module")
def data():
    return packed(seq_len=SEQ, n_docs=30)  # (tokenizer, PackedDataset): ~140 rows


def make(kind: str, tok, ds, seed: int = 0):
    if kind == "plain":
        return CausalLMCollator()
    if kind == "pose":
        return PoSECollator(target_length=TARGET, n_chunks=3, seed=seed)
    mixer = dict(tokenizer=tok, filler_ids=ds.stream, fraction=0.5, min_tokens=MIN, seed=seed)
    if kind == "passkey":
        return PasskeyMixer(**mixer)
    return PasskeyMixer(**mixer, collator=PoSECollator(target_length=TARGET, n_chunks=2, seed=seed))


KINDS = ["plain", "pose", "passkey", "passkey+pose"]


def per_sample(batch: dict, indices) -> dict[int, dict]:
    return {i: {k: v[r] for k, v in batch.items()} for r, i in enumerate(indices)}


# ---- determinism ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_and_index_same_row_whatever_the_batch(kind, data):
    """What Trainer's resume, several processes or workers change: batch composition, order, what ran before."""
    tok, ds = data
    indices = list(range(24))
    reference = per_sample(make(kind, tok, ds)([ds[i] for i in indices]), indices)
    rng = random.Random(5)
    for trial in range(3):
        order = indices[:]
        rng.shuffle(order)
        size = [1, 5, 8][trial]
        collator = make(kind, tok, ds)  # a fresh collator, as after a restart
        torch.manual_seed(1000 + trial)  # the global RNGs play no part
        random.seed(trial)
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            for i, row in per_sample(collator([ds[i] for i in chunk]), chunk).items():
                assert row.keys() == reference[i].keys()
                for key in row:
                    assert torch.equal(row[key], reference[i][key]), (kind, i, key)


@pytest.mark.parametrize("kind", KINDS)
def test_collators_leave_the_global_rngs_alone(kind, data):
    tok, ds = data
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    make(kind, tok, ds)([ds[i] for i in range(8)])
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), np_state, strict=True))


@pytest.mark.parametrize("kind", ["pose", "passkey"])
def test_another_seed_draws_otherwise(kind, data):
    tok, ds = data
    a = make(kind, tok, ds, seed=0)([ds[i] for i in range(16)])
    b = make(kind, tok, ds, seed=1)([ds[i] for i in range(16)])
    key = "position_ids" if kind == "pose" else "input_ids"
    assert not torch.equal(a[key], b[key])


def test_pose_draws_do_not_depend_on_passkey_mixing(data):
    """Separate streams per kind of draw: switching the mixer on leaves every row's PoSE positions as they were."""
    tok, ds = data
    rows = [ds[i] for i in range(16)]
    alone = make("pose", tok, ds)(rows)["position_ids"]
    mixed = PasskeyMixer(tok, ds.stream, fraction=1.0, min_tokens=MIN, collator=PoSECollator(TARGET, n_chunks=3))(rows)
    assert torch.equal(mixed["position_ids"], alone)
    assert not torch.equal(mixed["input_ids"], torch.stack([r["input_ids"] for r in rows]))


def test_sample_seed_is_a_fixed_function():
    """sha256 of "seed/stream/index" (no PYTHONHASHSEED, no process state); ints from tensors and numpy too."""
    expected = int.from_bytes(hashlib.sha256(b"3/pose/17").digest()[:8], "little") >> 1
    assert sample_seed(3, 17, "pose") == expected
    assert sample_seed(3, torch.tensor(17), "pose") == sample_seed(np.int64(3), np.int64(17), "pose") == expected
    assert sample_seed(3, 17, "passkey") != expected and sample_seed(3, 18, "pose") != expected
    assert 0 <= expected < 2**63
    assert sample_rng(3, 17, "pose").random() == random.Random(expected).random()
    assert torch.equal(torch.rand(3, generator=sample_generator(3, 17)),
                       torch.rand(3, generator=sample_generator(3, 17)))


@pytest.mark.parametrize("bad", [1.5, True, "3", torch.tensor([1, 2])])
def test_sample_seed_rejects_non_integers(bad):
    with pytest.raises(TypeError, match="integer"):
        sample_seed(0, bad)


# ---- PoSE -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("train,target,chunks",
                         [(128, 1024, 2), (128, 1024, 3), (64, 64, 2), (32, 4096, 5), (16, 200, 1)])
def test_pose_position_ids(train, target, chunks):
    collator = PoSECollator(target_length=target, n_chunks=chunks, seed=7)
    rows = [{"input_ids": torch.arange(train) % 50, "index": i} for i in range(300)]
    batch = collator(rows)
    pos = batch["position_ids"]
    steps = torch.diff(pos, dim=1)
    assert pos.shape == (300, train) and pos.dtype == torch.long
    assert (pos[:, 0] == 0).all()  # the first chunk starts at 0 (u_0 = 0)
    assert (steps >= 1).all()  # strictly increasing
    assert (pos[:, -1] <= target - 1).all()  # within the target window
    assert ((steps != 1).sum(1) <= chunks - 1).all()  # at most one skip per chunk boundary
    assert torch.equal(batch["attention_mask"], torch.ones_like(pos))  # the all-ones mask (pose.py's mask trap)
    assert torch.equal(batch["labels"], batch["input_ids"])
    if target > train and chunks > 1:
        spans = pos[:, -1]
        assert spans.max() >= target - 1 - 0.05 * target and len(set(spans.tolist())) > 10  # long distances occur
    else:
        assert torch.equal(pos, torch.arange(train).expand(300, train))  # no room to skip: plain positions


def test_pose_row_longer_than_the_target():
    with pytest.raises(ValueError, match="shorter than the training rows"):
        PoSECollator(target_length=64)([{"input_ids": list(range(128)), "index": 0}])


@pytest.mark.parametrize("kwargs,match",
                         [(dict(target_length=0), "target_length"), (dict(target_length=64, n_chunks=0), "n_chunks")])
def test_pose_settings_checked_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoSECollator(**kwargs)


# ---- passkey mixing ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.75, 1.0])
def test_passkey_mixing_fraction(fraction, data):
    tok, ds = data
    mixer = PasskeyMixer(tok, ds.stream, fraction=fraction, min_tokens=MIN)
    n = 2000
    row = ds[0]
    hits = sum("passkey" in mixer.mix({**row, "index": i}) for i in range(n))
    sigma = math.sqrt(n * fraction * (1 - fraction))
    assert abs(hits - n * fraction) <= 4 * sigma  # Bernoulli(fraction) per sample: exact at 0 and 1


def test_passkey_rows_hold_a_prompt_the_answer_and_the_rows_own_text(data):
    tok, ds = data
    mixer = PasskeyMixer(tok, ds.stream, fraction=0.5, min_tokens=MIN)
    mixed = 0
    for i in range(len(ds)):
        original = ds[i]
        out = mixer.mix(original)
        ids = torch.as_tensor(out["input_ids"]).tolist()
        assert len(ids) == SEQ and out["index"] == i
        if "passkey" not in out:
            assert torch.equal(out["input_ids"], original["input_ids"])
            continue
        mixed += 1
        info = out["passkey"]
        n = info["prompt_tokens"]
        assert MIN <= n <= SEQ - 8 and ids[0] == tok.bos_token_id
        prompt = tok.decode(ids[:n], skip_special_tokens=True)
        assert NEEDLE.format(passkey=info["answer"]).strip() in prompt and prompt.endswith(QUESTION + LEAD_IN)
        answer = tok.encode(f" {info['answer']}", add_special_tokens=False)
        assert ids[n : n + len(answer)] == answer and ids[n + len(answer)] == tok.eos_token_id
        rest = ids[n + len(answer) + 1 :]
        assert rest == original["input_ids"][: len(rest)].tolist()  # then the row's own text
    assert 0 < mixed < len(ds)


def test_passkey_mixer_feeds_the_next_collator(data):
    tok, ds = data
    batch = make("passkey+pose", tok, ds)([ds[i] for i in range(6)])
    assert set(batch) == {"input_ids", "position_ids", "attention_mask", "labels"}  # only what the model takes


@pytest.mark.parametrize("kwargs,match",
                         [(dict(fraction=1.5), "fraction"), (dict(fraction=0.5, min_tokens=8), "min_tokens"),
                                          (dict(fraction=0.5, min_tokens=97), "take 98 tokens"),
                                          (dict(fraction=1.0, min_tokens=SEQ - 7), "lower min_tokens")])
def test_passkey_mixer_errors(kwargs, match, data):
    tok, ds = data
    with pytest.raises(ValueError, match=match):
        PasskeyMixer(tok, ds.stream, **kwargs)([ds[0]])


# ---- what the collators ask of the data -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["pose", "passkey"])
def test_missing_index_says_how_to_keep_it(kind, data):
    tok, ds = data
    with pytest.raises(ValueError, match="remove_unused_columns=False"):
        make(kind, tok, ds)([{"input_ids": ds[0]["input_ids"]}])


@pytest.mark.parametrize("kind", ["plain", "pose"])
def test_rows_of_different_lengths(kind, data):
    tok, ds = data
    rows = [{"input_ids": list(range(SEQ)), "index": 0}, {"input_ids": list(range(SEQ - 1)), "index": 1}]
    with pytest.raises(ValueError, match="do not pad"):
        make(kind, tok, ds)(rows)


@pytest.mark.parametrize("kind", KINDS)
def test_weighted_collator_weighs_the_passkey_answers(kind, data):
    """The inner collator's batch, labels dropped, + loss_weights: 3.0 on each passkey answer, 1 elsewhere."""
    tok, ds = data
    inner = make(kind, tok, ds)
    rows = [ds[i] for i in range(16)]
    batch = WeightedCollator(inner, answer_loss_weight=3.0)(rows)
    plain = inner(rows)
    assert set(batch) == set(plain) - {"labels"} | {"loss_weights"}
    assert all(torch.equal(batch[k], plain[k]) for k in plain if k != "labels")
    expected = torch.ones(16, SEQ)
    if isinstance(inner, PasskeyMixer):
        for i, row in enumerate(inner.mix(r) for r in rows):
            if "passkey" in row:
                expected[i, row["passkey"]["answer_start"] : row["passkey"]["answer_end"]] = 3.0
        assert (expected == 3.0).any(1).sum() > 0
    assert torch.equal(batch["loss_weights"], expected)
