"""recipes/finetune_lora.py on a tiny random Llama: config errors, rows, resume, save/reload/merge, every shipped config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from helpers.recipes import ROOT, WINDOW, load_recipe, make_model_dir, make_text, tiny_cfg
from transformers import AutoModelForCausalLM

import rope_patch

ft = load_recipe()
# The fine-tuning configs (recipes/configs/ also holds the pretraining configs of rope-tiny, owned elsewhere).
CONFIGS = sorted(p for p in (ROOT / "recipes" / "configs").glob("*.yaml") if not p.name.startswith("pretrain_"))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return {"model": make_model_dir(root / "model"), "tied": make_model_dir(root / "tied", tie=True),
            "text": make_text(root / "train.txt"), "root": root}


def cfg_for(assets, tmp_path, **sections):
    return tiny_cfg(assets["model"], assets["text"], tmp_path / "run", **sections)


def _no_model_load(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the model was loaded before the config error was raised")

    monkeypatch.setattr(ft, "build_model", fail)


# ---- bad configs fail before training, naming the field ---------------------------------------------------------
BAD = [
    (dict(train={"seq_len": 128, "steps": 6, "warmup_step": 3}), "Unknown key.*'warmup_step'.*did you mean 'warmup_steps'"),
    (dict(rope_patch={"scheme": "yarn", "factr": 4.0}), "rope_patch"),
    (dict(rope_patch={"scheme": "yarn", "factor": -2.0}), "factor"),
    (dict(rope_patch={"scheme": "yarnn", "factor": 2.0}), "yarn"),
    (dict(rope_patch={"scheme": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}), "covers 64 positions.*target length 128"),
    (dict(data={"files": ["/nonexistent/austen/*.txt"]}), "data.files.*matches no file"),
    (dict(pose={"target_length": 300}), "pose.target_length.*not divisible by `train.seq_len`=128"),
    (dict(pose={"target_length": 64}), "shorter than the training rows"),
    (dict(train={"global_batch_size": 5}), "global_batch_size`=5 is not divisible"),
    (dict(lora={"r": 4, "target_modules": ["q_proj"], "alpha": 3}), "lora.*alpha"),
    (dict(train={"mixed_precision": "bf32"}), "mixed_precision"),
    (dict(model="/nonexistent/model"), "model"),
    (dict(eval={"heldout": "/nonexistent.txt", "perplexity_lengths": [64]}), "eval.heldout"),
]


@pytest.mark.parametrize("change,match", BAD, ids=[m.split(".")[0][:30] for _, m in BAD])
def test_bad_configs_fail_before_training(change, match, assets, tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    cfg = cfg_for(assets, tmp_path)
    for key, value in change.items():
        cfg[key] = {**cfg[key], **value} if key == "train" else value
    with pytest.raises(ft.ConfigError, match=match):
        ft.main(cfg)
    assert not (tmp_path / "run").exists()


def test_missing_required_key(assets, tmp_path):
    cfg = cfg_for(assets, tmp_path)
    del cfg["train"]["steps"]
    with pytest.raises(ft.ConfigError, match="`train.steps` is required"):
        ft.load_config(cfg)


def test_set_overrides_and_cli_check(assets, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg_for(assets, tmp_path)))
    cfg = ft.load_config(path, ["train.steps=3", "pose.target_length=512"])
    assert cfg["train"]["steps"] == 3 and cfg["pose"] == {"target_length": 512, "n_chunks": 2}
    assert ft.cli(["--config", str(path), "--check"]) == 0
    assert ft.cli(["--config", str(path), "--check", "--set", "train.bogus=1"]) == 2
    assert "Unknown key(s) in `train`" in capsys.readouterr().err


# ---- rows: deterministic, dealt out by index ---------------------------------------------------------------------
def test_ranks_and_accumulation_see_the_same_global_batch(assets, tmp_path):
    cfg = ft.load_config(cfg_for(assets, tmp_path, train={"global_batch_size": 8, "micro_batch_size": 2}))
    one = [list(r) for r in ft.micro_batches(5, cfg, 0, 1, 4)]
    two = [list(r) for k in range(2) for r in ft.micro_batches(5, cfg, k, 2, 2)]
    assert sorted(sum(one, [])) == sorted(sum(two, [])) == list(range(8))


def test_rows_are_a_function_of_step_and_index(assets, tmp_path):
    cfg = ft.load_config(cfg_for(assets, tmp_path, pose={"target_length": 512}, data={"passkey_fraction": 0.5}))
    tok = __import__("transformers").AutoTokenizer.from_pretrained(assets["model"])
    rows = ft.Rows(cfg, ft.token_stream(cfg, tok), tok)
    a, b = rows.batch(3, range(4)), rows.batch(3, range(4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(rows.batch(4, range(4))["input_ids"], a["input_ids"])
    assert a["input_ids"].shape == (4, 128) and a["position_ids"].max() <= 511
    assert (rows.batch(3, range(16))["weights"] == 3.0).any()  # passkey rows weigh their answer tokens
    cache = list(Path(cfg["data"]["cache_dir"]).glob("*.pt"))
    assert len(cache) == 1  # tokenised once, cached


# ---- train, save, reload, merge ---------------------------------------------------------------------------------
def test_train_save_reload_and_merge(assets, tmp_path):
    cfg = tiny_cfg(assets["tied"], assets["text"], tmp_path / "run", output={"merge": True},
                   lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["embed_tokens", "norm"]},
                   train={"steps": 4, "save_every": 0})
    summary = ft.main(cfg)
    out = Path(summary["adapter"])
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4] and all(r["tokens_per_s"] > 0 for r in log)

    ids = torch.randint(3, 60, (1, 100), generator=torch.Generator().manual_seed(0))  # 100 > the 32-token window
    again = rope_patch.from_pretrained(out, attn_implementation="eager").eval()
    assert rope_patch.current(again).name == "yarn"
    trained = torch.load(out / "trainable.pt")
    params = dict(again.named_parameters())
    assert all(torch.equal(params[n].float(), v) for n, v in trained.items())  # the adapter holds the trained weights
    assert any("modules_to_save" in n for n in trained)  # LongLoRA: embeddings and norms trained too

    merged = json.loads((tmp_path / "run" / "merged" / "config.json").read_text())
    assert merged["rope_parameters"]["rope_type"] == "yarn" and merged["rope_parameters"]["factor"] == 4.0
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "merged", attn_implementation="eager").eval()  # no rope_patch
    with torch.no_grad():
        assert (plain(ids).logits - again(ids).logits).abs().max().item() <= 1e-5

    from rope_patch.persistence import export_info

    for folder in (tmp_path / "run" / "merged", out):  # `rope-patch export` on the recipe's outputs
        info = export_info(folder)
        assert info["rope_parameters"]["rope_type"] == "yarn" and info["max_position_embeddings"] == merged["max_position_embeddings"]


def test_resume_after_crash_gives_the_same_adapter(assets, tmp_path, monkeypatch):
    """In-process version (the crash raises); tests/recipes/test_distributed.py kills a real process with SIGKILL."""
    ref = ft.main(cfg_for(assets, tmp_path / "a"))
    cfg = cfg_for(assets, tmp_path / "b")
    monkeypatch.setenv("ROPE_PATCH_FINETUNE_CRASH_MODE", "raise")
    monkeypatch.setenv("ROPE_PATCH_FINETUNE_CRASH", "after_step:3")  # checkpoint at 2 exists, step 3 is lost
    with pytest.raises(KeyboardInterrupt):
        ft.main(cfg)
    assert ft.latest_checkpoint(tmp_path / "b" / "run").name == "step-0000002"
    monkeypatch.setenv("ROPE_PATCH_FINETUNE_CRASH", "during_save:4")  # killed half-way through writing step 4
    with pytest.raises(KeyboardInterrupt):
        ft.main(cfg, resume=True)
    assert ft.latest_checkpoint(tmp_path / "b" / "run").name == "step-0000002"
    monkeypatch.delenv("ROPE_PATCH_FINETUNE_CRASH")
    got = ft.main(cfg, resume=True)
    a, b = torch.load(Path(ref["adapter"]) / "trainable.pt"), torch.load(Path(got["adapter"]) / "trainable.pt")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    log = [json.loads(line)["step"] for line in (tmp_path / "b" / "run" / "train_log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4, 5, 6]  # lines of lost steps were dropped, not duplicated
    assert not list((tmp_path / "b" / "run" / "checkpoints").glob(".tmp-*"))


def test_resume_refuses_a_different_config(assets, tmp_path, monkeypatch):
    cfg = cfg_for(assets, tmp_path, train={"steps": 4})
    monkeypatch.setenv("ROPE_PATCH_FINETUNE_CRASH_MODE", "raise")
    monkeypatch.setenv("ROPE_PATCH_FINETUNE_CRASH", "after_step:3")
    with pytest.raises(KeyboardInterrupt):
        ft.main(cfg)
    monkeypatch.delenv("ROPE_PATCH_FINETUNE_CRASH")
    cfg["train"]["lr"] = 5e-4
    with pytest.raises(ft.ConfigError, match="different training config"):
        ft.main(cfg, resume=True)


# ---- every shipped config: loads, validates, dry-runs on the tiny model ------------------------------------------
def shrink(cfg: dict, assets, out: Path) -> dict:
    """The config with its model, data and lengths scaled down: the same scheme, LoRA block and options."""
    cfg = ft.load_config(cfg)
    t = cfg["train"]
    target = cfg["pose"]["target_length"] if cfg["pose"] else t["seq_len"]
    scale = 128 / t["seq_len"]
    cfg.update(model=str(assets["model"]), tokenizer=None, output_dir=str(out), eval=None)
    cfg["data"].update(files=[str(assets["text"])], dataset=None, cache_dir=str(out.parent / "cache"), passkey_min_tokens=100)
    t.update(seq_len=128, steps=2, warmup_steps=1, save_every=0, global_batch_size=2, micro_batch_size=1,
             mixed_precision="no", model_dtype="float32", threads=1, attn_implementation="eager")
    if cfg["pose"]:
        cfg["pose"]["target_length"] = int(target * scale)
    if cfg["rope_patch"] and "original_max_position_embeddings" in cfg["rope_patch"]:
        rp = cfg["rope_patch"]
        rp["original_max_position_embeddings"] = original = max(8, int(rp["original_max_position_embeddings"] * scale))
        if original > WINDOW:  # a tiny model pre-trained on that window: an original above the model's is refused
            cfg["model"] = str(make_model_dir(out.parent / f"model_w{original}", window=original))
    return cfg


def test_configs_ship():
    names = {p.name for p in CONFIGS}
    assert {"tiny_yarn_4x.yaml", "tiny_pi_4x.yaml", "tiny_pose_8x.yaml"} <= names
    assert len(names) >= 7


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_loads_and_dry_runs(path, assets, tmp_path):
    text = path.read_text()
    assert "launch" in text.split("\n\n")[0].lower(), f"{path.name}: the header must hold the launch command"
    assert "recipes/finetune_lora.py" in text.split("\n\n")[0]
    raw = yaml.safe_load(text)
    cfg = ft.load_config(raw)  # structure: no unknown keys
    for key in ("rope_patch", "lora"):
        block_lines = [ln for ln in text.split(f"\n{key}:")[1].split("\n\n")[0].splitlines()[1:] if ln.startswith("  ") and ":" in ln]
        assert all("#" in ln for ln in block_lines), f"{path.name}: every `{key}` value carries a comment with its reason"
    summary = ft.main(shrink(raw, assets, tmp_path / "run"))
    assert summary["steps"] == 2 and summary["final_loss"] == summary["final_loss"]  # not NaN
    assert cfg["rope_patch"] is None or rope_patch.current(rope_patch.from_pretrained(summary["adapter"])).name == cfg["rope_patch"]["scheme"]


def test_accelerate_configs_parse():
    files = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))
    kinds = {yaml.safe_load(p.read_text())["distributed_type"] for p in files}
    assert {"MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED"} <= kinds
    from accelerate.commands.config.config_args import load_config_from_file

    for p in files:
        load_config_from_file(str(p))  # what `accelerate launch --config_file` reads: rejects unknown keys
        cfg = yaml.safe_load(p.read_text())
        if cfg["distributed_type"] == "DEEPSPEED":
            assert cfg["deepspeed_config"]["zero_stage"] == 3


def test_script_runs_as_a_command(assets, tmp_path):
    """`python recipes/finetune_lora.py --check` (no model load) from the repository root."""
    import subprocess
    import sys

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg_for(assets, tmp_path)))
    res = subprocess.run([sys.executable, str(ROOT / "recipes" / "finetune_lora.py"), "--config", str(path), "--check",
                          "--set", "train.global_batch_size=3"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 2 and "global_batch_size`=3 is not divisible" in res.stderr


def test_jsonl_documents_and_their_errors(assets, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    good = tmp_path / "docs.jsonl"
    good.write_text("\n".join(json.dumps({"body": f"doc {i} the pass key is {i}."}) for i in range(3)) + "\n")
    cfg = ft.load_config(cfg_for(assets, tmp_path, data={"files": [str(good)], "text_field": "body"}))
    stream = ft.token_stream(cfg, tok).tolist()
    assert stream.count(tok.bos_token_id) == 3 and stream.count(tok.eos_token_id) == 3  # one framed document per line
    cfg["data"]["text_field"] = "text"
    cfg["data"]["cache_dir"] = str(tmp_path / "other_cache")
    with pytest.raises(ft.ConfigError, match="docs.jsonl:1 has no field `text`"):
        ft.token_stream(cfg, tok)


def test_cosine_schedule_with_warmup():
    lr = [ft.cosine_with_warmup(s, 2, 10, 0.1) for s in range(11)]
    assert lr[0] == 0.5 and lr[1] == 1.0 and lr[2] == 1.0
    assert all(a >= b for a, b in zip(lr[2:], lr[3:], strict=False)) and lr[10] == pytest.approx(0.1)
