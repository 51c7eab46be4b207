"""`python -m rope_patch.cli ...` = `rope-patch ...`."""

import sys

from .main import main

sys.exit(main())
