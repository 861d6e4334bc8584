"""The pure layers must not import kopf, kubernetes or aiohttp (checked on the source, statically)."""

from __future__ import annotations

import ast
import tomllib
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
    sources = sorted((PACKAGE / layer).rglob("*.py"))
    # A renamed or moved layer would otherwise pass with nothing checked.
    assert len(sources) >= 2, f"pure layer {layer!r} has no modules under {PACKAGE / layer}"
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(_imported_roots(path) & FORBIDDEN)
        for path in sources
        if _imported_roots(path) & FORBIDDEN
    }
    assert not offenders, f"pure layer {layer!r} imports I/O frameworks: {offenders}"


def test_the_layers_are_those_import_linter_checks() -> None:
    """One list for both checks: the contract in pyproject.toml names exactly these layers."""
    config = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "forbidden"]
    assert sorted(contract["source_modules"]) == sorted(f"arl_tangram.{layer}" for layer in PURE)
    assert set(contract["forbidden_modules"]) == FORBIDDEN


def test_checker_catches_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os\nfrom kubernetes import client\nimport aiohttp.web as web\n"
        "def later():\n    import kopf\n\nfrom . import kopf as local\n"
    )
    # Nested and aliased imports count; a relative import of a sibling named kopf is not the framework.
    assert _imported_roots(bad) & FORBIDDEN == {"kubernetes", "aiohttp", "kopf"}
    (tmp_path / "relative.py").write_text("from . import kopf\n")
    assert not _imported_roots(tmp_path / "relative.py") & FORBIDDEN
