"""The pure layers must not import kopf, kubernetes or aiohttp (checked on the source, statically)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "arl_tangram"
PURE = ["api", "domain", "core", "managers", "planner", "sim"]
FORBIDDEN = {"kopf", "kubernetes", "aiohttp"}


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("layer", PURE)
def test_pure_layer_has_no_io_framework_imports(layer: str) -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(_imported_roots(path) & FORBIDDEN)
        for path in (PACKAGE / layer).rglob("*.py")
        if _imported_roots(path) & FORBIDDEN
    }
    assert not offenders, f"pure layer {layer!r} imports I/O frameworks: {offenders}"


def test_checker_catches_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom kubernetes import client\n")
    assert _imported_roots(bad) & FORBIDDEN == {"kubernetes"}
