"""Shared helpers of the API tests: the repository's samples and CRDs, and small dict utilities."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
CRDS = ROOT / "crds"
MANIFESTS = ROOT / "manifests"
SAMPLES = MANIFESTS / "samples"


def sample_files() -> list[Path]:
    """Every sample manifest."""
    return sorted(SAMPLES.glob("*.yaml"))


def sample(kind: str) -> dict[str, Any]:
    """A fresh copy of the (single) sample of ``kind``."""
    for path in sample_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == kind:
                return copy.deepcopy(doc)
    raise LookupError(f"no sample of kind {kind}")


def crd_files() -> list[Path]:
    """The checked-in CRD files."""
    return sorted(CRDS.glob("*.yaml"))


def crd_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of the checked-in CRD of ``kind``."""
    for path in crd_files():
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            return schema
    raise LookupError(f"no CRD of kind {kind}")


_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _parts(path: str) -> list[str | int]:
    return [name if name else int(index) for name, index in _PART.findall(path)]


def set_path(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Set ``a.b[2].c`` in ``obj`` (creating missing mappings) and return ``obj``."""
    parts = _parts(path)
    node: Any = obj
    for part in parts[:-1]:
        if isinstance(part, int):
            node = node[part]
        else:
            node = node.setdefault(part, {})
    node[parts[-1]] = value
    return obj


def delete_path(obj: dict[str, Any], path: str) -> dict[str, Any]:
    """Remove ``a.b[2].c`` from ``obj`` and return ``obj``."""
    parts = _parts(path)
    node: Any = obj
    for part in parts[:-1]:
        node = node[part]
    del node[parts[-1]]
    return obj


def walk(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (path, node) for every schema node: properties, items and additionalProperties."""
    yield path, schema
    for name, prop in schema.get("properties", {}).items():
        yield from walk(prop, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting as the API server does it: fill absent fields that have a default."""
    if isinstance(obj, dict) and "properties" in schema:
        for name, prop in schema["properties"].items():
            if name not in obj and "default" in prop:
                obj[name] = copy.deepcopy(prop["default"])
            if name in obj:
                obj[name] = apply_defaults(prop, obj[name])
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in obj]
    return obj


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The CRD schema as plain JSON Schema: x-kubernetes-* keys stripped, unknown fields refused.

    ``additionalProperties: false`` on every object with properties mirrors the API server's strict
    field validation (kubectl's default), which refuses unknown fields instead of pruning them silently.
    """
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-"):
            continue
        if key == "properties":
            out[key] = {name: json_schema(prop) for name, prop in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = json_schema(value)
        else:
            out[key] = value
    if "properties" in out and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out
