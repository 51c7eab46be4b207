"""`rope-patch export DIR --engine vllm|sglang` (rope_patch.serving): every scheme × both engines, decided by the
engine snapshot (rope_patch/data/engines.json), never by a list here: a native scheme's emitted rope_parameters carry a
rope type of the engine's table and only keys the engine reads for it (and every key it subscripts); the others are
refused in one line naming the scheme and the engine's rope types. Per-layer-type models (Gemma 3), the recipe's merged
LoRA checkpoint, adapters, the context length and the allow-longer variable, and where the config.json goes."""

from __future__ import annotations

import ast
import json
import os
import shlex
import types
import zipfile
from pathlib import Path

import pytest
from helpers.models import WINDOW, tiny_model
from helpers.schemes import SCHEMES

import rope_patch
from rope_patch import engines, serving
from rope_patch.cli import main
from rope_patch.registry import get_scheme_class

ENGINES = engines.ENGINES
# The native schemes an engine still cannot run as patched, because of what its source reads (the snapshot says so;
# the export's message names the reason). Anything else native must export.
ENGINE_LIMITS = {("p_rope", "sglang"): "does not read 'partial_rotary_factor'"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved tiny llama per scheme row (save_pretrained of the patched model), written on first use."""
    cache = {}

    def get(name, params, arch="llama"):
        key = (name, json.dumps(params, sort_keys=True), arch)
        if key not in cache:
            model = tiny_model(arch)
            rope_patch.apply(model, name, **params)
            folder = tmp_path_factory.mktemp(f"{arch}-{name}")
            rope_patch.save_pretrained(model, folder)
            cache[key] = folder
        return cache[key]

    return get


def _overrides(command: str) -> dict:
    """The JSON of the engine's override flag, parsed back from the printed command line (as a shell would)."""
    words = shlex.split(command)
    for flag in ("--hf-overrides", "--json-model-override-args"):
        if flag in words:
            return json.loads(words[words.index(flag) + 1])
    raise AssertionError(f"no override flag in {command}")


def _check_against_snapshot(info: dict, name: str, model_type: str) -> None:
    """Each entry's rope type is in the engine's table; every key is one the engine reads for it; every key the engine
    subscripts for it is there; the printed command carries the same JSON, the flags and the context length."""
    snap = engines.engine(name)
    rope = info["rope_parameters"]
    entries = serving._entries(rope)
    assert entries
    for entry in entries.values():
        rope_type = entry["rope_type"]
        assert rope_type in snap["rope_types"], (rope_type, list(snap["rope_types"]))
        reads = engines.keys_read(name, rope_type, model_type)
        assert set(entry) <= reads, sorted(set(entry) - reads)
        assert set(snap["rope_types"][rope_type]["required"]) <= set(entry)
    words = shlex.split(info["command"])
    assert _overrides(info["command"]) == {"rope_parameters": rope, "max_position_embeddings": info["max_position_embeddings"]}
    length_flag = "--max-model-len" if name == "vllm" else "--context-length"
    assert words[words.index(length_flag) + 1] == str(info["context_length"])
    assert all(w in snap["flags"] for w in words if w.startswith("--"))
    env = snap["context"]["env"]
    assert (f"{env}=1" in words) == (info["context_length"] > info["derived_length"])


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("row", SCHEMES, ids=[r.name for r in SCHEMES])
def test_every_scheme_on_both_engines(row, engine_name, saved, tmp_path):
    folder = saved(row.name, row.params)
    native = get_scheme_class(row.name).native
    limit = ENGINE_LIMITS.get((row.name, engine_name))
    if not native or limit:
        with pytest.raises(ValueError) as info:
            serving.export(folder, engine_name, out=tmp_path / "out")
        message = str(info.value)
        assert len(message.splitlines()) == 1 and row.name in message
        assert f"{engine_name} {engines.engine(engine_name)['version']}" in message
        if limit:
            assert limit in message
        else:
            assert ", ".join(engines.engine(engine_name)["rope_types"]) in message  # the engine's list
        assert not (tmp_path / "out").exists()  # nothing written
        return
    info = serving.export(folder, engine_name, out=tmp_path / "out")
    _check_against_snapshot(info, engine_name, "llama")
    plain = json.loads((folder / "config.json").read_text())
    assert info["context_length"] == serving.served_length(plain["rope_parameters"], plain["max_position_embeddings"])
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["rope_parameters"] == info["rope_parameters"]
    assert written["max_position_embeddings"] == info["max_position_embeddings"]
    assert {k: v for k, v in written.items() if k not in ("rope_parameters", "max_position_embeddings")} == \
        {k: v for k, v in plain.items() if k not in ("rope_parameters", "max_position_embeddings")}
    assert json.loads((folder / "config.json").read_text()) == plain  # the checkpoint's own config.json untouched


def test_stacks_and_modifiers_are_refused_naming_the_part(saved):
    folder = saved("stack", {"schemes": [{"scheme": "yarn", "params": {"factor": 4}},
                                          {"scheme": "self_extend", "params": {"group_size": 4, "window_size": 16}}]})
    for name in ENGINES:
        with pytest.raises(ValueError, match=r"cannot serve self_extend \(changes attention\) in stack yarn \+ self_extend"):
            serving.export(folder, name, write=False)


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("scheme,params", [("default", {"rope_theta": 40_000}), ("linear", {"factor": 2}),
                                           ("yarn", {"factor": 4}), ("dynamic", {"factor": 4})])
def test_per_layer_type_models(scheme, params, engine_name, saved, tmp_path):
    """Gemma 3 keeps rope_parameters keyed by layer type: every entry is exported and checked. SGLang's Gemma 3 code
    replaces the config's RoPE by {"rope_type": "default"} (the snapshot's fixed_rope_types): only `default` (a base
    per layer type, which it reads) serves there."""
    folder = saved(scheme, params, arch="gemma3")
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    fixed = engines.fixed_rope_types(engine_name, model_type)
    if fixed is not None and scheme not in fixed:
        with pytest.raises(ValueError, match=f"its {model_type} model code replaces the config's rope_parameters by rope "
                                             "type default"):
            serving.export(folder, engine_name, write=False)
        return
    info = serving.export(folder, engine_name, out=tmp_path / "out")
    assert set(info["rope_parameters"]) == {"sliding_attention", "full_attention"}
    _check_against_snapshot(info, engine_name, model_type)


def test_gemma3_layer_types_keep_their_own_base(saved):
    info = serving.export(saved("yarn", {"factor": 4}, arch="gemma3"), "vllm", write=False)
    rope = info["rope_parameters"]
    assert rope["full_attention"]["rope_theta"] != rope["sliding_attention"]["rope_theta"]
    assert {e["rope_type"] for e in rope.values()} == {"yarn"} and info["context_length"] == 4 * WINDOW


@pytest.mark.parametrize("engine_name", ENGINES)
def test_merged_lora_checkpoint_exports(engine_name, tmp_path):
    """The recipe's --merge: a LoRA trained under the patch, merged into the base and saved with rope_patch.save_pretrained,
    serves with the rope_parameters it was trained with."""
    import peft

    model = tiny_model()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    rope_patch.apply(lora, "yarn", factor=4)
    merged = lora.merge_and_unload()
    rope_patch.save_pretrained(merged, tmp_path / "merged")
    info = serving.export(tmp_path / "merged", engine_name, write=False)
    assert info["rope_parameters"] == rope_patch.native_config(merged)["rope_parameters"]
    assert info["context_length"] == 4 * WINDOW and info["scheme"] == "yarn"
    _check_against_snapshot(info, engine_name, "llama")


@pytest.mark.parametrize("engine_name", ENGINES)
def test_adapter_serves_on_its_base(engine_name, tmp_path):
    import peft

    tiny_model().save_pretrained(tmp_path / "base")
    from transformers import AutoModelForCausalLM

    lora = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                               peft.LoraConfig(r=2, target_modules=["q_proj"]))
    rope_patch.apply(lora, "linear", factor=2.0)
    rope_patch.save_pretrained(lora, tmp_path / "adapter")
    info = serving.export(tmp_path / "adapter", engine_name, out=tmp_path / "out")
    words = shlex.split(info["command"])
    assert str(tmp_path / "base") in words and f"adapter={tmp_path / 'adapter'}" in words and "--enable-lora" in words
    assert info["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    _check_against_snapshot(info, engine_name, "llama")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"] == info["rope_parameters"]
    with pytest.raises(FileExistsError, match="holds a saved model"):  # an adapter folder gets no config.json
        serving.export(tmp_path / "adapter", engine_name, out=tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "config.json").exists()


