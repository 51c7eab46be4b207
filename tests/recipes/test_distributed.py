"""Real processes: a run killed with SIGKILL inside a checkpoint save and resumed with --resume ends with the
uninterrupted loss curve and adapter; 2-process DDP on CPU (torchrun, gloo) gives the loss curve and adapter of
1 process with the same global batch; an FSDP request on CPU is refused instead of silently running DDP. Each spawns
Python processes (~10-20 s of imports each on a loaded 2-core machine), hence `slow`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.recipes import (
    adapter_weights,
    load_recipe,
    loss_curve,
    make_model_dir,
    make_text,
    max_weight_diff,
    tiny_cfg,
)
from helpers.scripts import ROOT

from rope_patch.training import last_checkpoint

ft = load_recipe()
SCRIPT = str(ROOT / "recipes" / "finetune_lora.py")
pytestmark = pytest.mark.slow

# The crash injection lives here, not in the recipe: this program runs the recipe's main() with a TrainerCallback
# that SIGKILLs its own process while checkpoint-4 is being written (Trainer has saved the adapter, optimizer, RNG and
# trainer state; the recipe has not yet marked it complete).
KILLED_RUN = """
import os, signal, sys
sys.path.insert(0, {recipes!r})
import finetune_lora
from transformers import TrainerCallback

class KillDuringSave(TrainerCallback):
    def on_save(self, args, state, control, **kw):
        if state.global_step == 4:
            os.kill(os.getpid(), signal.SIGKILL)

finetune_lora.main({config!r}, callbacks=[KillDuringSave()])
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return make_model_dir(root / "model"), make_text(root / "train.txt")


def _env(**extra):
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            **extra}


def _write(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_kill_9_during_a_save_then_resume_matches_uninterrupted(assets, tmp_path):
    model, text = assets
    ref = ft.main(tiny_cfg(model, text, tmp_path / "ref"))
    cfg = _write(tiny_cfg(model, text, tmp_path / "run"), tmp_path / "c.yaml")
    killed = subprocess.run([sys.executable, "-c", KILLED_RUN.format(recipes=str(ROOT / "recipes"), config=str(cfg))],
                            cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run = tmp_path / "run"
    assert (run / "checkpoints" / "checkpoint-4" / "optimizer.pt").is_file()  # written, but not complete
    assert last_checkpoint(run / "checkpoints").name == "checkpoint-2"
    assert list(loss_curve(run)) == [1, 2, 3, 4]
    resumed = subprocess.run([sys.executable, SCRIPT, "--config", str(cfg), "--resume"], cwd=ROOT, capture_output=True,
                             text=True, env=_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "checkpoint-2 (step 2)" in resumed.stdout
    a, b = loss_curve(tmp_path / "ref"), loss_curve(run)
    assert list(a) == list(b) == [1, 2, 3, 4, 5, 6]
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-6  # measured 0.0
    assert max_weight_diff(adapter_weights(Path(ref["adapter"]).parent), adapter_weights(run)) <= 1e-6  # measured 0.0


def test_two_process_ddp_matches_one_process(assets, tmp_path):
    """1 process x 2 accumulation steps x 2 rows vs 2 processes x 1 x 2 rows: the same 4 rows per step (the dataset is
    cut to whole global batches and accelerate's seeded sampler deals them out). Tolerance 1e-6: both sum the same
    fp32 gradients (accumulation adds g1/2 + g2/2, DDP all-reduces g1 + g2 and divides by 2), which can differ by an
    ulp per step; measured here: 0.0 for losses and weights."""
    model, text = assets
    common = dict(lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
                  train={"global_batch_size": 4, "micro_batch_size": 2, "steps": 4, "save_every": 0})
    one = ft.main(tiny_cfg(model, text, tmp_path / "one", **common))
    cfg = _write(tiny_cfg(model, text, tmp_path / "two", **common), tmp_path / "c.yaml")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          SCRIPT, "--config", str(cfg)],
                         cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 process(es) x 1 accumulation step(s) x 2 rows" in res.stdout and "distributed: MULTI_CPU" in res.stdout
    c1, c2 = loss_curve(tmp_path / "one"), loss_curve(tmp_path / "two")
    assert list(c1) == list(c2) == [1, 2, 3, 4]
    assert max(abs(c1[s] - c2[s]) for s in c1) <= 1e-6
    assert max_weight_diff(adapter_weights(Path(one["adapter"]).parent), adapter_weights(tmp_path / "two")) <= 1e-6


def test_fsdp_on_cpu_with_two_processes_is_refused(assets, tmp_path):
    """The FSDP attempt on CPU (gloo): accelerate 1.15 keeps MULTI_CPU whatever ACCELERATE_USE_FSDP says (FSDP is
    enabled for GPU-like devices only), so the recipe stops with a message instead of training with DDP."""
    model, text = assets
    cfg = _write(tiny_cfg(model, text, tmp_path / "fsdp", train={"steps": 2, "save_every": 0}), tmp_path / "c.yaml")
    env = _env(ACCELERATE_USE_FSDP="true", FSDP_SHARDING_STRATEGY="FULL_SHARD", FSDP_USE_ORIG_PARAMS="true",
               FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP", FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          SCRIPT, "--config", str(cfg)],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=400)
    assert res.returncode != 0
    assert "FSDP was requested" in res.stderr and "(MULTI_CPU)" in res.stderr
    assert not (tmp_path / "fsdp" / "adapter").exists()
