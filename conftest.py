"""Every ```python block of README.md and docs/**/*.md runs as a test (pytest-markdown-docs), in `make test`.

pyproject's testpaths name README.md and docs/ beside tests/; this hook hands their Markdown files to
pytest-markdown-docs' own collector, so its flag `--markdown-docs` (which would also run the fenced examples of every
docstring in tests/) is not needed. A block marked ```{.python notest} does not run (each says why beside it);
```{.python continuation} runs after the page's previous blocks (the superfences form, which Material renders).
`pytest README.md docs` runs only these. A block's output is shown when it fails, not on every run.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

try:  # a dev extra: without it (`pip install -e .` alone) the Markdown files are simply not collected
    from pytest_markdown_docs._runners import DefaultRunner, register_runner
    from pytest_markdown_docs.plugin import MarkdownTextFile
except ImportError:  # pragma: no cover
    MarkdownTextFile = None

ROOT = Path(__file__).resolve().parent
DOCS = ROOT / "docs"


def pytest_collect_file(file_path: Path, parent):
    # --markdown-docs given: the plugin collects them itself
    if MarkdownTextFile is None or parent.config.option.markdowndocs:
        return None
    path = Path(file_path).resolve()
    if path.suffix == ".md" and (path == ROOT / "README.md" or DOCS in path.parents):
        return MarkdownTextFile.from_parent(parent, path=path)
    return None


def pytest_configure(config):
    """Fence options in the superfences form (`{.python notest}`); the plain form (`python notest`) is read too."""
    if getattr(config.option, "markdowndocs_syntax", None) == "default":
        config.option.markdowndocs_syntax = "superfences"


if MarkdownTextFile is not None:
    @register_runner(default=True)
    class QuietRunner(DefaultRunner):
        """The plugin's default runner with the block's output kept: the plugin turns pytest's capture off around a
        block, so its prints and progress bars would land in the middle of `make test`; here they are attached to the
        error of a block that fails."""

        def runtest(self, test, args, *, asyncio_runner=None):
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    super().runtest(test, args, asyncio_runner=asyncio_runner)
            except BaseException as err:
                if out.getvalue() and hasattr(err, "add_note"):
                    err.add_note("output of the block:\n" + out.getvalue().rstrip())
                raise
