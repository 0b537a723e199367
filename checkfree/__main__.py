"""`python -m checkfree`: the same as the `checkfree` command."""

import sys

from checkfree.cli import main

sys.exit(main())
