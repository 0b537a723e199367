import sys

from benchmarks.accelerator.main import main

sys.exit(main())
