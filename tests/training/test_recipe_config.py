"""rope_patch.training.config, the fine-tuning recipe's config: every section is an HfArgumentParser dataclass whose
every field has its help and its check; the fingerprint that --resume compares is the one the recipe wrote before
the config moved into the package (checkpoints of earlier runs still resume); overrides; the cached token stream."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from helpers.recipes import make_model_dir, make_text, tiny_cfg
from helpers.scripts import ROOT
from transformers import AutoTokenizer, HfArgumentParser

from rope_patch.training import PackedDataset, token_stream
from rope_patch.training.config import (
    ConfigError,
    DataArgs,
    EvalArgs,
    OutputArgs,
    PoseArgs,
    RunArgs,
    TrainArgs,
    _specs,
    load_config,
)

SECTIONS = [RunArgs, DataArgs, PoseArgs, TrainArgs, EvalArgs, OutputArgs]
# --resume compares these (recipe_state.json); computed by recipes/finetune_lora.py before this module existed.
FINGERPRINTS = {
    "llama2_7b_pi_8k": "2014581a7c1e535c", "llama2_7b_yarn_32k": "81076fbc982288ad",
    "mistral_7b_yarn_32k": "994079129468f6b7", "qwen2_5_7b_pose_128k": "a4f514fa3228fee7",
    "smollm2_135m_yarn_16k": "07a22050237de843", "tiny_pi_4x": "87d7cab271f71762",
    "tiny_pose_8x": "5a57ee8fb21c6b8f", "tiny_yarn_4x": "239463dc69753754",
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    return make_model_dir(root / "model"), make_text(root / "train.txt")


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_every_field_has_help_and_a_check(cls):
    HfArgumentParser(cls)  # the parser takes every field (plain types, no Union of two non-None types)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    assert all(f.metadata.get("help") for f in fields), [f.name for f in fields if not f.metadata.get("help")]
    assert set(_specs(cls)) == {f.name for f in fields}


REQUIRED = {RunArgs: {"model": "m", "output_dir": "o"}, DataArgs: {"files": ["x.txt"]}, PoseArgs: {"target_length": 64},
            TrainArgs: {"seq_len": 8, "steps": 2}, EvalArgs: {}, OutputArgs: {}}


@pytest.mark.parametrize("cls,name", [(c, f.name) for c in SECTIONS for f in dataclasses.fields(c) if f.init],
                         ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_a_wrong_value_is_one_line_naming_the_field(cls, name):
    values = {**REQUIRED[cls], name: {"not": "this"}}  # a mapping fits no field
    with pytest.raises(ConfigError) as info:
        HfArgumentParser(cls).parse_dict(values)
    message = str(info.value)
    assert message.startswith(f"`{cls.key(name)}` must be ") and "got {'not': 'this'}" in message
    assert "\n" not in message


def test_shipped_configs_keep_their_fingerprints():
    for name, fingerprint in FINGERPRINTS.items():
        assert load_config(ROOT / "recipes" / "configs" / f"{name}.yaml").fingerprint() == fingerprint, name


def test_the_fingerprint_ignores_logging_and_cadence(assets, tmp_path):
    cfg = tiny_cfg(*assets, tmp_path)
    base = load_config(cfg).fingerprint()
    quiet = {"train.log_every": 7, "train.save_every": 3, "train.keep_checkpoints": 5, "train.threads": 2,
             "eval": {"perplexity_lengths": []}, "output.merge": True}
    assert load_config(cfg, quiet).fingerprint() == base
    for key, value in {"train.lr": 5e-4, "seed": 1, "lora.r": 2, "data.passkey_fraction": 0.5}.items():
        assert load_config(cfg, {key: value}).fingerprint() != base, key


def test_overrides_and_the_file_named_in_errors(assets, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg(*assets, tmp_path)))
    cfg = load_config(path, {"train.steps": 9, "pose.target_length": 256, "train.optim": "sgd"})
    assert (cfg.train.steps, cfg.pose, cfg.train.trainer) == (9, PoseArgs(256), {"optim": "sgd"})
    with pytest.raises(ConfigError, match=rf"^{path} \(with --set train.steps=0\): `train.steps` must be "
                                          r"an integer >= 1"):
        load_config(path, {"train.steps": 0})
    with pytest.raises(ConfigError, match=r"--set train.steps.x=\.\.\.: `steps` is not a section"):
        load_config(path, {"train.steps.x": 1})
    with pytest.raises(ConfigError, match=rf"^{path}: .*global_batch_size`=4 is not divisible .* 2 x 3 = 6"):
        load_config(path).validate(num_processes=3)


def test_documents_of_txt_and_jsonl_files_up_to_max_documents(tmp_path):
    (tmp_path / "a.txt").write_text("one whole file")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": f"line {i}"}) for i in range(3)) + "\n\n")
    data = DataArgs(files=[str(tmp_path / "*")], text_field="body")
    assert list(data.documents()) == ["one whole file", "line 0", "line 1", "line 2"]
    assert list(dataclasses.replace(data, max_documents=2).documents()) == ["one whole file", "line 0"]
    with pytest.raises(ConfigError, match=r"b.jsonl:1 has no field `text` \(data.text_field\); keys: \['body'\]"):
        list(dataclasses.replace(data, text_field="text").documents())


def test_eval_table_has_a_row_per_model_and_a_column_per_length():
    e = EvalArgs(heldout=str(ROOT / "rope_patch" / "data" / "heldout.txt"), perplexity_lengths=[32, 128],
                 passkey_lengths=[128])
    rows = {"base": {"perplexity": {"32": 5.0, "128": 9.5}, "passkey": {"128": 0.25}},
            "tuned": {"perplexity": {"32": 4.0}}}
    assert e.table(rows).splitlines() == ["| model | ppl@32 | ppl@128 | passkey@128 |", "|---|---:|---:|---:|",
                                          "| base | 5.00 | 9.50 | 25% |", "| tuned | 4.00 | nan | nan% |"]


def test_token_stream_is_cached_and_framed(assets, tmp_path):
    tok = AutoTokenizer.from_pretrained(assets[0])
    docs = ["first document", "second one"]
    stream = token_stream(iter(docs), tok, tmp_path, source={"kind": "test"})
    packed = PackedDataset([tok.encode(d, add_special_tokens=False) for d in docs], 1,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    assert stream.tolist() == packed.stream.tolist()
    assert len(list(tmp_path.glob("*.pt"))) == 1
    assert token_stream(iter(()), tok, tmp_path, source={"kind": "test"}).tolist() == stream.tolist()  # from the cache
    assert token_stream(iter(docs[:1]), tok, tmp_path, source={"kind": "other"}).numel() < stream.numel()
