"""The gateway tests run the real gateway app on loopback in front of the real dispatcher, which
drives real sandbox agents (started by the sandbox tests' harness)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dispatch"))  # dispatch_harness
sys.path.insert(0, str(Path(__file__).resolve().parent))
