"""rope_patch.engines: the committed snapshot of what vLLM and SGLang accept, and its extractor, tested on small
fixture sources laid out as the engines' wheels are (no download). With the real wheels at hand,
ROPE_PATCH_ENGINE_WHEELS=DIR also checks that the committed snapshot is what `python -m rope_patch.engines` regenerates
from them."""

from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path

import pytest

from rope_patch import engines, schema
from rope_patch.resources import data_path

# -- fixture sources: the shapes of the engines' code the extractor reads (not their code) --------------------------
VLLM_ROPE = '''
def get_rope(head_size, max_position, rope_parameters=None, dual_chunk_attention_config=None):
    rope_parameters = rope_parameters or {}
    base = rope_parameters.get("rope_theta", 10000)
    scaling_type = rope_parameters.get("rope_type", "default")
    if dual_chunk_attention_config is not None:
        x = 1
    elif scaling_type == "default":
        if "mrope_section" in rope_parameters:
            m = rope_parameters["mrope_section"]
    elif scaling_type in ["yarn", "deepseek_yarn"]:
        factor = rope_parameters["factor"]
        extra = {k: v for k, v in rope_parameters.items() if k in ("beta_fast", "beta_slow")}
    elif scaling_type == "dynamic":
        if "alpha" in rope_parameters:
            a = rope_parameters["alpha"]
        else:
            t = rope_parameters.get("max_trained_positions", max_position)
    else:
        raise ValueError(scaling_type)
'''
VLLM_MODEL = '''
def _get_and_verify_max_len(hf_config, rope_parameters):
    if rope_parameters and "gemma3" not in hf_config.model_type:
        for rp in rope_parameters:
            rope_type = rp["rope_type"]
            if rope_type not in ("longrope", "yarn"):
                factor = rp.get("factor", 1.0)
    if envs.VLLM_ALLOW_LONG_MAX_MODEL_LEN:
        pass

def _apply_dict_overrides(config, overrides):
    pass

class ModelConfig:
    def get_and_verify_max_len(self, max_model_len):
        tokenizer_config = None
        if self.runner_type == "pooling" and getattr(self.hf_config, "position_embedding_type", "") == "absolute":
            tokenizer_config = try_get_tokenizer_config(self.tokenizer)
        return _get_and_verify_max_len(self.hf_config, tokenizer_config, max_model_len)
'''
VLLM_FILES = {
    "vllm/model_executor/layers/rotary_embedding/__init__.py": VLLM_ROPE,
    "vllm/model_executor/models/llama.py": "def build(config):\n    d = getattr(config, 'head_dim', None)\n"
                                           "    return get_rope(1, 2, rope_parameters=config.rope_parameters)\n",
    "vllm/model_executor/models/gemma3.py": "def build(config, lt):\n    p = config.rope_parameters[lt]\n"
                                           "    return get_rope(1, 2, rope_parameters=p)\n",
    "vllm/config/model.py": VLLM_MODEL,
    "vllm/envs.py": "VLLM_ALLOW_LONG_MAX_MODEL_LEN: bool = False\n",
    "vllm/engine/arg_utils.py": 'def add(g):\n    g.add_argument("--hf-overrides")\n'
                                '    g.add_argument("--max-model-len")\n',
    "vllm/entrypoints/common/cli_args.py": 'def add(g):\n    g.add_argument("--lora-modules")\n',
    "vllm/transformers_utils/config.py": "def iter_rope_parameters(config):\n    yield config\n",
    "vllm/transformers_utils/model_arch_config_convertor.py":
        'def derive_max_model_len_and_key(self):\n    possible_keys = ["max_position_embeddings", "seq_length"]\n',
    "vllm/model_executor/layers/rotary_embedding/dynamic_ntk_scaling_rope.py":
        "class DynamicNTKScalingRotaryEmbedding:\n    def _compute_cos_sin_cache(self):\n        return 1\n",
    "vllm/model_executor/layers/rotary_embedding/phi3_long_rope_scaled_rope.py":
        "class Phi3LongRoPEScaledRotaryEmbedding:\n    def forward(self, positions):\n        return positions\n",
}
SGLANG_ROPE = '''
def get_rope(head_size, rotary_dim, max_position, base, rope_scaling=None):
    if rope_scaling is None:
        return None
    if "rope_type" in rope_scaling:
        scaling_type = rope_scaling["rope_type"]
    if scaling_type == "linear":
        f = _get_rope_param(rope_scaling, "factor", 1.0, scaling_type)
    elif scaling_type == "longrope":
        s = rope_scaling["short_factor"]
        extra = {k: v for k, v in rope_scaling.items() if k in ("short_mscale", "long_mscale")}
'''
SGLANG_COMMON = '''
CONTEXT_LENGTH_KEYS = ["max_sequence_length", "max_position_embeddings"]

def get_context_length(config):
    rope_scaling = getattr(config, "rope_scaling", None)
    if rope_scaling:
        if "original_max_position_embeddings" in rope_scaling:
            f = 1
        if rope_scaling.get("rope_type", None) == "llama3":
            f = 1
'''
SGLANG_FILES = {
    "sglang/srt/layers/rotary_embedding/factory.py": SGLANG_ROPE,
    "sglang/srt/models/llama.py": 'class LlamaAttention:\n    def __init__(self, config):\n'
                                  '        self.rotary_dim = int(getattr(config, "partial_rotary_factor", 1) * 16)\n'
                                  'def build(config):\n    rope_parameters = config.rope_parameters\n'
                                  '    theta = rope_parameters.get("rope_theta", 10000)\n'
                                  '    return get_rope(1, 1, 2, theta, rope_scaling=rope_parameters)\n',
    "sglang/srt/models/gemma3_causal.py": 'class Attn:\n    def __init__(self, config):\n'
                                          '        self.rope_scaling = {"rope_type": "default"}\n'
                                          '        self.rotary_emb = get_rope(1, 1, 2, 3, rope_scaling='
                                          'self.rope_scaling)\n',
    "sglang/srt/utils/hf_transformers/common.py": SGLANG_COMMON,
    "sglang/srt/utils/hf_transformers/config.py": "def get_config(model, model_override_args=None):\n    pass\n",
    "sglang/srt/configs/model_config.py": "def _derive_context_length(self, n):\n"
                                          "    if envs.SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN.get():\n"
                                          "        pass\n",
    "sglang/srt/environ.py": "class Envs:\n    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN = EnvBool(False)\n",
    "sglang/srt/arg_groups/fields/model.py": "class ModelFields:\n    model_path: str = ''\n"
                                             "    json_model_override_args: str = '{}'\n"
                                             "    context_length: int = None\n",
    "sglang/srt/arg_groups/fields/lora.py": "class LoraFields:\n    enable_lora: bool = None\n",
    "sglang/srt/layers/rotary_embedding/yarn.py":
        "def yarn_get_mscale_simple(scale=1):\n    return 1.0\n"
        "def yarn_get_mscale(scale=1, mscale=1):\n    return 1.0\n"
        "class YaRNScalingRotaryEmbedding:\n    def __init__(self, attn_factor=1):\n"
        "        self.mscale = attn_factor\n",
    "sglang/srt/layers/rotary_embedding/rope_variant.py":  # a method named as another class's: Class.method is read
        "class Other:\n    def forward(self):\n        return 0\n"
        "class DynamicNTKScalingRotaryEmbedding:\n    def _compute_cos_sin_cache(self):\n        return 1\n"
        "class Phi3LongRoPEScaledRotaryEmbedding:\n    def forward(self, positions):\n        return positions\n",
}