def test_engine_forms_differ_where_the_engine_reads_otherwise(saved):
    """vLLM's dynamic NTK needs max_trained_positions = L and max_position_embeddings = N; LongRoPE's factor is
    implied by max_position_embeddings / original_max_position_embeddings in both engines; the notes say where the
    engine's rope type is not transformers' (dynamic: static at N; longrope: long factors for every request)."""
    vllm = serving.export(saved("dynamic", {"factor": 4}), "vllm", write=False)
    assert vllm["rope_parameters"]["max_trained_positions"] == WINDOW and vllm["max_position_embeddings"] == 4 * WINDOW
    sglang = serving.export(saved("dynamic", {"factor": 4}), "sglang", write=False)
    assert "max_trained_positions" not in sglang["rope_parameters"] and sglang["max_position_embeddings"] == WINDOW
    for info in (vllm, sglang):
        assert info["context_length"] == 4 * WINDOW and "once, for length 128" in info["notes"][0]
    row = next(r for r in SCHEMES if r.name == "longrope")
    for name in ENGINES:
        info = serving.export(saved(row.name, row.params), name, write=False)
        assert "factor" not in info["rope_parameters"]
        assert ("long factors for every request" if name == "vllm" else "per forward batch") in info["notes"][0]


def test_longrope_attention_factor_becomes_both_mscales(saved):
    params = {"factor": 4, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8, "attention_factor": 1.25}
    for name in ENGINES:
        rope = serving.export(saved("longrope", params), name, write=False)["rope_parameters"]
        assert rope["short_mscale"] == rope["long_mscale"] == 1.25 and "attention_factor" not in rope


