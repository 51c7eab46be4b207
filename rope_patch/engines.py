"""What the serving engines (vLLM, SGLang) accept as RoPE configuration, read from their own source: the committed
snapshot rope_patch/data/engines.json and the extractor that regenerates it.

Both engines ship CUDA wheels that pin their own torch, so they are never installed here. Their configuration code is
plain Python, though: the extractor reads it from the wheel file with `ast` (nothing is imported or run) and records,
per engine,

    rope_types    the rope types the engine's `get_rope` dispatches on, and for each the `rope_parameters` keys its
                  branch reads ("required": subscripted in the branch's plain statements, so a missing one is a
                  KeyError; "optional": read under a condition, with `.get`, `in`, or a filter over `.items()`)
    common        the keys `get_rope` reads for every type (rope_theta, partial_rotary_factor, ...)
    models        per model file read (llama, gemma3): the keys its code reads from the config's rope dict, the
                  config attributes it reads with `getattr(config, "x", default)` (SGLang's llama takes
                  `partial_rotary_factor` from there, not from the rope dict), and the rope types it passes to
                  `get_rope` when it replaces the config's dict by a literal (SGLang's Gemma 3 runs
                  `{"rope_type": "default"}` on every layer whatever config.json says)
    context       how the engine derives the context length from config.json (the rope types and keys whose `factor`
                  it does not multiply in), when it lets the tokenizer's model_max_length cap it (vLLM: only for a
                  pooling runner on a model with absolute positions; SGLang: never), and the environment variable
                  that lets a longer one through
    flags         the command-line flags `rope-patch export --engine` prints, found in the engine's argument code
    functions     sha256 of each function whose logic rope_patch/serving.py mirrors by hand (override merging, length
                  derivation, the dynamic NTK cache and the LongRoPE switch its notes describe): `--check` names the
                  ones that changed, so a new engine release is reviewed, not trusted

The snapshot is regenerated from downloaded wheels (no install, no dependencies):

    pip download --no-deps vllm==0.34.0 sglang==0.5.23 -d wheels/
    python -m rope_patch.engines --refresh wheels/vllm-*.whl wheels/sglang-*.whl
    python -m rope_patch.engines --check wheels/*.whl      # exit status 1 when the snapshot differs
    ROPE_PATCH_ENGINE_WHEELS=wheels/ pytest tests/test_engines.py tests/test_serving.py
                        # also runs the engines' own get_rope, length checks and rotary classes on every export

This module is torch-free (the command line reads engine names from it before it parses), in the foundation layer
beside scheme_names, which follows the same pattern (a committed table, the command that rewrites it, here).
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

from . import schema
from .resources import data_path

SNAPSHOT = "engines.json"
COMMAND = "python -m rope_patch.engines --refresh WHEEL..."
FORMAT = "rope_patch.engines/1"

# Where each engine keeps what is read: files inside the wheel, the names the code uses. This says WHERE to look; what
# is there (types, keys, literals, flags) is read from the source.
TARGETS: dict[str, dict] = {
    "vllm": {
        "get_rope": "vllm/model_executor/layers/rotary_embedding/__init__.py",
        "dispatch": "scaling_type",          # get_rope's variable holding the rope type
        "rope_dict": ("rope_parameters",),   # get_rope's name of the config's rope dict
        "models": {  # model file -> the config model types it serves
            "vllm/model_executor/models/llama.py": ["llama"],
            "vllm/model_executor/models/gemma3.py": ["gemma3", "gemma3_text"],
        },
        "context": ("vllm/config/model.py", "_get_and_verify_max_len"),
        # the caller that decides whether tokenizer_config.json is read (and passed in) at all
        "tokenizer": ("vllm/config/model.py", "get_and_verify_max_len"),
        "length_keys": ("vllm/transformers_utils/model_arch_config_convertor.py", "possible_keys"),
        "env": ("vllm/config/model.py", "_get_and_verify_max_len", "vllm/envs.py"),
        "flags": [("vllm/engine/arg_utils.py",
                   ("--hf-overrides", "--max-model-len", "--hf-config-path", "--enable-lora")),
                  ("vllm/entrypoints/common/cli_args.py", ("--lora-modules",))],
        "mirrored": [("vllm/config/model.py", "_get_and_verify_max_len"),
                     ("vllm/config/model.py", "ModelConfig.get_and_verify_max_len"),
                     ("vllm/config/model.py", "_apply_dict_overrides"),
                     ("vllm/transformers_utils/config.py", "iter_rope_parameters"),
                     ("vllm/transformers_utils/model_arch_config_convertor.py", "derive_max_model_len_and_key"),
                     ("vllm/model_executor/layers/rotary_embedding/dynamic_ntk_scaling_rope.py",
                      "DynamicNTKScalingRotaryEmbedding._compute_cos_sin_cache"),
                     ("vllm/model_executor/layers/rotary_embedding/phi3_long_rope_scaled_rope.py",
                      "Phi3LongRoPEScaledRotaryEmbedding.forward")],
    },
    "sglang": {
        "get_rope": "sglang/srt/layers/rotary_embedding/factory.py",
        "dispatch": "scaling_type",
        "rope_dict": ("rope_scaling",),
        "models": {
            "sglang/srt/models/llama.py": ["llama"],
            "sglang/srt/models/gemma3_causal.py": ["gemma3", "gemma3_text"],
        },
        "context": ("sglang/srt/utils/hf_transformers/common.py", "get_context_length"),
        "tokenizer": ("sglang/srt/configs/model_config.py", "_derive_context_length"),
        "length_keys": ("sglang/srt/utils/hf_transformers/common.py", "CONTEXT_LENGTH_KEYS"),
        "env": ("sglang/srt/configs/model_config.py", "_derive_context_length", "sglang/srt/environ.py"),
        # SGLang builds its flags from dataclass fields: `json_model_override_args` is `--json-model-override-args`
        "flags": [("sglang/srt/arg_groups/fields/model.py", ("--model-path", "--json-model-override-args",
                                                             "--context-length")),
                  ("sglang/srt/arg_groups/fields/lora.py", ("--enable-lora", "--lora-paths"))],
        "mirrored": [("sglang/srt/utils/hf_transformers/common.py", "get_context_length"),
                     ("sglang/srt/utils/hf_transformers/config.py", "get_config"),
                     ("sglang/srt/configs/model_config.py", "_derive_context_length"),
                     ("sglang/srt/layers/rotary_embedding/rope_variant.py",
                      "DynamicNTKScalingRotaryEmbedding._compute_cos_sin_cache"),
                     ("sglang/srt/layers/rotary_embedding/rope_variant.py",
                      "Phi3LongRoPEScaledRotaryEmbedding.forward"),
                     # the YaRN scale its attn_factor multiplies (serving._attn_factor)
                     ("sglang/srt/layers/rotary_embedding/yarn.py", "YaRNScalingRotaryEmbedding.__init__"),
                     ("sglang/srt/layers/rotary_embedding/yarn.py", "yarn_get_mscale"),
                     ("sglang/srt/layers/rotary_embedding/yarn.py", "yarn_get_mscale_simple"),
                     # rotary_dim = int(partial_rotary_factor * head_dim), the factor read from the config's top level
                     ("sglang/srt/models/llama.py", "LlamaAttention.__init__")],
    },
}
ENGINES = tuple(TARGETS)

# names of the config's rope dict in model code (rope_parameters, rope_scaling, rope_params), not rope_type / rope_theta
_ROPE_NAME = re.compile(r"rope_?(param|scal)")


# ---- the snapshot ------------------------------------------------------------------------------------------------
_KEYS = schema.Obj({"required": schema.List(schema.Str()), "optional": schema.List(schema.Str())})
KIND = schema.Kind(
    "engine snapshot", format=FORMAT,
    fix=f"It is generated: restore it from the repository, or regenerate it with `{COMMAND}`.",
    spec=schema.Obj({"generated_by": schema.Str(), "engines": schema.Map(schema.Obj({
        "version": schema.Str(nonempty=True), "wheel": schema.Str(nonempty=True), "sha256": schema.Str(nonempty=True),
        "rope_types": schema.Map(_KEYS), "common": _KEYS,
        "models": schema.Map(schema.Obj({"model_types": schema.List(schema.Str()), "reads": schema.List(schema.Str()),
                                         "config_reads": schema.List(schema.Str()),
                                         "fixed_rope_types": schema.Opt(schema.List(schema.Str()))})),
        "context": schema.Obj({"env": schema.Str(nonempty=True), "length_keys": schema.List(schema.Str(), min_len=1),
                               "tokenizer_when": schema.Opt(schema.Map(schema.Str())),
                               "factor_exempt_types": schema.List(schema.Str()),
                               "factor_exempt_keys": schema.List(schema.Str()),
                               "factor_exempt_model_types": schema.List(schema.Str())}),
        "flags": schema.List(schema.Str()),
        "functions": schema.Map(schema.Str()),
    }))}),
)


@functools.cache
def snapshot() -> dict:
    """The committed snapshot, checked against its schema."""
    return schema.read(data_path(SNAPSHOT), KIND)


def engine(name: str) -> dict:
    """One engine's entry; ValueError with "Did you mean" for another name."""
    try:
        return snapshot()["engines"][name]
    except KeyError:
        raise ValueError(unknown_engine(name)) from None


