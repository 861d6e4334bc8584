"""The CRD reference is generated from the CRDs: every field the API server knows has its row, with
the CRD's own type, default and constraints, and ``--check`` catches a stale file."""

from __future__ import annotations

from pathlib import Path

import pytest

from arl_tangram.api.crdgen import KINDS, Kind, crd, main
from arl_tangram.api.docgen import fields, render


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_field_of_every_kind_has_its_row(kind: Kind) -> None:
    text = render()
    schema = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    section = text.split(f"## {kind.name}\n", 1)[1].split("\n## ", 1)[0]
    for part in ("spec", "status"):
        paths = [p for p, _, _ in fields(schema["properties"][part], part)]
        assert paths, part
        for path in paths:
            assert f"| `{path}`" in section, path


def test_a_row_carries_the_crds_default_and_constraints() -> None:
    row = next(line for line in render().splitlines() if line.startswith("| `spec.mode` |"))
    assert '`"shared"`' in row and "one of `shared`, `dedicated`" in row


def test_check_fails_on_a_stale_reference_and_passes_on_a_fresh_one(tmp_path: Path) -> None:
    doc = tmp_path / "crd-reference.md"
    assert main(["--docs", str(doc), "--check"]) == 1  # missing
    assert main(["--docs", str(doc)]) == 0
    assert main(["--docs", str(doc), "--check"]) == 0
    doc.write_text(doc.read_text().replace("| `spec.mode` |", "| `spec.moda` |"))
    assert main(["--docs", str(doc), "--check"]) == 1


def test_the_checked_in_reference_is_current() -> None:
    checked_in = Path(__file__).resolve().parents[3] / "docs" / "crd-reference.md"
    assert checked_in.read_text() == render(), "run `make crds`"
