"""A saved patched model, served by vLLM or SGLang the way it was patched: `rope-patch export DIR --engine vllm|sglang`.

    rope-patch export merged/ --engine vllm
    vllm serve merged/ --hf-overrides '{"rope_parameters":{...},"max_position_embeddings":16384}' --max-model-len 16384

What an engine accepts is read from its own source (rope_patch.engines: the committed snapshot, vLLM 0.34.0 and SGLang
0.5.23 when this was written; vLLM 0.33.0 gives the same tables), never from a hand list: the rope types its
`get_rope` dispatches on, the `rope_parameters` keys each branch and the model code read (and the config attributes
the model code reads), and how it derives the context length from config.json. An export

- runs only where the whole patch has a native `rope_parameters` form (rope_patch's save rule) and every entry's
  rope type is in the engine's table: attention-side schemes (Self-Extend, ReRoPE, STRING, DCA, ALiBi, ...), the
  modifiers (logn), `dynamic_yarn` and stacks with any of them are refused in one line that names the scheme and the
  engine's rope types;
- is refused where the engine would silently serve another model: a key the patched model sets that the engine reads
  neither in `rope_parameters` for that rope type nor at the config's top level, or model code that replaces the
  config's RoPE (SGLang's Gemma 3 runs `{"rope_type": "default"}` on every layer);
- writes the engine's form where it differs from transformers': LongRoPE's `factor` is dropped (both engines derive
  the scale from max_position_embeddings / original_max_position_embeddings, checked equal); vLLM's `dynamic` gets
  `max_trained_positions` = L and max_position_embeddings = N (with L alone it would keep the base and size its
  cos/sin cache to L); SGLang's `yarn` gets `attn_factor`, the multiplier on its own default scale that gives
  transformers' cos/sin scale (an `attention_factor` A: A / (0.1 ln s + 1)); a rope key that the engine's model code
  reads from the config's top level and not from `rope_parameters` goes there (SGLang's llama: `partial_rotary_factor`,
  so p-RoPE's `proportional` rotates the pairs it should);
- serves the context length N the patch serves (the extended window; dynamic NTK: factor × L) and adds the
  engine's environment variable (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1) only
  where N exceeds the length the engine derives from the config it will see (by the engine's rule: vLLM caps it by
  the tokenizer's model_max_length only for a pooling model with absolute positions, never for a causal LM);
- needs a tokenizer in the folder the engine loads (DIR, or an adapter's local base): without one the engine cannot
  start, so the export is refused with the line that adds it (`rope_patch.save_pretrained(model, DIR,
  tokenizer=tokenizer)`).

Per-layer-type models (Gemma 3) keep `rope_parameters` keyed by layer type; every entry is checked.

Parity is per rope type, and two engine types are not transformers': both engines compute `dynamic` NTK once, for the
longest length N, so the served model equals the patched one at length N only (transformers rescales with the current
length); `longrope` uses the long factors for every request once N > original_max_position_embeddings L (vLLM) or per
forward batch that holds a position past L (SGLang), where transformers switches per sequence once it holds more than
L tokens: at exactly L + 1 tokens transformers uses the long factors and SGLang the short ones, except at position L,
which reads row L of its short-then-long cos/sin table, the long table's position 0 (no rotation). The export says so
in a note.

The config.json: the command line works on DIR as it is (the overrides carry the whole `rope_parameters`), and the
engine-ready config.json (DIR's own, with the engine's rope_parameters, max_position_embeddings and top-level keys) is
written beside it, to DIR/serve-<engine>/config.json or `--out`, never over a checkpoint's own config.json: that file
is finished work (rope_patch's save rule wrote it for transformers), and an engine's form (vLLM's dynamic with N as
max_position_embeddings) would change what transformers loads from it. vLLM takes the folder with `--hf-config-path`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shlex
from pathlib import Path

from . import engines
from .api import as_scheme
from .persistence import MANIFEST, export_info, read_manifest
from .schemes.base import without_native_form

OVERRIDE_FLAG = {"vllm": "--hf-overrides", "sglang": "--json-model-override-args"}
LENGTH_FLAG = {"vllm": "--max-model-len", "sglang": "--context-length"}
# The runner `vllm serve` picks for a *ForCausalLM architecture (vLLM's ModelConfig: "generate"; "pooling" is for
# embedding / classification models). The snapshot's tokenizer_when says which runner reads the tokenizer's length.
VLLM_RUNNER = "generate"
# The rope keys transformers also takes from a config's top level (PreTrainedConfig.standardize_rope_params moves
# them into rope_parameters): the ones an engine's model code may read there instead.
_TOP_LEVEL = ("rope_theta", "partial_rotary_factor")
# What a folder holds when it has a tokenizer AutoTokenizer can load (a fast tokenizer's tokenizer.json, the class
# and settings in tokenizer_config.json, a sentencepiece model, a BPE / WordPiece vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class MissingTokenizerError(ValueError):
    """The folder the engine loads has no tokenizer: the engine could not start."""


# Keys at the value that changes nothing in transformers (Phi-3's rope_parameters carry partial_rotary_factor 1.0): an
# engine that does not read the key serves the same model, so the key is left out of its form rather than refused.
_IDENTITY = {"partial_rotary_factor": 1.0}


def _flag(name: str, flag: str) -> str:
    """A flag of the engine's command line, found in its argument code by the snapshot (or an error, not a guess)."""
    if flag not in engines.engine(name)["flags"]:
        raise ValueError(f"{_label(name)}'s argument code has no {flag} (rope_patch/data/engines.json): regenerate the "
                         f"snapshot ({engines.COMMAND}) and review rope_patch.serving.")
    return flag


