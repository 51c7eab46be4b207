"""Every scheme family on every RoPE folder of the installed transformers: what happens, measured.

`outcomes(folder)` runs, on the folder's tiny model (`helpers.models.tiny_model`, 2 rows × 40 tokens, row 0
left-padded where the architecture pads exactly):

- the frequency family, represented by yarn ×4: the patched model against a model built by transformers from the
  config the patch wrote (what a plain save reloads), and `remove()` bit-exact;
- each attention-side scheme at its identity setting (a window or chunk that covers the input) against the unpatched
  model, then at a real setting against `helpers.reference_any` (the papers' positions, the layer's own code), and
  `remove()` bit-exact after each;

and reports per scheme "exact", or "refused: <the message>" when `apply()` refuses, or what went wrong ("wrong: ...",
"crash: ..."). `tests/schemes/test_architectures.py` compares that with its table of expected refusals, and
`docs/architectures.md` is generated from the same table (`helpers.coverage.page`).
"""

from __future__ import annotations

import copy
import re

import torch
import transformers
from packaging.version import Version
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import rope_patch
from helpers.models import INPUTS, NEWER_FOLDERS, PADDING_INEXACT, VOCAB, rope_folders, tiny_model
from helpers.reference_any import forward as reference_forward

L, PAD = 40, 5
# |Δlogit| ≤ TOL · max(1, max |logit|): float noise of one more code path (the blocked attention, several kernels)
TOL = 1e-5
FREQUENCY = ("yarn", {"factor": 4.0})
# scheme -> (identity setting: must reproduce the unpatched model, or None; a real setting: must equal the reference)
ATTENTION = {
    "self_extend": ({"group_size": 4, "window_size": 64}, {"group_size": 4, "window_size": 12}),
    "self_extend_logistic": ({"group_size": 6, "window_size": 64, "growth_rate": 0.5},
                             {"group_size": 6, "window_size": 12, "growth_rate": 0.5}),
    "rerope": ({"window_size": 64}, {"window_size": 12}),
    "leaky_rerope": ({"window_size": 64, "factor": 4.0}, {"window_size": 12, "factor": 4.0}),
    "string": ({"shift_size": 64, "window_size": 8}, {"shift_size": 20, "window_size": 6}),
    "dca": ({"chunk_size": 64, "local_size": 4}, {"chunk_size": 24, "local_size": 4}),
    "dpe": ({"group_sizes": [4, 2], "window_size": 64}, {"group_sizes": [4, 2], "window_size": 12}),
    "ms_poe": ({"min_ratio": 1.0, "max_ratio": 1.0, "skip_layers": 0},
               {"min_ratio": 1.2, "max_ratio": 1.8, "skip_layers": 0}),
    "sink": ({"window_size": 64, "sink_size": 4}, {"window_size": 12, "sink_size": 4}),
    "lm_infinite": ({"local_size": 64, "global_size": 4}, {"local_size": 12, "global_size": 4, "max_distance": 10}),
    "alibi": (None, {}),
}
SCHEMES = (FREQUENCY[0], *ATTENTION)
FAMILY = {"yarn": "frequency", "alibi": "bias", **{s: "re-positioning" for s in ATTENTION if s != "alibi"}}


def folders() -> list[str]:
    return sorted(rope_folders())


def backend(folder: str) -> str:
    """sdpa where the architecture has it, else eager (transformers refuses sdpa for some: gpt-oss, DeepSeek-V4)."""
    try:
        tiny_model(folder, attn_implementation="sdpa")
    except ValueError:
        return "eager"
    return "sdpa"


def batch(folder: str):
    """ids (2, L), forward kwargs (mask and the position ids generate passes, or none where padding is not exact),
    real-token mask (2, L)."""
    ids = torch.randint(3, VOCAB, (2, L), generator=torch.Generator().manual_seed(0))
    if folder in PADDING_INEXACT:
        return ids, {}, torch.ones_like(ids, dtype=torch.bool)
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    ids = ids.masked_fill(mask == 0, 0)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return ids, {"attention_mask": mask, "position_ids": positions}, mask.bool()


def _logits(folder, model, ids, kw):
    with torch.no_grad():
        return model(ids, **kw, **INPUTS.get(folder, {})).logits


