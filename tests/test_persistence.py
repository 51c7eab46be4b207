"""Persistence that cannot lose data: every missing, corrupt, truncated, mismatched or future-format file of a
`rope_patch.save_pretrained` folder raises an error that names the file and says what to do.

Each case copies a folder saved once per module (tiny random llama) and breaks one file in it."""

from __future__ import annotations

import json
import re
import shutil
import warnings

import pytest
import torch
from helpers.models import WINDOW, logits, tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import rope_patch
from rope_patch.api import patch_modules
from rope_patch.files import sha256_file
from rope_patch.persistence import FORMAT, MANIFEST, PATCH_WEIGHTS, SINGLE_FORMAT, read_manifest

RESAVE = r"re-save (it|the model) with rope_patch\.save_pretrained"  # the "what to do" of a damaged save
LEARNED = {"relative_bias": "rope_patch_relative_bias.weight",
           "learned_absolute": "rope_patch_position_embeddings.weight"}


def patched_model(scheme: str):
    model = tiny_model()
    rope_patch.apply(model, scheme, **({"factor": 4} if scheme == "yarn" else {}))
    with torch.no_grad():  # "trained" tables: a fresh apply() would give other values
        for module in patch_modules(model).values():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{scheme: (model, folder)} saved once; tests break copies of the folders."""
    out = {}
    for scheme in ("yarn", *LEARNED):
        model = patched_model(scheme)
        out[scheme] = (model, rope_patch.save_pretrained(model, tmp_path_factory.mktemp(scheme)))
    return out


@pytest.fixture
def copy_of(saved, tmp_path):
    def make(scheme):
        return shutil.copytree(saved[scheme][1], tmp_path / scheme)
    return make


@pytest.fixture
def ids():
    return torch.randint(3, 97, (1, WINDOW), generator=torch.Generator().manual_seed(0))


def assert_raises(exc, fn, file, todo=RESAVE):
    """`fn()` raises `exc` whose message names `file` and says what to do (`todo`, a regex)."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert str(file) in msg, msg
    assert re.search(todo, msg), msg
    return msg


def edit_manifest(folder, change):
    manifest = json.loads((folder / MANIFEST).read_text())
    change(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


# ---- rope_patch.json ---------------------------------------------------------------------------------------------

def _set(key, value):
    return lambda m: m.__setitem__(key, value)


def _drop(key):
    return lambda m: m.pop(key)


TEXT_CASES = {  # name: the broken file's text from the valid one
    "corrupt": lambda text: "{not json" + text,
    "truncated": lambda text: text[: len(text) // 2],
    "empty": lambda text: "",
    "not_an_object": lambda text: "[1, 2]",
}


@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_unreadable_manifest(case, copy_of):
    folder = copy_of("yarn")
    file = folder / MANIFEST
    file.write_text(TEXT_CASES[case](file.read_text()))
    msg = assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), file)
    if case in ("corrupt", "truncated"):
        assert re.search(r"not valid JSON \(.* at line \d+, column \d+, char \d+\)", msg)
        assert "corrupt or truncated" in msg
    if case == "empty":
        assert "is empty (0 bytes)" in msg


def test_manifest_that_is_not_utf8(copy_of):
    folder = copy_of("yarn")
    (folder / MANIFEST).write_bytes(b'{"format": 2, "scheme": "\xff"}')
    assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / MANIFEST)


@pytest.mark.parametrize("key", ["format", "scheme", "params", "original", "native"])
def test_manifest_missing_a_required_key(key, copy_of):
    folder = copy_of("relative_bias")
    edit_manifest(folder, _drop(key))
    msg = assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / MANIFEST)
    assert f"lacks the required key {key!r}" in msg


def test_manifest_missing_several_keys_names_them_all(copy_of):
    folder = copy_of("yarn")
    (folder / MANIFEST).write_text(json.dumps({"format": 2, "scheme": "yarn"}))
    msg = assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / MANIFEST)
    assert "'params', 'original'" in msg


def test_manifest_from_a_newer_rope_patch(copy_of):
    folder = copy_of("yarn")
    edit_manifest(folder, lambda m: m.update(format=99, versions={"rope_patch": "7.3.0"}, renamed="keys"))
    msg = assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / MANIFEST,
                        todo=r"Upgrade rope_patch \(pip install -U rope_patch>=7\.3\.0\)")
    assert "format 99, written by rope_patch 7.3.0" in msg and f"reads formats 1 to {FORMAT}" in msg
    edit_manifest(folder, _drop("versions"))  # even without versions (and without the other keys): upgrade
    edit_manifest(folder, _drop("params"))
    assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / MANIFEST, todo="Upgrade rope_patch")