def test_a_key_at_its_identity_value_is_left_out_where_it_is_not_read(saved):
    """Phi-3 keeps partial_rotary_factor 1.0 (the whole head rotates) in rope_parameters; SGLang reads no such key for
    longrope, which is the same model: left out there, kept for vLLM, which reads it."""
    params = {"factor": 4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    folder = saved("longrope", params, arch="phi3")
    assert serving.export(folder, "vllm", write=False)["rope_parameters"]["partial_rotary_factor"] == 1.0
    info = serving.export(folder, "sglang", write=False)
    assert "partial_rotary_factor" not in info["rope_parameters"]
    _check_against_snapshot(info, "sglang", "phi3")


def test_a_key_the_engine_does_not_read_is_refused(saved):
    """SGLang's YaRN reads no `attention_factor` (it scales by attn_factor × its own mscale): a patch that sets it
    would be served as another model."""
    folder = saved("yarn", {"factor": 4, "attention_factor": 1.5})
    assert serving.export(folder, "vllm", write=False)["rope_parameters"]["attention_factor"] == 1.5
    with pytest.raises(ValueError, match="sglang 0.5.23 cannot serve yarn: it does not read 'attention_factor'"):
        serving.export(folder, "sglang", write=False)


def test_allow_longer_variable_only_past_the_derived_length(saved, tmp_path):
    """vLLM caps the derived length by the tokenizer's model_max_length: a tokenizer saved with the pre-training
    window makes N = 4·L pass it, so the command sets VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. SGLang reads no tokenizer."""
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(saved("yarn", {"factor": 4}), folder)
    assert "VLLM_ALLOW" not in serving.export(folder, "vllm", write=False)["command"]
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": WINDOW}))
    info = serving.export(folder, "vllm", write=False)
    assert info["derived_length"] == WINDOW and info["env"] == {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    assert info["command"].startswith("VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 vllm serve ")
    assert serving.export(folder, "sglang", write=False)["env"] == {}


def test_derived_length_follows_each_engines_rule():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    assert serving.derived_length("vllm", {"max_position_embeddings": 128, "rope_parameters": yarn}) == 128
    assert serving.derived_length("vllm", {"max_position_embeddings": 64, "rope_parameters": linear}) == 128
    assert serving.derived_length("vllm", {"max_position_embeddings": 64, "model_type": "gemma3_text",
                                           "rope_parameters": {"full_attention": linear}}) == 64
    assert serving.derived_length("vllm", {"max_position_embeddings": 64, "seq_length": 48}) == 48  # the smallest key
    assert serving.derived_length("sglang", {"max_position_embeddings": 128, "rope_parameters": yarn}) == 128
    assert serving.derived_length("sglang", {"max_position_embeddings": 64, "rope_parameters": linear}) == 128
    assert serving.derived_length("sglang", {"max_position_embeddings": 64, "max_sequence_length": 96}) == 96  # the first


# ---- the command line -----------------------------------------------------------------------------------------
def _run(capsys, *argv):
    code = main(["export", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prints_the_command_and_writes_beside_the_checkpoint(saved, capsys):
    folder = saved("yarn", {"factor": 4})
    for name in ENGINES:
        code, out, err = _run(capsys, folder, "--engine", name)
        assert code == 0 and err == ""
        command = out.strip().splitlines()[-1]
        assert command.startswith("vllm serve " if name == "vllm" else "python -m sglang.launch_server --model-path ")
        assert f"config.json with these rope_parameters: {folder / f'serve-{name}' / 'config.json'}" in out
        assert json.loads((folder / f"serve-{name}" / "config.json").read_text())["rope_parameters"] == \
            _overrides(command)["rope_parameters"]
        code, out, _ = _run(capsys, folder, "--engine", name, "--json")
        assert code == 0 and json.loads(out)["engine"] == name


def test_cli_errors_are_one_line(saved, tmp_path, capsys):
    row = next(r for r in SCHEMES if r.name == "self_extend")
    code, out, err = _run(capsys, saved(row.name, row.params), "--engine", "vllm")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "cannot serve self_extend" in err and "yarn" in err and "Traceback" not in err
    folder = saved("yarn", {"factor": 4})
    code, _, err = _run(capsys, folder, "--engine", "sglang", "--out", folder)  # over the checkpoint's own config.json
    assert code == 2 and "would replace or change finished work" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(capsys, folder, "--out", tmp_path)
    assert code == 2 and "pass --engine" in err
    code, _, err = _run(capsys, folder, "--engine", "vlm")
    assert code == 2 and "Did you mean 'vllm'?" in err and len(err.strip().splitlines()) == 1


def test_plain_export_is_unchanged(saved, capsys):
    code, out, _ = _run(capsys, saved("yarn", {"factor": 4}))
    assert code == 0 and out.startswith("scheme: yarn\nrope_parameters: {") and "vLLM: vllm serve " in out


# ---- the engines' own code on the export (optional: ROPE_PATCH_ENGINE_WHEELS=DIR holds the wheels) -----------------
WHEELS = os.environ.get("ROPE_PATCH_ENGINE_WHEELS")


class _Made:
    """Stands for an engine's rotary class: records what get_rope built it with."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def buffers(self):  # SGLang's cache asks whether a cached module's buffers are alive
        return []


def _engine_code(name: str, path: str, functions: tuple[str, ...], namespace: dict) -> dict:
    """The named functions (and module-level list assignments they use) of one file of the engine's wheel, compiled
    without their annotations and decorators and run in `namespace`: the engine's own logic, without its imports."""
    wheel = Path(WHEELS) / engines.engine(name)["wheel"]
    tree = ast.parse(zipfile.ZipFile(wheel).read(path).decode("utf-8"))
    first: dict[str, ast.FunctionDef] = {}  # a method overridden in subclasses: the base class's, defined first
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef) and n.name in functions:
            first.setdefault(n.name, n)
    nodes: list = list(first.values())
    nodes += [n for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.List)]
    for fn in (n for n in nodes if isinstance(n, ast.FunctionDef)):
        fn.decorator_list, fn.returns = [], None
        for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg):
            if a is not None:
                a.annotation = None
        for node in ast.walk(fn):  # annotated locals: plain assignments
            if isinstance(node, ast.AnnAssign):
                node.annotation = ast.Constant(None)
    rotary = {n.id: type(n.id, (_Made,), {}) for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id.endswith("RotaryEmbedding")}
    quiet = types.SimpleNamespace(warning=lambda *a, **k: None, warning_once=lambda *a, **k: None, info=lambda *a, **k: None,
                                  debug=lambda *a, **k: None)
    torch_stub = types.SimpleNamespace(get_default_dtype=lambda: "float32", dtype=object,
                                       get_default_device=lambda: types.SimpleNamespace(type="cpu"))
    scope = {"Any": object, "torch": torch_stub, "logger": quiet, "_ROPE_DICT": {}, "_use_aiter": False, "_is_hip": False,
             **rotary, **namespace}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), scope)  # noqa: S102 - the engine's source
    return scope


