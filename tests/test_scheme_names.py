"""The name table the command line checks scheme specs against without torch (rope_patch.scheme_names): generated
from the scheme classes, committed, and equal to the live registry; its checks give the library's messages."""

from __future__ import annotations

import json

import pytest

from rope_patch import registry, scheme_names
from rope_patch.resources import data_path
from rope_patch.specs import parse_scheme_spec


def test_the_committed_table_is_the_scheme_classes():
    """Adding or changing a scheme touches its class; this test then says the one command that regenerates the table."""
    committed = json.loads(data_path(scheme_names.TABLE).read_text(encoding="utf-8"))
    assert committed == scheme_names.build(), (
        f"rope_patch/data/{scheme_names.TABLE} is out of date with the scheme classes: run "
        f"`{scheme_names.COMMAND}` and commit the file.")
    assert data_path(scheme_names.TABLE).read_text(encoding="utf-8") == scheme_names.render(committed)


def test_the_table_answers_as_the_registry():
    assert scheme_names.list_schemes() == [n for n in registry.list_schemes()
                                           if registry.get_scheme_class(n).__module__.startswith("rope_patch.schemes.")]
    for alias, name in scheme_names.aliases().items():
        assert scheme_names.canonical_name(alias) == registry.canonical_name(alias) == name
    for name in scheme_names.table()["schemes"]:
        assert scheme_names.param_names(name) == registry.param_names(name)
        assert scheme_names.kind(name) == registry.get_scheme_class(name).kind
        assert scheme_names.bare_param(name) == registry.bare_param(name)  # the class's `bare_param`, or None
    assert scheme_names.canonical_name(" Self-Extend ") == "self_extend"


GOOD = ["rope", "yarn:8", "pi:4", "yarn:factor=8,beta_fast=16", "longrope:factor=4,short_factor=1/2,long_factor=2/4",
        "yarn:4+logn",
        "default:1e+6", "self_extend:group_size=4,window_size=64+yarn:2", "nope", "logn:llama4"]
BAD = ["yran:8", "yarn:fctor=2", "nope:3", "yarn:8,8", "self_extend:4+yran", "alibi:max_bas=8",
       "longrope:short_factor=[1,2]", ":8", "yarn:=3", "+logn", "Self-Extnd:2"]


@pytest.mark.parametrize("spec", GOOD)
def test_a_good_spec_passes_the_table(spec):
    scheme_names.check_spec(spec)
    parse_scheme_spec(spec)


@pytest.mark.parametrize("spec", BAD)
def test_a_bad_spec_fails_with_the_message_of_apply(spec):
    """The same error type and words as building the scheme (only the pointer to the list differs)."""
    with pytest.raises((ValueError, TypeError)) as table:
        scheme_names.check_spec(spec)
    with pytest.raises((ValueError, TypeError)) as live:
        parse_scheme_spec(spec)
    assert type(table.value) is type(live.value)
    assert str(table.value) == str(live.value).replace("(see rope_patch.list_schemes())", "(see `rope-patch list`)")


def test_the_command_rewrites_the_table_and_checks_it(tmp_path, monkeypatch, capsys, request):
    request.addfinalizer(scheme_names.table.cache_clear)  # later tests read the real table again
    target = tmp_path / scheme_names.TABLE
    monkeypatch.setattr(scheme_names, "data_path", lambda name: tmp_path / name)
    assert scheme_names.main(["--check"]) == 1  # missing
    assert "run `python -m rope_patch.scheme_names`" in capsys.readouterr().err
    assert scheme_names.main([]) == 0 and json.loads(target.read_text()) == scheme_names.build()
    assert scheme_names.main(["--check"]) == 0
    target.write_text(target.read_text().replace('"pi": "linear"', '"pi": "ntk"'))
    assert scheme_names.main(["--check"]) == 1


@pytest.mark.parametrize("spec", ["yarn:", "yarn:0.5", "self_extend:4"])
def test_values_are_left_to_the_scheme_classes(spec):
    """The table holds names only: a bad or missing value passes the parse-time check and fails when the command
    builds the scheme (before it loads a model)."""
    scheme_names.check_spec(spec)
    with pytest.raises((ValueError, TypeError)):
        parse_scheme_spec(spec)


def test_a_stack_with_an_empty_part_fails_the_parse_time_check():
    """A syntax error, not a value: caught with the names, before the scheme classes load."""
    with pytest.raises(ValueError, match=r"empty part after '\+'"):
        scheme_names.check_spec("yarn:4+")
