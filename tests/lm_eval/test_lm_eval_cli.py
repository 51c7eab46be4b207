"""`rope-patch-lm-eval` (lm-eval's CLI with the model registered) and multi-process data parallel runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.lm_eval import REPO, TASKS, by_doc, evaluate


def parse(monkeypatch, argv):
    from lm_eval._cli import HarnessCLI

    from rope_patch.integrations.lm_eval.cli import adjust

    monkeypatch.setattr(sys, "argv", ["rope-patch-lm-eval", *argv])
    parser = HarnessCLI()
    args = parser.parse_args()
    adjust(args)
    return args


def test_adjust_expands_groups_and_adds_the_task_folder(monkeypatch, assets):
    args = parse(monkeypatch, ["--model", "rope_patch", "--model_args", f"pretrained={assets['model']}",
                               "--tasks", "rope_passkey,arc_easy", "rope_ppl", "--metadata", "lengths=[256,1024]"])
    assert args.tasks == ["rope_passkey_256", "rope_passkey_1024", "arc_easy", "rope_ppl_256", "rope_ppl_1024"]
    assert args.include_path == str(TASKS)
    # without lengths the groups stay (their YAMLs list the default lengths); an explicit include path is kept
    args = parse(monkeypatch, ["--model", "rope_patch", "--tasks", "rope_passkey", "--include_path", "/x"])
    assert args.tasks == ["rope_passkey"] and args.include_path == "/x"


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _results(out):
    files = sorted(out.rglob("results_*.json"))
    assert files, f"no results JSON under {out}"
    return json.loads(files[-1].read_text())


def _samples(out, task):
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return by_doc([json.loads(line) for line in path.read_text().splitlines()])


@pytest.mark.slow
def test_console_script_writes_lm_eval_results(assets, tmp_path):
    """The acceptance command, on the tiny assets (the group expanded to one short length)."""
    exe = shutil.which("rope-patch-lm-eval") or f"{sys.executable} -m rope_patch.integrations.lm_eval.cli"
    meta = json.dumps({"heldout": str(assets["heldout"]), "samples": 1, "lengths": [128]})
    cmd = (f"{exe} --model rope_patch --model_args pretrained={assets['model']},scheme=yarn,factor=4 "
           f"--include_path {TASKS} --tasks rope_passkey --output_path {tmp_path / 'out'} --metadata '{meta}'")
    proc = subprocess.run(cmd, shell=True, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = _results(tmp_path / "out")
    assert res["results"]["rope_passkey_128"]["acc,none"] in (0.0, 1 / 3, 2 / 3, 1.0)
    assert res["config"]["model"] == "rope_patch"


def test_bad_model_args_fail_clearly_from_the_cli(assets, tmp_path):
    """Checked before lm-eval indexes its tasks: the error of apply(), at once, without a traceback."""
    cmd = [sys.executable, "-m", "rope_patch.integrations.lm_eval.cli", "--model", "rope_patch", "--model_args",
           f"pretrained={assets['model']},scheme=yarnn", "--tasks", "rope_passkey_128", "--include_path", str(TASKS)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "Did you mean 'yarn'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_two_processes_equal_one(assets, tmp_path):
    """ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2: each rank evaluates half the documents, and the
    gathered results equal a single-process run."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))  # installed with torch
    tasks = ["rope_passkey_128", "rope_ppl_128"]
    meta = {"heldout": str(assets["heldout"]), "samples": 3}
    args = {"pretrained": str(assets["model"]), "scheme": "yarn", "factor": 2}
    cmd = [torchrun, "--nproc_per_node", "2", "-m", "rope_patch.integrations.lm_eval.cli", "--model", "rope_patch",
           "--model_args", json.dumps(args), "--include_path", str(TASKS), "--tasks", ",".join(tasks),
           "--metadata", json.dumps(meta), "--output_path", str(tmp_path / "mp"), "--log_samples"]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**_env(), "ACCELERATE_USE_CPU": "true"}, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on rank 1" in proc.stderr  # data parallel really happened (lm-eval builds rank 1's share)
    multi = _results(tmp_path / "mp")
    single = evaluate("rope_patch", tasks, assets, model_args=args, meta=meta)
    for task in tasks:
        for key, value in single["results"][task].items():
            if isinstance(value, float):
                assert multi["results"][task][key] == pytest.approx(value, rel=1e-9), (task, key)
    # (lm-eval pads the shorter rank with a copy of its last request: that document logs two responses)
    assert [s["resps"][0][0] for s in _samples(tmp_path / "mp", tasks[0])] == [
        s["resps"][0][0] for s in by_doc(single["samples"][tasks[0]])]


def test_repo_has_the_console_script_entry():
    text = (REPO / "pyproject.toml").read_text()
    assert 'rope-patch-lm-eval = "rope_patch.integrations.lm_eval.cli:main"' in text
