"""`python -m maru` runs the maru command line."""

import sys

from maru.cli import main

sys.exit(main())