WRONG_TYPES = [
    ("params", ["factor", 4], "'params' must be a JSON object"),
    ("params", None, "'params' must be a JSON object"),
    ("scheme", 5, "'scheme' must be a scheme name"),
    ("scheme", {"name": "yarn"}, "'scheme' must be a scheme name"),
    ("format", "2", "'format' must be a positive integer"),
    ("format", 0, "'format' must be a positive integer"),
    ("format", True, "'format' must be a positive integer"),
    ("original", [], "'original' must be a JSON object"),
    ("original", {"max_position_embeddings": 32}, "'original' lacks the required key 'rope_parameters'"),
    ("original", {"rope_parameters": {}, "max_position_embeddings": "32"},
     "'original.max_position_embeddings' must be an integer"),
    ("native", "yes", "'native' must be true or false"),
    ("weights", {"file": "../elsewhere.safetensors", "keys": []}, "'weights' must be null or"),
    ("weights", {"file": PATCH_WEIGHTS, "keys": "rope_patch_relative_bias.weight"},
     "'weights.keys' must be a list of strings"),
]


@pytest.mark.parametrize("key,value,expected", WRONG_TYPES, ids=[f"{k}={v!r}" for k, v, _ in WRONG_TYPES])
def test_manifest_value_of_the_wrong_type(key, value, expected, copy_of):
    folder = copy_of("relative_bias")
    edit_manifest(folder, _set(key, value))
    msg = assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / MANIFEST)
    assert expected in msg


def test_manifest_with_a_scheme_this_rope_patch_does_not_know(copy_of):
    folder = copy_of("yarn")
    edit_manifest(folder, _set("scheme", "my_own_scheme"))
    assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / MANIFEST, todo="register_scheme")


def test_read_manifest_returns_none_without_a_manifest_and_the_checked_dict_with_one(saved, tmp_path):
    assert read_manifest(tmp_path) is None
    manifest = read_manifest(saved["relative_bias"][1])
    assert manifest["format"] == SINGLE_FORMAT == 2 and FORMAT == 3  # one scheme: the format older readers know
    weights = manifest["weights"]
    assert weights["file"] == PATCH_WEIGHTS and weights["keys"] == [LEARNED["relative_bias"]]
    assert weights["sha256"] == sha256_file(saved["relative_bias"][1] / PATCH_WEIGHTS)
    assert read_manifest(saved["yarn"][1])["weights"] is None


# ---- rope_patch.safetensors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", list(LEARNED))
def test_learned_tables_round_trip(scheme, saved, ids):
    model, folder = saved[scheme]
    again = rope_patch.from_pretrained(folder, attn_implementation="eager").eval()
    key = LEARNED[scheme]
    assert torch.equal(again.state_dict()[key], model.state_dict()[key])
    assert torch.equal(logits(again, ids), logits(model, ids))


@pytest.mark.parametrize("scheme", list(LEARNED))
def test_missing_safetensors_of_a_learned_scheme(scheme, copy_of):
    folder = copy_of(scheme)
    (folder / PATCH_WEIGHTS).unlink()
    msg = assert_raises(FileNotFoundError, lambda: rope_patch.from_pretrained(folder), folder / PATCH_WEIGHTS,
                        todo=r"Copy the file back .* or re-save the model with rope_patch\.save_pretrained")
    assert LEARNED[scheme] in msg and "freshly initialised" in msg


def _rewrite_weights(folder, tensors, *, record_sha=True):
    """Replace the weights file; with `record_sha` the manifest is made to agree (a consistent but wrong save)."""
    save_file(tensors, folder / PATCH_WEIGHTS)
    if record_sha:
        edit_manifest(folder, lambda m: m["weights"].update(sha256=sha256_file(folder / PATCH_WEIGHTS)))


