"""The API server's own validation code, run offline, on our CRDs, the samples and the invalid table.

``apiserver/main.go`` links k8s.io/apiextensions-apiserver (the code inside kube-apiserver) and applies
what a create goes through: CRD validation (structural rules, CEL compilation and cost limits), then
per object pruning of unknown fields, defaulting, OpenAPI validation, list uniqueness and CEL rules.
Not a mock: the same Go packages the server runs, at the version pinned in apiserver/go.mod. It needs Go
and those modules in the local module cache (the test bed's build fetches them); otherwise it skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from api_testkit import ROOT, crd_files, sample
from test_api_invalid import BAD, Bad

from arl_tangram.api import load

SOURCE = Path(__file__).resolve().parent / "apiserver"
BINARY = ROOT / ".cache" / "crdvalidate"
OFFLINE_HINTS = ("GOPROXY=off", "module lookup disabled", "cannot find module", "missing go.sum entry")
TOOLCHAIN_HINTS = ("requires go >=", "toolchain")


@cache
def _binary() -> Path | str:
    """The built validator, or the reason it cannot be built here."""
    go = shutil.which("go")
    if go is None:
        return "Go is not installed"
    env = {**os.environ, "GOPROXY": "off", "GOFLAGS": "-buildvcs=false -mod=readonly", "CGO_ENABLED": "0"}
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [go, "build", "-o", str(BINARY), "."],
        cwd=SOURCE,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        if any(hint in result.stderr for hint in TOOLCHAIN_HINTS):
            return f"the local Go is older than apiserver/go.mod needs: {result.stderr.strip()[:200]}"
        if any(hint in result.stderr for hint in OFFLINE_HINTS):
            return (
                "the k8s.io Go modules are not in the local module cache (the test bed's build fetches them)"
            )
        raise AssertionError(f"building the validator failed:\n{result.stderr}")
    return BINARY


def _validate(objects: list[dict[str, Any]]) -> dict[str, Any]:
    binary = _binary()
    if isinstance(binary, str):
        pytest.skip(binary)
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
