"""The generated CRDs: checked in and current, structural everywhere, complete for kubectl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from api_testkit import CRDS, crd_files, walk

from arl_tangram import cli
from arl_tangram.api import crdgen

# The only places where unknown fields are kept on purpose: embedded PodSpec fragments and payloads.
FREE_FORM = {
    "ActionPool": {".spec.template.podSpec"},
    "RewardModelService": {".spec.server.podSpec"},
    "ActionBatch": {".spec.actions[].payload"},
}
FORBIDDEN_KEYS = {
    "$ref",
    "$defs",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "nullable",
    "uniqueItems",
    "title",
    "const",
}


def _crds() -> dict[str, dict[str, Any]]:
    return {
        yaml.safe_load(p.read_text())["spec"]["names"]["kind"]: yaml.safe_load(p.read_text())
        for p in crd_files()
    }


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_checked_in_files_equal_fresh_output() -> None:
    files = crdgen.render()
    on_disk = {p.name: p.read_text() for p in CRDS.iterdir() if p.is_file()}
    assert on_disk == files, "crds/ is stale: run `make crds`"


def test_file_names() -> None:
    assert sorted(crdgen.render()) == [
        "Kustomization",
        "actionbatches.tangram.arl.dev.yaml",
        "actionpools.tangram.arl.dev.yaml",
        "rewardmodelservices.tangram.arl.dev.yaml",
    ]


def _render_in_a_process(hash_seed: str) -> dict[str, str]:
    code = "import json, sys; from arl_tangram.api import crdgen; json.dump(crdgen.render(), sys.stdout)"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    rendered: dict[str, str] = json.loads(result.stdout)
    return rendered


def test_output_is_the_same_in_every_process() -> None:
    """Set and dict orders hang on string hashing, which differs per process: fresh interpreters with
    other hash seeds (and the checked-in files, written by yet another) must render the same bytes."""
    here = crdgen.render()
    for seed in ("0", "1", "4242"):
        assert _render_in_a_process(seed) == here, f"PYTHONHASHSEED={seed}"


def test_check_passes_on_fresh_output_and_fails_with_a_diff_on_drift(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 0
    capsys.readouterr()
    path = tmp_path / "actionpools.tangram.arl.dev.yaml"
    path.write_text(path.read_text().replace("minHosts must not exceed maxHosts", "anything goes"))
    (tmp_path / "old.tangram.arl.dev.yaml").write_text("kind: Stale\n")
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 1
    out, err = capsys.readouterr()
    assert "-                  message: anything goes" in out
    assert "+                  message: minHosts must not exceed maxHosts" in out
    assert "old.tangram.arl.dev.yaml: not generated" in out
    assert "run `make crds`" in err
    # Writing again repairs the changed file and leaves the others alone.
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert path.read_text() == crdgen.render()[path.name]


def test_check_reports_missing_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crdgen.main(["--out", str(tmp_path / "none"), "--check"]) == 1
    assert "(missing)" in capsys.readouterr().out


def test_tangram_crds_command_is_wired(tmp_path: Path) -> None:
    assert cli.main(["crds", "--out", str(tmp_path)]) == 0
    assert cli.main(["crds", "--out", str(tmp_path), "--check"]) == 0
    assert {p.name for p in tmp_path.iterdir()} == set(crdgen.render())


@pytest.mark.parametrize("kind", sorted(FREE_FORM))
def test_every_node_is_structural(kind: str) -> None:
    schema = _schema(_crds()[kind])
    preserved = set()
    for path, node in walk(schema):
        assert "type" in node, f"{kind}{path}: no type"
        assert not FORBIDDEN_KEYS & node.keys(), f"{kind}{path}: {FORBIDDEN_KEYS & node.keys()}"
        assert not isinstance(node.get("additionalProperties"), bool), (
            f"{kind}{path}: additionalProperties bool"
        )
        assert not ("properties" in node and "additionalProperties" in node), f"{kind}{path}: both"
        if node.get("x-kubernetes-preserve-unknown-fields"):
            preserved.add(path)
            assert node["type"] == "object" and "properties" not in node
    assert preserved == FREE_FORM[kind]


@pytest.mark.parametrize("kind", sorted(FREE_FORM))
def test_every_field_is_explained_and_bounded(kind: str) -> None:
    """Descriptions feed `kubectl explain`; bounds let the API server estimate CEL costs."""
    schema = _schema(_crds()[kind])
    for path, node in walk(schema):
        if path in ("", ".metadata", ".apiVersion", ".kind") or path.endswith("{}"):
            continue
        # Scalar list items are explained by their list's description.
        scalar_item = path.endswith("[]") and node["type"] not in ("object", "array")
        assert scalar_item or node.get("description"), f"{kind}{path}: no description"
        if node["type"] == "array":
            assert "maxItems" in node, f"{kind}{path}: unbounded list"
        if node["type"] == "string" and "enum" not in node and node.get("format") != "date-time":
            assert "maxLength" in node, f"{kind}{path}: unbounded string"
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), f"{kind}{path}: map keys not required"
        if "required" in node:
            assert set(node["required"]) <= set(node["properties"]), f"{kind}{path}: unknown required"


@pytest.mark.parametrize("kind", sorted(FREE_FORM))
def test_optional_fields_are_never_null(kind: str) -> None:
    text = yaml.safe_dump(_schema(_crds()[kind]))
    assert "nullable" not in text and "type: 'null'" not in text and "default: null" not in text


def test_names_categories_and_subresources() -> None:
    crds = _crds()
    assert set(crds) == {"ActionPool", "RewardModelService", "ActionBatch"}
    short_names: set[str] = set()
    for kind, crd in crds.items():
        spec = crd["spec"]
        assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
        assert spec["group"] == "tangram.arl.dev" and spec["scope"] == "Namespaced"
        assert spec["names"]["categories"] == ["tangram"]
        assert crd["metadata"]["name"] == f"{spec['names']['plural']}.tangram.arl.dev"
        assert spec["names"]["shortNames"] and not short_names & set(spec["names"]["shortNames"])
        short_names |= set(spec["names"]["shortNames"])
        (version,) = spec["versions"]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"]["status"] == {}
        if kind == "ActionBatch":
            assert "scale" not in version["subresources"]
        else:
            scale = version["subresources"]["scale"]
            assert scale == {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            }
            props = version["schema"]["openAPIV3Schema"]["properties"]
            assert props["spec"]["properties"]["replicas"]["type"] == "integer"
            assert props["status"]["properties"]["replicas"]["type"] == "integer"
            assert props["status"]["properties"]["selector"]["type"] == "string"


def _column_type(schema: dict[str, Any], json_path: str) -> str:
    """The schema type at a printer column's JSONPath (metadata is the API server's own)."""
    if json_path == ".metadata.creationTimestamp":
        return "date"
    node = schema
    for part in json_path.split("[?")[0].strip(".").split("."):
        node = node["properties"][part]
        if node["type"] == "array":
            node = node["items"]
    filtered = json_path.split(")].")
    if len(filtered) == 2:
        node = node["properties"][filtered[1]]
    return str(node["type"])


def test_printer_columns_show_readiness_counters_and_age() -> None:
    for kind, crd in _crds().items():
        version = crd["spec"]["versions"][0]
        columns = version["additionalPrinterColumns"]
        names = [c["name"] for c in columns]
        condition = "Complete" if kind == "ActionBatch" else "Ready"
        assert names[:2] == [condition, "Reason"] and names[-1] == "Age"
        assert columns[0]["jsonPath"] == f'.status.conditions[?(@.type=="{condition}")].status'
        assert columns[1]["jsonPath"] == f'.status.conditions[?(@.type=="{condition}")].reason'
        assert columns[-1] == {
            "name": "Age",
            "jsonPath": ".metadata.creationTimestamp",
            "type": "date",
            "description": "Time since creation.",
        }
        assert sum(c["type"] == "integer" for c in columns) >= 2
        for column in columns:
            # Every column points at a field that exists in the schema, with the column's type.
            assert _column_type(version["schema"]["openAPIV3Schema"], column["jsonPath"]) == column["type"]


def test_a_reward_model_service_rollout_shows_in_kubectl_get() -> None:
    """A rollout showed only in the Scaling condition: ``kubectl get`` said nothing of how far."""
    version = _crds()["RewardModelService"]["spec"]["versions"][0]
    paths = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"] if not c.get("priority")}
    assert paths["Updated"] == ".status.updatedReplicas"


def test_cel_rules_sit_on_objects_and_name_existing_fields() -> None:
    for kind, crd in _crds().items():
        for path, node in walk(_schema(crd)):
            for rule in node.get("x-kubernetes-validations", []):
                assert node["type"] == "object", f"{kind}{path}"
                assert rule["rule"] and rule["message"]
                if "fieldPath" in rule:
                    target = node
                    for part in rule["fieldPath"].strip(".").split("."):
                        target = target["properties"][part]
                    assert rule["reason"] == "FieldValueInvalid"