def _wheel(folder: Path, name: str, files: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with zipfile.ZipFile(path, "w") as z:
        for inner, text in files.items():
            z.writestr(inner, text)
    return path


@pytest.fixture
def wheels(tmp_path):
    return [_wheel(tmp_path, "vllm-9.9.0-cp38-abi3-manylinux_2_28_x86_64.whl", VLLM_FILES),
            _wheel(tmp_path, "sglang-8.8.8-py3-none-any.whl", SGLANG_FILES)]


def test_extractor_reads_the_tables_from_fixture_sources(wheels):
    name, vllm = engines.extract(wheels[0])
    assert name == "vllm" and vllm["version"] == "9.9.0" and re.fullmatch(r"[0-9a-f]{64}", vllm["sha256"])
    assert vllm["rope_types"] == {
        "default": {"required": [], "optional": ["mrope_section"]},
        "deepseek_yarn": {"required": ["factor"], "optional": ["beta_fast", "beta_slow"]},
        "dynamic": {"required": [], "optional": ["alpha", "max_trained_positions"]},
        "yarn": {"required": ["factor"], "optional": ["beta_fast", "beta_slow"]},
    }
    assert vllm["common"] == {"required": [], "optional": ["rope_theta", "rope_type"]}
    assert vllm["models"]["gemma3"] == {"model_types": ["gemma3", "gemma3_text"], "reads": [], "config_reads": [],
                                        "fixed_rope_types": None}
    assert vllm["models"]["llama"]["config_reads"] == ["head_dim"]  # getattr(config, ...): the config's own attributes
    # the tokenizer's length is read only under the guard of the `if` around the read
    assert vllm["context"] == {"factor_exempt_types": ["longrope", "yarn"], "factor_exempt_keys": [],
                               "factor_exempt_model_types": ["gemma3"],
                               "length_keys": ["max_position_embeddings", "seq_length"],
                               "tokenizer_when": {"runner_type": "pooling", "position_embedding_type": "absolute"},
                               "env": "VLLM_ALLOW_LONG_MAX_MODEL_LEN"}
    # flags found in the argument code; one that is not there (--hf-config-path, --enable-lora) is left out
    assert vllm["flags"] == ["--hf-overrides", "--max-model-len", "--lora-modules"]
    assert set(vllm["functions"]) == {f"{p}:{f}" for p, f in engines.TARGETS["vllm"]["mirrored"]}

    name, sglang = engines.extract(wheels[1])
    assert sglang["rope_types"] == {"linear": {"required": [], "optional": ["factor"]},
                                    "longrope": {"required": ["short_factor"],
                                                 "optional": ["long_mscale", "short_mscale"]}}
    assert sglang["common"] == {"required": [], "optional": ["rope_type"]}
    assert sglang["models"]["llama"]["reads"] == ["rope_theta"]
    assert sglang["models"]["llama"]["fixed_rope_types"] is None
    assert sglang["models"]["llama"]["config_reads"] == ["partial_rotary_factor"]
    assert sglang["context"]["tokenizer_when"] is None  # its length code reads no tokenizer
    assert sglang["models"]["gemma3_causal"]["fixed_rope_types"] == ["default"]  # a literal replaces the config's
    assert sglang["context"]["factor_exempt_keys"] == ["original_max_position_embeddings"]
    assert sglang["context"]["factor_exempt_types"] == ["llama3"]
    assert sglang["context"]["env"] == "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"
    assert sglang["flags"] == ["--model-path", "--json-model-override-args", "--context-length", "--enable-lora"]


def test_refresh_and_check_round_trip(wheels, tmp_path, capsys):
    out = tmp_path / "engines.json"
    assert engines.main(["--refresh", *map(str, wheels), "--snapshot", str(out)]) == 0
    data = schema.read(out, engines.KIND)
    assert data["generated_by"] == engines.COMMAND and list(data["engines"]) == list(engines.ENGINES)
    assert engines.main(["--check", *map(str, wheels), "--snapshot", str(out)]) == 0
    capsys.readouterr()
    edited = VLLM_MODEL.replace("def _apply_dict_overrides(config, overrides):\n    pass",
                                "def _apply_dict_overrides(config, overrides):\n    return config")
    changed = _wheel(tmp_path / "new", wheels[0].name, {**VLLM_FILES, "vllm/config/model.py": edited})
    # a mirrored rule changed
    assert engines.main(["--check", str(changed), str(wheels[1]), "--snapshot", str(out)]) == 1
    assert "_apply_dict_overrides changed: review" in capsys.readouterr().out


def test_extractor_errors_are_one_line(wheels, tmp_path, capsys):
    broken = _wheel(tmp_path, "vllm-9.9.1-py3-none-any.whl",
                    {k: v for k, v in VLLM_FILES.items() if not k.endswith("rotary_embedding/__init__.py")})
    assert engines.main(["--check", str(broken), str(wheels[1]), "--snapshot", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layout changed" in err
    assert engines.main(["--check", str(wheels[1]), "--snapshot", str(tmp_path / "x.json")]) == 2
    assert "vllm missing" in capsys.readouterr().err


@pytest.mark.parametrize("source,rule", [
    ("def f(self):\n    c = try_get_tokenizer_config(self.tokenizer)\n    return g(c)\n", {}),  # read always
    ("def f(self):\n    return g(None)\n", None),  # never
    ("def f(self):\n    c = None\n    if self.runner_type == 'pooling':\n"
     "        c = try_get_tokenizer_config(self.tokenizer)\n", {"runner_type": "pooling"}),
])
def test_tokenizer_rule(source, rule):
    assert engines.tokenizer_rule(source, "f") == rule


def test_the_committed_snapshot():
    """Checked by its schema; the engine versions, wheel files and digests it was made from; the command that
    regenerates it; and the facts the export relies on (each engine's rope types, the allow-longer variable)."""
    data = engines.snapshot()
    assert data["generated_by"] == engines.COMMAND and set(data["engines"]) == set(engines.ENGINES)
    vllm, sglang = data["engines"]["vllm"], data["engines"]["sglang"]
    assert (vllm["version"], sglang["version"]) == ("0.34.0", "0.5.23")
    for eng in (vllm, sglang):
        assert eng["wheel"].startswith(f"{eng['wheel'].split('-')[0]}-{eng['version']}-")
        assert eng["wheel"].endswith(".whl")
        assert re.fullmatch(r"[0-9a-f]{64}", eng["sha256"])
        assert {"default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional"} <= set(eng["rope_types"])
    assert vllm["context"]["env"] == "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
    assert sglang["context"]["env"] == "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"
    # the facts the export's engine forms rest on: vLLM reads the tokenizer's length only for pooling models with
    # absolute positions; SGLang's yarn reads attn_factor (not attention_factor); its llama reads partial_rotary_factor
    # from the config's top level
    assert vllm["context"]["tokenizer_when"] == {"runner_type": "pooling", "position_embedding_type": "absolute"}
    assert sglang["context"]["tokenizer_when"] is None
    assert "attn_factor" in sglang["rope_types"]["yarn"]["optional"] and "attention_factor" not in engines.keys_read(
        "sglang", "yarn", "llama")
    assert "partial_rotary_factor" in sglang["models"]["llama"]["config_reads"]
    assert "partial_rotary_factor" not in engines.keys_read("sglang", "proportional", "llama")
    text = data_path(engines.SNAPSHOT).read_text()
    assert not re.search(r"/(home|tmp|work|Users)/", text)  # no machine paths
    assert json.loads(text) == data


@pytest.mark.skipif(not os.environ.get("ROPE_PATCH_ENGINE_WHEELS"), reason="ROPE_PATCH_ENGINE_WHEELS=DIR holds the "
                    "engine wheels (pip download --no-deps vllm==0.34.0 sglang==0.5.23 -d DIR)")
def test_the_snapshot_is_what_the_wheels_give():
    folder = Path(os.environ["ROPE_PATCH_ENGINE_WHEELS"])
    files = [folder / e["wheel"] for e in engines.snapshot()["engines"].values()]
    assert engines.render(engines.build(files)) == data_path(engines.SNAPSHOT).read_text()
