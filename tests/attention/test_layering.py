"""The attention package's layering, on its source: no module under rope_patch/attention (nor rope_patch/discovery.py)
hides a dependency on a sibling in a function-level `from .` / `from ..` import, and each module imports on its own in
a fresh interpreter, without the package's __init__ having loaded its siblings first (a cycle between modules would
fail there, in one order or another)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rope_patch"
CHECKED = [*sorted((PACKAGE / "attention").glob("*.py")), PACKAGE / "discovery.py"]

# (module path relative to rope_patch/, enclosing function) -> why the relative import must stay inside it. Empty:
# a lazy import of a heavy third-party module (transformers' flex integration in flex.py) is not relative.
ALLOWED: dict[tuple[str, str], str] = {}


def _function_level_relative_imports(path: Path) -> list[tuple[str, int, str]]:
    """(enclosing function, line, source) of every relative import inside a function or method of `path`."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
            elif isinstance(child, ast.ImportFrom) and child.level and function is not None:
                found.append((function, child.lineno, ast.unparse(child)))
            else:
                visit(child, function)

    visit(ast.parse(path.read_text(encoding="utf-8")), None)
    return found


@pytest.mark.parametrize("path", CHECKED, ids=[str(p.relative_to(PACKAGE)) for p in CHECKED])
def test_no_function_level_relative_import(path):
    where = str(path.relative_to(PACKAGE))
    hidden = [f"{where}:{line} in {fn}(): {text}" for fn, line, text in _function_level_relative_imports(path)
              if (where, fn) not in ALLOWED]
    assert not hidden, ("a function-level import hides a dependency between rope_patch's modules: import at the top, "
                        "or move the code to the layer it needs:\n" + "\n".join(hidden))


def test_the_allow_list_names_only_imports_that_exist():
    """An entry outlives its import only by mistake: remove it with the import."""
    present = {(str(p.relative_to(PACKAGE)), fn) for p in CHECKED for fn, _, _ in _function_level_relative_imports(p)}
    assert set(ALLOWED) <= present, sorted(set(ALLOWED) - present)


def test_the_checker_sees_a_function_level_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from . import a\n\ndef f():\n    from .b import c\n\nclass K:\n    def g(self):\n"
                    "        from ..d import e\n")
    assert [(fn, line) for fn, line, _ in _function_level_relative_imports(path)] == [("f", 4), ("g", 8)]


# Loads the module with its package's __init__ left out: an empty package object stands in for
# rope_patch.attention, so the module's own imports alone decide what loads, and in which order.
ALONE = """
import importlib, importlib.util, sys, types
name = sys.argv[1]
package, _, _ = name.rpartition(".")
if package != "rope_patch":
    spec = importlib.util.find_spec(package)
    stub = types.ModuleType(package)
    stub.__path__, stub.__package__ = list(spec.submodule_search_locations), package
    sys.modules[package] = stub
importlib.import_module(name)
"""

MODULES = [f"rope_patch.{p.relative_to(PACKAGE).with_suffix('').as_posix().replace('/', '.')}" for p in CHECKED
           if p.name != "__init__.py"]


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone_in_a_fresh_interpreter(module):
    proc = subprocess.run([sys.executable, "-c", ALONE, module], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_protocol_imports_in_a_fresh_interpreter():
    proc = subprocess.run([sys.executable, "-c", "import rope_patch.attention.protocol"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