def unknown_engine(name: str) -> str:
    from .registry import did_you_mean

    return f"unknown engine {name!r}.{did_you_mean(name, ENGINES)} Engines: {', '.join(ENGINES)}."


def keys_read(name: str, rope_type: str, model_type: str | None = None) -> set[str] | None:
    """The `rope_parameters` keys `name` reads for `rope_type` on a model of `model_type` (its get_rope's common keys
    and branch, and the model code's own reads: the file read for that model type, else every model file read); None
    where the engine does not run the type."""
    eng = engine(name)
    if rope_type not in eng["rope_types"]:
        return None
    branch = eng["rope_types"][rope_type]
    models = [m for m in eng["models"].values() if model_type in m["model_types"]] or list(eng["models"].values())
    model_reads = set().union(*(m["reads"] for m in models))
    return {*eng["common"]["required"], *eng["common"]["optional"], *branch["required"], *branch["optional"],
            "rope_type", *model_reads}


def config_reads(name: str, model_type: str | None = None) -> set[str]:
    """The config attributes the engine's model code for `model_type` reads with getattr (every model file read when
    the snapshot has none for that type): where a rope key is read from the config's top level, not its rope dict."""
    eng = engine(name)
    models = [m for m in eng["models"].values() if model_type in m["model_types"]] or list(eng["models"].values())
    return set().union(*(m["config_reads"] for m in models))


