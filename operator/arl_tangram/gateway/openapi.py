"""``/openapi.json``, generated from the route table and the pydantic models it names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from arl_tangram import __version__
from arl_tangram.gateway.models import ErrorBody
from arl_tangram.gateway.routing import QUERY_PARAMS

REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class RouteDoc:
    """What the OpenAPI text says about one route."""

    method: str
    path: str
    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    # Content types other than one JSON object in and out.
    ndjson_in: bool = False
    ndjson_out: bool = False
    text_out: bool = False
    number_out: bool = False
    list_out: bool = False
    open: bool = False
    status: int = 200
    # Query parameters the route takes (``routing.QUERY_PARAMS``); any other is refused.
    query: tuple[str, ...] = ()
    # The status of "bounded wait full, retry after Retry-After": 429, or 503 on the shapes of
    # servers that never answer 429, whose clients take a 4xx as final (verl's reward loop retries
    # a 5xx and gives up on a 4xx at once).
    busy_status: int = 429


def _schema(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, ref_template=REF)
    for name, sub in schema.pop("$defs", {}).items():
        schemas.setdefault(name, sub)
    schemas.setdefault(model.__name__, schema)
    return {"$ref": REF.format(model=model.__name__)}


def openapi(routes: Sequence[RouteDoc]) -> dict[str, Any]:
    """The OpenAPI 3.1 description of ``routes``."""
    schemas: dict[str, Any] = {}
    error = _schema(ErrorBody, schemas)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        op: dict[str, Any] = {"summary": route.summary, "operationId": f"{route.method}_{route.path}"}
        params = [p.strip("{}") for p in route.path.split("/") if p.startswith("{")]
        parameters: list[dict[str, Any]] = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params
        ]
        parameters += [
            {"name": q, "in": "query", "description": QUERY_PARAMS[q], "schema": {"type": "string"}}
            for q in route.query
        ]
        if parameters:
            op["parameters"] = parameters
        if route.request is not None:
            ref = _schema(route.request, schemas)
            kind = "application/x-ndjson" if route.ndjson_in else "application/json"
            desc = "one JSON object per line" if route.ndjson_in else None
            op["requestBody"] = {"required": True, "content": {kind: {"schema": ref}}}
            if desc:
                op["requestBody"]["description"] = desc
        ok: dict[str, Any] = {"description": "OK"}
        if route.response is not None:
            ref = _schema(route.response, schemas)
            if route.list_out:
                ref = {"oneOf": [ref, {"type": "array", "items": ref}]}
            kind = "application/x-ndjson" if route.ndjson_out else "application/json"
            ok["content"] = {kind: {"schema": ref}}
        elif route.text_out:
            ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
        elif route.number_out:
            ok["content"] = {"application/json": {"schema": {"type": "number"}}}
        responses: dict[str, Any] = {str(route.status): ok}
        if not route.open:
            busy = "bounded wait full: retry after Retry-After seconds"
            for status, why in (
                ("400", "malformed JSON, an invalid value or an unknown query parameter (each is named)"),
                ("401", "no valid bearer token"),
                ("403", "RBAC does not allow this in the namespace"),
                ("408", "the body did not all arrive within the gateway's body timeout"),
                (
                    "413",
                    "body over the limit (before it is sent, where the client sends Expect: 100-continue)",
                ),
                ("422", "wrong shape or type (each field is named)"),
                ("429", busy),
                ("503", "standby replica (the leader's address is named) or infrastructure failure"),
            ):
                if status == "429" and route.busy_status != 429:
                    continue
                if status == str(route.busy_status) and status != "429":
                    why = f"{why}, or {busy}"
                responses[status] = {"description": why, "content": {"application/json": {"schema": error}}}
        op["responses"] = responses
        if not route.open:
            op["security"] = [{"bearer": []}]
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "ARL-Tangram gateway", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A Kubernetes ServiceAccount token for the gateway's audience",
                }
            },
        },
    }