def _types(name: str) -> str:
    return ", ".join(engines.engine(name)["rope_types"])


def _label(name: str) -> str:
    return f"{name} {engines.engine(name)['version']}"


def refusal(scheme, name: str) -> str | None:
    """Why `name` cannot run `scheme` (a Scheme: a stack's parts each), or None."""
    lacking = without_native_form(scheme)
    if not lacking:
        return None
    parts = ", ".join(f"{p.name} (changes {p.changes})" for p in lacking)
    whole = f" in {scheme.name} " + " + ".join(p.name for p in scheme.schemes) if scheme.kind == "stack" else ""
    return (f"{_label(name)} cannot serve {parts}{whole}: it runs RoPE through its own get_rope, whose rope types are "
            f"{_types(name)}; none expresses it. Serve the model with transformers (rope_patch.from_pretrained), or "
            "export a frequency scheme alone.")


def _entries(rope: dict) -> dict:
    """{layer type or None: entry} of a flat or per-layer-type rope_parameters (None entries: layers without RoPE)."""
    if "rope_type" in rope or "rope_theta" in rope or not all(isinstance(v, dict) or v is None for v in rope.values()):
        return {None: rope}
    return {lt: v for lt, v in rope.items() if v is not None}


def served_length(rope: dict, window: int) -> int:
    """N, the length the patched model serves: its announced window, except transformers' `dynamic`, which announces
    the pre-training window L and scales past it (N = factor × L)."""
    n = window
    for entry in _entries(rope).values():
        if entry.get("rope_type") == "dynamic":
            n = max(n, int(entry["factor"] * window))
    return n


