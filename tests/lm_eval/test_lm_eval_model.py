"""The `rope_patch` lm-eval model: model_args, errors, max_length, loud truncation warnings, adapters."""

from __future__ import annotations

import pytest
import torch
from helpers.lm_eval import WINDOW, tiny_llama

import rope_patch


def make(assets, **kw):
    from rope_patch.integrations.lm_eval.model import RopePatchLM

    return RopePatchLM(pretrained=str(assets["model"]), **kw)


def apply_error(scheme, **params):
    """The exception `rope_patch.apply` raises for these arguments on a tiny model."""
    from transformers import AutoTokenizer

    model = tiny_llama(AutoTokenizer.from_pretrained(str(_ASSETS["model"])))
    with pytest.raises((ValueError, TypeError)) as info:
        rope_patch.apply(model, scheme, **params)
    return info.value


_ASSETS: dict = {}


@pytest.fixture(autouse=True)
def _remember(assets):
    _ASSETS.update(assets)


def test_registered():
    from lm_eval.api.registry import get_model

    from rope_patch.integrations.lm_eval.model import RopePatchLM

    assert get_model("rope_patch") is RopePatchLM


@pytest.mark.parametrize("scheme, params", [
    ("yarnn", {}),                              # unknown scheme: "Did you mean 'yarn'"
    ("yarn", {"factor": 0.5}),                  # bad value
    ("yarn", {"group_size": 4}),                # a parameter of another scheme
    ("yarn", {"factr": 4}),                     # a typo of this scheme's parameter
])
def test_bad_scheme_args_fail_like_apply(assets, scheme, params):
    expected = apply_error(scheme, **params)
    with pytest.raises(type(expected)) as info:
        make(assets, scheme=scheme, **params)
    assert str(info.value) == str(expected)


def test_scheme_params_without_scheme(assets):
    with pytest.raises(TypeError, match="without scheme="):
        make(assets, factor=4)


def test_missing_adapter_and_model(assets, tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter="):
        make(assets, adapter=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="not an adapter"):
        make(assets, adapter=str(tmp_path))
    from rope_patch.integrations.lm_eval.model import RopePatchLM

    with pytest.raises((FileNotFoundError, ValueError), match="nope"):
        RopePatchLM(pretrained=str(tmp_path / "nope"))


def test_max_length_is_the_patched_window(assets):
    lm = make(assets, scheme="yarn", factor=4)
    assert rope_patch.current(lm.model).name == "yarn"
    assert lm.max_length == 4 * WINDOW
    assert make(assets).max_length == WINDOW
    assert make(assets, scheme="yarn", factor=4, max_length=100).max_length == 100
    assert lm.model.dtype == torch.float32


def test_max_length_of_an_attention_side_scheme(assets):
    """The length Self-Extend serves, (L − W)·G + W; an unbounded scheme (ReRoPE) keeps the window, since lm-eval's
    rolling perplexity windows are max_length long."""
    assert make(assets, scheme="self_extend", group_size=4, window_size=8).max_length == (WINDOW - 8) * 4 + 8
    assert make(assets, scheme="rerope", window_size=8).max_length == WINDOW


def test_string_values_and_lists_are_parsed(assets):
    lm = make(assets, scheme="linear", factor="2")
    assert rope_patch.current(lm.model).params()["factor"] == 2


def test_truncation_warns_loudly(assets, caplog):
    lm = make(assets)
    long_text = "the morning walk was long and " * 40
    with pytest.warns(RuntimeWarning, match="TRUNCATES IT FROM THE LEFT"):
        ids, _ = lm.tok_batch_encode([long_text], left_truncate_len=WINDOW - 8)
    assert ids.shape[1] == WINDOW - 8


def test_adapter_saved_by_rope_patch(assets, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(assets["model"]))
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    rope_patch.apply(peft_model, "yarn", factor=2)
    rope_patch.save_pretrained(peft_model, tmp_path / "rp_adapter")
    peft_model.save_pretrained(tmp_path / "plain_adapter")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        want = peft_model(ids).logits

    lm = make(assets, adapter=str(tmp_path / "rp_adapter"))
    assert rope_patch.current(lm.model).name == "yarn"  # the recorded patch is re-applied
    assert lm.max_length == 2 * WINDOW
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, want)

    lm = make(assets, adapter=str(tmp_path / "plain_adapter"), scheme="yarn", factor=2)
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, want)


