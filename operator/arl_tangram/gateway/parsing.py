"""Reading request bodies: size, JSON, shape, each failure a 4xx naming the problem."""

from __future__ import annotations

import asyncio
import copy
import json
import re
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ValidationError

from arl_tangram.api.meta import TangramModel
from arl_tangram.gateway.config import GatewayConfig

M = TypeVar("M", bound=BaseModel)


class ClientGone(Exception):
    """The client closed the connection before its request body arrived: nobody to answer."""


def unreadable_body(request: web.BaseRequest, exc: RequestPayloadError) -> BadRequest:
    """A body aiohttp could not decode (a corrupt ``Content-Encoding``), as a 400 saying so. Its
    stream is marked ended: aiohttp would drain the rest after the answer, meet the same error
    again and log it as an unhandled exception (a traceback per bad request). The connection is
    closed after the answer (``app._error_response``): its parser cannot carry another request."""
    request.content.feed_eof()
    cause = exc.__cause__ or exc
    return BadRequest(400, f"the request body could not be decoded ({cause}); check Content-Encoding")


def too_large(config: GatewayConfig) -> BadRequest:
    """The 413 for a body over the limit (read, or announced by ``Content-Length``)."""
    return BadRequest(413, f"request body exceeds the limit of {config.max_body_bytes} bytes")


class BadRequest(Exception):
    """A request refused with ``status`` and a message naming what is wrong."""

    def __init__(
        self, status: int, message: str, detail: list[dict[str, Any]] | None = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail
        self.field = field


async def read_body(request: web.Request, config: GatewayConfig) -> bytes:
    """The body's bytes: 413 past ``max_body_bytes``, 408 when it has not all arrived within
    ``body_timeout_s``."""
    try:
        if request.content.is_eof():  # all of it came with the head (most bodies): nothing to time
            return await request.read()
        async with asyncio.timeout(config.body_timeout_s):  # no task per request, as wait_for makes
            return await request.read()
    except TimeoutError as exc:
        raise BadRequest(
            408, f"the request body did not arrive within {config.body_timeout_s:g} seconds"
        ) from exc
    except web.HTTPRequestEntityTooLarge as exc:
        raise too_large(config) from exc
    except RequestPayloadError as exc:
        raise unreadable_body(request, exc) from exc
    except ConnectionResetError as exc:  # aiohttp's "Connection lost" mid-body
        raise ClientGone(str(exc)) from exc


async def read_json(request: web.Request, config: GatewayConfig) -> Any:
    """The body as JSON (see ``read_body``); 400 when it is not JSON."""
    return loads(await read_body(request, config))


def loads(raw: bytes | str) -> Any:
    if not raw:
        raise BadRequest(400, "empty body: a JSON object is expected")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError: syntax, encoding, or an integer past Python's digit limit; RecursionError:
        # nesting deeper than the decoder goes.
        raise BadRequest(400, f"malformed JSON: {exc}") from exc
    # JSON may escape a lone UTF-16 surrogate ("\\ud800"), which decodes to a str that cannot be
    # encoded again, so it would fail later, far from here (a 500). Only bodies with such an escape
    # pay for the walk.
    if _SURROGATE_ESCAPE.search(raw if isinstance(raw, bytes) else raw.encode(errors="surrogatepass")):
        where = _surrogate_at(data, "")
        if where is not None:
            raise BadRequest(
                400,
                f"{where or 'the body'}: invalid Unicode (a lone UTF-16 surrogate escape)",
                field=where or None,
            )
    return data


def _surrogate_at(value: Any, path: str) -> str | None:
    """The dotted path of the first string (or key) holding a lone surrogate; None when none does."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        here = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _surrogate_at(key, here) is not None:
            return here
        found = _surrogate_at(item, here)
        if found is not None:
            return found
    return None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _strictly(model: type[M], data: dict[str, Any]) -> M:
    """``data`` as ``model``, strictly, except that a whole float (``30.0``) where an integer is
    expected is taken as that integer: JSON does not tell them apart (JSON Schema calls both
    integers, and a trainer's timeout is often computed in floats)."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        wholes = [
            err["loc"]
            for err in exc.errors()
            if err["type"] == "int_type" and type(err["input"]) is float and err["input"].is_integer()
        ]
        fixed = copy.deepcopy(data) if wholes else None
        if fixed is None or not all(_set_int(fixed, loc) for loc in wholes):
            raise
    return model.model_validate(fixed, strict=True)


def _set_int(data: Any, loc: tuple[int | str, ...]) -> bool:
    """Make the float at ``loc`` (an error's path into the input) an int; False where the path
    does not lead to it (a union member's name in the path)."""
    for step in loc[:-1]:
        try:
            data = data[step]
        except (KeyError, IndexError, TypeError):
            return False
    last = loc[-1] if loc else None
    try:
        value = data[last]
    except (KeyError, IndexError, TypeError):
        return False
    if type(value) is not float:
        return False
    data[last] = int(value)
    return True


def validate(model: type[M], data: Any, where: str = "") -> M:
    """``data`` as ``model``; 422 naming each wrong field (its dotted path) otherwise.

    The native API's models (``TangramModel``: the ActionBatch action and the gateway's own bodies)
    are validated strictly, as the API server validates the same fields of a custom resource: no
    ``true`` or ``"5"`` for a number (``timeoutSeconds: true`` was one second). The trainers' shapes
    keep their owners' parsing (vLLM, SandboxFusion and the reward servers coerce as pydantic's
    default does), so a client that works against them works here."""
    if not isinstance(data, dict):
        raise BadRequest(422, f"{where or 'the body'} must be a JSON object, not {type(data).__name__}")
    try:
        return _strictly(model, data) if issubclass(model, TangramModel) else model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        locs = [_field_path(data, err["loc"], err["type"]) for err in errors]
        detail = [
            {"loc": [where, *loc] if where else list(loc), "msg": err["msg"], "type": err["type"]}
            for err, loc in zip(errors, locs, strict=True)
        ]
        summary = "; ".join(f"{'.'.join(map(str, d['loc'])) or '(body)'}: {d['msg']}" for d in detail[:5])
        more = f" (and {len(detail) - 5} more)" if len(detail) > 5 else ""
        # The field within the object (a stream line's number is said apart from its field).
        first = ".".join(map(str, locs[0])) if locs else None
        raise BadRequest(422, f"invalid request: {summary}{more}", detail, first) from exc


def _field_path(data: Any, loc: tuple[int | str, ...], error_type: str) -> tuple[int | str, ...]:
    """An error's path as the caller's fields: pydantic puts the member of a union it tried in the
    path (``input.function-after[_encodable(), str]`` for ``input: str | list[str]``), which names
    no field the caller sent. A step is kept where it leads into the data, or, last, names the field
    found missing; any other step is such a member and is left out."""
    path: list[int | str] = []
    node = data
    for i, step in enumerate(loc):
        child = _child(node, step)
        if child is not _ABSENT:
            node = child
        elif not (error_type == "missing" and i == len(loc) - 1):
            continue
        path.append(step)
    return tuple(path)


_ABSENT = object()


def _child(node: Any, step: int | str) -> Any:
    """``node[step]`` where the data has it (a key of an object, an index of an array), else
    ``_ABSENT``."""
    if isinstance(node, dict):
        return node.get(step, _ABSENT)
    if isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
        return node[step]
    return _ABSENT


async def parse(request: web.Request, model: type[M], config: GatewayConfig) -> M:
    """The body validated as ``model``."""
    return validate(model, await read_json(request, config))