def engine_form(name: str, rope: dict, window: int, n: int, model_type: str | None,
                scheme: str | None) -> tuple[dict, int, dict, list[str]]:
    """(rope_parameters as the engine reads them, the max_position_embeddings it must see, the config's top-level keys
    it must see, notes), or ValueError."""
    eng = engines.engine(name)
    fixed = engines.fixed_rope_types(name, model_type)
    what = scheme or "the unpatched model"
    out, mpe, notes = copy.deepcopy(rope), window, []
    top: dict[str, list] = {}  # key -> the value of every entry that carries it
    entries = _entries(out)
    if not any(model_type in m["model_types"] for m in eng["models"].values()):
        read = ", ".join(sorted({t for m in eng["models"].values() for t in m["model_types"]}))
        notes.append(f"{name}'s model code for {model_type} is not in the snapshot (it read the code of {read}): "
                     "checked against its get_rope and that code.")
    for lt, entry in entries.items():
        where = f" (its {lt} layers)" if lt else ""
        rope_type = entry.get("rope_type", "default")
        if rope_type not in eng["rope_types"]:
            raise ValueError(f"{_label(name)} cannot serve {what}{where}: rope type {rope_type!r} is not "
                             f"among its rope types ({_types(name)}).")
        if fixed is not None and rope_type not in fixed:
            raise ValueError(f"{_label(name)} cannot serve {what}{where} on {model_type}: its {model_type} model code "
                             f"replaces the config's rope_parameters by rope type {', '.join(fixed)} on every layer "
                             f"(rope types of its get_rope: {_types(name)}). Serve it with transformers, or with an "
                             "engine that reads the config's rope_parameters.")
        if rope_type == "longrope" and "factor" in entry:
            # both engines derive LongRoPE's scale from max_position_embeddings / original_max_position_embeddings
            original = entry["original_max_position_embeddings"]
            if not math.isclose(entry["factor"] * original, window, rel_tol=1e-9):
                raise ValueError(f"{_label(name)} cannot serve {what}{where}: it derives LongRoPE's scale from "
                                 f"max_position_embeddings / original_max_position_embeddings = {window}/{original}, "
                                 f"not from factor = {entry['factor']}.")
            del entry["factor"]
        if rope_type == "longrope" and "attention_factor" in entry:
            a = entry.pop("attention_factor")  # transformers' one cos/sin scale for both factor sets
            entry["short_mscale"] = entry["long_mscale"] = a
        if name == "vllm" and rope_type == "dynamic":
            # vLLM's dynamic NTK: base·(s·mpe/max_trained − (s − 1))^(d/(d−2)), a cache of mpe positions
            entry["max_trained_positions"] = window
            mpe = n
        reads = engines.keys_read(name, rope_type, model_type)
        if rope_type == "yarn" and "attention_factor" not in reads and "attn_factor" in reads:
            _attn_factor(name, entry, what + where)
        for key, value in _IDENTITY.items():
            if key not in reads and entry.get(key, object()) == value:
                del entry[key]  # the value that changes nothing: an engine that does not read the key is the same
        for key in sorted(set(entry) - reads):
            if key in _TOP_LEVEL and key in engines.config_reads(name, model_type):
                top.setdefault(key, []).append(entry.pop(key))  # its model code reads it from the config itself
        unread = sorted(set(entry) - reads)
        if unread:
            raise ValueError(f"{_label(name)} cannot serve {what}{where}: it does not read "
                             f"{', '.join(map(repr, unread))} for rope type {rope_type!r} (it reads "
                             f"{', '.join(sorted(reads))}), so it would serve another model.")
        if rope_type == "dynamic":
            notes.append(f"{name} computes dynamic NTK once, for length {n}: equal to the patched model at that "
                         "length, not below it (transformers rescales with the current length).")
        if rope_type == "longrope" and n > entry["original_max_position_embeddings"]:
            original = entry["original_max_position_embeddings"]
            # vLLM: Phi3LongRoPEScaledRotaryEmbedding.__init__ (max_model_len > L) / forward; SGLang: its forward,
            # `torch.any(positions > L)`; transformers: longrope_frequency_update, max(position_ids) + 1 > L
            notes.append(
                f"vllm uses LongRoPE's long factors for every request, short ones too, when the context length "
                f"exceeds {original} (transformers switches per sequence, past {original} tokens)." if name == "vllm"
                else f"sglang switches to LongRoPE's long factors per forward batch, when any position in it exceeds "
                f"{original}, transformers per sequence when it holds more than {original} tokens: they differ at "
                f"exactly {original + 1} tokens (transformers: long factors; sglang: short ones, and position "
                f"{original} reads row {original} of its short-then-long table, the long table's position 0, i.e. no "
                "rotation); short requests batched with a long one get the long factors too, and cached keys keep "
                "the factors they were written with.")
    mixed = {k: v for k, v in top.items() if len(v) != len(entries) or len(set(map(json.dumps, v))) > 1}
    if mixed:
        raise ValueError(f"{_label(name)} cannot serve {what}: its model code reads {', '.join(mixed)} from the "
                         "config's top level, one value for every layer, and the layer types' rope_parameters differ "
                         f"there ({'; '.join(f'{k}: {v}' for k, v in mixed.items())}).")
    return out, mpe, {k: v[0] for k, v in top.items()}, list(dict.fromkeys(notes))  # per layer type: once


