"""recipes/finetune_lora.py (transformers Trainer + peft) on a tiny random Llama: config errors, --set, the rows and
their weights, the schedule, train/save/reload/merge, an in-process crash and resume, every shipped config.

The recipe is a class (`LoRAFinetuneRecipe`: setup / evaluate / train / save) over rope_patch.training: its config
(`config.py`, HfArgumentParser dataclasses), the Trainer subclass (`trainer.py`) and the callbacks (`callback.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers.recipes import (
    WINDOW,
    adapter_weights,
    load_recipe,
    log_records,
    loss_curve,
    make_model_dir,
    make_text,
    max_weight_diff,
    tiny_cfg,
)
from helpers.scripts import ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import rope_patch
from rope_patch.training import complete_checkpoints, last_checkpoint, learned_modules_to_save, weighted_loss
from rope_patch.training.config import PoseArgs

ft = load_recipe()
# The fine-tuning configs (recipes/configs/ also holds the pretraining config of rope-tiny).
CONFIGS = sorted(p for p in (ROOT / "recipes" / "configs").glob("*.yaml") if not p.name.startswith("pretrain_"))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return {"model": make_model_dir(root / "model"), "tied": make_model_dir(root / "tied", tie=True),
            "text": make_text(root / "train.txt"), "root": root}


def cfg_for(assets, tmp_path, **sections):
    return tiny_cfg(assets["model"], assets["text"], tmp_path / "run", **sections)


# ---- bad configs fail before training, naming the field ---------------------------------------------------------
BAD = [
    (dict(train={"warmup_step": 3}), r"Unknown key.*'warmup_step' \(did you mean 'warmup_steps'\?\)"),
    (dict(trian={"steps": 3}), r"top level.*'trian' \(did you mean 'train'\?\)"),
    (dict(data={"passkey_fracton": 0.5}), r"'passkey_fracton' \(did you mean 'passkey_fraction'\?\)"),
    (dict(train={"learning_rate": 1e-4}), r"`train.learning_rate` is set by the recipe from train.lr"),
    (dict(train={"optim": "no_such_optimizer"}), r"TrainingArguments.*no_such_optimizer"),
    (dict(rope_patch={"scheme": "yarn", "factr": 4.0}), "rope_patch"),
    (dict(rope_patch={"scheme": "yarn", "factor": -2.0}), "factor"),
    (dict(rope_patch={"scheme": "yarnn", "factor": 2.0}), "yarn"),
    (dict(rope_patch={"factor": 2.0}), "needs a `scheme:` key"),
    (dict(rope_patch={"scheme": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}),
     "covers 64 positions.*target length 128"),
    (dict(data={"files": ["/nonexistent/austen/*.txt"]}), "data.files.*matches no file"),
    (dict(data={"passkey_fraction": 1.5}), r"data.passkey_fraction.*<= 1"),
    (dict(data={"passkey_min_tokens": 125}), r"passkey_min_tokens`=125 must lie in \[16, seq_len - 8 = 120\]"),
    (dict(pose={"target_length": 300}), "pose.target_length.*not divisible by `train.seq_len`=128"),
    (dict(pose={"target_length": 64}), "shorter than the training rows"),
    (dict(pose={"target_lenght": 256}), r"'target_lenght' \(did you mean 'target_length'\?\)"),
    (dict(train={"global_batch_size": 5}), "global_batch_size`=5 is not divisible"),
    (dict(train={"warmup_steps": 6}), "warmup_steps`=6 must be smaller than `train.steps`=6"),
    (dict(train={"mixed_precision": "bf32"}), "mixed_precision"),
    (dict(lora={"r": 4, "target_modules": ["q_proj"], "alpha": 3}), r"lora.*'alpha' \(did you mean 'lora_alpha'\?\)"),
    (dict(model="/nonexistent/model"), "model"),
    (dict(eval={"heldout": "/nonexistent.txt", "perplexity_lengths": [64]}), "eval.heldout"),
    # a learned position table shorter than the rows or the evaluation: its forward would fail mid-run
    (dict(rope_patch={"scheme": "learned_absolute", "max_position_embeddings": 64}),
     r"learned_absolute runs at most 64 positions .*fewer than the training rows \(`train.seq_len`\): 128\. Raise "
     r"its max_position_embeddings to at least 128"),
    (dict(rope_patch={"scheme": "learned_absolute", "max_position_embeddings": 128},
          pose={"target_length": 256}), r"at most 128 positions .*\(`pose.target_length`\): 256"),
    (dict(rope_patch={"scheme": "learned_absolute", "max_position_embeddings": 128},
          eval={"heldout": str(ROOT / "rope_patch" / "data" / "heldout.txt"), "passkey_lengths": [512]}),
     r"at most 128 positions .*fewer than the evaluation .*: 512\. Raise its max_position_embeddings to at least 512"),
]


@pytest.mark.parametrize("change,match", BAD, ids=[f"{i}-{next(iter(c))}" for i, (c, _) in enumerate(BAD)])
def test_bad_configs_fail_before_training(change, match, assets, tmp_path, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the model was loaded before the config error was raised")

    monkeypatch.setattr(ft.LoRAFinetuneRecipe, "build_model", fail)
    cfg = cfg_for(assets, tmp_path)
    for key, value in change.items():
        cfg[key] = {**cfg[key], **value} if key in ("train", "data") else value
    with pytest.raises(ft.ConfigError, match=match):
        ft.main(cfg)
    assert not (tmp_path / "run").exists()


def test_missing_required_keys(assets, tmp_path):
    cfg = cfg_for(assets, tmp_path)
    del cfg["train"]["steps"]
    with pytest.raises(ft.ConfigError, match="`train.steps` is required"):
        ft.load_config(cfg)
    cfg = cfg_for(assets, tmp_path)
    del cfg["output_dir"]
    with pytest.raises(ft.ConfigError, match="`output_dir` is required"):
        ft.load_config(cfg)


def test_set_overrides_and_cli_check(assets, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg_for(assets, tmp_path)))
    cfg = ft.load_config(path, ft.parse_overrides(["train.steps=3", "pose.target_length=512", "lora.r=2",
                                                   "train.optim=sgd", "rope_patch.factor=16.0", "seed=7"]))
    assert cfg.train.steps == 3 and cfg.pose == PoseArgs(target_length=512, n_chunks=2)
    assert cfg.lora.r == 2 and cfg.run.seed == 7 and cfg.patch.resolved.params()["factor"] == 16.0
    assert cfg.train.trainer == {"optim": "sgd"}  # another TrainingArguments field, passed on unchanged
    assert cfg.training_arguments(1).optim == "sgd"
    assert ft.cli(["--config", str(path), "--check"]) == 0
    assert f"{path}: OK" in capsys.readouterr().out
    assert ft.cli(["--config", str(path), "--check", "--set", "train.bogus=1"]) == 2
    assert ft.cli(["--config", str(path), "--check", "--set", "train.stepz=1"]) == 2
    assert ft.cli(["--config", str(path), "--check", "--set", "steps"]) == 2
    err = capsys.readouterr().err
    assert "Unknown key(s) in `train`" in err and "'stepz' (did you mean 'steps'?)" in err
    assert "--set expects section.key=value" in err
    assert not (tmp_path / "run").exists()  # --check writes nothing


def test_parse_overrides_reads_yaml_values():
    assert ft.parse_overrides(["train.steps=20", "data.files=[a.txt, b.txt]", "rope_patch=null", "train.lr=1e-3"]) == {
        "train.steps": 20, "data.files": ["a.txt", "b.txt"], "rope_patch": None, "train.lr": "1e-3"}  # YAML 1.1
    for bad in ("steps", "=3"):
        with pytest.raises(ft.ConfigError, match="--set expects section.key=value"):
            ft.parse_overrides([bad])


def test_training_arguments_come_from_the_recipe_keys(assets, tmp_path):
    cfg = ft.load_config(cfg_for(assets, tmp_path, train={"global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-4,
                                                          "min_lr_ratio": 0.25, "save_every": 3,
                                                          "keep_checkpoints": 1}))
    assert cfg.validate(num_processes=2)["accumulation_steps"] == 2  # 8 = 2 rows x 2 processes x 2 steps
    assert cfg.validate(num_processes=1)["accumulation_steps"] == 4
    args = cfg.training_arguments(4)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_steps) == (2, 4, 6)
    assert args.lr_scheduler_type == "cosine_with_min_lr" and args.lr_scheduler_kwargs == {"min_lr_rate": 0.25}
    assert args.remove_unused_columns is False and args.save_steps == 3
    assert args.save_total_limit is None  # keep_checkpoints: the recipe removes old checkpoints once marked
    assert Path(args.output_dir) == tmp_path / "run" / "checkpoints"


# ---- rows: packed, weighted, a function of the sample index --------------------------------------------------------
@pytest.mark.parametrize("sampling", ["windows", "rows"])
def test_rows_and_weights_are_a_function_of_the_index(assets, tmp_path, sampling):
    # validated: yarn x16 covers 512
    recipe = ft.LoRAFinetuneRecipe(cfg_for(assets, tmp_path, pose={"target_length": 512},
                                           rope_patch={"scheme": "yarn", "factor": 16.0,
                                                       "original_max_position_embeddings": WINDOW},
                                           data={"passkey_fraction": 0.5, "sampling": sampling}))
    cfg = recipe.cfg
    tok = AutoTokenizer.from_pretrained(assets["model"])
    stream = cfg.data.token_stream(tok)
    assert stream[0] == tok.bos_token_id and (stream == tok.eos_token_id).sum() == 1  # one framed document
    assert len(list(Path(cfg.data.cache_dir).glob("*.pt"))) == 1  # tokenised once, cached
    assert torch.equal(cfg.data.token_stream(tok), stream)
    dataset = recipe.build_dataset(stream)
    assert len(dataset) % cfg.train.global_batch_size == 0
    if sampling == "rows":  # the packed rows, cut to whole global batches
        assert len(dataset) == len(stream) // 128 // 4 * 4
    else:  # one epoch of steps x global batch windows, each a slice of the stream at its own offset
        assert len(dataset) == cfg.train.steps * cfg.train.global_batch_size
        starts = {dataset.offset(i) for i in range(len(dataset))}
        assert len(starts) > len(dataset) // 2 and all(
            torch.equal(dataset[i]["input_ids"], stream[dataset.offset(i):][:128]) for i in range(4))
    collate = recipe.build_collator(tok, stream)
    rows = [dataset[i] for i in range(16)]
    a, b = collate(rows[:8]), collate(list(reversed(rows[:8])))
    assert set(a) == {"input_ids", "position_ids", "attention_mask", "loss_weights"}
    assert all(torch.equal(a[k], b[k].flip(0)) for k in a)  # the same example gets the same draw in any batch
    assert a["input_ids"].shape == (8, 128) and a["position_ids"].max() <= 511
    assert (torch.diff(a["position_ids"], dim=1) > 1).any()  # PoSE skips
    weights = collate(rows)["loss_weights"]
    heavy = weights == 3.0  # answer_loss_weight on the passkey answers, 1 elsewhere
    assert heavy.any() and ((weights == 1.0) | heavy).all()
    answer_rows = heavy.any(1)
    assert 0 < answer_rows.sum() < 16 and (heavy.sum(1)[answer_rows] == 6).all()  # " 12345": 6 character tokens


def test_weighted_loss_weighs_rows_equally():
    torch.manual_seed(0)
    logits, ids = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    ones = torch.ones(2, 5)
    plain = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), ids[:, 1:].reshape(-1))
    assert torch.allclose(weighted_loss(logits, ids, ones), plain)
    w = ones.clone()
    w[0, 2] = 5.0  # a heavier answer token in row 0 moves row 0's mean only
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    row0 = (nll[0] * w[0, 1:]).sum() / w[0, 1:].sum()
    assert torch.allclose(weighted_loss(logits, ids, w), (row0 + nll[1].mean()) / 2)


def test_jsonl_documents_and_their_errors(assets, tmp_path):
    tok = AutoTokenizer.from_pretrained(assets["model"])
    good = tmp_path / "docs.jsonl"
    good.write_text("\n".join(json.dumps({"body": f"doc {i} the pass key is {i}."}) for i in range(3)) + "\n")
    cfg = ft.load_config(cfg_for(assets, tmp_path, data={"files": [str(good)], "text_field": "body"}))
    stream = cfg.data.token_stream(tok).tolist()
    assert stream.count(tok.bos_token_id) == 3 and stream.count(tok.eos_token_id) == 3  # one framed document per line
    cfg = ft.load_config(cfg_for(assets, tmp_path, data={"files": [str(good)], "cache_dir": str(tmp_path / "other")}))
    with pytest.raises(ft.ConfigError, match="docs.jsonl:1 has no field `text`"):
        cfg.data.token_stream(tok)


# ---- train, save, reload, merge ---------------------------------------------------------------------------------
def test_train_save_reload_and_merge(assets, tmp_path):
    cfg = tiny_cfg(assets["tied"], assets["text"], tmp_path / "run", output={"merge": True},
                   lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                         "modules_to_save": ["embed_tokens", "norm"]},
                   train={"steps": 4, "save_every": 0, "warmup_steps": 2, "min_lr_ratio": 0.1})
    summary = ft.main(cfg)
    out = Path(summary["adapter"])
    log = log_records(tmp_path / "run")
    assert [r["step"] for r in log] == [1, 2, 3, 4] and all(r["tokens_per_s"] > 0 for r in log)
    assert summary["final_loss"] == log[-1]["loss"]
    # transformers' cosine_with_min_lr, 2 warm-up steps of 4: 0, lr/2, lr, then half-way down the cosine to lr x 0.1
    assert [r["lr"] for r in log] == pytest.approx([0.0, 5e-4, 1e-3, 1e-4 + 0.9e-3 * 0.5])

    ids = torch.randint(3, 40, (1, 100), generator=torch.Generator().manual_seed(0))  # 100 > the 32-token window
    again = rope_patch.from_pretrained(out, attn_implementation="eager").eval()
    assert rope_patch.current(again).name == "yarn"
    trained = adapter_weights(tmp_path / "run")
    # LongLoRA: embeddings and norms trained too (peft saves its modules_to_save copies under the plain names)
    assert {"base_model.model.model.embed_tokens.weight", "base_model.model.model.norm.weight"} <= set(trained)
    from peft import get_peft_model_state_dict

    reloaded = get_peft_model_state_dict(again)
    assert reloaded.keys() == trained.keys() and all(torch.equal(reloaded[n], v) for n, v in trained.items())

    merged = json.loads((tmp_path / "run" / "merged" / "config.json").read_text())
    assert merged["rope_parameters"]["rope_type"] == "yarn" and merged["rope_parameters"]["factor"] == 4.0
    # no rope_patch
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "merged", attn_implementation="eager").eval()
    with torch.no_grad():
        assert (plain(ids).logits - again(ids).logits).abs().max().item() <= 1e-5

    from rope_patch.persistence import export_info

    for folder in (tmp_path / "run" / "merged", out):  # `rope-patch export` on the recipe's outputs
        info = export_info(folder)
        assert info["rope_parameters"]["rope_type"] == "yarn"
        assert info["max_position_embeddings"] == merged["max_position_embeddings"]
    from rope_patch.serving import export

    assert export(tmp_path / "run" / "merged", "vllm", write=False)["command"]  # its tokenizer is there for the engine


def test_before_and_after_evaluation(assets, tmp_path):
    heldout = make_text(tmp_path / "heldout.txt", n_words=800, seed=5)
    cfg = cfg_for(assets, tmp_path, train={"steps": 2, "save_every": 0},
                  eval={"heldout": str(heldout), "perplexity_lengths": [32, 128], "perplexity_tokens": 256,
                        "passkey_lengths": [128], "passkey_depths": [0.5], "passkey_samples": 2})
    summary = ft.main(cfg)
    rows = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert list(rows) == ["base (unpatched)", "yarn, no fine-tuning", "yarn + LoRA fine-tuned"]
    for r in rows.values():
        assert set(r["perplexity"]) == {"32", "128"} and all(v > 1 for v in r["perplexity"].values())
        assert 0.0 <= r["passkey"]["128"] <= 1.0 and r["passkey_prompts"] == 2
    assert rows["base (unpatched)"]["perplexity"] != rows["yarn, no fine-tuning"]["perplexity"]  # the patch was removed
    assert summary["eval"] == rows and "| yarn + LoRA fine-tuned |" in (tmp_path / "run" / "eval.md").read_text()


LABELS = [  # (rope_patch: section, the evaluation table's label of the patched model)
    (None, "unpatched"),
    ({"scheme": "yarn", "factor": 4}, "yarn"),
    ({"scheme": "yarn", "factor": 4, "resonance": True}, "yarn+resonance"),
    ({"scheme": "yarn:4+logn"}, "yarn + logn"),
    ({"scheme": "relative_bias+logn"}, "relative_bias + logn"),
]


@pytest.mark.parametrize("patch,label", LABELS)
def test_evaluation_rows_name_the_scheme(patch, label):
    scheme = None if patch is None else rope_patch.api.as_scheme(**patch)
    assert ft._label(scheme) == label


LEARNED = [  # (scheme, evaluate before training): the "before" rows remove and re-apply the patch
    ({"scheme": "relative_bias", "max_distance": 128, "init": "alibi"}, False),
    ({"scheme": "relative_bias", "max_distance": 128, "init": "alibi"}, True),
    ({"scheme": "learned_absolute", "max_position_embeddings": 128}, True),
]


@pytest.mark.parametrize("patch,before", LEARNED, ids=lambda v: v["scheme"] if isinstance(v, dict) else f"eval={v}")
def test_a_learned_table_trains_through_modules_to_save(patch, before, assets, tmp_path):
    """relative_bias / learned_absolute own a learned table: the recipe adds it to the LoRA block's modules_to_save
    by itself, and it stays there through the evaluation before training; a resumed run loads it back."""
    ev = {"heldout": str(make_text(tmp_path / "heldout.txt", n_words=400, seed=5)), "perplexity_lengths": [32],
          "perplexity_tokens": 64, "passkey_lengths": [], "passkey_samples": 1, "before": before}
    cfg = cfg_for(assets, tmp_path, train={"steps": 2, "save_every": 1, "warmup_steps": 0}, eval=ev)
    cfg["rope_patch"] = patch
    with pytest.raises(KeyboardInterrupt):
        ft.main(cfg, callbacks=[Crash(2)])
    summary = ft.main(cfg, resume=True)
    assert summary["resumed_from"].endswith("checkpoint-1") and summary["steps"] == 2
    again = rope_patch.from_pretrained(summary["adapter"])
    assert rope_patch.current(again).name == patch["scheme"]
    (table,) = learned_modules_to_save(again)  # peft saved the trained copy: the table was in modules_to_save
    assert [n for n in adapter_weights(tmp_path / "run") if "rope_patch_" in n] == [f"base_model.model.{table}.weight"]


class Partition(TrainerCallback):
    """What DeepSpeed ZeRO-3 leaves of the learned tables after training: each parameter's data is an empty tensor
    (the process's shard lives elsewhere), `ds_id` marks it, and `deepspeed.zero.GatheredParameters` (a stand-in
    module here) puts the full values back inside its block."""

    def __init__(self, monkeypatch):
        self.full, self.monkeypatch = {}, monkeypatch

    def on_train_end(self, args, state, control, model=None, **kw):
        self.monkeypatch.setitem(sys.modules, "deepspeed", self.deepspeed())  # from here on: the save
        for module in rope_patch.api.patch_modules(rope_patch.discovery.unwrap(model)).values():
            for p in module.parameters():
                self.full[p] = p.data.clone()
                p.ds_id, p.data = 1, torch.empty(0, dtype=p.dtype)

    def deepspeed(self):
        import contextlib
        import importlib.machinery
        import types

        @contextlib.contextmanager
        def gathered(params, modifier_rank=None):
            for p in params:
                p.data = self.full[p]
            yield
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype)
        module = types.ModuleType("deepspeed")
        module.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)
        module.zero = types.SimpleNamespace(GatheredParameters=gathered)
        return module


def test_the_adapter_gets_the_gathered_tables_under_zero3(assets, tmp_path, monkeypatch):
    """The recipe writes rope_patch.safetensors beside the adapter after training: under ZeRO-3 from the gathered
    tables, not from the process's empty shard."""
    partition = Partition(monkeypatch)
    cfg = cfg_for(assets, tmp_path, train={"steps": 1, "save_every": 0, "warmup_steps": 0})
    cfg["rope_patch"] = {"scheme": "relative_bias", "init": "alibi"}
    summary = ft.main(cfg, callbacks=[partition])
    from safetensors.torch import load_file

    saved = load_file(str(Path(summary["adapter"]) / "rope_patch.safetensors"))["rope_patch_relative_bias.weight"]
    (trained,) = partition.full.values()
    assert saved.shape == trained.shape and torch.equal(saved, trained)