@pytest.mark.parametrize("scheme", list(LEARNED))
def test_safetensors_with_a_missing_and_an_unexpected_key(scheme, copy_of):
    folder = copy_of(scheme)
    table = load_file(folder / PATCH_WEIGHTS)[LEARNED[scheme]]
    _rewrite_weights(folder, {"some_other_table.weight": table})
    msg = assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / PATCH_WEIGHTS)
    assert f"missing keys: {LEARNED[scheme]}" in msg and "unexpected keys: some_other_table.weight" in msg


@pytest.mark.parametrize("scheme", list(LEARNED))
def test_safetensors_with_an_extra_key(scheme, copy_of):
    folder = copy_of(scheme)
    tensors = load_file(folder / PATCH_WEIGHTS)
    _rewrite_weights(folder, {**tensors, "stowaway": torch.zeros(3)})
    msg = assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / PATCH_WEIGHTS)
    assert "unexpected keys: stowaway" in msg and "missing keys" not in msg


@pytest.mark.parametrize("scheme", list(LEARNED))
def test_safetensors_with_a_wrong_shape(scheme, copy_of):
    folder = copy_of(scheme)
    table = load_file(folder / PATCH_WEIGHTS)[LEARNED[scheme]]
    _rewrite_weights(folder, {LEARNED[scheme]: table[..., :-1].contiguous()})
    msg = assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / PATCH_WEIGHTS)
    shape, cut = tuple(table.shape), tuple(table[..., :-1].shape)
    assert f"wrong shapes: {LEARNED[scheme]} (file {cut}, model {shape})" in msg


@pytest.mark.parametrize("scheme", list(LEARNED))
def test_safetensors_from_another_save_fails_the_recorded_checksum(scheme, copy_of):
    folder = copy_of(scheme)
    tensors = load_file(folder / PATCH_WEIGHTS)
    _rewrite_weights(folder, {k: v + 1 for k, v in tensors.items()}, record_sha=False)  # right keys, other values
    msg = assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / PATCH_WEIGHTS)
    assert "does not match" in msg and "sha256" in msg


@pytest.mark.parametrize("record_sha", [True, False], ids=["format2", "format1"])
def test_truncated_safetensors(record_sha, copy_of):
    folder = copy_of("learned_absolute")
    data = (folder / PATCH_WEIGHTS).read_bytes()
    (folder / PATCH_WEIGHTS).write_bytes(data[: len(data) // 2])
    if not record_sha:  # format 1 records no checksum: safetensors' own error, with the file named
        edit_manifest(folder, lambda m: (m.pop("weights"), m.update(format=1)))
    msg = assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / PATCH_WEIGHTS)
    assert ("sha256" in msg) if record_sha else ("cannot be read as safetensors" in msg)


def test_manifest_recording_weights_for_a_scheme_without_learned_parameters(saved, copy_of):
    folder = copy_of("yarn")
    edit_manifest(folder, _set("weights", {"file": PATCH_WEIGHTS, "keys": [LEARNED["relative_bias"]]}))
    assert_raises(FileNotFoundError, lambda: rope_patch.from_pretrained(folder), folder / PATCH_WEIGHTS)
    shutil.copy(saved["relative_bias"][1] / PATCH_WEIGHTS, folder / PATCH_WEIGHTS)
    msg = assert_raises(ValueError, lambda: rope_patch.from_pretrained(folder), folder / MANIFEST)
    assert "attaches no modules" in msg


# ---- format 1 -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["yarn", *LEARNED])
def test_format_1_manifest_still_loads(scheme, saved, copy_of, ids):
    model = saved[scheme][0]
    folder = copy_of(scheme)
    edit_manifest(folder, lambda m: (m.pop("weights"), m.update(format=1)))  # what rope_patch wrote before format 2
    again = rope_patch.from_pretrained(folder, attn_implementation="eager").eval()
    assert rope_patch.current(again) == rope_patch.current(model)
    assert torch.equal(logits(again, ids), logits(model, ids))


def test_format_1_manifest_of_a_learned_scheme_without_its_safetensors(copy_of):
    folder = copy_of("relative_bias")
    edit_manifest(folder, lambda m: (m.pop("weights"), m.update(format=1)))
    (folder / PATCH_WEIGHTS).unlink()
    assert_raises(FileNotFoundError, lambda: rope_patch.from_pretrained(folder), folder / PATCH_WEIGHTS, todo="re-save")


# ---- folders -------------------------------------------------------------------------------------------------------

def test_folder_without_manifest_loads_the_plain_model(tmp_path, ids):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    again = rope_patch.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert rope_patch.current(again) is None
    assert torch.equal(logits(again, ids), logits(model, ids))


def test_folder_without_config(tmp_path, copy_of):
    (tmp_path / "empty").mkdir()
    assert_raises(FileNotFoundError, lambda: rope_patch.from_pretrained(tmp_path / "empty"), tmp_path / "empty",
                  todo="Pass a folder written by rope_patch.save_pretrained")
    folder = copy_of("yarn")
    (folder / "config.json").unlink()
    assert_raises(FileNotFoundError, lambda: rope_patch.from_pretrained(folder), folder / "config.json")


def test_weights_without_manifest_are_an_interrupted_save(copy_of):
    folder = copy_of("relative_bias")
    (folder / MANIFEST).unlink()
    msg = assert_raises(FileNotFoundError, lambda: rope_patch.from_pretrained(folder), folder / MANIFEST)
    assert "interrupted" in msg


# ---- saving --------------------------------------------------------------------------------------------------------

def test_crash_while_writing_weights_leaves_no_manifest(copy_of, monkeypatch):
    """Saving over an earlier save: the old manifest goes first, the new one comes last, so a crash in between
    leaves none, and loading says the save was interrupted instead of pairing the old manifest with new files."""
    from rope_patch import persistence as export

    folder = copy_of("relative_bias")

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export, "save_file", crash)  # the writer of the learned tables
    with pytest.raises(OSError, match="disk full"):
        rope_patch.save_pretrained(patched_model("learned_absolute"), folder)
    assert not (folder / MANIFEST).exists()
    assert_raises(FileNotFoundError, lambda: rope_patch.from_pretrained(folder), folder / MANIFEST, todo="interrupted")


