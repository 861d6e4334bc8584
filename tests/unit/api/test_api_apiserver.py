"""The API server's own validation code, run offline, on our CRDs, the samples and the invalid table.

``apiserver/main.go`` links k8s.io/apiextensions-apiserver (the code inside kube-apiserver) and applies
what a create goes through: CRD validation (structural rules, CEL compilation and cost limits), then
per object pruning of unknown fields, defaulting, OpenAPI validation, list uniqueness and CEL rules.
Not a mock: the same Go packages the server runs, at the version pinned in apiserver/go.mod.
``hack/crdvalidate.sh`` builds it (the first time it fetches the pinned modules, as the test bed's
build does, and takes a minute or two); where it cannot be built, as where Go is missing, these tests
fail and say why instead of skipping: they are the only check of what the server-side rules mean.
"""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from api_testkit import ROOT, crd_files, sample
from test_api_invalid import BAD, EDGES, Bad, on_edge, over_edge

from arl_tangram.api import load

BUILD = ROOT / "hack" / "crdvalidate.sh"
# The first build on a fresh machine downloads and compiles the k8s.io modules (pytest's default
# per-test timeout is 300 s).
pytestmark = pytest.mark.timeout(1200)


@cache
def _binary() -> Path:
    """The built validator; fails the test, naming the reason, when it cannot be built."""
    result = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=1100)
    if result.returncode != 0:
        pytest.fail(
            f"{BUILD.relative_to(ROOT)} could not build the validator:\n{result.stderr}", pytrace=False
        )
    return Path(result.stdout.strip().splitlines()[-1])


def _validate(objects: list[dict[str, Any]]) -> dict[str, Any]:
    binary = _binary()
    result = subprocess.run(
        [str(binary), *map(str, crd_files())],
        input=json.dumps(objects),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_api_server_accepts_the_crds() -> None:
    report = _validate([])
    assert sorted(Path(p).name for p in report["crds"]) == sorted(p.name for p in crd_files())
    assert report["crds"] == {str(p): [] for p in crd_files()}


@pytest.mark.parametrize("kind", ["ActionPool", "RewardModelService", "ActionBatch"])
def test_api_server_accepts_the_samples_and_defaults_them_as_the_models_do(kind: str) -> None:
    obj = sample(kind)
    (result,) = _validate([obj])["objects"]
    assert result["errors"] == []
    assert result["object"]["spec"] == load(obj).to_dict()["spec"]


def _broken(bad: Bad) -> dict[str, Any]:
    obj = sample(bad.kind)
    bad.breaks(obj)
    return obj


def test_api_server_refuses_every_invalid_row_and_names_the_field() -> None:
    rows = [b for b in BAD if b.server]
    results = _validate([_broken(b) for b in rows])["objects"]
    for bad, result in zip(rows, results, strict=True):
        errors = result["errors"]
        assert errors, f"the API server accepts {bad.name}"
        # A malformed quantity is reported once, by the pattern, not again by a CEL rule.
        assert not any("quantities must match" in e for e in errors), errors
        # The server names the field as the models do (list-map duplicates: the item; root rules: none).
        named = bad.field.removesuffix(".id") if "duplicate action" in bad.message else bad.field
        text = "\n".join(errors)
        assert named in text or bad.message in text, f"{bad.name}: {errors}"
        if not bad.schema and "duplicate" not in bad.message:
            # A CEL rule: the server's message is the model's message.
            assert bad.message in text, f"{bad.name}: {errors}"


def test_model_only_rows_are_accepted_by_the_server() -> None:
    """Rows marked server=False really are beyond the schema: the models are the only guard there."""
    rows = [b for b in BAD if not b.server and b.field != "apiVersion"]
    results = _validate([_broken(b) for b in rows])["objects"]
    assert rows and all(r["errors"] == [] for r in results)


def test_api_server_accepts_every_edge_row_and_refuses_one_step_over() -> None:
    """The server-side meaning of every CEL rule at its boundary (min == max is accepted, ...)."""
    results = _validate([on_edge(e) for e in EDGES] + [over_edge(e) for e in EDGES])["objects"]
    on, over = results[: len(EDGES)], results[len(EDGES) :]
    for edge, at, past in zip(EDGES, on, over, strict=True):
        assert at["errors"] == [], f"the API server refuses {edge.name}"
        assert any(edge.rule in e for e in past["errors"]), f"{edge.name}, one step over: {past['errors']}"