@pytest.mark.skipif(not WHEELS, reason="ROPE_PATCH_ENGINE_WHEELS=DIR holds the engine wheels (pip download --no-deps "
                    "vllm==0.34.0 sglang==0.5.23 -d DIR)")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_engines_own_code_takes_the_export(arch, saved, tmp_path):
    """vLLM's get_rope / _get_and_verify_max_len and SGLang's get_rope / get_context_length, read from the wheels and
    run on every export: each entry builds a rotary module, the derived length equals serving.derived_length (vLLM
    accepts --max-model-len up to it and refuses one more without its variable), and the printed N is accepted exactly
    when the command sets the variable or N is within the derived length."""
    from transformers.configuration_utils import ALLOWED_LAYER_TYPES

    vllm_rope = _engine_code("vllm", engines.TARGETS["vllm"]["get_rope"], ("get_rope",), {})["get_rope"]
    vllm_len = _engine_code("vllm", "vllm/transformers_utils/config.py", ("iter_rope_parameters", "is_rope_parameters_nested"),
                            {"ALLOWED_LAYER_TYPES": ALLOWED_LAYER_TYPES})
    convert = _engine_code("vllm", "vllm/transformers_utils/model_arch_config_convertor.py",
                           ("derive_max_model_len_and_key",), {})["derive_max_model_len_and_key"]
    sglang_rope = _engine_code("sglang", engines.TARGETS["sglang"]["get_rope"],
                               ("get_rope", "_get_rope_param", "_get_live_rope_cache_entry", "_bailing_yarn_kwargs"),
                               {})["get_rope"]
    sglang_len = _engine_code("sglang", "sglang/srt/utils/hf_transformers/common.py", ("get_context_length",),
                              {})["get_context_length"]
    checked = 0
    for row in SCHEMES:
        if not get_scheme_class(row.name).native:
            continue
        folder = saved(row.name, row.params, arch=arch)
        for name in ENGINES:
            try:
                info = serving.export(folder, name, out=tmp_path / f"{row.name}-{name}")
            except ValueError:
                continue  # refused: test_every_scheme_on_both_engines checks why
            seen = json.loads(Path(info["config_path"]).read_text())
            cfg = types.SimpleNamespace(**seen)
            for entry in serving._entries(info["rope_parameters"]).values():
                if name == "vllm":
                    made = vllm_rope(16, info["max_position_embeddings"], True, rope_parameters=entry)
                else:
                    made = sglang_rope(16, 16, info["max_position_embeddings"], entry.get("rope_theta", 1e4),
                                       rope_scaling=entry)
                assert isinstance(made, _Made), (row.name, name, entry)
                # a scaled rope type builds the engine's class for it, not plain RoPE
                assert (type(made).__name__ == "RotaryEmbedding") == (entry["rope_type"] == "default"), type(made)
            if name == "vllm":
                arch_cfg = types.SimpleNamespace(derived_max_model_len_and_key=convert(types.SimpleNamespace(hf_text_config=cfg)))

                def verify(n, allow, cfg=cfg, arch_cfg=arch_cfg):
                    scope = _engine_code("vllm", "vllm/config/model.py", ("_get_and_verify_max_len",), {
                        **vllm_len, "envs": types.SimpleNamespace(VLLM_ALLOW_LONG_MAX_MODEL_LEN=allow),
                        "current_platform": types.SimpleNamespace(check_max_model_len=lambda x: x)})
                    return scope["_get_and_verify_max_len"](cfg, arch_cfg, None, n, False, None)

                derived = info["derived_length"]
                assert verify(derived, False) == derived
                with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
                    verify(derived + 1, False)
                assert verify(info["context_length"], bool(info["env"])) == info["context_length"]
            else:
                merged = {**json.loads((folder / "config.json").read_text())["rope_parameters"], **info["rope_parameters"]}
                assert sglang_len(types.SimpleNamespace(**{**seen, "rope_scaling": merged})) == info["derived_length"]
                assert info["context_length"] <= info["derived_length"] or info["env"]
            checked += 1
    assert checked >= (10 if arch == "llama" else 5)