@pytest.mark.parametrize("patch", [{"scheme": "relative_bias", "init": "alibi"},
                                   {"scheme": "learned_absolute", "max_position_embeddings": 128}],
                         ids=lambda p: p["scheme"])
def test_tables_train_in_float32_on_a_bfloat16_model(patch, assets, tmp_path):
    """model_dtype bfloat16 under bf16 autocast: peft copied the learned table (modules_to_save) in bfloat16, where
    ~90% of its entries never moved at lr 1e-4. They train in float32; evaluation, merge and resume still work."""
    heldout = make_text(tmp_path / "heldout.txt", n_words=400, seed=5)
    cfg = cfg_for(assets, tmp_path, output={"merge": True},
                  lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["norm"]},
                  train={"steps": 2, "save_every": 1, "warmup_steps": 0, "lr": 1e-4, "model_dtype": "bfloat16",
                         "mixed_precision": "bf16"},
                  eval={"heldout": str(heldout), "perplexity_lengths": [32], "perplexity_tokens": 64,
                        "passkey_lengths": [], "passkey_samples": 1})
    cfg["rope_patch"] = patch
    with pytest.raises(KeyboardInterrupt):
        ft.main(cfg, callbacks=[Crash(2)])
    summary = ft.main(cfg, resume=True)
    from safetensors.torch import load_file

    (table,) = load_file(str(Path(summary["adapter"]) / "rope_patch.safetensors")).values()
    start = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.bfloat16)
    rope_patch.apply(start, **patch)
    (initial,) = rope_patch.api.patch_modules(start).values()
    assert table.dtype == torch.float32
    assert (table != initial.weight.float()).float().mean().item() > 0.9  # bfloat16: ~0.1
    assert len(summary["eval"]) == 3 and rope_patch.current(rope_patch.from_pretrained(summary["merged"]))