def _delta(got, want, real) -> float:
    n = got.shape[1]  # csm's depth decoder returns no logits for position 0: aligned from the right
    real = real[:, -n:]
    return ((got - want)[real].abs().max() / want[real].abs().max().clamp(min=1.0)).item()


def _native(model):
    """A model built by transformers from the config the patch wrote, with the same weights."""
    twin = type(model)(copy.deepcopy(model.config)).eval()
    twin.load_state_dict(model.state_dict())
    twin.set_attn_implementation(model.config._attn_implementation)
    return twin


def _table_reference(model, scheme: str, params: dict):
    """For a model that rotates from a sin/cos table and has no `rope_parameters` (GPT-J, CodeGen:
    `rotary_emb.embed_positions`, [sin | cos] of base 10000 over the first `rotary_dim` coordinates, built at init by
    `create_sinusoidal_positions`): the same model with its table built as that function builds it, from the
    frequencies and cos/sin scale of transformers' own init function (`ROPE_INIT_FUNCTIONS[scheme]`) on a config
    carrying the scheme's parameters, for factor × the window."""
    twin = copy.deepcopy(model)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    window = cfg.max_position_embeddings
    rope = {"rope_type": scheme, "rope_theta": 10000.0, "original_max_position_embeddings": window,
            "partial_rotary_factor": cfg.rotary_dim / head_dim, **params}
    standalone = PreTrainedConfig(rope_parameters=rope, head_dim=head_dim, hidden_size=cfg.hidden_size,
                                  num_attention_heads=cfg.num_attention_heads,
                                  max_position_embeddings=int(params.get("factor", 1) * window))
    inv_freq, scale = ROPE_INIT_FUNCTIONS[scheme](standalone)
    angles = torch.arange(standalone.max_position_embeddings, dtype=torch.int64).float()[:, None] * inv_freq.float()
    rotary = next(m for m in twin.modules() if "embed_positions" in m._buffers)
    rotary.embed_positions = torch.cat((torch.sin(angles) * scale, torch.cos(angles) * scale), dim=1)
    return twin


def _frequency(folder, make, ids, kw, real) -> str:
    model = make()
    before = _logits(folder, model, ids, kw)
    scheme, params = FREQUENCY
    try:
        rope_patch.apply(model, scheme, **params)
    except (ValueError, TypeError) as e:
        return f"refused: {e}"
    got = _logits(folder, model, ids, kw)
    table = getattr(model.config, "rope_parameters", None) is None
    want = _table_reference(make(), scheme, params) if table else _native(model)
    d = _delta(got, _logits(folder, want, ids, kw), real)
    rope_patch.remove(model)
    if not torch.equal(_logits(folder, model, ids, kw), before):
        return "wrong: remove() is not bit-exact"
    return "exact" if d <= TOL else f"wrong: {d:.1e} from a natively configured model"


def _attention(folder, scheme, make, ids, kw, real) -> str:
    identity, setting = ATTENTION[scheme]
    model = make()
    before = _logits(folder, model, ids, kw)
    if identity is not None:
        try:
            rope_patch.apply(model, scheme, **identity)
        except (ValueError, TypeError) as e:
            return f"refused: {e}"
        d = _delta(_logits(folder, model, ids, kw), before, real)
        rope_patch.remove(model)
        if d > TOL:
            return f"wrong: {d:.1e} from the model at the identity setting {identity}"
        if not torch.equal(_logits(folder, model, ids, kw), before):
            return "wrong: remove() is not bit-exact"
    try:
        rope_patch.apply(model, scheme, **setting)
    except (ValueError, TypeError) as e:
        return f"refused: {e}"
    got = _logits(folder, model, ids, kw)
    want = reference_forward(make(), model, ids, scheme, setting, kw.get("attention_mask"),
                             **{k: v for k, v in kw.items() if k != "attention_mask"}, **INPUTS.get(folder, {}))
    d = _delta(got, want, real)
    rope_patch.remove(model)
    if d > TOL:
        return f"wrong: {d:.1e} from the reference at {setting}"
    if not torch.equal(_logits(folder, model, ids, kw), before):
        return "wrong: remove() is not bit-exact"
    return "exact"