def _module_code(name: str, path: str, scope: dict, functions_only: bool = False, keep: set | None = None) -> dict:
    """Run one file of the engine's wheel in `scope` without its imports (the names it imports are in `scope`), its
    annotations and its decorators: the engine's own classes and functions (those named in `keep`, if given;
    module-level assignments only to names `scope` does not hold already)."""
    tree = ast.parse(zipfile.ZipFile(Path(WHEELS) / engines.engine(name)["wheel"]).read(path).decode("utf-8"))
    kinds = (ast.FunctionDef,) if functions_only else (ast.FunctionDef, ast.ClassDef, ast.Assign)
    body = [n for n in tree.body if isinstance(n, kinds) and (
        (keep is None or n.name in keep) if not isinstance(n, ast.Assign) else
        keep is None and not all(isinstance(t, ast.Name) and t.id in scope for t in n.targets))]
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            node.decorator_list = [d for d in node.decorator_list if isinstance(d, ast.Name) and d.id in
                                   ("staticmethod", "classmethod", "property")]
        if isinstance(node, ast.FunctionDef):
            node.returns = None
            for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg):
                if a is not None:
                    a.annotation = None
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), scope)  # noqa: S102 - the engine's source
    return scope


def _vllm_get_rope(n: int):
    """vLLM's get_rope over its own rotary classes (base, linear, ntk, dynamic, yarn, llama3, proportional, longrope),
    read from the wheel and run on CPU; `n`: the max_model_len its LongRoPE asks the engine config for."""
    import math

    import torch

    class CustomOp(torch.nn.Module):
        @classmethod
        def register(cls, _name):
            return lambda c: c

        def enabled(self):
            return False

    quiet = types.SimpleNamespace(warning=lambda *a, **k: None, warning_once=lambda *a, **k: None,
                                  info=lambda *a, **k: None, info_once=lambda *a, **k: None, debug=lambda *a, **k: None)
    scope = {"torch": torch, "nn": torch.nn, "math": math, "CustomOp": CustomOp, "Any": object, "logger": quiet,
             "init_logger": lambda _n: quiet, "ApplyRotaryEmb": lambda **k: None, "_ROPE_DICT": {},
             "rocm_aiter_ops": types.SimpleNamespace(is_triton_rotary_embed_enabled=lambda: False),
             "get_current_vllm_config": lambda: types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=n))}
    root = "vllm/model_executor/layers/rotary_embedding/"
    _module_code("vllm", root + "common.py", scope, functions_only=True)
    for file in ("base", "linear_scaling_rope", "ntk_scaling_rope", "dynamic_ntk_scaling_rope", "yarn_scaling_rope",
                 "llama3_rope", "gemma4_rope", "phi3_long_rope_scaled_rope"):
        _module_code("vllm", f"{root}{file}.py", scope)
    get_rope = _module_code("vllm", root + "__init__.py", scope, functions_only=True)["get_rope"]
    return lambda entry, mpe: get_rope(16, mpe, True, rope_parameters=entry, dtype=__import__("torch").float32)


