"""`rope-patch export DIR --engine vllm|sglang` (rope_patch.serving): every scheme × both engines, decided by the
engine snapshot (rope_patch/data/engines.json), never by a list here: a native scheme's emitted rope_parameters carry a
rope type of the engine's table and only keys the engine reads for it (and every key it subscripts); the others are
refused in one line naming the scheme and the engine's rope types. Per-layer-type models (Gemma 3), the recipe's merged
LoRA checkpoint, adapters, the context length and the allow-longer variable, the tokenizer the engine loads, and where
the config.json goes."""

from __future__ import annotations

import ast
import json
import math
import os
import shlex
import types
import zipfile
from pathlib import Path

import pytest
from helpers.models import WINDOW, tiny_model
from helpers.schemes import SCHEMES
from helpers.text import char_tokenizer

import rope_patch
from rope_patch import engines, serving
from rope_patch.cli import main
from rope_patch.registry import get_scheme_class

ENGINES = engines.ENGINES
# The native schemes an engine still cannot run as patched, because of what its source reads (the snapshot says so;
# the export's message names the reason). Anything else native must export: none today.
ENGINE_LIMITS: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """One saved tiny llama per scheme row (save_pretrained of the patched model, with a tokenizer as an engine needs),
    written on first use."""
    cache = {}

    def get(name, params, arch="llama"):
        key = (name, json.dumps(params, sort_keys=True), arch)
        if key not in cache:
            model = tiny_model(arch)
            rope_patch.apply(model, name, **params)
            folder = tmp_path_factory.mktemp(f"{arch}-{name}")
            rope_patch.save_pretrained(model, folder, tokenizer=tokenizer)
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
    assert set(info["top_level"]) <= engines.config_reads(name, model_type)  # read by its model code from there
    words = shlex.split(info["command"])
    assert _overrides(info["command"]) == {"rope_parameters": rope, **info["top_level"],
                                           "max_position_embeddings": info["max_position_embeddings"]}
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
    assert {k: written[k] for k in info["top_level"]} == info["top_level"]
    changed = ("rope_parameters", "max_position_embeddings", *info["top_level"])
    assert {k: v for k, v in written.items() if k not in changed} == \
        {k: v for k, v in plain.items() if k not in changed}
    assert json.loads((folder / "config.json").read_text()) == plain  # the checkpoint's own config.json untouched


def test_stacks_and_modifiers_are_refused_naming_the_part(saved):
    folder = saved("stack", {"schemes": [{"scheme": "yarn", "params": {"factor": 4}},
                                          {"scheme": "self_extend", "params": {"group_size": 4, "window_size": 16}}]})
    for name in ENGINES:
        with pytest.raises(ValueError, match=r"cannot serve self_extend \(changes attention\) in stack yarn "
                                             r"\+ self_extend"):
            serving.export(folder, name, write=False)


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("scheme,params", [("default", {"rope_theta": 40_000}), ("linear", {"factor": 2}),
                                           ("yarn", {"factor": 4}), ("dynamic", {"factor": 4}),
                                           ("longrope", {"factor": 4, "short_factor": [1.0] * 8,
                                                         "long_factor": [3.0] * 8})])
def test_per_layer_type_models(scheme, params, engine_name, saved, tmp_path):
    """Gemma 3 keeps rope_parameters keyed by layer type: every entry is exported and checked. SGLang's Gemma 3 code
    replaces the config's RoPE by {"rope_type": "default"} (the snapshot's fixed_rope_types): only `default` (a base
    per layer type, which it reads) serves there. A note says a thing once, not once per layer type (before: dynamic's
    and longrope's notes were printed twice)."""
    folder = saved(scheme, params, arch="gemma3")
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    fixed = engines.fixed_rope_types(engine_name, model_type)
    if fixed is not None and scheme not in fixed:
        with pytest.raises(ValueError, match=f"its {model_type} model code replaces the config's "
                                             "rope_parameters by rope type default"):
            serving.export(folder, engine_name, write=False)
        return
    info = serving.export(folder, engine_name, out=tmp_path / "out")
    assert set(info["rope_parameters"]) == {"sliding_attention", "full_attention"}
    _check_against_snapshot(info, engine_name, model_type)
    assert len(info["notes"]) == len(set(info["notes"])), info["notes"]
    assert (scheme in ("dynamic", "longrope")) == bool(info["notes"])


