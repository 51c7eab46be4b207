"""Real processes: a run killed with SIGKILL and resumed ends with the uninterrupted adapter; 2-process DDP on CPU
(gloo) gives the loss curve of 1 process with the same global batch. Each spawns Python processes (~15 s of imports
each on a loaded 2-core machine), hence `slow`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers.recipes import ROOT, load_recipe, make_model_dir, make_text, tiny_cfg

ft = load_recipe()
SCRIPT = str(ROOT / "recipes" / "finetune_lora.py")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return make_model_dir(root / "model"), make_text(root / "train.txt")


def _env(**extra):
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def _write(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def _weights(summary_dir: Path) -> dict:
    return torch.load(summary_dir / "adapter" / "trainable.pt")


def test_kill_9_then_resume_matches_uninterrupted(assets, tmp_path):
    model, text = assets
    ref = ft.main(tiny_cfg(model, text, tmp_path / "ref"))
    cfg = _write(tiny_cfg(model, text, tmp_path / "run"), tmp_path / "c.yaml")
    killed = subprocess.run([sys.executable, SCRIPT, "--config", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                            env=_env(ROPE_PATCH_FINETUNE_CRASH="during_save:4"), timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert ft.latest_checkpoint(tmp_path / "run").name == "step-0000002"  # the half-written step 4 does not count
    resumed = subprocess.run([sys.executable, SCRIPT, "--config", str(cfg), "--resume"], cwd=ROOT, capture_output=True,
                             text=True, env=_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    a, b = _weights(Path(ref["adapter"]).parent), _weights(tmp_path / "run")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_two_process_ddp_matches_one_process(assets, tmp_path):
    model, text = assets
    common = dict(lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
                  train={"global_batch_size": 4, "micro_batch_size": 2, "steps": 4, "save_every": 0})
    one = ft.main(tiny_cfg(model, text, tmp_path / "one", **common))  # 1 process x 2 accumulation steps x 2 rows
    cfg = _write(tiny_cfg(model, text, tmp_path / "two", **common), tmp_path / "c.yaml")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
                          "--config", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                         env=_env(ACCELERATE_USE_CPU="true"), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 process(es) x 1 accumulation step(s) x 2 rows" in res.stdout

    def curve(d):
        return [json.loads(line)["loss"] for line in (Path(d) / "train_log.jsonl").read_text().splitlines()]

    c1, c2 = curve(tmp_path / "one"), curve(tmp_path / "two")
    assert len(c1) == len(c2) == 4
    assert max(abs(x - y) for x, y in zip(c1, c2, strict=True)) <= 1e-5
    a, b = _weights(Path(one["adapter"]).parent), _weights(tmp_path / "two")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
