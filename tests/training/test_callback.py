"""RopePatchCallback / restore_patch / learned_modules_to_save / export.save_patch, one case per row; the run's
checkpoint-completeness marker and JSON log."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import peft
import pytest
import torch
from helpers.models import WINDOW, logits, tiny_config, tiny_model
from helpers.training import packed
from transformers import AutoModelForCausalLM

import rope_patch
from rope_patch.api import patch_modules
from rope_patch.persistence import MANIFEST, PATCH_WEIGHTS, save_patch
from rope_patch.training import (
    CompleteCheckpointCallback,
    ConfigError,
    JsonLogCallback,
    PoSECollator,
    RopePatchCallback,
    complete_checkpoints,
    discard_checkpoints_after,
    frozen_tables,
    last_checkpoint,
    learned_modules_to_save,
    restore_patch,
    resume_checkpoint,
)
from rope_patch.training.callback import COMPLETE

PATCHES = {  # scheme -> (params, learned modules)
    None: ({}, []),
    "yarn": (dict(factor=4), []),
    "alibi": ({}, []),
    "relative_bias": (dict(init="alibi"), ["rope_patch_relative_bias"]),
    "learned_absolute": (dict(max_position_embeddings=4 * WINDOW), ["rope_patch_position_embeddings"]),
}


def patched(scheme, seed: int = 0):
    model = tiny_model(seed=seed)
    if scheme is not None:
        rope_patch.apply(model, scheme, **PATCHES[scheme][0])
    return model


def train_a_little(model):
    """Move the learned tables away from their initial values (what training does)."""
    with torch.no_grad():
        for module in patch_modules(model).values():
            for p in module.parameters():
                p.add_(torch.linspace(-0.5, 0.5, p.numel()).reshape(p.shape))


@pytest.mark.parametrize("scheme", list(PATCHES), ids=str)
def test_learned_modules_to_save(scheme):
    model = patched(scheme)
    assert learned_modules_to_save(model) == PATCHES[scheme][1]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                      modules_to_save=learned_modules_to_save(model) or None))
    assert learned_modules_to_save(lora) == PATCHES[scheme][1]  # the names are those of the base model
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    for name in PATCHES[scheme][1]:
        assert any(f"{name}.modules_to_save" in n for n in trainable)


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "adapter"])
@pytest.mark.parametrize("scheme", ["yarn", "alibi", "relative_bias", "learned_absolute"])
def test_save_patch_next_to_a_plain_save_loads_like_save_pretrained(scheme, adapter, tmp_path, ids):
    """A folder written by transformers / peft (what a Trainer checkpoint holds) + save_patch = a rope_patch save."""
    model = patched(scheme).eval()
    train_a_little(model)
    if adapter:
        tiny_model(seed=0).save_pretrained(tmp_path / "base")
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "ckpt")
    assert save_patch(model, tmp_path / "ckpt") == tmp_path / "ckpt"
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    assert manifest["scheme"] == scheme and manifest["adapter"] is adapter
    assert (tmp_path / "ckpt" / PATCH_WEIGHTS).is_file() == bool(PATCHES[scheme][1])
    kw = {"base_model": str(tmp_path / "base")} if adapter else {}
    again = rope_patch.from_pretrained(tmp_path / "ckpt", attn_implementation="eager", **kw).eval()
    assert (logits(again, ids) - logits(model, ids)).abs().max().item() <= 1e-5


def test_save_patch_needs_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        save_patch(patched("yarn"), tmp_path / "missing")


# ---- restore_patch ----------------------------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    """{scheme: folder} of trained, saved models (a checkpoint's patch files)."""
    out = {}
    for scheme in ("yarn", "relative_bias"):
        model = patched(scheme)
        train_a_little(model)
        out[scheme] = (rope_patch.save_pretrained(model, tmp_path / scheme), model)
    return out


@pytest.mark.parametrize("prepatch", [False, True], ids=["unpatched", "patched"])
@pytest.mark.parametrize("scheme", ["yarn", "relative_bias"])
def test_restore_patch(scheme, prepatch, saved, ids):
    folder, trained = saved[scheme]
    model = patched(scheme if prepatch else None)
    assert restore_patch(model, folder).name == scheme
    model.eval(), trained.eval()
    assert (logits(model, ids) - logits(trained, ids)).abs().max().item() <= 1e-6  # tables loaded too


WRAPPED = [  # (checkpoint's scheme, restore_patch on an unpatched model already wrapped by peft)
    ("relative_bias", r"before wrapping it \(get_peft_model"),
    ("yarn", None),  # no tables: re-applied under the wrapper as well
]


@pytest.mark.parametrize("scheme,refused", WRAPPED)
def test_restore_patch_after_get_peft_model(scheme, refused, saved):
    """Learned tables restored under peft's wrapper would not be its modules_to_save: refused, naming the order."""
    model = peft.get_peft_model(patched(None), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    if refused:
        with pytest.raises(ValueError, match=rf"records relative_bias with learned tables .*already wrapped "
                                             rf"\(PeftModel\) and unpatched: .*{refused}"):
            restore_patch(model, saved[scheme][0])
        assert rope_patch.current(model) is None
    else:
        assert restore_patch(model, saved[scheme][0]).name == scheme


def test_restore_patch_refuses_another_patch(saved):
    with pytest.raises(ValueError, match=r"records the patch relative_bias\(.*carries yarn\(factor=4"):
        restore_patch(patched("yarn"), saved["relative_bias"][0])
    model = tiny_model()
    rope_patch.apply(model, "relative_bias", init="zeros")
    with pytest.raises(ValueError, match="init='alibi'.*init='zeros'"):
        restore_patch(model, saved["relative_bias"][0])


def test_restore_patch_refuses_another_base_model(saved):
    cfg = tiny_config()
    cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": 123.0}
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    rope_patch.apply(model, "yarn", factor=4)
    with pytest.raises(ValueError, match="another base model"):
        restore_patch(model, saved["yarn"][0])


def test_restore_patch_without_a_checkpoint(tmp_path):
    model = patched("yarn")
    assert restore_patch(model, None).name == "yarn"
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileNotFoundError, match="without RopePatchCallback"):
        restore_patch(model, tmp_path / "ckpt")


# ---- the callback's two events, called as Trainer calls them ----------------------------------------------------

def call(event, model, output_dir, step, should_save=True, **init):
    args = SimpleNamespace(output_dir=str(output_dir), should_save=should_save, resume_from_checkpoint=None)
    state = SimpleNamespace(global_step=step)
    return getattr(RopePatchCallback(**init), event)(args, state, SimpleNamespace(), model=model)


@pytest.mark.parametrize("should_save", [True, False])
def test_on_save_writes_into_the_checkpoint_folder(should_save, tmp_path):
    model = peft.get_peft_model(patched("relative_bias"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    (tmp_path / "checkpoint-6").mkdir()
    call("on_save", model, tmp_path, 6, should_save=should_save)
    assert (tmp_path / "checkpoint-6" / MANIFEST).is_file() == should_save  # only the saving process writes
    assert (tmp_path / "checkpoint-6" / PATCH_WEIGHTS).is_file() == should_save


def test_on_save_without_the_folder_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        call("on_save", patched("yarn"), tmp_path, 3)
    assert "no checkpoint folder" in caplog.text and not list(tmp_path.iterdir())


RESUME = [  # (checkpoint's scheme, model's scheme, what on_train_begin does)
    ("yarn", None, "reapplied"),
    ("alibi", None, "reapplied"),
    ("yarn", "yarn", "kept"),
    ("relative_bias", "relative_bias", "kept"),
    (None, None, "kept"),
    ("yarn", "alibi", "records the patch yarn"),
    (None, "yarn", "records the patch no patch"),
    ("relative_bias", None, "restore_patch"),
]


@pytest.mark.parametrize("recorded,live,outcome", RESUME)
def test_on_train_begin_on_resume(recorded, live, outcome, tmp_path):
    folder = tmp_path / "checkpoint-4"
    rope_patch.save_pretrained(patched(recorded), folder)
    model = patched(live)
    if outcome in ("reapplied", "kept"):
        call("on_train_begin", model, tmp_path, 4)
        assert (rope_patch.current(model) and rope_patch.current(model).name) == (recorded or None)
    else:
        with pytest.raises(ValueError, match=outcome):
            call("on_train_begin", model, tmp_path, 4)


FROZEN = [  # (scheme, how the model trains, the tables on_train_begin names as frozen)
    ("relative_bias", "lora", ["rope_patch_relative_bias"]),
    ("learned_absolute", "lora", ["rope_patch_position_embeddings"]),
    ("relative_bias", "lora+modules_to_save", []),
    ("learned_absolute", "lora+modules_to_save", []),
    ("relative_bias", "full", []),
    ("yarn", "lora", []),
    (None, "lora", []),
    ("relative_bias", "reloaded", ["rope_patch_relative_bias"]),  # an adapter loaded for inference
    ("relative_bias", "reloaded, is_trainable", []),
]


@pytest.mark.parametrize("scheme,how,frozen", FROZEN)
def test_on_train_begin_warns_about_a_frozen_learned_table(scheme, how, frozen, tmp_path, caplog):
    """A LoRA built without modules_to_save=learned_modules_to_save(model) leaves the learned table at its initial
    values: the run must say so where training begins, naming the fix."""
    model = patched(scheme)
    if how != "full":
        names = learned_modules_to_save(model) if how != "lora" else []
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                           modules_to_save=names or None))
    if how.startswith("reloaded"):
        tiny_model(seed=0).save_pretrained(tmp_path / "base")
        rope_patch.save_pretrained(model, tmp_path / "adapter")
        model = rope_patch.from_pretrained(tmp_path / "adapter", base_model=str(tmp_path / "base"),
                                           **({"is_trainable": True} if "is_trainable" in how else {}))
    assert frozen_tables(model) == frozen
    with caplog.at_level(logging.WARNING, logger="rope_patch"):
        call("on_train_begin", model, tmp_path, 0)
    if how == "reloaded":
        assert "the adapter was loaded for inference" in caplog.text and "is_trainable=True" in caplog.text
    elif frozen:
        assert f"the learned table(s) {', '.join(frozen)} of the {scheme} patch are frozen" in caplog.text
        assert "modules_to_save=rope_patch.training.learned_modules_to_save(model)" in caplog.text
    else:
        assert "frozen" not in caplog.text


FSDP = [  # (scheme, how FSDP shows, refused)
    ("relative_bias", "args.fsdp", True),
    ("learned_absolute", "ACCELERATE_USE_FSDP", True),
    ("relative_bias", "DTensor", True),
    ("yarn", "args.fsdp", False),  # no tables: nothing to gather
    ("self_extend", "ACCELERATE_USE_FSDP", False),
    ("relative_bias", None, False),
]


@pytest.mark.parametrize("scheme,how,refused", FSDP)
def test_on_train_begin_refuses_learned_tables_under_fsdp(scheme, how, refused, tmp_path, monkeypatch):
    """FSDP shards the tables and rope_patch does not gather them there: every checkpoint would hold one process's
    shard (a reload fails on the shapes, after training), so training does not begin."""
    model = patched(scheme) if scheme != "self_extend" else tiny_model()
    if scheme == "self_extend":
        rope_patch.apply(model, "self_extend", group_size=2, window_size=8)
    args = SimpleNamespace(output_dir=str(tmp_path), should_save=True, resume_from_checkpoint=None,
                           fsdp=how == "args.fsdp")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true" if how == "ACCELERATE_USE_FSDP" else "false")
    if how == "DTensor":  # what FSDP2's fully_shard makes of a parameter
        monkeypatch.setattr(patch_modules(model)["rope_patch_relative_bias"], "weight",
                            type("DTensor", (torch.nn.Parameter,), {})(torch.zeros(1)))
    callback = RopePatchCallback()
    if refused:
        with pytest.raises(ValueError, match=r"owns learned tables \(rope_patch_.*\), which rope_patch cannot gather "
                                             r"under FSDP.*DDP or DeepSpeed ZeRO-3"):
            callback.on_train_begin(args, SimpleNamespace(global_step=0), SimpleNamespace(), model=model)
    else:
        callback.on_train_begin(args, SimpleNamespace(global_step=0), SimpleNamespace(), model=model)


def test_on_train_begin_finds_the_checkpoint(tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    rope_patch.save_pretrained(patched("yarn"), elsewhere)
    model = patched(None)
    call("on_train_begin", model, tmp_path, 0)  # a fresh start: nothing to restore
    assert rope_patch.current(model) is None
    with caplog.at_level(logging.WARNING):
        call("on_train_begin", model, tmp_path, 4)  # resumed, but no output_dir/checkpoint-4
    assert "found no" in caplog.text and rope_patch.current(model) is None
    call("on_train_begin", model, tmp_path, 4, resume_from_checkpoint=elsewhere)
    assert rope_patch.current(model).name == "yarn"


# ---- a real Trainer: a full (not peft) model, yarn, resumed on an unpatched model ------------------------------

def run(out, *, patch: bool, resume=None, max_steps=4):
    from transformers import Trainer, TrainingArguments

    model = tiny_model(seed=0)
    if patch:
        rope_patch.apply(model, "yarn", factor=8)
    tok, train = packed(seq_len=64, n_docs=8)
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=2, logging_steps=1,
                             per_device_train_batch_size=2, learning_rate=1e-3, seed=0, use_cpu=True, report_to=[],
                             dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[RopePatchCallback()],
                      data_collator=PoSECollator(target_length=256, seed=0))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_a_resumed_full_model_run_gets_its_patch_back(tmp_path):
    full = run(tmp_path / "full", patch=True)
    for step in (2, 4):
        folder = tmp_path / "full" / f"checkpoint-{step}"
        assert json.loads((folder / MANIFEST).read_text())["scheme"] == "yarn"
        # the checkpoint's config.json carries yarn natively (as rope_patch.save_pretrained writes it)
        assert json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "killed" / "checkpoint-2")
    resumed = run(tmp_path / "killed", patch=False, resume=True)  # the script forgot the patch: the callback has it
    assert rope_patch.current(resumed.model).name == "yarn"
    a, b = dict(full.model.named_parameters()), dict(resumed.model.named_parameters())
    assert max((a[n] - b[n]).abs().max().item() for n in a) <= 1e-6
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "killed" / "checkpoint-4", attn_implementation="eager")
    ids = torch.randint(3, 90, (1, 100), generator=torch.Generator().manual_seed(0))
    assert (logits(plain, ids) - logits(resumed.model.eval(), ids)).abs().max().item() <= 1e-5