def fixed_rope_types(name: str, model_type: str | None) -> list[str] | None:
    """The rope types the engine's model code for `model_type` runs whatever the config says (None: the config's)."""
    for m in engine(name)["models"].values():
        if model_type in m["model_types"]:
            return m["fixed_rope_types"]
    return None


# ---- the extractor (ast only: nothing of the engine is imported) -------------------------------------------------
def _const_strs(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _is_dict(node, names) -> bool:
    """`node` names one of the rope dicts: a bare name, or an attribute (`self.rope_scaling`)."""
    return (isinstance(node, ast.Name) and node.id in names) or (isinstance(node, ast.Attribute) and node.attr in names)


def _reads(nodes, names, skip=()) -> set[str]:
    """The string keys read from the dicts `names` under `nodes`, not descending into `skip`: d["k"], d.get("k"),
    "k" in d, f(d, "k", ...) (a getter taking the dict then the key), and {k: v for k, v in d.items() if k in (...)}."""
    found: set[str] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if any(node is s for s in skip):
            continue
        if isinstance(node, ast.Subscript) and _is_dict(node.value, names) and isinstance(node.ctx, ast.Load):
            found.update(_const_strs(node.slice))
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "get" and _is_dict(f.value, names) and node.args:
                found.update(_const_strs(node.args[0]))
            for a, b in zip(node.args, node.args[1:], strict=False):
                if _is_dict(a, names):
                    found.update(_const_strs(b))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if any(_is_dict(c, names) for c in node.comparators):
                found.update(_const_strs(node.left))
        elif isinstance(node, (ast.DictComp, ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            for gen in node.generators:
                it = gen.iter
                if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items" \
                        and _is_dict(it.func.value, names):
                    for cond in gen.ifs:
                        if isinstance(cond, ast.Compare):
                            for c in cond.comparators:
                                found.update(_const_strs(c))
        todo.extend(ast.iter_child_nodes(node))
    return found


_COMPOUND = (ast.If, ast.For, ast.While, ast.Try, ast.With, ast.Match, ast.FunctionDef, ast.ClassDef)


def _required(body, names) -> set[str]:
    """Keys subscripted (d["k"]: a KeyError when absent) in the plain statements of `body`, outside any nested
    condition or loop: read whenever the branch runs."""
    found: set[str] = set()
    for stmt in body:
        if isinstance(stmt, _COMPOUND):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Subscript) and _is_dict(node.value, names) and isinstance(node.ctx, ast.Load):
                found.update(_const_strs(node.slice))
    return found


def _keys(body, names, skip=()) -> dict:
    read, req = _reads(body, names, skip), _required(body, names)
    return {"required": sorted(req), "optional": sorted(read - req)}


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise LookupError(f"no function {name!r}")


def _dispatch_types(test, var: str) -> list[str]:
    """The rope types an `if` test compares the dispatch variable with (`t == "x"`, `t in ["x", "y"]`)."""
    if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == var:
        if all(isinstance(op, (ast.Eq, ast.In)) for op in test.ops):
            return [s for c in test.comparators for s in _const_strs(c)]
    return []


def rope_table(source: str, var: str, names: tuple[str, ...]) -> tuple[dict, dict]:
    """({rope_type: {"required", "optional"}}, common keys) of a `get_rope` source."""
    fn = _function(ast.parse(source), "get_rope")
    branches = [(t, node) for node in ast.walk(fn) if isinstance(node, ast.If)
                for t in [_dispatch_types(node.test, var)] if t]
    table: dict[str, dict] = {}
    bodies = []
    for types, node in branches:
        bodies.extend(node.body)
        for t in types:
            table[t] = _keys(node.body, names)
    return dict(sorted(table.items())), _keys(fn.body, names, skip=bodies)


def model_reads(source: str) -> dict:
    """What a model file reads of the config's rope dict: keys read from names containing "rope" (rope_parameters,
    rope_scaling, rope_params: also `config.rope_parameters["full_attention"]`'s layer-type keys, left out), and the
    rope types of dict literals it hands to `get_rope` in place of the config's (None when it hands the config's)."""
    tree = ast.parse(source)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and _ROPE_NAME.search(n.id)} | \
            {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _ROPE_NAME.search(n.attr)}
    reads = sorted(_reads([tree], tuple(names)) - {"sliding_attention", "full_attention", "chunked_attention"})
    # getattr(config, "x", default): attributes read from the config itself (`config`, `hf_config`, `self.config`)
    attrs = sorted({s for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
                    and len(n.args) >= 2 and _is_config(n.args[0]) for s in _const_strs(n.args[1])})
    # get_rope(..., rope_scaling=X / rope_parameters=X): X bound only to dict literals -> fixed types
    literal_types: set[str] = set()
    passes_config = False
    assigned: dict[tuple, list] = {}

    def ref(node):  # a local name and an attribute (self.x) of the same name are different variables
        return ("name", node.id) if isinstance(node, ast.Name) else ("attr", node.attr) \
            if isinstance(node, ast.Attribute) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if ref(t):
                    assigned.setdefault(ref(t), []).append(node.value)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "get_rope":
            for kw in node.keywords:
                if kw.arg in ("rope_scaling", "rope_parameters"):
                    v = kw.value
                    values = assigned.get(ref(v), []) if ref(v) else [v]
                    if values and all(isinstance(x, ast.Dict) for x in values):
                        for d in values:
                            for k, val in zip(d.keys, d.values, strict=True):
                                if _const_strs(k) == ["rope_type"]:
                                    literal_types.update(_const_strs(val))
                    else:
                        passes_config = True
    return {"reads": reads, "config_reads": attrs,
            "fixed_rope_types": None if passes_config or not literal_types else sorted(literal_types)}


def _is_config(node) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "config" or name.endswith("_config")


def tokenizer_rule(source: str, function: str) -> dict | None:
    """When `function` reads the tokenizer's config (tokenizer_config.json, whose model_max_length caps the length):
    {attribute: value} of the `==` tests on the `if` that guards the read (`self.runner_type == "pooling"`,
    `getattr(hf_config, "position_embedding_type", "") == "absolute"`), {} when it reads it unconditionally, None
    when it does not read it."""
    fn = _function(ast.parse(source), function)

    def reads(nodes) -> bool:
        return any(isinstance(n, ast.Call) and "tokenizer_config" in (getattr(n.func, "id", None) or
                                                                        getattr(n.func, "attr", ""))
                   for node in nodes for n in ast.walk(node))

    if not reads(fn.body):
        return None
    guards = [n for n in ast.walk(fn) if isinstance(n, ast.If) and reads(n.body) and not reads([n.test])]
    rule: dict[str, str] = {}
    for guard in guards:
        for node in ast.walk(guard.test):
            if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
                value, left = _const_strs(node.comparators[0]), node.left
                key = left.attr if isinstance(left, ast.Attribute) else \
                    _const_strs(left.args[1]) if isinstance(left, ast.Call) and len(left.args) >= 2 and \
                    getattr(left.func, "id", None) == "getattr" else None
                key = key[0] if isinstance(key, list) and key else key
                if isinstance(key, str) and value:
                    rule[key] = value[0]
    return rule


def context_rule(source: str, function: str, names: tuple[str, ...]) -> dict:
    """The constants of the engine's context-length derivation: rope types compared with the rope type (their factor
    is not multiplied in), rope dict keys whose presence does the same, model-type substrings tested, and the
    ALLOW-longer environment variable it consults."""
    fn = _function(ast.parse(source), function)
    types, keys, model_types = set(), set(), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Compare):
            left = node.left
            lname = left.id if isinstance(left, ast.Name) else left.attr if isinstance(left, ast.Attribute) else None
            call_get = isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute) and left.func.attr == "get" \
                and left.args and _const_strs(left.args[0]) == ["rope_type"]
            if lname == "rope_type" or call_get:
                for c in node.comparators:
                    types.update(_const_strs(c))
            elif isinstance(left, ast.Constant) and any(isinstance(c, ast.Attribute) and c.attr == "model_type"
                                                        for c in node.comparators):
                model_types.update(_const_strs(left))
            elif isinstance(left, ast.Constant) and any(_is_dict(c, names) for c in node.comparators):
                keys.update(_const_strs(left))
    return {"factor_exempt_types": sorted(types), "factor_exempt_keys": sorted(keys),
            "factor_exempt_model_types": sorted(model_types)}