def outcomes(folder: str, schemes=SCHEMES) -> dict[str, str]:
    """scheme -> "exact" | "refused: ..." | "wrong: ..." | "crash: ..." on the folder's tiny model."""
    impl = backend(folder)

    def make():
        return tiny_model(folder, attn_implementation=impl)

    ids, kw, real = batch(folder)
    out = {}
    unpatched = make()
    before = _logits(folder, unpatched, ids, kw)
    rope_patch.remove(unpatched)  # a no-op on an unpatched model of any architecture
    out["remove_unpatched"] = "exact" if torch.equal(_logits(folder, unpatched, ids, kw), before) else "wrong"
    for scheme in schemes:
        try:
            out[scheme] = (_frequency(folder, make, ids, kw, real) if scheme == FREQUENCY[0]
                           else _attention(folder, scheme, make, ids, kw, real))
        except Exception as e:  # noqa: BLE001 (a crash is an outcome, reported as such)
            out[scheme] = f"crash: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return out


# ---- what is expected: exact, or refused for a reason ----------------------------------------------------------------
ALL_ATTENTION = tuple(ATTENTION)
REPOSITIONING = tuple(s for s in ATTENTION if s != "alibi")
# Why a folder refuses a scheme: (a phrase of apply()'s refusal, the reason in a few words for the architecture page)
NO_ROTARY = ("has no rotary position embedding module",
             "no RoPE: Inkling 2's text decoder has a learned relative-position bias")
# GPT-J / CodeGen rotate from a table of sin/cos rows at integer positions (discovery.SinCosTable)
FRACTIONAL = ("fractional positions",
              "it rotates from a sin/cos table of integer positions; leaky ReRoPE moves queries and keys to fractional "
              "ones (j/k; Ms-PoE p/r), where the table has no rows")
GROUPED = ("frequency group of the rotation at positions of its own",
           "it rotates from a sin/cos table of integer positions whose rows are not split by frequency; "
           "DPE places each frequency group at positions of its own")
OWN_ATTENTION = ("computes attention in its own module code",
                 "attention computed in the module's own code, not through transformers' attention interface")
NATIVE_REJECTS = ("rejects this RoPE configuration",
                  "the model's config class rejects the rope type (Phi-3 and Phi-4-multimodal: longrope only)")
PROPORTIONAL = ("('proportional') gives",
                "global layers use `proportional` RoPE (full-width frequencies, a quarter non-zero); yarn gives a "
                "quarter-width set there, which a natively configured model cannot run either")


INSTALLED = Version(transformers.__version__)
OLDEST = Version("5.19")  # the oldest supported release (pyproject.toml): CI's second pass runs this coverage on it


def before(release: str, version: Version = INSTALLED) -> bool:
    """Whether `version` (the installed transformers) is older than `release`: a row that holds only there (the release
    changed the structure the outcome is read from) is kept for the oldest supported release's coverage run."""
    return version < Version(release)


def own_code(version: Version = INSTALLED) -> tuple[str, ...]:
    """The folders that compute attention in their own module code on transformers `version` (Falcon up to 5.24: 5.25
    moved it onto the attention interface)."""
    return ("gpt_neox_japanese",) + (("falcon",) if before("5.25", version) else ())