def test_gemma3_layer_types_keep_their_own_base(saved):
    info = serving.export(saved("yarn", {"factor": 4}, arch="gemma3"), "vllm", write=False)
    rope = info["rope_parameters"]
    assert rope["full_attention"]["rope_theta"] != rope["sliding_attention"]["rope_theta"]
    assert {e["rope_type"] for e in rope.values()} == {"yarn"} and info["context_length"] == 4 * WINDOW


@pytest.mark.parametrize("engine_name", ENGINES)
def test_merged_lora_checkpoint_exports(engine_name, tokenizer, tmp_path):
    """The recipe's --merge: a LoRA trained under the patch, merged into the base and saved with
    rope_patch.save_pretrained, serves with the rope_parameters it was trained with."""
    import peft

    model = tiny_model()
    lora = peft.get_peft_model(model,
                               peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    rope_patch.apply(lora, "yarn", factor=4)
    merged = lora.merge_and_unload()
    rope_patch.save_pretrained(merged, tmp_path / "merged", tokenizer=tokenizer)
    info = serving.export(tmp_path / "merged", engine_name, write=False)
    assert info["rope_parameters"] == rope_patch.native_config(merged)["rope_parameters"]
    assert info["context_length"] == 4 * WINDOW and info["scheme"] == "yarn"
    _check_against_snapshot(info, engine_name, "llama")


@pytest.mark.parametrize("engine_name", ENGINES)
def test_adapter_serves_on_its_base(engine_name, tokenizer, tmp_path):
    import peft

    tiny_model().save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")  # the engine loads the base's tokenizer
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
    # SGLang: long once a position exceeds L (torch.any(positions > L)); transformers once it holds more than L tokens
    # (max(position_ids) + 1 > L): at L + 1 tokens, transformers long and SGLang short
    note = serving.export(saved(row.name, row.params), "sglang", write=False)["notes"][0]
    assert f"differ at exactly {WINDOW + 1} tokens (transformers: long factors; sglang: short ones, and position " \
        f"{WINDOW} reads row {WINDOW} of its short-then-long table, the long table's position 0, i.e. no " \
        "rotation)" in note


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


def test_a_key_the_engine_does_not_read_is_refused():
    """transformers' `proportional` divides its frequencies by `factor`; neither engine's proportional branch reads a
    factor: an entry that sets it would be served as another model."""
    entry = {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "factor": 2.0}
    for name in ENGINES:
        with pytest.raises(ValueError, match=f"{name} [0-9.]+ cannot serve p_rope: it does not read 'factor' for rope "
                                             r"type 'proportional' \(it reads "):
            serving.engine_form(name, entry, WINDOW, WINDOW, "llama", "p_rope")
    del entry["factor"]
    assert all(serving.engine_form(name, entry, WINDOW, WINDOW, "llama", "p_rope") for name in ENGINES)


# (attention_factor, mscale, mscale_all_dim) -> the attn_factor SGLang needs: its scale is attn_factor × its default,
# 0.1 ln s + 1 (s = factor), or with both mscale and mscale_all_dim (0.1·m·ln s + 1) / (0.1·m_all·ln s + 1)
YARN_SCALES = [((1.5, None, None), lambda d, r: 1.5 / d), ((None, None, None), None),
               ((None, 1.0, 0.5), None), ((1.25, 1.0, 0.5), lambda d, r: 1.25 / r),
               ((0.8, 0.7, None), lambda d, r: 0.8 / d)]


@pytest.mark.parametrize("scales,expected", YARN_SCALES, ids=[str(s) for s, _ in YARN_SCALES])
def test_sglang_yarn_attn_factor_gives_transformers_scale(scales, expected, saved):
    """SGLang's YaRN reads `attn_factor`, a multiplier on its own default scale, and no `attention_factor`: the export
    writes the attn_factor whose product with SGLang's default is transformers' scale (the rotary's
    attention_scaling), and none where the two defaults agree."""
    a, m, m_all = scales
    params = {"factor": 4, **{k: v for k, v in (("attention_factor", a), ("mscale", m), ("mscale_all_dim", m_all))
                              if v is not None}}
    folder = saved("yarn", params)
    info = serving.export(folder, "sglang", write=False)
    rope = info["rope_parameters"]
    assert "attention_factor" not in rope and {k: rope[k] for k in ("mscale", "mscale_all_dim") if k in rope} == \
        {k: v for k, v in (("mscale", m), ("mscale_all_dim", m_all)) if v is not None}
    default = 0.1 * math.log(4) + 1
    ratio = (0.1 * (m or 0) * math.log(4) + 1) / (0.1 * (m_all or 0) * math.log(4) + 1)
    if expected is None:
        assert "attn_factor" not in rope
    else:
        assert rope["attn_factor"] == pytest.approx(expected(default, ratio), rel=1e-12)
    sglang_default = ratio if m is not None and m_all is not None else default
    scale = rope_patch.from_pretrained(folder).model.rotary_emb.attention_scaling  # transformers' own computation
    assert sglang_default * rope.get("attn_factor", 1.0) == pytest.approx(scale, rel=1e-12)
    _check_against_snapshot(info, "sglang", "llama")
    vllm = serving.export(folder, "vllm", write=False)["rope_parameters"]  # vLLM reads attention_factor itself
    assert "attn_factor" not in vllm and vllm.get("attention_factor") == a


def test_sglang_yarn_scale_no_attn_factor_can_give_is_refused():
    """A zero mscale_all_dim (transformers: falsy, its plain default) with 0.1·mscale·ln s + 1 = 0: SGLang takes the
    ratio, 0, which no attn_factor scales to transformers' scale."""
    entry = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": WINDOW,
             "mscale": -10 / math.log(4), "mscale_all_dim": 0.0}
    with pytest.raises(ValueError, match="no attn_factor gives transformers' scale"):
        serving.engine_form("sglang", entry, 4 * WINDOW, 4 * WINDOW, "llama", "yarn")