def length_keys(source: str, variable: str) -> list[str]:
    """The config keys a context length is read from: the list literal assigned to `variable` (vLLM's
    `possible_keys`, the smallest of which wins; SGLang's CONTEXT_LENGTH_KEYS, the first present wins)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets):
            return _const_strs(node.value)
    raise LookupError(f"no list {variable!r}")


def allow_env(source: str, function: str) -> str | None:
    """The environment variable (`envs.X_ALLOW_..._LEN`) that `function` consults before it refuses a longer length."""
    for node in ast.walk(_function(ast.parse(source), function)):
        if isinstance(node, ast.Attribute) and re.fullmatch(r"[A-Z_]*ALLOW[A-Z_]*LEN[A-Z_]*", node.attr):
            return node.attr
    return None


def _function_digest(source: str, name: str) -> str:
    """sha256 of a function's syntax tree (`name`, or `Class.method`): unchanged by comments and formatting."""
    tree = ast.parse(source)
    if "." in name:
        cls, name = name.split(".", 1)
        tree = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if tree is None:
            raise LookupError(f"no class {cls!r}")
    return hashlib.sha256(ast.dump(_function(tree, name)).encode()).hexdigest()


def extract(wheel: str | Path) -> tuple[str, dict]:
    """(engine name, its snapshot entry) read from one wheel file."""
    wheel = Path(wheel)
    dist = wheel.name.split("-")[0].lower()
    if dist not in TARGETS:
        raise ValueError(f"{wheel.name}: not a wheel of {' or '.join(ENGINES)}.")
    t = TARGETS[dist]
    with zipfile.ZipFile(wheel) as z:
        def read(path):
            try:
                return z.read(path).decode("utf-8")
            except KeyError:
                raise LookupError(f"{wheel.name} has no {path}: the engine's layout changed; update "
                                  "rope_patch.engines.TARGETS") from None

        version = wheel.name.split("-")[1]
        rope_types, common = rope_table(read(t["get_rope"]), t["dispatch"], t["rope_dict"])
        models = {Path(p).stem: {"model_types": types, **model_reads(read(p))} for p, types in t["models"].items()}
        ctx_file, ctx_fn = t["context"]
        context = context_rule(read(ctx_file), ctx_fn, ("rope_scaling", "rope_parameters", "rp"))
        keys_file, keys_var = t["length_keys"]
        context["length_keys"] = length_keys(read(keys_file), keys_var)
        tok_file, tok_fn = t["tokenizer"]
        context["tokenizer_when"] = tokenizer_rule(read(tok_file), tok_fn)
        env_file, env_fn, env_defs = t["env"]
        context["env"] = allow_env(read(env_file), env_fn)
        if not context["env"] or context["env"] not in read(env_defs):
            raise LookupError(f"{wheel.name}: no ALLOW…LEN environment variable in {env_fn} / {env_defs}")
        found = [f for flag_file, flags in t["flags"] for src in [read(flag_file)] for f in flags
                 if f"\"{f}\"" in src or re.search(rf"^\s*{f[2:].replace('-', '_')}\s*:", src, re.M)]
        functions = {f"{p}:{name}": _function_digest(read(p), name) for p, name in t["mirrored"]}
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return dist, {"version": version, "wheel": wheel.name, "sha256": digest, "rope_types": rope_types,
                  "common": common, "models": models, "context": context, "flags": found, "functions": functions}


