"""rope_patch.specs: the `name[:value | :key=value,...]` grammar, table-driven."""

from __future__ import annotations

import pytest

from rope_patch.specs import parse_scheme_spec, parse_spec, scheme_label

PARSE = [
    # spec, canonical name, params as parsed
    ("yarn", "yarn", {}),
    ("  yarn  ", "yarn", {}),
    ("yarn:", "yarn", {}),
    ("yarn:8", "yarn", {"factor": 8}),
    ("yarn:2.5", "yarn", {"factor": 2.5}),
    ("yarn:1e1", "yarn", {"factor": 10.0}),
    ("default:500000", "default", {"rope_theta": 500000}),
    ("p_rope:0.75", "p_rope", {"partial_rotary_factor": 0.75}),
    ("alibi:4", "alibi", {"max_bias": 4}),
    ("self_extend:4", "self_extend", {"group_size": 4}),
    ("rerope:512", "rerope", {"window_size": 512}),
    ("leaky_rerope:512,factor=16", "leaky_rerope", {"window_size": 512, "factor": 16}),
    ("yarn:factor=8,beta_fast=16", "yarn", {"factor": 8, "beta_fast": 16}),
    ("yarn: factor = 8 , beta_fast=16 ,", "yarn", {"factor": 8, "beta_fast": 16}),
    ("yarn:factor=4,truncate=false", "yarn", {"factor": 4, "truncate": False}),
    ("longrope:factor=2,short_factor=1/1.5", "longrope", {"factor": 2, "short_factor": [1, 1.5]}),
    ("self_extend:group_size=4,window_size=1024", "self_extend", {"group_size": 4, "window_size": 1024}),
    ("default:1e+6", "default", {"rope_theta": 1e6}),  # a '+' in an exponent is no stack
    ("dpe:group_sizes=4/4,window_size=64", "dpe", {"group_sizes": [4, 4], "window_size": 64}),
    # aliases and spelling
    ("pi:4", "linear", {"factor": 4}),
    ("YaRN:8", "yarn", {"factor": 8}),
    ("dynamic-ntk:2", "dynamic", {"factor": 2}),
    ("ntk_aware:8", "ntk", {"factor": 8}),
    ("vanilla", "default", {}),
]


@pytest.mark.parametrize("spec,name,params", PARSE, ids=[s for s, *_ in PARSE])
def test_parse_spec(spec, name, params):
    assert parse_spec(spec) == (name, params)


BUILD = [
    ("yarn:8", "yarn", dict(factor=8.0)),
    ("pi:4", "linear", dict(factor=4.0)),
    ("longrope:factor=2,short_factor=1/1,long_factor=2/3", "longrope",
     dict(factor=2.0, short_factor=(1.0, 1.0), long_factor=(2.0, 3.0))),
    ("self_extend:group_size=4,window_size=1024", "self_extend", dict(group_size=4, window_size=1024)),
    ("default", "default", {}),
]


@pytest.mark.parametrize("spec,name,params", BUILD, ids=[s for s, *_ in BUILD])
def test_parse_scheme_spec_builds_the_registered_class(spec, name, params):
    import rope_patch

    scheme = parse_scheme_spec(spec)
    assert scheme.name == name and scheme.params() == params
    assert scheme == rope_patch.as_scheme(name, **params)  # the same class and validation as apply()


ERRORS = [
    # unknown names and keys: "Did you mean"
    ("yran:8", ValueError, "Did you mean 'yarn'"),
    ("lineer", ValueError, "Did you mean 'linear'"),
    ("yarn:fctor=8", TypeError, "Did you mean 'factor'"),
    ("self_extend:group_size=4,windw_size=8", TypeError, "Did you mean 'window_size'"),
    # malformed items
    ("", ValueError, "no scheme name"),
    (":8", ValueError, "no scheme name"),
    ("yarn:=8", ValueError, "no parameter name"),
    ("yarn:factor=", ValueError, "has no value"),
    ("yarn:4,8", ValueError, "sets 'factor' twice"),
    ("yarn:4,factor=8", ValueError, "sets 'factor' twice"),
    ("nope:4", TypeError, "takes no positional value; it has no parameters"),
    ("relative_bias:4", TypeError, "name the parameter, e.g. relative_bias:num_buckets="),
    # what was meant: a list ('/'), a stack with nothing after '+', parameters separated by ','
    ("dpe:group_sizes=4,4,window_size=64", ValueError,
     r"sets 'group_sizes' twice: commas separate parameters.*A list value is joined with '/': "
     r"'dpe:group_sizes=4/4,window_size=64'"),
    ("dpe:window_size=64,group_sizes=4,4,4", ValueError, r"'dpe:window_size=64,group_sizes=4/4/4'"),
    ("yarn:4+", ValueError, r"'yarn:4\+' has an empty part after '\+'"),
    ("yarn:4++logn", ValueError, r"has an empty part after '\+'"),
    ("yarn:4 + ", ValueError, r"has an empty part after '\+'"),
    ("self_extend:group_size=4;window_size=1024", ValueError,
     r"parameters are separated by ',', e.g. 'self_extend:group_size=4,window_size=1024'"),
    ("self_extend:group_size=4 window_size=1024", ValueError,
     r"parameters are separated by ',', e.g. 'self_extend:group_size=4,window_size=1024'"),
    # bad numbers: the scheme's own validation
    ("yarn:abc", TypeError, "must be a number"),
    ("yarn:4x", TypeError, "must be a number"),
    ("yarn:1e400", ValueError, "finite"),
    ("yarn:nan", ValueError, "finite"),
    ("linear:0.5", ValueError, "shrink"),
    ("default:0", ValueError, "rope_theta"),
    ("yarn:factor=4,original_max_position_embeddings=12.5", TypeError, "must be an integer"),
    ("longrope:short_factor=1/x", TypeError, r"short_factor\[1\]"),
    # a bracketed list: its commas would split it ("sets 'factor' twice"); the '/' form is named instead
    ("longrope:short_factor=[1,1.5,2],long_factor=[2,3,4]", ValueError,
     r"a list is written with '/'.*'longrope:short_factor=1/1.5/2,long_factor=2/3/4'"),
    ("longrope:short_factor=(1, 2)", ValueError, r"'longrope:short_factor=1/2'"),
]


@pytest.mark.parametrize("spec,exc,match", ERRORS, ids=[s or "<empty>" for s, *_ in ERRORS])
def test_bad_specs(spec, exc, match):
    with pytest.raises(exc, match=match):
        parse_scheme_spec(spec)


def test_not_a_string():
    with pytest.raises(TypeError, match="must be a str"):
        parse_spec(8)


@pytest.mark.parametrize("spec,label", [("yarn:8", "yarn×8"), ("yarn", "yarn"), ("yarn:factor=8", "yarn:factor=8"),
                                        ("leaky_rerope:512,factor=16", "leaky_rerope:512,factor=16")])
def test_scheme_label(spec, label):
    assert scheme_label(spec) == label


def test_specs_imports_neither_the_command_line_nor_api():
    """api imports specs (apply(m, "yarn:4")): specs must not import api or cli back."""
    import ast

    import rope_patch.specs as specs

    tree = ast.parse(open(specs.__file__).read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert not {m for m in imported if m and m.split(".")[-1] in ("cli", "api")}