# ---- a checkpoint is complete once its marker is written; one JSON line per logged step ---------------------------

def test_complete_checkpoints_are_the_marked_ones_in_step_order(tmp_path):
    for step in (2, 9, 10, 12):
        (tmp_path / f"checkpoint-{step}").mkdir()
    args = SimpleNamespace(output_dir=str(tmp_path), should_save=True)
    for step in (10, 2, 9):  # checkpoint-12: killed inside its save, never marked
        CompleteCheckpointCallback("abc").on_save(args, SimpleNamespace(global_step=step), None)
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / "checkpoint-x" / COMPLETE).write_text("{}")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-9", "checkpoint-10"]
    assert last_checkpoint(tmp_path).name == "checkpoint-10" and last_checkpoint(tmp_path / "none") is None
    assert json.loads((tmp_path / "checkpoint-9" / COMPLETE).read_text()) == {"step": 9, "config": "abc"}
    CompleteCheckpointCallback("abc").on_save(SimpleNamespace(output_dir=str(tmp_path), should_save=False),
                                              SimpleNamespace(global_step=12), None)
    assert not (tmp_path / "checkpoint-12" / COMPLETE).exists()  # only the saving process writes


KEPT = [  # (Trainer's best checkpoint, the folders left after checkpoint-6 is marked with keep=1)
    (None, ["checkpoint-6"]),
    ("checkpoint-2", ["checkpoint-2", "checkpoint-6"]),  # load_best_model_at_end reads it at the end
]


