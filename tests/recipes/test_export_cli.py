"""`rope-patch export DIR`: native rope_parameters + vLLM --hf-overrides for models, merged models and adapters."""

from __future__ import annotations

import json

from helpers.models import WINDOW, tiny_model
from helpers.text import char_tokenizer

import rope_patch
from rope_patch.cli import main


def _run(capsys, *argv):
    code = main(["export", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_patched_model(tmp_path, capsys):
    model = tiny_model()
    rope_patch.apply(model, "yarn", factor=4.0)
    rope_patch.save_pretrained(model, tmp_path, tokenizer=char_tokenizer())  # the engine loads it from the folder
    code, out, _ = _run(capsys, tmp_path, "--json")
    info = json.loads(out)
    assert code == 0 and info["scheme"] == "yarn"
    assert info["rope_parameters"] == rope_patch.native_config(model)["rope_parameters"]
    assert info["max_position_embeddings"] == 4 * WINDOW
    hf = json.loads(info["vllm"].split("'")[1])  # the checked command (rope_patch.serving), as the text prints it
    assert hf == {"rope_parameters": info["rope_parameters"], "max_position_embeddings": 4 * WINDOW}
    assert info["vllm"].startswith(f"vllm serve {tmp_path} --hf-overrides") and info["vllm"].endswith(
        f"--max-model-len {4 * WINDOW}") and "vllm_refused" not in info
    code, out, _ = _run(capsys, tmp_path)
    assert "rope_parameters: {" in out and "--hf-overrides '" in out


def test_adapter_rebuilds_the_native_form_from_its_base(tmp_path, capsys):
    import peft
    tiny_model().save_pretrained(tmp_path / "base")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    rope_patch.apply(lora, "linear", factor=2.0)
    rope_patch.save_pretrained(lora, tmp_path / "adapter")
    code, out, _ = _run(capsys, tmp_path / "adapter", "--json")
    info = json.loads(out)
    assert code == 0 and info["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    assert info["max_position_embeddings"] == rope_patch.native_config(lora)["max_position_embeddings"]


def test_non_native_scheme_is_a_clear_error(tmp_path, capsys):
    model = tiny_model()
    rope_patch.apply(model, "dynamic_yarn", factor=4)  # no native form (p_rope is transformers' proportional)
    rope_patch.save_pretrained(model, tmp_path)
    code, out, err = _run(capsys, tmp_path)
    assert code == 2 and out == ""
    assert "no native transformers/vLLM" in err and "rope_patch.from_pretrained" in err


def test_unpatched_and_missing(tmp_path, capsys):
    tiny_model().save_pretrained(tmp_path / "plain")
    code, out, _ = _run(capsys, tmp_path / "plain", "--json")
    assert code == 0 and json.loads(out)["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    code, _, err = _run(capsys, tmp_path / "nothing")
    assert code == 2 and "not a directory" in err
