"""The dispatcher's tests drive real sandbox agents, started by the sandbox tests' harness."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox"))