def _sglang_get_rope(n: int):
    """SGLang's get_rope over its own rotary classes, read from the wheel and run on CPU."""
    import math
    import typing

    import torch

    class BaseFusedOp(torch.nn.Module):
        pass

    quiet = types.SimpleNamespace(warning=lambda *a, **k: None, warning_once=lambda *a, **k: None,
                                  info=lambda *a, **k: None, debug=lambda *a, **k: None)
    flag = types.SimpleNamespace(get=lambda: True)
    scope = {"torch": torch, "nn": torch.nn, "F": torch.nn.functional, "math": math, "BaseFusedOp": BaseFusedOp,
             **{k: getattr(typing, k) for k in ("Any", "Dict", "List", "Optional", "Tuple", "Union", "Callable")},
             "logger": quiet, "envs": types.SimpleNamespace(SGLANG_ROPE_CACHE_FP32=flag), "publish_role": lambda: None,
             "get_exec": lambda: None, "current_platform": types.SimpleNamespace(is_out_of_tree=lambda: False),
             "apply_rotary_emb": None, "_ROPE_DICT": {}, "_use_aiter": False, "_is_cuda": False, "_is_hip": False,
             "_is_npu": False, "_is_cpu": True, "_is_xpu": False, "_is_musa": False, "_is_mps": False,
             "_is_cpu_amx_available": False, "get_bool_env_var": lambda *a: False}
    root = "sglang/srt/layers/rotary_embedding/"
    _module_code("sglang", root + "utils.py", scope, keep={"rotate_neox", "rotate_gptj"})
    _module_code("sglang", root + "base.py", scope, keep={"RotaryEmbedding", "LinearScalingRotaryEmbedding"})
    _module_code("sglang", root + "yarn.py", scope, keep={"yarn_find_correction_dim", "yarn_find_correction_range",
                                                          "yarn_linear_ramp_mask", "yarn_get_mscale_simple",
                                                          "yarn_get_mscale", "_extend_yarn_cache",
                                                          "YaRNScalingRotaryEmbedding"})
    _module_code("sglang", root + "rope_variant.py", scope, keep={
        "DynamicNTKScalingRotaryEmbedding", "Llama3RotaryEmbedding", "Phi3LongRoPEScaledRotaryEmbedding",
        "Gemma4RotaryEmbedding"})
    get_rope = _module_code("sglang", root + "factory.py", scope, keep={
        "get_rope", "_get_rope_param", "_get_live_rope_cache_entry", "_bailing_yarn_kwargs"})["get_rope"]
    return lambda entry, mpe: get_rope(16, 16, mpe, entry["rope_theta"], rope_scaling=entry,
                                       dtype=__import__("torch").float32)