def _default_yarn_scale(factor: float, mscale=None, mscale_all_dim=None, *, truthy: bool) -> float:
    """YaRN's default cos/sin scale: 0.1·ln s + 1, or with both mscale and mscale_all_dim the ratio
    (0.1·mscale·ln s + 1) / (0.1·mscale_all_dim·ln s + 1); 1 for s <= 1. transformers (`_compute_yarn_parameters`) takes
    the ratio when both are truthy, SGLang (`YaRNScalingRotaryEmbedding.__init__`) when both are not None."""
    def get(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    both = (mscale and mscale_all_dim) if truthy else (mscale is not None and mscale_all_dim is not None)
    return float(get(mscale) / get(mscale_all_dim)) if both else float(get())


def _attn_factor(name: str, entry: dict, what: str) -> None:
    """SGLang's YaRN scales cos/sin by attn_factor × its default scale and reads no `attention_factor`: write the
    attn_factor that makes the product transformers' scale (the attention_factor A where set, else transformers' own
    default, which differs from SGLang's only for a zero mscale / mscale_all_dim)."""
    factor = entry.get("factor", 1.0)
    mscale, mscale_all_dim = entry.get("mscale"), entry.get("mscale_all_dim")
    target = entry.pop("attention_factor", None)
    if target is None:
        target = _default_yarn_scale(factor, mscale, mscale_all_dim, truthy=True)
    try:
        default = _default_yarn_scale(factor, mscale, mscale_all_dim, truthy=False)
    except ZeroDivisionError:
        default = math.nan
    if not math.isfinite(default) or default == 0:
        raise ValueError(f"{_label(name)} cannot serve {what}: its YaRN scale is attn_factor × its default scale, "
                         f"which is {default} for factor {factor}, mscale {mscale}, mscale_all_dim {mscale_all_dim}: "
                         "no attn_factor gives transformers' scale. Leave mscale / mscale_all_dim out.")
    if target != default:
        entry["attn_factor"] = target / default


def reads_tokenizer(name: str, config: dict, runner_type: str = VLLM_RUNNER) -> bool:
    """Whether the engine caps the derived length by the tokenizer's model_max_length for this config, by the rule
    the snapshot read from its code (`tokenizer_when`: vLLM's get_and_verify_max_len reads tokenizer_config.json only
    for runner "pooling" on a config whose position_embedding_type is "absolute"; SGLang never)."""
    rule = engines.engine(name)["context"]["tokenizer_when"]
    facts = {**config, "runner_type": runner_type}
    return rule is not None and all(facts.get(k) == v for k, v in rule.items())


def derived_length(name: str, config: dict, tokenizer_max: int | None = None, runner_type: str = VLLM_RUNNER) -> int:
    """The context length the engine derives from `config` (a config.json as the engine will see it; `tokenizer_max`:
    tokenizer_config.json's model_max_length, taken only where the engine reads it: `reads_tokenizer`), as its own code
    does: vLLM (`derive_max_model_len_and_key`, `_get_and_verify_max_len`) takes the smallest of its length keys
    (model_max_length where the config has one), caps it by the tokenizer's where it reads that, and multiplies in the
    last non-exempt entry's `factor`; SGLang (`get_context_length`) takes the first length key present and multiplies in
    `factor` unless the rope type or a key exempts it. The snapshot records the constants; `python -m rope_patch.engines
    --check` flags a change in these functions."""
    ctx = engines.engine(name)["context"]
    rope = config.get("rope_parameters") or {}
    entries = list(_entries(rope).values()) if rope else []
    present = [config[k] for k in ctx["length_keys"] if isinstance(config.get(k), (int, float))]
    if name == "vllm":
        length = config["model_max_length"] if config.get("model_max_length") else min(present, default=2048)
        if tokenizer_max and reads_tokenizer(name, config, runner_type):
            length = min(length, tokenizer_max)
        factor = 1.0
        if entries and not any(m in config.get("model_type", "") for m in ctx["factor_exempt_model_types"]):
            for entry in entries:
                if entry.get("rope_type") not in ctx["factor_exempt_types"]:
                    factor = entry.get("factor", factor)
        return int(length * (factor or 1.0))
    factor = 1
    if rope and "rope_type" in rope:  # a per-layer-type dict has no top-level factor: 1
        factor = rope.get("factor", 1)
        if any(k in rope for k in ctx["factor_exempt_keys"]) or rope.get("rope_type") in ctx["factor_exempt_types"]:
            factor = 1
    return int(factor * present[0]) if present else 2048


def _leaks(name: str, current: dict | None, ours: dict, model_type: str | None) -> list[str]:
    """SGLang merges a rope_parameters override into the config's one level deep ({**current, **override}): keys of
    the config that the override lacks survive. The ones the engine reads for the override's rope type (or a layer
    type the override does not replace) would change what it serves."""
    if name != "sglang" or not current:
        return []
    mine = _entries(ours)
    if None not in mine:  # per layer type: each layer type's dict is replaced whole
        return sorted(set(current) - set(ours))
    rope_type = ours.get("rope_type", "default")
    reads = engines.keys_read(name, rope_type, model_type) or set()
    return sorted(k for k in set(current) - set(ours) if k in reads)


def export(directory: str | os.PathLike, name: str, base: str | os.PathLike | None = None,
           out: str | os.PathLike | None = None, write: bool = True) -> dict:
    """The engine's command line for a folder written by `rope_patch.save_pretrained` (model, merged model or
    adapter), and the engine-ready config.json written to `out` (default DIR/serve-<engine>/).

    Returns {"engine", "version", "scheme", "rope_parameters", "max_position_embeddings", "top_level" (config keys the
    engine reads outside rope_parameters, in the overrides and the written config too), "context_length",
    "derived_length" (what the engine derives from the config it sees), "env", "command", "config_path",
    "alternative" (vLLM: the command that reads the written config with --hf-config-path), "notes"}. Raises
    ValueError (one line: the scheme, the engine's rope types, the reason) where the engine does not run the patch,
    MissingTokenizerError (a ValueError) where the folder the engine loads has no tokenizer, and FileExistsError where
    `out` is a saved model's folder."""
    eng = engines.engine(name)
    path = Path(directory)
    manifest = read_manifest(path) if path.is_dir() else None
    if manifest and manifest["scheme"] and not manifest["native"]:
        try:
            scheme = as_scheme(manifest["scheme"], **manifest["params"])
        except (ValueError, TypeError) as err:
            raise type(err)(f"{path / MANIFEST}: the recorded scheme {manifest['scheme']!r} cannot be "
                            f"read: {err}") from None
        why = refusal(scheme, name)
        if why:
            raise ValueError(why)
    info = export_info(path, base)
    adapter = (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()
    if adapter:
        recorded = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        src = Path(base or recorded or "")
        if (src / "config.json").is_file():
            config = json.loads((src / "config.json").read_text())
        else:  # a hub id: transformers' cache (export_info read it already)
            import transformers

            config = transformers.AutoConfig.from_pretrained(str(base or recorded)).to_dict()
        serve_dir = str(base or recorded)
    else:
        config = json.loads((path / "config.json").read_text())
        serve_dir = str(path)
    rope, window = info["rope_parameters"], info["max_position_embeddings"]
    n = served_length(rope, window)
    form, mpe, top, notes = engine_form(name, rope, window, n, config.get("model_type"), info["scheme"])
    leaks = _leaks(name, config.get("rope_parameters"), form, config.get("model_type"))
    if leaks:
        raise ValueError(f"{_label(name)} merges --json-model-override-args' rope_parameters into the config's, so "
                         f"{', '.join(leaks)} of {serve_dir}'s config.json would stay: serve a copy of the model whose "
                         "config.json is the one this export writes.")
    _require_tokenizer(name, Path(serve_dir), adapter)
    served = {**config, "rope_parameters": form, "max_position_embeddings": mpe, **top}
    seen = served
    if name == "sglang" and None in _entries(form) and isinstance(config.get("rope_parameters"), dict):
        seen = {**served, "rope_parameters": {**config["rope_parameters"], **form}}  # what SGLang's merge leaves
    tokenizer = Path(serve_dir) / "tokenizer_config.json"
    tokenizer_max = None
    if reads_tokenizer(name, seen) and tokenizer.is_file():  # vLLM: a pooling model with absolute positions only
        value = json.loads(tokenizer.read_text()).get("model_max_length")
        tokenizer_max = int(value) if isinstance(value, (int, float)) and value < 1e12 else None
    derived = derived_length(name, seen, tokenizer_max)
    env = {eng["context"]["env"]: "1"} if n > derived else {}
    overrides = json.dumps({"rope_parameters": form, "max_position_embeddings": mpe, **top}, separators=(",", ":"))
    prefix = "".join(f"{k}={v} " for k, v in env.items())
    serve = "vllm serve" if name == "vllm" else f"python -m sglang.launch_server {_flag(name, '--model-path')}"
    parts = [f"{prefix}{serve} {shlex.quote(serve_dir)}"]
    if adapter:
        parts.append(f"{_flag(name, '--enable-lora')} "
                     f"{_flag(name, '--lora-modules' if name == 'vllm' else '--lora-paths')} "
                     f"adapter={shlex.quote(str(path))}")
    parts += [f"{_flag(name, OVERRIDE_FLAG[name])} '{overrides}'", f"{_flag(name, LENGTH_FLAG[name])} {n}"]
    target = Path(out) if out is not None else path / f"serve-{name}"
    if write:
        _write_config(target, served, path)
    alternative = None
    if name == "vllm" and not adapter:  # the written config instead of the overrides
        alternative = (f"{prefix}vllm serve {shlex.quote(serve_dir)} {_flag(name, '--hf-config-path')} "
                       f"{shlex.quote(str(target))} {_flag(name, LENGTH_FLAG[name])} {n}")
    return {"engine": name, "version": eng["version"], "scheme": info["scheme"], "rope_parameters": form,
            "max_position_embeddings": mpe, "top_level": top,
            "context_length": n, "derived_length": derived, "env": env,
            "command": " ".join(parts), "config_path": str(target / "config.json") if write else None,
            "alternative": alternative if write else None, "notes": notes}


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a tokenizer (one of TOKENIZER_FILES)."""
    return any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)


def _require_tokenizer(name: str, folder: Path, adapter: bool) -> None:
    """The engine loads its tokenizer from the model folder it serves (DIR, or an adapter's base) and cannot start
    without one. A base given by hub id is fetched whole by the engine: not checked."""
    if adapter and not folder.is_dir():
        return
    if has_tokenizer(folder):
        return
    where = repr(str(folder))  # as Python writes the path
    how = f"tokenizer.save_pretrained({where})" if adapter else \
        f"rope_patch.save_pretrained(model, {where}, tokenizer=tokenizer) (or tokenizer.save_pretrained({where}))"
    raise MissingTokenizerError(
        f"{'the adapter base ' if adapter else ''}{folder} has no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...), "
        f"and {name} loads it from there to start: save the model's tokenizer there with {how}, then export again.")


def _write_config(folder: Path, config: dict, source: Path) -> None:
    """config.json into `folder`, never into a saved model's own folder (DIR itself, or any folder holding weights, an
    adapter or a rope_patch manifest): that config.json is finished work, or its absence is (an adapter folder)."""
    file = folder / "config.json"
    own = folder.exists() and (folder.resolve() == source.resolve() or any(
        any(folder.glob(pattern)) for pattern in ("*.safetensors", "*.bin", "adapter_config.json", MANIFEST)))
    if own:
        raise FileExistsError(f"{folder} holds a saved model: writing the engine's config.json there would replace or "
                              "change finished work. Pass --out to another folder.")
    from .files import write_text_atomic

    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(file, json.dumps(config, indent=2, sort_keys=True) + "\n")
