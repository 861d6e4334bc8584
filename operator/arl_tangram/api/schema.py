"""From pydantic's JSON Schema to a Kubernetes *structural* OpenAPI v3 schema.

The API server accepts only structural schemas: every node has a type, no ``$ref``, no ``anyOf`` for
optional values, no ``additionalProperties: false``, no ``uniqueItems``. pydantic emits all of these, so
this module rewrites its output: definitions are inlined, ``X | None`` becomes plain ``X`` (optional
fields are simply not required, never ``nullable``), titles are dropped, and free-form objects keep
only ``x-kubernetes-preserve-unknown-fields``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# Keys of pydantic's output that a structural schema must not carry (or that only add noise).
_DROPPED = {"title", "examples"}
_NULL = {"type": "null"}


class SchemaError(ValueError):
    """The model uses a construct that has no structural-schema equivalent."""


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of ``model`` (camelCase property names), definitions inlined."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs: dict[str, Any] = raw.pop("$defs", {})
    return _convert(raw, defs, path=model.__name__, seen=())


def _resolve(ref: str, defs: dict[str, Any], path: str, seen: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    name = ref.removeprefix("#/$defs/")
    if name not in defs:
        raise SchemaError(f"{path}: unresolvable reference {ref}")
    if name in seen:
        # A structural schema is a finite tree: recursive models cannot be expressed.
        raise SchemaError(f"{path}: recursive model {name}")
    return defs[name], name


def _flatten(node: dict[str, Any], defs: dict[str, Any], path: str, seen: tuple[str, ...]) -> dict[str, Any]:
    """Merge $ref, single-part allOf and Optional's anyOf into one node; the outer keys win."""
    node = dict(node)
    if "$ref" in node:
        target, name = _resolve(node.pop("$ref"), defs, path, seen)
        # The referencing node's own keys (description, default) win over the model's.
        return _flatten({**target, **node}, defs, path, (*seen, name))
    if "allOf" in node:
        parts = node.pop("allOf")
        if len(parts) != 1:
            raise SchemaError(f"{path}: allOf with {len(parts)} parts is not supported")
        return _flatten({**parts[0], **node}, defs, path, seen)
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b != _NULL]
        if len(branches) != 1:
            raise SchemaError(f"{path}: unions of several types are not structural; use one type")
        # Optional[X]: the field is simply not required. The null default means "unset", so it goes.
        if "default" in node and node["default"] is None:
            del node["default"]
        return _flatten({**branches[0], **node}, defs, path, seen)
    return node


def _convert(node: dict[str, Any], defs: dict[str, Any], path: str, seen: tuple[str, ...]) -> dict[str, Any]:
    node = _flatten(node, defs, path, seen)
    if "oneOf" in node or node.get("type") == "null":
        raise SchemaError(f"{path}: oneOf and null types are not structural")

    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "properties":
            out[key] = {name: _convert(prop, defs, f"{path}.{name}", seen) for name, prop in value.items()}
        elif key == "items":
            out[key] = _convert(value, defs, f"{path}[]", seen)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = _convert(value, defs, f"{path}{{}}", seen)
            # `false` (extra="forbid") is implied by a structural schema; `true` becomes preserve below.
        elif key == "const":
            out["enum"] = [value]
        elif key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum" and not isinstance(value, bool):
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "uniqueItems":
            raise SchemaError(f"{path}: uniqueItems is refused by the API server; use x-kubernetes-list-type")
        else:
            out[key] = value
    if node.get("additionalProperties") is True and not out.get("x-kubernetes-preserve-unknown-fields"):
        raise SchemaError(f"{path}: free-form object without x-kubernetes-preserve-unknown-fields")
    if out.get("type") == "object" and "properties" in out:
        out.setdefault("required", [])
        if not out["required"]:
            del out["required"]
    return out