def refused(version: Version = INSTALLED) -> dict[str, dict[str, tuple[str, str]]]:
    """folder -> {scheme: (phrase, reason)} on transformers `version`; every (folder, scheme) not listed is exact."""
    sparse_indexer = "a sparse-attention indexer picks the keys at the tokens' positions"
    return {
        "inkling2": dict.fromkeys(SCHEMES, NO_ROTARY),
        **{f: {"leaky_rerope": FRACTIONAL, "ms_poe": FRACTIONAL, "dpe": GROUPED} for f in ("codegen", "gptj")},
        **{f: dict.fromkeys(ALL_ATTENTION, OWN_ATTENTION) for f in own_code(version)},
        **{f: {"yarn": NATIVE_REJECTS} for f in ("phi3", "phi4_multimodal")},
        **{f: {"yarn": PROPORTIONAL} for f in ("gemma4", "gemma4_unified", "lfm3")},
        "mimo_v2_flash": {"yarn": ("RoPE computation fails on",
                                   "transformers' own yarn computation fails on its config (partial rotary 0.334 read "
                                   "in two ways), so a natively configured model fails too")},
        "recurrent_gemma": {
            "yarn": ("records no max_position_embeddings",
                     "its config records no window for a factor to be relative to; transformers' scaled types need it "
                     "too")},
        "deepseek_v4": {
            # its tiny model's rotary_dim 2 has one frequency for dpe's two groups
            "dpe": ("2 group sizes for the 1 RoPE frequencies",
                    "one RoPE frequency (rotary_dim 2) for two groups on the tiny model"),
            "ms_poe": ("without the head order of its prompt",
                       "attention over compressed memory: no call's queries are its keys, so no prompt orders the "
                       "heads")},
        # 5.25 hands the text position ids to every layer, the global NoPE ones too, so the schemes that hide keys
        # (sink, lm_infinite) hide their middle keys
        "cohere_compass": dict.fromkeys(("sink", "lm_infinite"), (
            "runs without positions",
            "its global layers receive no positions (NoPE), and a scheme that hides keys (StreamingLLM, LM-Infinite) "
            "must hide their middle keys by the tokens' positions too")) if before("5.25", version) else {},
        # its indexer rotates every cached key again at each decoding step, from the position embeddings the layer
        # receives: at copy 0's positions, which DCA and Ms-PoE move
        "qwen4_exp": dict.fromkeys(("dca", "ms_poe"), (
            "reads every key's position",
            "its sparse indexer re-reads every cached key's position at each decoding step, at the layer's first "
            "position copy, which DCA (chunk positions) and Ms-PoE (0 and p/r) move")),
        # before 5.21 Zaya's layers read their convolution state straight off the cache layer
        # (`layers[i].conv_states`), where the position copies' cache view does not stack it; from 5.21 they ask the
        # cache (`get_conv_state`)
        **({"zaya": dict.fromkeys(REPOSITIONING, ("apply-time check",
                                                  "its layers read their convolution state straight off the cache "
                                                  "layer (before transformers 5.21), which the position copies do not "
                                                  "reach (the check's cached decoding fails)"))}
           if before("5.21", version) else {}),
        "zamba2": {"ms_poe": ("several depths", "one attention module shared by several depths (a hybrid's shared "
                                                "block): Ms-PoE keeps the prompt's head order per layer, not per "
                                                "depth")},
        **{f: {"dca": ("sparse-attention indexer's choice of keys",
                       f"{sparse_indexer}; DCA moves every copy, so no copy has them"),
               "ms_poe": ("apply-time check", f"{sparse_indexer}; Ms-PoE moves every copy (to 0 and p/r), so no copy "
                                              "has them"),
               **dict.fromkeys(("sink", "lm_infinite"), (
                   "hides every key between the first tokens and its window",
                   "attention reads only the keys a sparse-attention indexer chose; a scheme that hides the middle "
                   "keys (StreamingLLM, LM-Infinite) leaves a query whose chosen keys all lie there no key at all"))}
           for f in ("axk2", "deepseek_v32", "dots3_note", "glm_moe_dsa", "hy_v4")},
    }


OWN_CODE = own_code()
REFUSED = refused()


def expected(folder: str, scheme: str) -> tuple[str, str] | None:
    """(phrase, reason) of the refusal expected of `scheme` on `folder`, or None: exact."""
    return REFUSED.get(folder, {}).get(scheme)


def page_version(text: str) -> str:
    """The transformers version a generated architecture page names (page() writes it in its first paragraph)."""
    found = re.search(r"^Every model folder of transformers (\S+) ", text, re.M)
    if found is None:
        raise ValueError("docs/architectures.md names no transformers version: regenerate it with "
                         "`cd tests && python -m helpers.coverage`")
    return found.group(1)


