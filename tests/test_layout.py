"""The package's layering, checked on its source: a lower layer never imports a higher one, and no module-level
import cycle exists (imports inside functions are not seen here; the few left are optional packages); and the
repository passes its linter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "rope_patch"

# Lowest first. A module may import its own layer and the ones below (the Development page's tree, docs/development.md,
# draws this).
LAYERS = [
    ("foundation", ["_version", "files", "resources", "registry", "scheme_names", "undo", "rotary", "validation",
                    "discovery", "specs", "zoo", "schema", "fingerprint", "engines", "notices"]),
    ("attention", ["attention"]),
    ("schemes", ["schemes"]),
    ("api", ["api", "lengths", "persistence", "suggest", "serving"]),
    ("analysis / evaluation / training / tuning", ["analysis", "evaluation", "training", "tuning"]),
    ("plots", ["plots"]),
    ("integrations", ["integrations"]),
    ("cli", ["cli"]),
]
LAYER = {name: k for k, (_, names) in enumerate(LAYERS) for name in names}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(module: str) -> bool:
    base = ROOT.parent / module.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def module_imports() -> dict[str, set[str]]:
    """module -> the rope_patch modules it imports at module level (TYPE_CHECKING blocks excluded)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        if "data" in path.relative_to(ROOT).parts:
            continue
        name = _module(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                deps.add(target)
                deps.update(f"{target}.{a.name}" for a in node.names if _exists(f"{target}.{a.name}"))
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        # a module's own packages are imported before it anyway: not an edge of the layering
        out[name] = {d for d in deps if d.startswith("rope_patch.") and not name.startswith(d + ".") and d != name}
    return out


def _layer(module: str) -> int:
    top = module.split(".")[1]
    if top not in LAYER:
        raise AssertionError(f"{module}: add its top-level name {top!r} to LAYERS in tests/test_layout.py")
    return LAYER[top]


GRAPH = module_imports()


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m != "rope_patch"))
def test_no_import_from_a_higher_layer(module):
    mine = _layer(module)
    up = sorted(d for d in GRAPH[module] if _layer(d) > mine)
    assert not up, f"{module} ({LAYERS[mine][0]}) imports {up} from a higher layer"


def test_no_module_level_import_cycle():
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(GRAPH.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(d):], d]))
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


def test_the_checker_sees_imports():
    """Guards the checker itself: known edges are found."""
    assert "rope_patch.rotary" in GRAPH["rope_patch.attention.copies"]
    assert "rope_patch.attention.protocol" in GRAPH["rope_patch.attention.blocked"]
    assert "rope_patch.schemes.base" in GRAPH["rope_patch.api"]


def test_the_repository_passes_its_linter():
    """`make lint` (ruff, configured in pyproject.toml) over every Python folder, so that CI sees what it sees."""
    folders = ["rope_patch", "tests", "bench", "recipes", "eval"]
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", *folders], cwd=ROOT.parent, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
