"""A user's own short transformers.Trainer script: peft LoRA + the patch's learned table, the collators, the callback.

Interrupted at checkpoint-2 and resumed, it ends with the weights and losses of the uninterrupted run."""

from __future__ import annotations

import json
import random
import shutil

import peft
import pytest
import torch
import transformers
from helpers.models import tiny_model
from helpers.training import packed

import rope_patch
from rope_patch.training import (  # noqa: E402
    PasskeyMixer,
    PoSECollator,
    RopePatchCallback,
    learned_modules_to_save,
    restore_patch,
)

SEQ, TARGET = 128, 256
# Both own a learned table (trained through peft's modules_to_save). relative_bias measures distance by token order,
# so PoSE's position ids do not reach it; learned_absolute looks its table up by position id, so they do.
SCHEMES = {"relative_bias": dict(max_distance=TARGET, init="alibi"),
           "learned_absolute": dict(max_position_embeddings=TARGET)}
TABLES = {"relative_bias": "rope_patch_relative_bias", "learned_absolute": "rope_patch_position_embeddings"}


class StatefulPoSE(PoSECollator):
    """The naive collator: one generator advanced batch after batch (what a resume cannot reproduce)."""

    def __post_init__(self):
        super().__post_init__()
        self.rng = random.Random(0)

    def position_ids(self, index, train_length):
        from rope_patch.training.pose import pose_position_ids

        return pose_position_ids(train_length, self.target_length, self.n_chunks, self.rng)


def user_script(out, scheme, resume=False, pose=PoSECollator):
    """What a practitioner writes (the only rope_patch lines: apply/restore_patch, learned_modules_to_save, the
    collators and the callback)."""
    checkpoint = transformers.trainer_utils.get_last_checkpoint(str(out)) if resume else None
    model = tiny_model(seed=0)
    if checkpoint is None:
        rope_patch.apply(model, scheme, **SCHEMES[scheme])
    else:
        restore_patch(model, checkpoint)  # before get_peft_model: the table must exist to be wrapped
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
                           modules_to_save=learned_modules_to_save(model), task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    tok, train = packed(seq_len=SEQ, n_docs=12)
    collator = PasskeyMixer(tok, train.stream, fraction=0.5, min_tokens=100, seed=0,
                            collator=pose(target_length=TARGET, n_chunks=2, seed=0))
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=4, save_steps=2, save_strategy="steps", logging_steps=1,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=5e-3, warmup_steps=1,
        lr_scheduler_type="cosine", seed=0, use_cpu=True, report_to=[], dataloader_num_workers=0,
        remove_unused_columns=False, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train, data_collator=collator,
                                   callbacks=[RopePatchCallback()])
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer


def interrupt_and_resume(root, scheme, pose=PoSECollator):
    """The uninterrupted run, and a run killed right after checkpoint-2 (its output folder holds only that
    checkpoint) then resumed by the same script."""
    full = user_script(root / scheme, scheme, pose=pose)
    shutil.copytree(root / scheme / "checkpoint-2", root / f"{scheme}-killed" / "checkpoint-2")
    return full, user_script(root / f"{scheme}-killed", scheme, resume=True, pose=pose)


def trained(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def step_losses(trainer) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in trainer.state.log_history if "loss" in r}


@pytest.fixture(scope="module", params=list(SCHEMES))
def runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    full, resumed = interrupt_and_resume(root, request.param)
    return {"root": root / request.param, "scheme": request.param, "full": full, "resumed": resumed}


def test_every_checkpoint_carries_the_patch(runs):
    for step in (2, 4):
        folder = runs["root"] / f"checkpoint-{step}"
        manifest = json.loads((folder / "rope_patch.json").read_text())
        assert manifest["scheme"] == runs["scheme"] and manifest["adapter"] is True
        assert manifest["weights"]["keys"] == [f"{TABLES[runs['scheme']]}.weight"]
        assert (folder / "rope_patch.safetensors").is_file() and (folder / "adapter_model.safetensors").is_file()


def test_the_table_trains_through_modules_to_save(runs):
    names = [n for n in trained(runs["full"].model) if TABLES[runs["scheme"]] in n]
    assert names and all("modules_to_save" in n for n in names)
    start = tiny_model(seed=0)
    rope_patch.apply(start, runs["scheme"], **SCHEMES[runs["scheme"]])
    initial = getattr(start, TABLES[runs["scheme"]]).weight
    final = dict(runs["full"].model.named_parameters())[names[0]]
    assert (final - initial).abs().max() > 1e-4  # it moved: the optimizer had it


def max_diff(a, b) -> tuple[float, float]:
    """(largest |Δ| over the trained weights, largest |Δ| over the logged step losses) of two runs."""
    wa, wb = trained(a.model), trained(b.model)
    assert wa.keys() == wb.keys()
    la, lb = step_losses(a), step_losses(b)
    assert la.keys() == lb.keys() == {1, 2, 3, 4}
    return max((wa[n] - wb[n]).abs().max().item() for n in wa), max(abs(la[s] - lb[s]) for s in la)


def test_resume_from_checkpoint_2_equals_the_uninterrupted_run(runs):
    weights, losses = max_diff(runs["full"], runs["resumed"])
    assert weights <= 1e-6 and losses <= 1e-6, (weights, losses)  # measured: 0.0 and 0.0 (CPU, fp32)
    assert rope_patch.current(runs["resumed"].model).name == runs["scheme"]


def test_a_collator_with_its_own_generator_would_not_resume_exactly(tmp_path):
    """The control: the same script with a generator advanced batch by batch (Trainer skips the seen batches
    without calling the collator, so after the resume it draws the rows of steps 1-2 again)."""
    full, resumed = interrupt_and_resume(tmp_path, "learned_absolute", pose=StatefulPoSE)  # PoSE reaches its table
    weights, losses = max_diff(full, resumed)
    assert weights > 1e-5 and losses > 1e-5


def test_a_checkpoint_loads_with_rope_patch_from_pretrained(runs, tmp_path):
    """checkpoint-4 is an adapter folder + rope_patch.json: from_pretrained rebuilds the trained model."""
    base_dir = tmp_path / "base"
    tiny_model(seed=0).save_pretrained(base_dir)
    again = rope_patch.from_pretrained(runs["root"] / "checkpoint-4", base_model=str(base_dir)).eval()
    model = runs["full"].model.eval()
    ids = torch.randint(3, 90, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (again(ids).logits - model(ids).logits).abs().max().item() <= 1e-5
    assert rope_patch.current(again).name == runs["scheme"]