def test_crash_while_writing_the_model_leaves_the_folder_without_manifest(tmp_path, monkeypatch):
    def crash(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(tiny_model()), "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        rope_patch.save_pretrained(patched_model("relative_bias"), tmp_path)
    assert not (tmp_path / MANIFEST).exists() and not (tmp_path / PATCH_WEIGHTS).exists()


def test_unserialisable_params_fail_before_anything_is_written(saved, copy_of, monkeypatch):
    import rope_patch.persistence as export

    folder = copy_of("relative_bias")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    monkeypatch.setattr(export, "_jsonable", lambda params: {"bad": object()})
    with pytest.raises(TypeError):
        rope_patch.save_pretrained(saved["yarn"][0], folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_resaving_without_learned_parameters_removes_the_old_tables(saved, copy_of, ids):
    folder = copy_of("relative_bias")
    rope_patch.save_pretrained(saved["yarn"][0], folder)
    assert not (folder / PATCH_WEIGHTS).exists() and not list(folder.glob("*.tmp"))
    again = rope_patch.from_pretrained(folder, attn_implementation="eager").eval()
    assert rope_patch.current(again).name == "yarn"
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert (logits(plain, ids) - logits(again, ids)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
@pytest.mark.parametrize("scheme", list(LEARNED))
def test_tables_trained_through_peft_modules_to_save_survive_a_save(scheme, merge, tmp_path, ids):
    """peft trains a copy of a `modules_to_save` table (and `merge_and_unload` puts the copy in its place): the saved
    tables are that trained copy, not the untrained original."""
    import peft
    tiny_model().save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="sdpa").eval()
    rope_patch.apply(model, scheme)
    module = LEARNED[scheme].rsplit(".", 1)[0]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=[module]))
    with torch.no_grad():  # what training does to the copy
        getattr(model, module).modules_to_save["default"].weight.add_(0.5)
    trained = lora.merge_and_unload() if merge else lora
    expected = logits(trained, ids)
    rope_patch.save_pretrained(trained, tmp_path / "saved")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft: "Found unexpected adapter keys" (a table it cannot place)
        again = rope_patch.from_pretrained(tmp_path / "saved", attn_implementation="sdpa").eval()
    assert torch.equal(logits(again, ids), expected)
    if not merge:  # the table is peft's trained copy again, so training goes on from it
        wrapper = getattr(again.base_model.model, module)
        assert torch.equal(wrapper.modules_to_save["default"].weight, getattr(model, module).modules_to_save[
            "default"].weight)


