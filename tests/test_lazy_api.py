"""`import rope_patch` imports nothing heavy (PEP 562: the public names load on first use), and the public API
behaves as with eager imports: attribute access, `from rope_patch import ...`, dir(), submodules, type checkers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import rope_patch

INIT = Path(rope_patch.__file__)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def test_import_rope_patch_imports_neither_torch_nor_transformers():
    proc = run("import sys, rope_patch; rope_patch.__version__; "
               "heavy = [m for m in ('torch', 'transformers', 'numpy', 'rope_patch.api') if m in sys.modules]; "
               "assert not heavy, heavy")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_library_imports_no_flex_machinery_until_a_flex_path_runs():
    """transformers' flex integration (torch._dynamo's compile machinery) is imported by rope_patch.attention.flex
    only when a flex call runs. Entered through a submodule, the registry still has every built-in scheme."""
    proc = run("import sys; from rope_patch.specs import parse_scheme_spec; assert parse_scheme_spec('pi:4').name == "
               "'linear'; import rope_patch; rope_patch.apply, rope_patch.save_pretrained, rope_patch.suggest; "
               "import rope_patch.attention.flex; "
               "assert 'transformers.integrations.flex_attention' not in sys.modules")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_public_name_resolves():
    namespace: dict = {}
    exec("from rope_patch import *", namespace)
    for name in rope_patch.__all__:
        value = getattr(rope_patch, name)
        assert namespace[name] is value
        assert getattr(value, "__module__", "").startswith("rope_patch."), name
    assert set(rope_patch.__all__) <= set(dir(rope_patch)) and "__version__" in dir(rope_patch)
    assert not {"importlib", "types", "sys", "TYPE_CHECKING", "Any"} & set(dir(rope_patch))
    from rope_patch import FrequencyScheme, Scheme, apply

    assert apply is rope_patch.apply and issubclass(FrequencyScheme, Scheme)


def test_submodules_load_on_attribute_access_and_unknown_names_fail():
    assert rope_patch.discovery.find_target  # as when the package imported its submodules eagerly
    assert rope_patch.api.patch_modules
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        rope_patch.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from rope_patch import no_such_name", {})


def test_suggest_stays_the_function_when_its_module_is_imported():
    import rope_patch.suggest as bound  # the import system binds the submodule on the package: the function wins

    assert callable(rope_patch.suggest) and rope_patch.suggest.__name__ == "suggest"
    assert bound is rope_patch.suggest  # `import a.b as m` reads the attribute, as with the eager imports
    assert sys.modules["rope_patch.suggest"].specs_for_target


def _type_checking_imports() -> dict[str, str]:
    """name -> module of the `if TYPE_CHECKING:` block of rope_patch/__init__.py (what mypy reads)."""
    tree = ast.parse(INIT.read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    return {a.asname or a.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for a in node.names}


def test_the_type_checking_block_is_the_lazy_table():
    """Static type checkers read the TYPE_CHECKING imports, the runtime the _EXPORTS table: they must agree."""
    assert _type_checking_imports() == rope_patch._EXPORTS
    assert set(rope_patch._EXPORTS) == set(rope_patch.__all__)
