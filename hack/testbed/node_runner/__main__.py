"""`python -m node_runner`: the test bed's node runner (see the package docstring)."""

import sys

from .cli import main

sys.exit(main())
