"""The test bed's node runner is a package under hack/testbed (not part of arl_tangram): its pure parts
are imported from there, as `python -m node_runner` runs it."""

from __future__ import annotations

import sys
from pathlib import Path

TESTBED = Path(__file__).resolve().parents[3] / "hack" / "testbed"
if str(TESTBED) not in sys.path:
    sys.path.insert(0, str(TESTBED))