def _span(releases: list[Version]) -> str:
    lo, hi = min(releases), max(releases)
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def older_releases() -> list[str]:
    """The page's lines on the supported releases older than the installed one (from OLDEST): the folders they lack
    (NEWER_FOLDERS) and the cells whose expectation differs there (`refused(version)` against REFUSED)."""
    releases = [Version(f"{OLDEST.major}.{minor}") for minor in range(OLDEST.minor, INSTALLED.minor)]
    if INSTALLED.major != OLDEST.major or not releases:
        return []
    added: dict[str, list[str]] = {}
    for folder, release in sorted(NEWER_FOLDERS.items(), key=lambda item: Version(item[1])):
        if not before(release):
            added.setdefault(release, []).append(folder)
    changed: dict[tuple, dict] = {}  # (folder, then, now) -> schemes and the releases where `then` holds
    for version in releases:
        then_table = refused(version)
        for folder in folders():
            for scheme in SCHEMES:
                then, now = then_table.get(folder, {}).get(scheme), expected(folder, scheme)
                if then != now:
                    row = changed.setdefault((folder, then, now), {"schemes": [], "releases": []})
                    row["schemes"] += [scheme] if scheme not in row["schemes"] else []
                    row["releases"] += [version] if version not in row["releases"] else []
    names = {ALL_ATTENTION: "every attention-side scheme", REPOSITIONING: "every re-positioning scheme"}
    lines = ["", "## Older releases", "",
             f"rope_patch supports transformers {OLDEST} and newer (`pyproject.toml`), and CI runs this coverage on "
             f"{OLDEST} too. Before {transformers.__version__} the table differs "
             "(`helpers.coverage.refused(version)`):",
             "", "- folders in it from a later release on (new folders; codegen's and gptj's rotary became a module "
             "in 5.24):", *[f"    - {release}: {', '.join(f)}" for release, f in added.items()]]
    for (folder, then, _now), row in changed.items():
        which = names.get(tuple(row["schemes"]), ", ".join(row["schemes"]))
        span = _span(row["releases"])
        lines.append(f"- {folder}, {which}: " + (f"✗ on {span}: {then[1]}" if then is not None else f"✓ on {span}"))
    return lines


def page() -> str:
    """docs/architectures.md: which scheme families each RoPE folder of the installed transformers runs exactly, and
    why the others are refused (from REFUSED, which tests/schemes/test_architectures.py holds to what apply() does)."""
    folders_ = folders()
    exact = {s: sum(expected(f, s) is None for f in folders_) for s in SCHEMES}
    lines = [
        "# Supported architectures",
        "",
        "<!-- generated by `cd tests && python -m helpers.coverage` from `helpers/coverage.py`; "
        "tests/schemes/test_architectures.py checks every row -->",
        "",
        f"Every model folder of transformers {transformers.__version__} that defines a rotary embedding and a causal "
        f"LM ({len(folders_)} folders), tried on a tiny random model of each (`tests/helpers/models.py`): the "
        "frequency schemes (yarn ×4 against a model transformers builds from the patched config; GPT-J and CodeGen, "
        "whose configs have no `rope_parameters` and which rotate from a sin/cos table built at init, against the same "
        "model with its table built from the frequencies and attention scaling of transformers' "
        "`ROPE_INIT_FUNCTIONS['yarn']` on a config carrying the same parameters), the re-positioning "
        "schemes (Self-Extend, SELF, ReRoPE, leaky ReRoPE, STRING, DCA, DPE, Ms-PoE, StreamingLLM sinks: "
        "at an identity setting against the model, at a real one against a reference that places each pair where the "
        "papers do and runs the layer's own code) and ALiBi (against a reference). ✓ is exact (max |Δlogit| ≤ 1e-5 "
        "relative to the logits' scale) with `remove()` bit-exact; ✗ is refused at `apply()` with the reason below, "
        "the model left as it was. Nothing is wrong or crashes.",
        "",
        "| scheme | exact on |",
        "| --- | ---: |",
        *[f"| {s} | {exact[s]} of {len(folders_)} |" for s in SCHEMES],
        "",
        f"| folder | {' | '.join(SCHEMES)} |",
        f"| --- | {' | '.join(':---:' for _ in SCHEMES)} |",
    ]
    reasons: dict[str, int] = {}
    for f in folders_:
        cells = []
        for s in SCHEMES:
            why = expected(f, s)
            if why is None:
                cells.append("✓")
                continue
            number = reasons.setdefault(why[1], len(reasons) + 1)
            cells.append(f"✗ {number}")
        lines.append(f"| {f} | {' | '.join(cells)} |")
    lines += ["", "Refused because:", ""]
    lines += [f"{n}. {reason}" for reason, n in reasons.items()]
    lines += older_releases()
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # cd tests && python -m helpers.coverage: rewrite docs/architectures.md
    from pathlib import Path

    (Path(__file__).resolve().parents[2] / "docs" / "architectures.md").write_text(page(), encoding="utf-8")
