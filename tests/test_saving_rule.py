"""The one rule of every save of a patched model: config.json reloads (with transformers alone) to the patched model
where the WHOLE patch has a native form, and to the unpatched model otherwise, with a logged warning that names the
part without a native form and how to reload the patch. The three ways to save: transformers' own
`model.save_pretrained`, `rope_patch.save_pretrained`, and the LoRA recipe's `--merge` (merge_and_unload, then
rope_patch.save_pretrained).

Before the rule, a stack saved with a plain save_pretrained reloaded as its frequency part alone (yarn:4+self_extend
as native yarn x4): a model that was neither the patched nor the unpatched one."""

from __future__ import annotations

import logging

import peft
import pytest
import torch
from helpers.models import WINDOW, logits, tiny_model
from transformers import AutoModelForCausalLM

import rope_patch
from rope_patch.persistence import MANIFEST

# spec, the parts the warning must name as lacking a native form
STACKS = [
    ("yarn:4+self_extend:group_size=4,window_size=16", ["self_extend"]),
    ("yarn:4+logn", ["logn"]),
    ("linear:4+rerope:window_size=16", ["rerope"]),
    ("llama3:4+dca", ["dca"]),
]
SINGLE = [  # one scheme: native (reloads patched, says nothing) or not (reloads unpatched, says why)
    ("yarn:4", []),
    ("dynamic_yarn:4", ["dynamic_yarn"]),
    ("self_extend:group_size=4,window_size=16", ["self_extend"]),
]
SAVES = ["plain", "rope_patch", "merged"]


def _save(model, how: str, folder):
    if how == "plain":
        model.save_pretrained(folder)
    elif how == "rope_patch":
        rope_patch.save_pretrained(model, folder)
    else:  # what recipes/finetune_lora.py --merge does with the trained adapter
        merged = model.merge_and_unload()
        rope_patch.save_pretrained(merged, folder)


def _model(how: str, spec: str):
    model = tiny_model(attn_implementation="sdpa")
    if how == "merged":
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False)).eval()
    return model


@pytest.mark.parametrize("how", SAVES)
@pytest.mark.parametrize("spec,lacking", STACKS + SINGLE, ids=[s for s, _ in STACKS + SINGLE])
def test_a_save_reloads_the_patched_or_the_unpatched_model_and_says_which(spec, lacking, how, tmp_path, caplog):
    ids = torch.randint(3, 97, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    model = _model(how, spec)
    unpatched = logits(model, ids)
    rope_patch.apply(model, spec)
    patched = logits(model, ids)
    assert (patched - unpatched).abs().max().item() > 1e-4  # the patch changes this input: the checks below can fail
    with caplog.at_level(logging.WARNING, logger="rope_patch"):
        _save(model, how, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert rope_patch.current(plain) is None
    expected = unpatched if lacking else patched
    assert (logits(plain, ids) - expected).abs().max().item() <= 1e-5, "config.json reloads a third model"
    notices = [r.getMessage() for r in caplog.records if r.name == "rope_patch" and "config.json" in r.getMessage()]
    if not lacking:
        assert not notices
        return
    assert len(notices) == 1, notices
    msg = notices[0]
    assert str(tmp_path / "config.json") in msg and "unpatched model" in msg
    assert all(f"{name} " in msg for name in lacking) and "no native transformers form" in msg
    if how == "plain":
        assert "rope_patch.save_pretrained(model, dir)" in msg and "rope_patch.from_pretrained(dir)" in msg
        assert not (tmp_path / MANIFEST).exists()
    else:
        assert f"rope_patch.from_pretrained({str(tmp_path)!r}) reads the rope_patch.json" in msg
        again = rope_patch.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
        assert (logits(again, ids) - patched).abs().max().item() <= 1e-5


def test_the_patched_config_is_what_a_save_writes(tmp_path):
    """A stack's public config keeps the unpatched RoPE (the frequency part alone would be a third model); the rotary
    still runs the stack's frequencies; remove() gives the class's save_pretrained back."""
    model = tiny_model()
    original = {"rope_parameters": dict(model.config.rope_parameters), "window": model.config.max_position_embeddings}
    rope_patch.apply(model, "yarn:4+logn")
    assert model.config.rope_parameters == original["rope_parameters"]
    assert model.config.max_position_embeddings == original["window"]
    assert model.model.rotary_emb.rope_type == "yarn" and rope_patch.context_window(model) == 4 * WINDOW
    assert "save_pretrained" in vars(model)
    rope_patch.remove(model)
    assert "save_pretrained" not in vars(model)
    rope_patch.apply(model, "yarn:4")  # native: the class's own save, nothing to say
    assert "save_pretrained" not in vars(model) and model.config.rope_parameters["rope_type"] == "yarn"


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_notice_and_point_it_at_themselves(how, tmp_path, caplog):
    from helpers.models import roundtrip

    model = tiny_model()
    rope_patch.apply(model, "yarn:4+logn")
    copy = roundtrip(model, how)
    assert vars(copy)["save_pretrained"].model is copy
    with caplog.at_level(logging.WARNING, logger="rope_patch"):
        copy.save_pretrained(tmp_path)
    assert any("logn has no native transformers form" in r.getMessage() for r in caplog.records)


def test_checkpoints_of_one_run_warn_once(tmp_path, caplog):
    """A Trainer run's checkpoints (checkpoint-N in one folder) warn once, later ones at info level; another run,
    another folder of the same parent, and a copy of the model warn again."""
    from helpers.models import roundtrip

    model = tiny_model()
    rope_patch.apply(model, "yarn:4+logn")

    def warned(folder, who=model):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="rope_patch"):
            who.save_pretrained(folder)
        said = [r for r in caplog.records if "no native transformers form" in r.getMessage()]
        assert len(said) == 1, said
        return said[0].levelno == logging.WARNING

    assert [warned(tmp_path / "run" / f"checkpoint-{n}") for n in (1, 2, 3)] == [True, False, False]
    assert warned(tmp_path / "other" / "checkpoint-1")
    assert [warned(tmp_path / name) for name in ("a", "b", "a")] == [True, True, False]  # folders of one parent
    assert warned(tmp_path / "run" / "checkpoint-4", roundtrip(model, "deepcopy"))