PLAIN = [
    ("default", dict(rope_theta=500_000.0), True),
    ("linear", dict(factor=2), True),
    ("ntk", dict(factor=4), True),
    ("dynamic", dict(factor=4), True),
    ("yarn", dict(factor=4), True),
    ("llama3", dict(factor=4), True),
    ("longrope", dict(factor=4, short_factor=[1.0] * 8, long_factor=[4.0] * 8), True),
    ("p_rope", dict(partial_rotary_factor=0.5, rope_theta=500_000.0), True),
    ("alibi", {}, False),
    ("self_extend", dict(group_size=2, window_size=8), False),
    ("relative_bias", {}, False),
    ("sinusoidal", {}, False),
    ("learned_absolute", dict(max_position_embeddings=4 * WINDOW), False),
]


@pytest.mark.parametrize("scheme,params,native", PLAIN, ids=[s for s, *_ in PLAIN])
def test_plain_save_pretrained_reloads_the_patched_or_the_unpatched_model_never_a_third(scheme, params, native,
                                                                                        tmp_path):
    """`model.save_pretrained` (transformers', not rope_patch's) of a patched model, reloaded without rope_patch:
    the patched model where transformers can express the scheme, else the unpatched one (dynamic NTK used to reload
    with its window moved to s·L: a model that was neither)."""
    ids = torch.randint(3, 97, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    model = tiny_model(attn_implementation="sdpa")
    unpatched = logits(model, ids)
    rope_patch.apply(model, scheme, **params)
    patched_out = logits(model, ids)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert rope_patch.current(again) is None
    expected = patched_out if native else unpatched
    assert (logits(again, ids) - expected).abs().max().item() <= 1e-5


def test_save_pretrained_saves_the_tokenizer_beside_the_model(tmp_path):
    """tokenizer= writes the tokenizer into the folder (what a serving engine loads from it); the manifest still comes
    last, and the reloaded tokenizer encodes as the original."""
    from helpers.text import char_tokenizer
    from transformers import AutoTokenizer

    tokenizer = char_tokenizer()
    model = tiny_model()
    rope_patch.apply(model, "yarn", factor=4)
    rope_patch.save_pretrained(model, tmp_path / "m", tokenizer=tokenizer)
    files = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "m").iterdir()}
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    assert files[MANIFEST] >= max(files.values())  # written last
    again = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert again("ab cd").input_ids == tokenizer("ab cd").input_ids
    rope_patch.save_pretrained(model, tmp_path / "plain")  # without: no tokenizer files
    assert not any(p.name.startswith("tokenizer") for p in (tmp_path / "plain").iterdir())


def test_save_pretrained_refuses_a_tokenizer_without_save_pretrained(tmp_path):
    model = tiny_model()
    with pytest.raises(TypeError, match="tokenizer= takes a tokenizer with a save_pretrained method .* got str. "
                                        "Nothing was written"):
        rope_patch.save_pretrained(model, tmp_path / "m", tokenizer="gpt2")
    assert not (tmp_path / "m").exists()


SAVE_KWARGS = [  # (scheme, the argument of accelerate's distributed save the caller passes)
    ("yarn", "state_dict"),
    ("relative_bias", "state_dict"),
    ("learned_absolute", "state_dict"),
    ("yarn", "is_main_process=False"),
    ("relative_bias", "is_main_process=False"),
]


@pytest.mark.parametrize("scheme,how", SAVE_KWARGS)
def test_save_pretrained_takes_the_arguments_of_a_distributed_save(scheme, how, saved, tmp_path, ids):
    """`save_pretrained(model, dir, is_main_process=..., state_dict=accelerator.get_state_dict(model))`: the learned
    tables come from the state_dict (ZeRO-3 gathers them there; the live ones are partitioned), and only the main
    process writes rope_patch's files (another process's call leaves a previous save as it was)."""
    model, folder = saved[scheme]
    if how == "state_dict":
        state = {k: v.clone() for k, v in model.state_dict().items()}
        live = [p for m in patch_modules(model).values() for p in m.parameters()]
        before = [p.detach().clone() for p in live]
        with torch.no_grad():  # what a process holds of a partitioned table: not its values
            for p in live:
                p.zero_()
        try:
            rope_patch.save_pretrained(model, tmp_path / "m", state_dict=state)
        finally:
            with torch.no_grad():
                for p, v in zip(live, before, strict=True):
                    p.copy_(v)
        assert not set(load_file(tmp_path / "m" / "model.safetensors")) & set(LEARNED.values())  # in PATCH_WEIGHTS
        again = rope_patch.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
        assert (logits(again, ids) - logits(model.eval(), ids)).abs().max().item() <= 1e-6
    else:
        target = shutil.copytree(folder, tmp_path / "m")
        files = {p.name: p.read_bytes() for p in target.iterdir() if p.name in (MANIFEST, PATCH_WEIGHTS)}
        rope_patch.save_pretrained(model, target, is_main_process=False)
        assert {p.name: p.read_bytes() for p in target.iterdir() if p.name in (MANIFEST, PATCH_WEIGHTS)} == files
        rope_patch.save_pretrained(model, tmp_path / "other", is_main_process=False)
        assert not (tmp_path / "other" / MANIFEST).exists()