def test_sglang_p_rope_sets_the_top_level_partial_rotary_factor(saved, tmp_path):
    """SGLang's llama takes rotary_dim = int(partial_rotary_factor × head_dim) with the factor read from the config's
    top level (`getattr(config, "partial_rotary_factor", 1)`), not from rope_parameters: the export sets it there, in
    the override (which SGLang setattr's onto the loaded config) and in the written config.json. vLLM reads it from
    rope_parameters."""
    folder = saved("p_rope", {"partial_rotary_factor": 0.5})
    info = serving.export(folder, "sglang", out=tmp_path / "out")
    assert info["top_level"] == {"partial_rotary_factor": 0.5}
    assert info["rope_parameters"] == {"rope_type": "proportional", "rope_theta": 10000.0}
    assert _overrides(info["command"])["partial_rotary_factor"] == 0.5
    assert json.loads((tmp_path / "out" / "config.json").read_text())["partial_rotary_factor"] == 0.5
    vllm = serving.export(folder, "vllm", write=False)
    assert vllm["top_level"] == {} and vllm["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert "partial_rotary_factor" in engines.config_reads("sglang", "llama")  # the snapshot's reading of its llama.py


def test_a_top_level_key_must_be_one_value_for_every_layer_type():
    rope = {"sliding_attention": {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}
    with pytest.raises(ValueError, match="reads partial_rotary_factor from the config's top level, one value for every "
                                         "layer"):
        serving.engine_form("sglang", rope, WINDOW, WINDOW, "llama", "p_rope")


def test_vllm_reads_the_tokenizer_length_only_for_pooling_models_with_absolute_positions(saved, tmp_path):
    """vLLM's ModelConfig.get_and_verify_max_len reads tokenizer_config.json only for the pooling runner on a config
    with position_embedding_type "absolute" (the snapshot's tokenizer_when): a causal LM served by `vllm serve` gets
    the length from config.json alone, so a tokenizer saved with model_max_length L changes nothing and no
    allow-longer variable is set. SGLang reads no tokenizer length."""
    import shutil

    assert engines.engine("vllm")["context"]["tokenizer_when"] == {"runner_type": "pooling",
                                                                   "position_embedding_type": "absolute"}
    assert engines.engine("sglang")["context"]["tokenizer_when"] is None
    folder = tmp_path / "m"
    shutil.copytree(saved("yarn", {"factor": 4}), folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": WINDOW}))
    for name in ENGINES:
        info = serving.export(folder, name, write=False)
        assert info["derived_length"] == 4 * WINDOW and info["env"] == {} and "ALLOW" not in info["command"]
    config = {"max_position_embeddings": 4 * WINDOW, "position_embedding_type": "absolute"}
    assert serving.derived_length("vllm", config, tokenizer_max=WINDOW) == 4 * WINDOW  # runner "generate"
    assert serving.derived_length("vllm", config, tokenizer_max=WINDOW, runner_type="pooling") == WINDOW
    assert serving.derived_length("vllm", {**config, "position_embedding_type": "rope"}, tokenizer_max=WINDOW,
                                  runner_type="pooling") == 4 * WINDOW
    assert serving.derived_length("sglang", config, tokenizer_max=WINDOW, runner_type="pooling") == 4 * WINDOW


def test_allow_longer_variable_only_past_the_derived_length(saved, tmp_path):
    """N past what the engine derives from the config it sees: a config.json whose max_position_embeddings is below
    the window (a model trained past its config) makes both commands set the engine's variable."""
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(saved("yarn", {"factor": 4}), folder)
    for name in ENGINES:
        assert serving.export(folder, name, write=False)["env"] == {}
    config = json.loads((folder / "config.json").read_text())  # a length key both engines read, below the window
    (folder / "config.json").write_text(json.dumps({**config, "max_sequence_length": 2 * WINDOW}))
    for name in ENGINES:
        info = serving.export(folder, name, write=False)
        env = engines.engine(name)["context"]["env"]
        assert info["derived_length"] == 2 * WINDOW and info["context_length"] == 4 * WINDOW
        assert info["env"] == {env: "1"} and f"{env}=1" in shlex.split(info["command"])


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
    # the first
    assert serving.derived_length("sglang", {"max_position_embeddings": 64, "max_sequence_length": 96}) == 96


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
    rotary = {n.id: type(n.id, (_Made,), {}) for n in ast.walk(tree)
              if isinstance(n, ast.Name) and n.id.endswith("RotaryEmbedding")}
    quiet = types.SimpleNamespace(warning=lambda *a, **k: None, warning_once=lambda *a, **k: None,
                                  info=lambda *a, **k: None, debug=lambda *a, **k: None)
    torch_stub = types.SimpleNamespace(get_default_dtype=lambda: "float32", dtype=object,
                                       get_default_device=lambda: types.SimpleNamespace(type="cpu"))
    scope = {"Any": object, "torch": torch_stub, "logger": quiet, "_ROPE_DICT": {}, "_use_aiter": False,
             "_is_hip": False,
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
    vllm_len = _engine_code("vllm", "vllm/transformers_utils/config.py",
                            ("iter_rope_parameters", "is_rope_parameters_nested"),
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
                arch_cfg = types.SimpleNamespace(
                    derived_max_model_len_and_key=convert(types.SimpleNamespace(hf_text_config=cfg)))

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
                merged = {**json.loads((folder / "config.json").read_text())["rope_parameters"],
                          **info["rope_parameters"]}
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
            for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg,
                      node.args.kwarg):
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
             "get_current_vllm_config":
                 lambda: types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=n))}
    root = "vllm/model_executor/layers/rotary_embedding/"
    _module_code("vllm", root + "common.py", scope, functions_only=True)
    for file in ("base", "linear_scaling_rope", "ntk_scaling_rope", "dynamic_ntk_scaling_rope", "yarn_scaling_rope",
                 "llama3_rope", "gemma4_rope", "phi3_long_rope_scaled_rope"):
        _module_code("vllm", f"{root}{file}.py", scope)
    get_rope = _module_code("vllm", root + "__init__.py", scope, functions_only=True)["get_rope"]
    return lambda entry, mpe: get_rope(16, mpe, True, rope_parameters=entry, dtype=__import__("torch").float32)


def _sglang_scope(n: int) -> dict:
    """SGLang's get_rope over its own rotary classes, read from the wheel, in a scope that runs on CPU."""
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
    return _module_code("sglang", root + "factory.py", scope, keep={
        "get_rope", "_get_rope_param", "_get_live_rope_cache_entry", "_bailing_yarn_kwargs"})


def _sglang_get_rope(n: int):
    """SGLang's get_rope over its own rotary classes, read from the wheel and run on CPU (the whole head rotated)."""
    import torch

    get_rope = _sglang_scope(n)["get_rope"]
    return lambda entry, mpe: get_rope(16, 16, mpe, entry["rope_theta"], rope_scaling=entry, dtype=torch.float32)


def _sglang_llama_rotary(n: int):
    """The rotary module SGLang's own LlamaAttention (read from the wheel) builds from the config SGLang sees: its
    rotary_dim = int(partial_rotary_factor × head_dim) with the factor read from the config's top level, its
    rope_scaling the config's rope_parameters (as LlamaDecoderLayer passes them)."""
    import typing

    import torch

    none = lambda *a, **k: None  # noqa: E731 - the linear layers and attention kernel: not what is checked
    scope = {"nn": torch.nn, "torch": torch, "get_rope": _sglang_scope(n)["get_rope"], "add_prefix": lambda a, b: a,
             "get_parallel": lambda: types.SimpleNamespace(tp_size=1), "QKVParallelLinear": none,
             "RowParallelLinear": none, "RadixAttention": none,
             **{k: getattr(typing, k) for k in ("Any", "Dict", "List", "Optional", "Tuple", "Union", "Iterable")}}
    attention = _module_code("sglang", "sglang/srt/models/llama.py", scope, keep={"LlamaAttention"})["LlamaAttention"]

    def build(config, mpe):
        rope = config.rope_parameters
        return attention(config=config, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                         num_kv_heads=config.num_key_value_heads, rope_theta=rope.get("rope_theta", 10000),
                         rope_scaling=rope, max_position_embeddings=mpe).rotary_emb

    return build


def _sglang_sees(folder: Path, info: dict) -> types.SimpleNamespace:
    """The config SGLang's get_config makes of DIR's config.json and the printed --json-model-override-args: a
    rope_parameters override merged one level deep into the config's, every other key set as an attribute."""
    config = json.loads((folder / "config.json").read_text())
    for key, value in _overrides(info["command"]).items():
        config[key] = {**config[key], **value} if key == "rope_parameters" and isinstance(config.get(key), dict) \
            else value
    return types.SimpleNamespace(**config)


def _assert_engine_rotary_equals_the_patched_model(folder: Path, info: dict, engine_name: str, arch: str) -> None:
    import torch

    n = info["context_length"]
    model = rope_patch.from_pretrained(folder)
    x = torch.zeros(1, n, model.config.hidden_size)
    for lt, entry in serving._entries(info["rope_parameters"]).items():
        if engine_name == "sglang" and arch == "llama":  # built as its llama builds it, top-level keys included
            rotary = _sglang_llama_rotary(n)(_sglang_sees(folder, info), info["max_position_embeddings"])
        else:
            rotary = (_vllm_get_rope if engine_name == "vllm" else _sglang_get_rope)(n)(entry,
                                                                                        info["max_position_embeddings"])
        if hasattr(rotary, "long_short_cos_sin_cache"):  # LongRoPE: the long half, from offset L
            original = entry["original_max_position_embeddings"]
            offset = original if n > original + 1 else 0
            cache = rotary.long_short_cos_sin_cache[offset:offset + n]
        else:
            cache = rotary.cos_sin_cache[:n]
        half = cache.shape[-1] // 2
        cos, sin = model.model.rotary_emb(x, torch.arange(n)[None], *([lt] if lt else []))
        assert cache.shape[0] == n
        assert torch.allclose(cache[:, :half], cos[0, :, :half], atol=2e-5), (
            lt, (cache[:, :half] - cos[0, :, :half]).abs().max())
        assert torch.allclose(cache[:, half:], sin[0, :, :half], atol=2e-5), (
            lt, (cache[:, half:] - sin[0, :, :half]).abs().max())


@pytest.mark.skipif(not WHEELS, reason="ROPE_PATCH_ENGINE_WHEELS=DIR holds the engine wheels")
@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("row", [r for r in SCHEMES if get_scheme_class(r.name).native], ids=lambda r: r.name)
def test_engine_rotary_equals_the_patched_model(row, arch, engine_name, saved):
    """Parity by number: the engine's own rotary classes (read from its wheel, run on CPU; SGLang's llama through its
    own LlamaAttention, which takes partial_rotary_factor from the config's top level) build, from the export, the
    cos/sin the patched transformers model computes at the served length N (dynamic NTK: at N, where the engines'
    static form equals it; LongRoPE: the long factors, which both engines use for a batch reaching N > L + 1). Exports
    the engine refuses are skipped (test_every_scheme_on_both_engines checks the refusals)."""
    try:
        folder = saved(row.name, row.params, arch=arch)
        info = serving.export(folder, engine_name, write=False)
    except ValueError as err:
        pytest.skip(f"not served: {err}")
    _assert_engine_rotary_equals_the_patched_model(folder, info, engine_name, arch)


@pytest.mark.skipif(not WHEELS, reason="ROPE_PATCH_ENGINE_WHEELS=DIR holds the engine wheels")
@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("scales", [s for s, _ in YARN_SCALES], ids=str)
def test_engine_yarn_scale_equals_the_patched_model(scales, engine_name, saved):
    """YaRN with attention_factor / mscale / mscale_all_dim: vLLM's YaRNScalingRotaryEmbedding reads attention_factor,
    SGLang's multiplies its own default by the exported attn_factor; both give transformers' cos/sin and scale."""
    a, m, m_all = scales
    params = {"factor": 4, **{k: v for k, v in (("attention_factor", a), ("mscale", m), ("mscale_all_dim", m_all))
                              if v is not None}}
    folder = saved("yarn", params)
    _assert_engine_rotary_equals_the_patched_model(folder, serving.export(folder, engine_name, write=False),
                                                   engine_name, "llama")


@pytest.mark.skipif(not WHEELS, reason="ROPE_PATCH_ENGINE_WHEELS=DIR holds the engine wheels")
def test_sglang_longrope_switches_one_token_after_transformers(saved):
    """SGLang's own Phi3LongRoPEScaledRotaryEmbedding.forward (long when any position > L) against transformers
    (long when max(position_ids) + 1 > L), rotating the same query: equal at L and at L + 2 tokens; at exactly L + 1
    tokens transformers uses the long factors and SGLang the short ones below position L, and for position L row L of
    its short-then-long table, the long table's position 0 (no rotation, the long scale only), as the note says."""
    import torch
    from transformers.models.llama.modeling_llama import rotate_half

    row = next(r for r in SCHEMES if r.name == "longrope")
    folder = saved(row.name, row.params)
    info = serving.export(folder, "sglang", write=False)
    entry, L = info["rope_parameters"], WINDOW
    assert entry["original_max_position_embeddings"] == L
    assert f"differ at exactly {L + 1} tokens" in info["notes"][0]
    rotary = _sglang_get_rope(info["context_length"])(entry, info["max_position_embeddings"])
    model = rope_patch.from_pretrained(folder)
    q = torch.randn(L + 2, 16, generator=torch.Generator().manual_seed(0))

    def sglang(t):
        return rotary.forward(torch.arange(t), q[:t].clone(), q[:t].clone())[0]

    def transformers(t):
        cos, sin = model.model.rotary_emb(q[None, :t], torch.arange(t)[None])
        return q[:t] * cos[0] + rotate_half(q[:t]) * sin[0]

    close = lambda a, b: torch.allclose(a, b, atol=2e-5)  # noqa: E731
    assert close(sglang(L), transformers(L)) and close(sglang(L + 2), transformers(L + 2))
    at, tf = sglang(L + 1), transformers(L + 1)
    assert close(tf, transformers(L + 2)[:L + 1])                   # transformers: long at L + 1 tokens
    assert close(at[:L], transformers(L)) and not close(at, tf)    # SGLang: short below position L
    assert close(at[L], q[L] * model.model.rotary_emb.attention_scaling)  # position L: the long table's row 0


@pytest.mark.skipif(not WHEELS, reason="ROPE_PATCH_ENGINE_WHEELS=DIR holds the engine wheels")
def test_vllm_reads_the_tokenizer_length_by_its_own_code(saved, tmp_path):
    """vLLM's own ModelConfig.get_and_verify_max_len and _get_and_verify_max_len (read from the wheel) on a folder whose
    tokenizer says model_max_length L: the generate runner accepts the exported N = 4·L without
    VLLM_ALLOW_LONG_MAX_MODEL_LEN (and the export sets none); a pooling model with absolute positions is capped at
    the tokenizer's L, as serving.derived_length says for that runner."""
    import shutil

    from transformers.configuration_utils import ALLOWED_LAYER_TYPES

    folder = tmp_path / "m"
    shutil.copytree(saved("yarn", {"factor": 4}), folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": WINDOW}))
    info = serving.export(folder, "vllm", write=False)
    assert info["env"] == {} and info["context_length"] == 4 * WINDOW
    rope = _engine_code("vllm", "vllm/transformers_utils/config.py",
                        ("iter_rope_parameters", "is_rope_parameters_nested"),
                        {"ALLOWED_LAYER_TYPES": ALLOWED_LAYER_TYPES})
    convert = _engine_code("vllm", "vllm/transformers_utils/model_arch_config_convertor.py",
                           ("derive_max_model_len_and_key",), {})["derive_max_model_len_and_key"]
    read = []

    def tokenizer_config(tokenizer, **_):
        read.append(tokenizer)
        return json.loads((Path(tokenizer) / "tokenizer_config.json").read_text())

    def verify(config: dict, runner: str, n: int) -> int:
        scope = _engine_code("vllm", "vllm/config/model.py", ("get_and_verify_max_len", "_get_and_verify_max_len"), {
            **rope, "envs": types.SimpleNamespace(VLLM_ALLOW_LONG_MAX_MODEL_LEN=False),
            "current_platform": types.SimpleNamespace(check_max_model_len=lambda x: x),
            "try_get_tokenizer_config": tokenizer_config})
        cfg = types.SimpleNamespace(**config)
        me = types.SimpleNamespace(
            runner_type=runner, hf_config=cfg, hf_text_config=cfg, tokenizer=str(folder), trust_remote_code=False,
            tokenizer_revision=None, disable_sliding_window=False, get_sliding_window=lambda: None,
            spec_target_max_model_len=None, encoder_config=None,
            model_arch_config=types.SimpleNamespace(
                derived_max_model_len_and_key=convert(types.SimpleNamespace(hf_text_config=cfg))))
        return scope["get_and_verify_max_len"](me, n)

    seen = {**json.loads((folder / "config.json").read_text()), **_overrides(info["command"])}
    assert verify(seen, "generate", info["context_length"]) == 4 * WINDOW and read == []  # not read at all
    pooling = {**seen, "position_embedding_type": "absolute"}
    capped = serving.derived_length("vllm", pooling, tokenizer_max=WINDOW, runner_type="pooling")
    assert capped == WINDOW and verify(pooling, "pooling", capped) == capped and read == [str(folder)]
    with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        verify(pooling, "pooling", capped + 1)
    assert verify({**seen, "position_embedding_type": "rope"}, "pooling", 4 * WINDOW) == 4 * WINDOW


# ---- the tokenizer the engine loads ---------------------------------------------------------------------------------
def test_a_folder_without_tokenizer_is_refused_saying_how_to_add_one(tmp_path, tokenizer, capsys):
    """Both engines load the tokenizer from the folder they serve and cannot start without one: the export refuses in
    one line that says how to save it there, writes nothing, and passes once it is there."""
    model = tiny_model()
    rope_patch.apply(model, "yarn", factor=4)
    rope_patch.save_pretrained(model, tmp_path / "m")
    capsys.readouterr()  # transformers' save progress
    for name in ENGINES:
        with pytest.raises(serving.MissingTokenizerError) as info:
            serving.export(tmp_path / "m", name, out=tmp_path / "out")
        message = str(info.value)
        assert len(message.splitlines()) == 1 and f"{tmp_path / 'm'} has no tokenizer" in message
        assert f"rope_patch.save_pretrained(model, {str(tmp_path / 'm')!r}, tokenizer=tokenizer)" in message
        assert not (tmp_path / "out").exists()
        code, out, err = _run(capsys, tmp_path / "m", "--engine", name)
        assert code == 2 and out == "" and err.strip().endswith("then export again.")
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    code, out, _ = _run(capsys, tmp_path / "m")  # the plain export prints no command that cannot start
    assert code == 0 and "vllm serve" not in out and "vLLM: " + f"{tmp_path / 'm'} has no tokenizer" in out
    rope_patch.save_pretrained(model, tmp_path / "m", tokenizer=tokenizer)
    for name in ENGINES:
        assert serving.export(tmp_path / "m", name, write=False)["command"]


def test_an_adapter_needs_the_tokenizer_of_its_base(tmp_path, tokenizer):
    import peft
    from transformers import AutoModelForCausalLM

    tiny_model().save_pretrained(tmp_path / "base")
    lora = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                               peft.LoraConfig(r=2, target_modules=["q_proj"]))
    rope_patch.apply(lora, "linear", factor=2.0)
    rope_patch.save_pretrained(lora, tmp_path / "adapter", tokenizer=tokenizer)  # in the adapter: not where it loads
    for name in ENGINES:
        with pytest.raises(serving.MissingTokenizerError,
                           match=f"the adapter base {tmp_path / 'base'} has no tokenizer .* tokenizer.save_pretrained"):
            serving.export(tmp_path / "adapter", name, write=False)
    tokenizer.save_pretrained(tmp_path / "base")
    assert serving.export(tmp_path / "adapter", "vllm", write=False)["command"]
