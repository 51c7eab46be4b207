"""The one table of schemes the suites test (tests/helpers/schemes.py) is the registry's built-in schemes: a scheme
added without its row fails here, and so does a row whose scheme is gone (the suites would stop testing it)."""

from __future__ import annotations

import pytest
from helpers.schemes import BY_NAME, SCHEMES

import rope_patch
from rope_patch import registry
from rope_patch.specs import parse_scheme_spec


def builtin_schemes() -> dict:
    """name -> class of the listed built-in schemes (a scheme a test registers in this process is not one)."""
    return {name: registry.get_scheme_class(name) for name in registry.list_schemes()
            if registry.get_scheme_class(name).__module__.startswith("rope_patch.schemes.")}


def test_every_registered_scheme_has_a_row_and_every_row_is_registered():
    rows, builtin = [r.name for r in SCHEMES], builtin_schemes()
    assert len(rows) == len(set(rows)), "a scheme has two rows in tests/helpers/schemes.py"
    missing = sorted(set(builtin) - set(rows))
    assert not missing, f"registered schemes without a row in tests/helpers/schemes.py: {missing} (add one each)"
    gone = sorted(set(rows) - set(builtin))
    assert not gone, f"rows of tests/helpers/schemes.py that are no registered scheme: {gone}"


@pytest.mark.parametrize("name", list(BY_NAME))
def test_a_row_is_a_valid_scheme_of_its_family(name):
    row = BY_NAME[name]
    scheme = rope_patch.as_scheme(name, **row.params)
    assert type(scheme).kind == row.family
    assert parse_scheme_spec(row.spec) == scheme  # the row's spec string is the same scheme