RELOAD_KWARGS = [  # (folder, from_pretrained's peft keywords, trainable parameters after loading or the error)
    ("adapter", {}, set()),  # peft's default: loaded for inference
    ("adapter", {"is_trainable": True}, {"lora_A", "lora_B", "modules_to_save"}),
    ("adapter", {"is_trainable": True, "adapter_name": "long"}, {"lora_A", "lora_B", "modules_to_save"}),
    ("full", {"is_trainable": True}, "is_trainable= applies to an adapter folder"),
    ("full", {"is_trainable": False}, None),  # what code that loads either kind passes: a full model loads as it is
]


@pytest.mark.parametrize("folder,kwargs,expected", RELOAD_KWARGS)
def test_from_pretrained_passes_peft_keywords_to_the_adapter(folder, kwargs, expected, saved, tmp_path, ids):
    """To train a saved adapter further it is reloaded with is_trainable=True (transformers' from_pretrained took the
    keyword and failed); the trained tables come back as they were saved."""
    import peft
    full = saved["relative_bias"][1]
    if folder == "full":
        if expected is None:
            assert rope_patch.current(rope_patch.from_pretrained(full, **kwargs)).name == "relative_bias"
            return
        with pytest.raises(TypeError, match=expected):
            rope_patch.from_pretrained(full, **kwargs)
        return
    tiny_model().save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    rope_patch.apply(base, "relative_bias")
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False,
                                                     modules_to_save=["rope_patch_relative_bias"]))
    with torch.no_grad():
        base.rope_patch_relative_bias.modules_to_save["default"].weight.add_(0.5)
    rope_patch.save_pretrained(lora, tmp_path / "adapter")
    again = rope_patch.from_pretrained(tmp_path / "adapter", attn_implementation="eager", **kwargs).eval()
    trainable = {part for n, p in again.named_parameters() if p.requires_grad
                 for part in ("lora_A", "lora_B", "modules_to_save") if part in n}
    assert trainable == expected
    assert (logits(again, ids) - logits(lora.eval(), ids)).abs().max().item() <= 1e-6


PEFT_SAVED = [  # (the LoRA's modules_to_save, saved by peft alone: what rope_patch.from_pretrained does)
    (["rope_patch_relative_bias"], "refused"),
    (["rope_patch_relative_bias", "lm_head"], "refused"),
    (["lm_head"], "plain"),
    (None, "plain"),
]


@pytest.mark.parametrize("modules_to_save,outcome", PEFT_SAVED)
def test_an_adapter_saved_without_its_patch_is_refused_where_it_trains_a_table(modules_to_save, outcome, tmp_path):
    """peft's own save_pretrained (Trainer.save_model) writes no rope_patch.json: an adapter that trains a rope_patch
    table then loaded as a plain adapter, the patch and the trained table dropped with only peft's "unexpected adapter
    keys" warning."""
    import peft
    tiny_model().save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    rope_patch.apply(base, "relative_bias")
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=modules_to_save))
    lora.save_pretrained(tmp_path / "adapter")  # peft's, not rope_patch's
    if outcome == "refused":
        with pytest.raises(FileNotFoundError, match=r"rope_patch.json is missing, though .*adapter_config.json trains "
                                                    r"the rope_patch table\(s\) rope_patch_relative_bias: .*"
                                                    r"peft.PeftModel.from_pretrained\(base, dir\)"):
            rope_patch.from_pretrained(tmp_path / "adapter")
    else:
        assert rope_patch.current(rope_patch.from_pretrained(tmp_path / "adapter")) is None