# ---- crash and resume, in process (tests/recipes/test_distributed.py kills a real process with SIGKILL) ------------
class Crash(TrainerCallback):
    """Raises at the end of step `step`, or inside the checkpoint save of `step` (before the recipe marks it
    complete)."""

    def __init__(self, step: int, where: str = "step_end"):
        self.step, self.where = step, where

    def on_step_end(self, args, state, control, **kw):
        if self.where == "step_end" and state.global_step == self.step:
            raise KeyboardInterrupt(f"crash after step {self.step}")

    def on_save(self, args, state, control, **kw):
        if self.where == "save" and state.global_step == self.step:
            raise KeyboardInterrupt(f"crash while saving step {self.step}")


def test_resume_after_crashes_gives_the_uninterrupted_run(assets, tmp_path):
    ref = ft.main(cfg_for(assets, tmp_path / "a"))
    cfg = cfg_for(assets, tmp_path / "b")
    run = tmp_path / "b" / "run"
    with pytest.raises(KeyboardInterrupt):
        ft.main(cfg, callbacks=[Crash(3)])  # checkpoint-2 exists, step 3 is lost
    assert last_checkpoint(run / "checkpoints").name == "checkpoint-2"
    with pytest.raises(KeyboardInterrupt):
        ft.main(cfg, resume=True, callbacks=[Crash(4, "save")])  # checkpoint-4 written but not marked complete
    assert (run / "checkpoints" / "checkpoint-4" / "adapter_model.safetensors").is_file()
    assert last_checkpoint(run / "checkpoints").name == "checkpoint-2"
    got = ft.main(cfg, resume=True)
    assert got["resumed_from"].endswith("checkpoint-2") and got["steps"] == 6
    assert max_weight_diff(adapter_weights(Path(ref["adapter"]).parent), adapter_weights(run)) <= 1e-6  # measured 0.0
    a, b = loss_curve(Path(ref["adapter"]).parent), loss_curve(run)
    assert list(b) == [1, 2, 3, 4, 5, 6]  # lines of lost steps were dropped, not duplicated
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-6
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["checkpoint-4", "checkpoint-6"]