def build(wheels) -> dict:
    engines = dict(extract(w) for w in wheels)
    missing = [e for e in ENGINES if e not in engines]
    if missing:
        raise ValueError(f"give a wheel of every engine: {', '.join(missing)} missing.")
    return {"format": FORMAT, "generated_by": COMMAND, "engines": {e: engines[e] for e in ENGINES}}


def render(data: dict) -> str:
    return json.dumps(data, indent=1, sort_keys=False) + "\n"


def _changes(old: dict, new: dict) -> list[str]:
    out = []
    for name, eng in new["engines"].items():
        was = old.get("engines", {}).get(name, {})
        for key in ("version", "rope_types", "common", "models", "context", "flags"):
            if was.get(key) != eng[key]:
                out.append(f"{name}: {key} changed")
        for fn, digest in eng["functions"].items():
            before = was.get("functions", {}).get(fn)
            if before != digest:
                out.append(f"{name}: {fn} {'changed' if before else 'is new'}: review the rule rope_patch/serving.py "
                           "mirrors from it")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rope_patch.engines", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--refresh", nargs="+", metavar="WHEEL", help="rewrite rope_patch/data/engines.json from wheels")
    mode.add_argument("--check", nargs="+", metavar="WHEEL", help="only compare; exit status 1 when it differs")
    parser.add_argument("--snapshot", default=None, help="the snapshot file (default: the package's engines.json)")
    args = parser.parse_args(argv)
    try:
        new = build(args.refresh or args.check)
    except (OSError, ValueError, LookupError, zipfile.BadZipFile, SyntaxError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    path = Path(args.snapshot) if args.snapshot else data_path(SNAPSHOT)
    old = schema.parse_text(path, KIND) if path.is_file() else {}
    changes = _changes(old, new)
    for line in changes:
        print(line)
    if args.check:
        return 1 if render(new) != (path.read_text(encoding="utf-8") if path.is_file() else None) else 0
    path.write_text(render(new), encoding="utf-8")
    snapshot.cache_clear()
    print(f"{path.name}: " + ", ".join(f"{e} {v['version']} ({len(v['rope_types'])} rope types)"
                                       for e, v in new["engines"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
