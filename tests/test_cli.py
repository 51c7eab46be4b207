"""`rope-patch` command line: scheme specs and `list`."""

from __future__ import annotations

import pytest

from rope_patch.cli import main
from rope_patch.specs import parse_scheme_spec

SPECS = [
    ("yarn:8", "yarn", dict(factor=8.0)),
    ("YaRN:factor=8,beta_fast=16", "yarn", dict(factor=8.0, beta_fast=16.0)),
    ("default:500000", "default", dict(rope_theta=500000.0)),
    ("pi:4", "linear", dict(factor=4.0)),
    ("p_rope:0.75", "p_rope", dict(partial_rotary_factor=0.75)),
    ("yarn:factor=4,truncate=false", "yarn", dict(factor=4.0, truncate=False)),
    ("longrope:factor=2,short_factor=1/1,long_factor=2/3", "longrope", dict(factor=2.0, short_factor=(1.0, 1.0), long_factor=(2.0, 3.0))),
    ("default", "default", {}),
]


@pytest.mark.parametrize("spec,name,params", SPECS, ids=[s for s, *_ in SPECS])
def test_parse_scheme_spec(spec, name, params):
    scheme = parse_scheme_spec(spec)
    assert scheme.name == name and scheme.params() == params


@pytest.mark.parametrize("spec,exc,match", [
    ("yran:8", ValueError, "Did you mean 'yarn'"),
    ("yarn:fctor=8", TypeError, "Did you mean 'factor'"),
    ("yarn:abc", TypeError, "must be a number"),
    ("linear:0.5", ValueError, "shrink"),
])
def test_bad_specs(spec, exc, match):
    with pytest.raises(exc, match=match):
        parse_scheme_spec(spec)


def test_list_command(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "yarn" in out and "beta_fast" in out and "frequency" in out and "pi" in out
