"""A saved tiny random Llama with a real character-level tokenizer, training text, and recipe configs for it."""

from __future__ import annotations

from pathlib import Path

from helpers.models import WINDOW, saved_model
from helpers.scripts import load_script
from helpers.text import char_tokenizer, filler_text


def load_recipe():
    """recipes/finetune_lora.py as a module (it is a script, not part of the package)."""
    return load_script("recipes/finetune_lora.py", register=True)


def make_model_dir(path: Path, *, tie: bool = False, seed: int = 0, window: int = WINDOW) -> Path:
    """A 2-layer Llama (window 32, head_dim 16, vocab 64) + a character tokenizer, saved with save_pretrained."""
    return saved_model(path, char_tokenizer(), seed=seed, vocab_size=64, max_position_embeddings=window,
                       tie_word_embeddings=tie)


def make_text(path: Path, n_words: int = 4000, seed: int = 0) -> Path:
    path.write_text(filler_text(n_words, seed))
    return path


def tiny_cfg(model_dir: Path, text: Path, out: Path, /, **sections) -> dict:
    """A config that trains in a few seconds: yarn x4 on the 32-token model at 128 tokens, a checkpoint every 2
    steps."""
    cfg = {
        "model": str(model_dir),
        "output_dir": str(out),
        "seed": 0,
        "rope_patch": {"scheme": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"]},
        "data": {"files": [str(text)], "cache_dir": str(out.parent / "token_cache"), "passkey_fraction": 0.25,
                 "passkey_min_tokens": 100, "answer_loss_weight": 3.0},
        "train": {"seq_len": 128, "global_batch_size": 4, "micro_batch_size": 2, "steps": 6, "lr": 1e-3,
                  "warmup_steps": 1,
                  "threads": 1, "attn_implementation": "eager", "save_every": 2, "log_every": 1},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def adapter_weights(run_dir: Path) -> dict:
    """The trained weights of a run's final adapter (adapter_model.safetensors: LoRA + modules_to_save), by name."""
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "adapter" / "adapter_model.safetensors"))


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a, (sorted(a)[:3], sorted(b)[:3])
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def log_records(run_dir: Path) -> list[dict]:
    """train_log.jsonl of a run, one dict per logged step."""
    import json

    return [json.loads(line) for line in (Path(run_dir) / "train_log.jsonl").read_text().splitlines() if line.strip()]


def loss_curve(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in log_records(run_dir)}
