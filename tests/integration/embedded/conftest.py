"""The embedded-mode tests run ``tangram up`` as a real process and talk to it over real HTTP."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