@pytest.mark.parametrize("best,left", KEPT)
def test_keep_removes_older_checkpoints_mark_first_and_never_the_best(best, left, tmp_path, monkeypatch):
    args = SimpleNamespace(output_dir=str(tmp_path), should_save=True)
    removed = []
    real = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda p, **k: (removed.append((p.name, (p / COMPLETE).exists())),
                                                            real(p, **k)))
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        state = SimpleNamespace(global_step=step, best_model_checkpoint=best and str(tmp_path / best))
        CompleteCheckpointCallback("abc", keep=1).on_save(args, state, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == left
    assert removed and not any(marked for _, marked in removed)  # a kill inside rmtree leaves no 'complete' folder


def test_resume_takes_the_newest_complete_checkpoint_of_the_same_config(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path), should_save=True)
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
    for step in (2, 4):  # checkpoint-6: a killed run's incomplete save
        CompleteCheckpointCallback("abc").on_save(args, SimpleNamespace(global_step=step), None)
    assert resume_checkpoint(tmp_path, "abc").name == "checkpoint-4"
    assert resume_checkpoint(tmp_path / "none", "abc") is None
    with pytest.raises(ConfigError, match=r"checkpoint-4: it was written with a different training "
                                          r"config \(fingerprint abc vs xyz\)"):
        resume_checkpoint(tmp_path, "xyz")
    (tmp_path / "other").mkdir()
    discard_checkpoints_after(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4", "other"]



def test_json_log_writes_one_line_per_logged_loss(tmp_path, capsys):
    log = JsonLogCallback(tmp_path / "log.jsonl", tokens_per_step=512, elapsed_before=60.0, last_step=4)
    args = SimpleNamespace(disable_tqdm=True)
    for step, logs in ((5, {"loss": 2.5, "learning_rate": 1e-3, "grad_norm": 0.5}), (6, {"eval_loss": 1.0})):
        state = SimpleNamespace(is_world_process_zero=True, global_step=step, max_steps=10)
        log.on_log(args, state, None, logs=logs)
    log.on_log(args, SimpleNamespace(is_world_process_zero=False, global_step=7, max_steps=10), None,
               logs={"loss": 1.0})
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["step"] == 5 and lines[0]["tokens"] == 5 * 512 and lines[0]["elapsed_s"] >= 60
    assert {k: lines[0][k] for k in ("loss", "lr", "grad_norm")} == {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5}
    assert "step      5/10  loss 2.5000" in capsys.readouterr().out
