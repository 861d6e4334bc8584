"""``make gpu-check``: imports only what a bare GPU machine has, is read-only, and fails cleanly without
a GPU. Its measurements need an NVIDIA GPU, which the test machines lack; a session on a GPU machine
runs ``make gpu-check`` itself."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "operator" / "arl_tangram"
# What the GPU machine has besides the standard library: torch, nvidia-ml-py, numpy (aiohttp and
# pyyaml too, but the check must not need them).
ALLOWED = ("numpy", "torch", "pynvml", "arl_tangram")

BLOCKER = f"""
import importlib.abc, sys
ALLOWED = set(sys.stdlib_module_names) | {set(ALLOWED)!r}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in ALLOWED:
            raise ImportError(f"blocked import: {{name}}")
        return None
sys.meta_path.insert(0, Refuse())
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(PACKAGE.parent), "PATH": "/usr/bin:/bin"},
    )


def test_the_check_and_the_builtin_gpu_path_import_only_what_they_may() -> None:
    out = _python(
        "before = set(sys.modules)\n"
        "import arl_tangram.gpu.check, arl_tangram.rewards.builtin\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "import json; print(json.dumps(sorted(new - set(sys.stdlib_module_names))))\n"
    )
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)) <= set(ALLOWED)


def test_the_blocker_really_blocks() -> None:
    out = _python("import pydantic\n")
    assert out.returncode != 0 and "blocked import: pydantic" in out.stderr


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.skipif(_nvml_works(), reason="this machine has a working NVML")
def test_without_a_gpu_the_check_says_so_in_one_line() -> None:
    out = _python("import runpy\nrunpy.run_module('arl_tangram.gpu.check', run_name='__main__')\n")
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.startswith("gpu-check: NVML unavailable") and out.stderr.count("\n") == 1


SETTERS = re.compile(r"nvml\w*(Set|Create|Destroy|Reset|Clear|Enable|Disable|Register)\w*")


@pytest.mark.parametrize("module", ["gpu/nvml.py", "gpu/check.py", "gpu/agent.py"])
def test_nothing_on_the_gpu_path_calls_an_nvml_setter(module: str) -> None:
    source = (PACKAGE / module).read_text()
    assert not SETTERS.search(source)
    assert "nvidia-smi" not in source


def test_the_setter_pattern_catches_setters() -> None:
    assert SETTERS.search("pynvml.nvmlDeviceSetMigMode(h, 1)")
    assert SETTERS.search("pynvml.nvmlDeviceCreateGpuInstance(h, 9)")
    assert not SETTERS.search("pynvml.nvmlDeviceGetMigMode(h)")