@pytest.mark.skipif(not WHEELS, reason="ROPE_PATCH_ENGINE_WHEELS=DIR holds the engine wheels")
@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("row", [r for r in SCHEMES if get_scheme_class(r.name).native], ids=lambda r: r.name)
def test_engine_rotary_equals_the_patched_model(row, arch, engine_name, saved):
    """Parity by number: the engine's own rotary classes (read from its wheel, run on CPU) build, from the exported
    rope_parameters (each layer type's), the cos/sin the patched transformers model computes at the served length N
    (dynamic NTK: at N, where the engines' static form equals it; LongRoPE: the long factors, which both engines use
    for a batch reaching N > L). Exports the engine refuses are skipped (test_every_scheme_on_both_engines checks
    the refusals)."""
    import torch

    try:
        folder = saved(row.name, row.params, arch=arch)
        info = serving.export(folder, engine_name, write=False)
    except ValueError as err:
        pytest.skip(f"not served: {err}")
    n = info["context_length"]
    get_rope = (_vllm_get_rope if engine_name == "vllm" else _sglang_get_rope)(n)
    model = rope_patch.from_pretrained(folder)
    x = torch.zeros(1, n, model.config.hidden_size)
    for lt, entry in serving._entries(info["rope_parameters"]).items():
        rotary = get_rope(entry, info["max_position_embeddings"])
        if hasattr(rotary, "long_short_cos_sin_cache"):  # LongRoPE: the long half, from offset L
            original = entry["original_max_position_embeddings"]
            offset = original if n > original + 1 else 0
            cache = rotary.long_short_cos_sin_cache[offset:offset + n]
        else:
            cache = rotary.cos_sin_cache[:n]
        half = cache.shape[-1] // 2
        cos, sin = model.model.rotary_emb(x, torch.arange(n)[None], *([lt] if lt else []))
        assert cache.shape[0] == n
        assert torch.allclose(cache[:, :half], cos[0, :, :half], atol=2e-5), (lt, (cache[:, :half] - cos[0, :, :half]).abs().max())
        assert torch.allclose(cache[:, half:], sin[0, :, :half], atol=2e-5), (lt, (cache[:, half:] - sin[0, :, :half]).abs().max())
