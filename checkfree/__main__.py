"""`python -m checkfree`: the same as the `checkfree` command (the entry point lives above the
library, in cli/main.py; this file only forwards to it)."""

import sys

from cli.main import main

sys.exit(main())
