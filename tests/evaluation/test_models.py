"""Model specs: tiny / smollm2 / a local path; the SmolLM2 cache (slow, only when it has been fetched)."""

from __future__ import annotations

import pytest
from helpers.models import tiny_model
from helpers.text import char_tokenizer

from rope_patch import zoo as models
from rope_patch.cli import main
from rope_patch.zoo import load_model, model_name, resolve_model_path


@pytest.fixture
def saved(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_local_path_and_env_override(saved, monkeypatch, tmp_path):
    assert resolve_model_path(str(saved)) == saved
    model, tok = load_model(str(saved))
    assert not model.training and tok.bos_token_id == 1
    assert model_name(str(saved)) == "m" and model_name("tiny") == "tiny"
    monkeypatch.setenv(models.TINY_ENV, str(saved))
    assert resolve_model_path("tiny") == saved
    monkeypatch.setenv(models.TINY_ENV, str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match=models.TINY_ENV):
        resolve_model_path("tiny")


def test_tiny_is_the_package_data_whatever_the_cwd(monkeypatch, tmp_path):
    monkeypatch.delenv(models.TINY_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # not from the cwd: from the package itself (a wheel install ships it too)
    assert models.tiny_candidates() == [models.Path(models.__file__).resolve().parent / "data" / "rope-tiny"]
    assert resolve_model_path("tiny") == models.tiny_candidates()[0]
    monkeypatch.setenv(models.TINY_ENV, str(tmp_path))  # the user's own path wins
    assert models.tiny_candidates()[0] == tmp_path


def test_errors(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    assert models.cache_dir() == tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match="rope-patch models fetch smollm2"):
        resolve_model_path("smollm2")
    with pytest.raises(ValueError, match="Unknown model 'nope'"):
        resolve_model_path("nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(tmp_path / "empty")
    with pytest.raises(ValueError, match="dtype"):
        models.torch_dtype("float8")


def test_models_list_cli(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "rope-patch models fetch smollm2" in out


@pytest.mark.slow
def test_smollm2_cache_matches_the_recorded_continuation():
    """Runs where `rope-patch models fetch smollm2` has been run (not in CI: a 93 MB download)."""
    try:
        path = resolve_model_path("smollm2")
    except FileNotFoundError:
        pytest.skip("SmolLM2 not fetched (rope-patch models fetch smollm2)")
    model, tok = load_model(path)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.max_position_embeddings == 8192 and cfg.rope_parameters["rope_theta"] == 100000.0
    assert models.greedy_continuation(model, tok) == models.VERIFY_CONTINUATION
