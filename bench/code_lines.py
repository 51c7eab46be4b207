"""Code lines of the attention machinery (no docstrings, comments or blank lines): rope_patch/attention/*.py plus the
attention-side scheme modules, at a git revision or in the working tree, and per scheme class.

    python bench/code_lines.py                 # the working tree: per file, total, and the scheme classes
    python bench/code_lines.py --rev ade57bc   # a revision (files it lacks are skipped)

Issue 38's measures: the total against its parent's, and each re-expressed scheme class.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import textwrap
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEME_MODULES = ("absolute", "bias", "cached", "chunked", "common", "dimensions", "multiscale", "positions", "sink",
                  "lm_infinite")
SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    """Lines holding a token of code: docstrings (a body's first string statement), comments and blanks excluded."""
    docs = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in SKIP:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


def classes(source: str) -> dict[str, int]:
    """Each top-level class's code lines, decorators included."""
    text = source.splitlines(keepends=True)
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out[node.name] = code_lines(textwrap.dedent("".join(text[start - 1:node.end_lineno])))
    return out


def sources(rev: str | None) -> dict[str, str]:
    if rev is None:
        paths = sorted((ROOT / "rope_patch" / "attention").glob("*.py"))
        paths += [ROOT / "rope_patch" / "schemes" / f"{m}.py" for m in SCHEME_MODULES]
        return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in paths if p.exists()}
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:rope_patch/attention"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    paths = [f"rope_patch/attention/{n}" for n in listed if n.endswith(".py")]
    paths += [f"rope_patch/schemes/{m}.py" for m in SCHEME_MODULES]
    out = {}
    for path in paths:
        shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode == 0:
            out[path] = shown.stdout
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", help="a git revision (default: the working tree)")
    rev = ap.parse_args().rev
    found = sources(rev)
    total = 0
    for path, source in found.items():
        n = code_lines(source)
        total += n
        print(f"{n:6d}  {path}")
    print(f"{total:6d}  total")
    for path, source in found.items():
        if "/schemes/" in path:
            for name, n in classes(source).items():
                print(f"{n:6d}  {path.rsplit('/', 1)[1]}:{name}")


if __name__ == "__main__":
    main()