def test_model_saved_by_rope_patch(assets, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(assets["model"]))
    rope_patch.apply(model, "yarn", factor=4)
    rope_patch.save_pretrained(model, tmp_path / "saved")
    AutoTokenizer.from_pretrained(str(assets["model"])).save_pretrained(tmp_path / "saved")
    from rope_patch.integrations.lm_eval.model import RopePatchLM

    lm = RopePatchLM(pretrained=str(tmp_path / "saved"))
    assert rope_patch.current(lm.model).name == "yarn"
    assert lm.max_length == 4 * WINDOW
    ids = torch.tensor([[5, 6, 7, 8, 9, 10] * 30])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, model(ids).logits)


def test_model_info_records_the_patch(assets):
    info = make(assets, scheme="yarn", factor=4).get_model_info()
    assert info["rope_patch"]["scheme"] == "yarn"
    assert info["rope_patch"]["params"]["factor"] == 4
    assert info["rope_patch"]["max_length"] == 4 * WINDOW


@pytest.mark.parametrize("scheme", [None, "self_extend"])
def test_lm_evals_own_paths_run_a_hybrid_models_sliding_layers_windowed(assets, monkeypatch, scheme):
    """From WINDOWED_FROM on, every path of the lm-eval model runs the sliding layers windowed, with the default
    path's tokens, logits and log-likelihoods (no L x L mask: at 64k Gemma 3 would need about 21 GB for it): HFLM's
    generate and model call (documents without token ids: RULER's tasks, any text task; a left-padded batch too) and
    the exact-token rolling log-likelihood (rope_ppl_*)."""
    from types import SimpleNamespace

    from helpers.models import record_implementations, tiny_hybrid

    from rope_patch.evaluation import common

    lm = make(assets)
    n = len(lm.tokenizer)
    model = tiny_hybrid(vocab_size=n, pad_token_id=lm.tokenizer.pad_token_id, eos_token_id=lm.tokenizer.eos_token_id)
    if scheme:
        rope_patch.apply(model, scheme, group_size=2, window_size=16)
    lm._model, lm._max_length = model, 128
    own = model.config._attn_implementation
    ids = torch.randint(3, n, (2, 72), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the second prompt is 5 tokens shorter, left-padded
    ids[1, :5] = lm.tokenizer.pad_token_id
    doc = lm.tokenizer("the cat sat on the mat " * 20, add_special_tokens=False)["input_ids"][:80]
    rolling = SimpleNamespace(args=(lm.tokenizer.decode(doc),), doc={"input_ids": doc}, task_name="rope_ppl_test")
    seen = record_implementations(monkeypatch, model)

    def run():
        seen.clear()
        return (lm._model_generate(ids, 72 + 6, [], attention_mask=mask, do_sample=False), lm._model_call(ids[:1]),
                torch.tensor(lm.loglikelihood_rolling([rolling])))

    tokens, logits, ll = run()
    assert set(seen) == {own}
    monkeypatch.setattr(common, "WINDOWED_FROM", 64)
    windowed_tokens, windowed_logits, windowed_ll = run()
    # the padded batch generates a row at a time (2 × 6 forwards), then 1 call and 1 rolling
    assert len(seen) == 14 and all(s.startswith("rope_patch_windowed") for s in seen)
    assert torch.equal(windowed_tokens, tokens) and model.config._attn_implementation == own
    torch.testing.assert_close(windowed_logits, logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(windowed_ll, ll, atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("implementation,square", [("eager", True), ("sdpa", True), ("rope_patch_windowed", True),
                                                   ("rope_patch_blocked", True), ("rope_patch_dense", True),
                                                   ("flash_attention_2", False), ("flex_attention", False),
                                                   ("rope_patch_fa2", False), ("rope_patch_flex", False)])
def test_square_masks_reads_the_implementations_mask_function(implementation, square):
    from types import SimpleNamespace

    from rope_patch.attention import register
    from rope_patch.attention.windowed import register as register_windowed
    from rope_patch.evaluation import common

    register()
    register_windowed()
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=implementation))
    assert common.square_masks(model) is square


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_of_long_prompts_generates_a_row_at_a_time(assets, monkeypatch, side):
    """From WINDOWED_FROM on, a left-padded batch (lm-eval's batches of text prompts of different lengths) is generated
    one prompt at a time without its padding, since padding hands every layer a (b, 1, L, L) mask: the same greedy
    tokens, the rows left-padded as they went in and right-padded where one stopped sooner. Padding elsewhere than on
    the left runs as a batch."""
    from rope_patch.evaluation import common

    lm = make(assets)
    model = lm.model
    pad_id, eos = lm.tokenizer.pad_token_id, lm.tokenizer.eos_token_id
    ids = torch.randint(3, len(lm.tokenizer), (3, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    for row, pads in ((1, 7), (2, 5)):
        mask[row, slice(0, pads) if side == "left" else slice(40 - pads, 40)] = 0
    ids = ids.masked_fill(mask == 0, pad_id)
    masks: list = []
    decoder = type(model.get_decoder())
    forward = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda m, *a, **k: masks.append(
        (k["input_ids"].shape[0], k.get("attention_mask"))) or forward(m, *a, **k))

    def generate():
        masks.clear()
        return lm._model_generate(ids.clone(), 40 + 5, [], attention_mask=mask.clone(), do_sample=False)

    batch = generate()
    assert [b for b, _ in masks] == [3] * 5
    monkeypatch.setattr(common, "WINDOWED_FROM", 32)
    rows = generate()
    if side == "right":
        assert [b for b, _ in masks] == [3] * 5 and torch.equal(rows, batch)
        return
    # one row at a time, none padded (a row stops at its end-of-sequence token)
    assert len(masks) > 5 and all(b == 1 and (m is None or bool(m.all())) for b, m in masks)
    assert torch.equal(rows, batch) and rows.shape == (3, 45)
    # a row that stops sooner (its end-of-sequence token) is right-padded, as generate pads a finished row
    monkeypatch.setattr(model.generation_config, "eos_token_id", int(batch[1, 40]))
    early = generate()
    assert early.shape == (3, 45) and torch.equal(early[1, 41:], torch.full((4,), pad_id))
    assert torch.equal(early[:, :41], batch[:, :41]) and eos is not None


def test_long_loglikelihood_requests_hold_a_slice_of_logits_at_a_time(assets, monkeypatch):
    """From WINDOWED_FROM on, a log-likelihood request (a multiple-choice option, a rolling window of a text task)
    runs one at a time with its logits a slice of positions at a time (`common.continuation_loglikelihood`): lm-eval's
    own path holds T × vocab logits and their log-softmax. The answers (log p, greedy), their order and the cache
    hook's entries are lm-eval's; shorter requests still take lm-eval's batched path."""
    from types import SimpleNamespace

    from rope_patch.evaluation import common

    lm = make(assets, batch_size=2)
    n = len(lm.tokenizer)
    rows = torch.randint(3, n, (4, 60), generator=torch.Generator().manual_seed(6)).tolist()
    greedy = lm._model_call(torch.tensor([rows[3][:40]]))[0, -1].argmax().item()
    requests = [(("a", "b"), rows[0][:50], rows[0][50:55]), (("c", "d"), rows[1][:10], rows[1][10:12]),
                ((None, None), [rows[2][0]], rows[2][1:60]), (("e", "f"), rows[3][:40], [greedy]),
                (("g", "h"), rows[3][:40], [7])]  # one input, two one-token options: one forward
    text = lm.tokenizer.decode(rows[2], skip_special_tokens=True)
    monkeypatch.setattr(common, "LOGITS_BUDGET_BYTES", 4 * n * 7)  # slices of 7 positions

    def run():
        calls, cached = [], []
        monkeypatch.setattr(lm, "_model_call", lambda inps, **k: calls.append(inps.shape) or type(lm)._model_call(
            lm, inps, **k))
        monkeypatch.setattr(lm.cache_hook, "add_partial", lambda *a: cached.append(a))
        answers = lm._loglikelihood_tokens(requests)
        rolling = lm.loglikelihood_rolling([SimpleNamespace(args=(text,), doc={}, task_name="wikitext")])
        return answers, rolling, calls, cached

    answers, rolling, calls, cached = run()
    monkeypatch.setattr(common, "WINDOWED_FROM", 32)
    long_answers, long_rolling, long_calls, long_cached = run()
    assert [g for _, g in long_answers] == [g for _, g in answers] and answers[3][1]
    torch.testing.assert_close(torch.tensor([a for a, _ in long_answers]), torch.tensor([a for a, _ in answers]),
                               atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(torch.tensor(long_rolling), torch.tensor(rolling), atol=1e-4, rtol=1e-6)
    # every keyed request and the rolling document (lm-eval adds them in its own batch order)
    assert sorted(repr(c[:2]) for c in long_cached) == sorted(repr(c[:2]) for c in cached) and len(cached) == 6
    assert all(shape[1] < 32 for shape in long_calls) and max(shape[1] for shape in calls) >= 49
