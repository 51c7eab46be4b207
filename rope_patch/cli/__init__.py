"""The `rope-patch` command line: one module per subcommand, each only parsing its arguments and calling the
library (rope_patch.evaluation, rope_patch.plots, rope_patch.persistence, ...), which does the work.

    main.py      the parser, `rope-patch list`, errors as one line
    args.py      argparse types and the RoPE-layout options shared by `plot` and `explain`
    compare.py   models.py   plot.py   explain.py   export.py   sweep.py

`main` is the console script (`rope-patch = "rope_patch.cli:main"`); `python -m rope_patch.cli` runs it too.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