def test_a_fresh_run_refuses_the_checkpoints_of_an_earlier_run(assets, tmp_path):
    """A fresh run into the same output_dir would overwrite some of the earlier run's checkpoints and keep the newer
    ones, which a later --resume would take for its own."""
    cfg = cfg_for(assets, tmp_path, train={"steps": 2, "save_every": 1})
    ft.main(cfg)
    with pytest.raises(ft.ConfigError, match=r"checkpoints holds checkpoints of an earlier run \(.*checkpoint-2\): "
                                             r"pass --resume to continue that run, or delete them"):
        ft.main(cfg)
    assert ft.main(cfg, resume=True)["resumed_from"].endswith("checkpoint-2")  # finished: nothing left to train
    for folder in complete_checkpoints(tmp_path / "run" / "checkpoints"):  # a run killed inside its first save
        (folder / "recipe_state.json").unlink()
    assert ft.main(cfg, resume=True)["resumed_from"] is None
    assert [p.name for p in complete_checkpoints(tmp_path / "run" / "checkpoints")][-1] == "checkpoint-2"


@pytest.mark.parametrize("keep", [1, 2])
def test_a_kill_inside_a_save_leaves_a_complete_checkpoint_whatever_is_kept(keep, assets, tmp_path):
    """Trainer's save_total_limit removed the older checkpoints before the new one was marked complete: with
    keep_checkpoints 1, a run killed inside the save of checkpoint-4 was left with none, and --resume trained every
    step again. The recipe removes them itself, once the new one is complete."""
    cfg = cfg_for(assets, tmp_path, train={"keep_checkpoints": keep})
    checkpoints = tmp_path / "run" / "checkpoints"
    with pytest.raises(KeyboardInterrupt):
        ft.main(cfg, callbacks=[Crash(4, "save")])
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["checkpoint-2"]
    assert ft.main(cfg, resume=True)["resumed_from"].endswith("checkpoint-2")
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["checkpoint-4", "checkpoint-6"][-keep:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-4", "checkpoint-6"][-keep:]


def test_trim_log_keeps_the_lines_up_to_the_resumed_step(tmp_path):
    path = tmp_path / "log.jsonl"
    assert ft.trim_log(path, 0) == 0.0 and path.read_text() == ""  # a fresh run: an empty log
    path.write_text("".join(json.dumps({"step": s, "elapsed_s": 10.0 * s}) + "\n" for s in (1, 2, 3, 4)) + "\n")
    assert ft.trim_log(path, 2) == 20.0
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert ft.trim_log(path, 0) == 0.0 and path.read_text() == ""


def test_resume_refuses_a_different_config(assets, tmp_path):
    cfg = cfg_for(assets, tmp_path, train={"steps": 4})
    with pytest.raises(KeyboardInterrupt):
        ft.main(cfg, callbacks=[Crash(3)])
    cfg["train"]["lr"] = 5e-4
    with pytest.raises(ft.ConfigError, match="different training config"):
        ft.main(cfg, resume=True)
    cfg["train"]["lr"], cfg["train"]["log_every"] = 1e-3, 2  # logging is not part of the trajectory
    assert ft.main(cfg, resume=True)["resumed_from"].endswith("checkpoint-2")


def test_fsdp_on_cpu_is_refused(assets, tmp_path, monkeypatch):
    """accelerate enables FSDP only on GPU-like devices: on CPU it would silently train with DDP (recipe header)."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ft.ConfigError, match="FSDP was requested.*silently train with plain DDP"):
        ft.main(cfg_for(assets, tmp_path, train={"steps": 2, "save_every": 0}))


# ---- every shipped config: loads, validates, dry-runs on the tiny model ------------------------------------------
def shrink(raw: dict, assets, out: Path) -> dict:
    """The config with its model, data and lengths scaled down: the same scheme, LoRA block and options."""
    cfg = ft.load_config(raw)
    raw = json.loads(json.dumps(raw))
    t = raw["train"]
    target = cfg.pose.target_length if cfg.pose else cfg.train.seq_len
    scale = 128 / cfg.train.seq_len
    raw.update(model=str(assets["model"]), output_dir=str(out))
    raw.pop("tokenizer", None)
    raw.pop("eval", None)
    raw["data"] = {k: v for k, v in raw["data"].items()
                   if k not in ("dataset", "dataset_config", "split", "max_documents")}
    raw["data"].update(files=[str(assets["text"])], cache_dir=str(out.parent / "cache"), passkey_min_tokens=100)
    t.update(seq_len=128, steps=2, warmup_steps=1, save_every=0, log_every=1, global_batch_size=2, micro_batch_size=1,
             mixed_precision="no", model_dtype="float32", threads=1, attn_implementation="eager")
    if raw.get("pose"):
        raw["pose"]["target_length"] = int(target * scale)
    rp = raw.get("rope_patch")
    if rp and "original_max_position_embeddings" in rp:
        rp["original_max_position_embeddings"] = original = max(8, int(rp["original_max_position_embeddings"] * scale))
        if original > WINDOW:  # a tiny model pre-trained on that window: an original above the model's is refused
            raw["model"] = str(make_model_dir(out.parent / f"model_w{original}", window=original))
    return raw


def test_configs_ship():
    names = {p.name for p in CONFIGS}
    assert {"tiny_yarn_4x.yaml", "tiny_pi_4x.yaml", "tiny_pose_8x.yaml"} <= names
    assert len(names) >= 7


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_loads_and_dry_runs(path, assets, tmp_path):
    text = path.read_text()
    header = text.split("\n\n")[0]
    assert "launch" in header.lower() and "recipes/finetune_lora.py" in header, (
        f"{path.name}: the header must hold the launch command")
    raw = yaml.safe_load(text)
    cfg = ft.load_config(raw)  # structure: no unknown keys
    for key in ("rope_patch", "lora"):
        block_lines = [ln for ln in text.split(f"\n{key}:")[1].split("\n\n")[0].splitlines()[1:]
                       if ln.startswith("  ") and ":" in ln]
        assert all("#" in ln for ln in block_lines), (
            f"{path.name}: every `{key}` value carries a comment with its reason")
    summary = ft.main(shrink(raw, assets, tmp_path / "run"))
    assert summary["steps"] == 2 and 0 < summary["final_loss"] < 20  # a number, not NaN
    reloaded = rope_patch.current(rope_patch.from_pretrained(summary["adapter"]))
    assert (reloaded is None) if cfg.patch is None else reloaded.name == cfg.patch.resolved.name


def test_real_model_configs_pass_check_where_their_data_is_local():
    """--check on the shipped configs as they are: the hub models and datasets cannot be checked offline (the model
    id is accepted as a hub id), the tiny configs need the prepared Austen text (header of each config)."""
    for path in CONFIGS:
        cfg = ft.load_config(path)
        if cfg.data.files and not all(__import__("glob").glob(f) for f in cfg.data.files):
            continue
        if cfg.eval is not None and cfg.eval.heldout and not Path(cfg.eval.heldout).is_file():
            continue
        try:
            assert cfg.validate()["accumulation_steps"] >= 1, path.name
        except ft.ConfigError as err:  # smollm2 is converted once from a wheel: not there on a fresh machine
            assert cfg.run.model == "smollm2" and "rope-patch models fetch smollm2" in str(err), (path.name, err)


def test_accelerate_configs_parse():
    files = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))
    kinds = {yaml.safe_load(p.read_text())["distributed_type"] for p in files}
    assert {"MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED"} <= kinds
    from accelerate.commands.config.config_args import load_config_from_file

    for p in files:
        cfg = load_config_from_file(str(p))  # what `accelerate launch --config_file` reads: rejects unknown keys
        assert cfg.distributed_type.value == yaml.safe_load(p.read_text())["distributed_type"]
        raw = yaml.safe_load(p.read_text())
        if raw["distributed_type"] == "DEEPSPEED":
            assert raw["deepspeed_config"]["zero_stage"] == 3
        if raw["distributed_type"] == "FSDP":
            assert raw["fsdp_config"]["fsdp_use_orig_params"] is True  # LoRA mixes frozen and trainable parameters


def test_script_runs_as_a_command(assets, tmp_path):
    """`python recipes/finetune_lora.py --check` (no model load) from the repository root."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg_for(assets, tmp_path)))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    res = subprocess.run([sys.executable, str(ROOT / "recipes" / "finetune_lora.py"), "--config", str(path), "--check",
                          "--set", "train.global_batch_size=3"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert res.returncode == 2 and "global_batch_size`=3 is not divisible" in res.stderr
    res = subprocess.run([sys.executable, str(ROOT / "recipes" / "finetune_lora.py"), "--help"], capture_output=True,
                         text=True, cwd=ROOT, env=env)
    assert res.returncode == 0 and "--resume" in res.stdout and "torchrun --standalone" in res.stdout
