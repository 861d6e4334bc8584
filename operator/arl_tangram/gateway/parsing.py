"""Reading request bodies: size, JSON, shape, each failure a 4xx naming the problem."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ValidationError

from arl_tangram.api.meta import TangramModel
from arl_tangram.gateway.config import GatewayConfig

M = TypeVar("M", bound=BaseModel)


class ClientGone(Exception):
    """The client closed the connection before its request body arrived: nobody to answer."""


def unreadable_body(request: web.BaseRequest, exc: RequestPayloadError) -> BadRequest:
    """A body aiohttp could not read (its chunked framing broken after the head: the gateway decodes
    Content-Encoding itself, ``body_coding``), as a 400 saying so. Its stream is marked ended:
    aiohttp would drain the rest after the answer, meet the same error again and log it as an
    unhandled exception (a traceback per bad request). The connection is closed after the answer
    (``app._error_response``): its parser cannot carry another request."""
    request.content.feed_eof()
    cause = exc.__cause__ or exc
    return BadRequest(400, f"the request body could not be read ({cause}); check Transfer-Encoding")


def too_large(config: GatewayConfig) -> BadRequest:
    """The 413 for a body over the limit (read, or announced by ``Content-Length``)."""
    return BadRequest(413, f"request body exceeds the limit of {config.max_body_bytes} bytes")


class BadRequest(Exception):
    """A request refused with ``status`` and a message naming what is wrong (and ``headers`` HTTP
    asks for with that status)."""

    def __init__(
        self,
        status: int,
        message: str,
        detail: list[dict[str, Any]] | None = None,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail
        self.field = field
        self.headers = headers or {}


# The content codings a request body may come in (RFC 9110 8.4.1.3: ``x-gzip`` is gzip). The gateway
# decodes them itself (``build_gateway_app`` turns aiohttp's decoding off): aiohttp answered a coding
# it cannot decode (``br``, ``zstd``) with a plain-text 400 and a logged traceback before any handler
# saw the request, and passed one it does not know (``foo``, a chain such as ``gzip, br``) through
# undecoded, so a body that was not plain ran as if it were.
BODY_CODINGS = ("identity", "gzip", "x-gzip", "deflate")
# Set on a request whose body could not be decoded: its connection is closed after the answer
# (``app._error_response``), as after any body whose rest is not read.
BODY_UNDECODABLE: web.RequestKey[bool] = web.RequestKey("body_undecodable", bool)
# Where decoding stops to hand a piece on: a small compressed body may decode to gigabytes.
_DECODE_PIECE = 1 << 16


def body_coding(request: web.BaseRequest) -> str | None:
    """The request body's content coding (``gzip`` or ``deflate``; None for a plain body), or 415
    naming the coding sent and those accepted (in ``Accept-Encoding`` too, as RFC 9110 15.5.16 asks).
    One coding at a time: a chain (``gzip, gzip``) is refused, as each stage would need a bound of
    its own and no trainer's client sends one."""
    sent = ", ".join(request.headers.getall(hdrs.CONTENT_ENCODING, []))
    codings = [c.strip().lower() for c in sent.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in BODY_CODINGS:
        return "gzip" if codings[0] == "x-gzip" else codings[0]
    accepted = ", ".join(BODY_CODINGS)
    why = "a chain of codings" if len(codings) > 1 else "an unsupported coding"
    raise BadRequest(
        415,
        f"Content-Encoding {sent[:80]!r} is {why}: send the body as one of {accepted}",
        field="Content-Encoding",
        headers={hdrs.ACCEPT_ENCODING: accepted},
    )


class BodyDecoder:
    """Decodes a gzip or deflate body as it comes; each failure a 400 naming Content-Encoding."""

    def __init__(self, coding: str, request: web.BaseRequest) -> None:
        self.coding = coding
        self.request = request
        self._inflate: Any = None  # zlib's decompress object, made on the first byte (see feed)

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The decoded bytes of ``data``, in pieces of at most ``_DECODE_PIECE`` bytes."""
        while data:
            if self._inflate is None or self._inflate.eof:
                if self._inflate is not None and self.coding != "gzip":
                    raise self._error("data after the end of the deflate stream")
                if self._inflate is not None:
                    # Zero padding after a gzip member, which Python's gzip skips (between members
                    # too): skipped wherever the chunks of the body happen to end.
                    data = data.lstrip(b"\0")
                    if not data:
                        return
                # deflate is zlib's format (RFC 9110), yet some clients send raw deflate: told
                # apart by the first byte, as browsers and aiohttp do. gzip may hold several members.
                wbits = 16 + zlib.MAX_WBITS if self.coding == "gzip" else zlib.MAX_WBITS
                if self.coding == "deflate" and data[0] & 0x0F != 8:
                    wbits = -zlib.MAX_WBITS
                self._inflate = zlib.decompressobj(wbits)
            while True:
                try:
                    piece = self._inflate.decompress(data, _DECODE_PIECE)
                except zlib.error as exc:
                    raise self._error(str(exc)) from None
                data = self._inflate.unconsumed_tail
                if piece:
                    yield piece
                # A full piece may leave output inside zlib with no input left to feed it.
                if not data and (len(piece) < _DECODE_PIECE or self._inflate.eof):
                    break
            data = self._inflate.unused_data

    def end(self) -> None:
        """The body ended: 400 when its coded stream did not (a truncated body). An empty body is
        left to be refused as empty."""
        if self._inflate is not None and not self._inflate.eof:
            raise self._error("the body ends before its compressed stream does")

    def _error(self, why: str) -> BadRequest:
        self.request[BODY_UNDECODABLE] = True
        return BadRequest(
            400, f"the request body could not be decoded as {self.coding} ({why}); check Content-Encoding"
        )


def decode_body(request: web.BaseRequest, raw: bytes, config: GatewayConfig) -> bytes:
    """``raw`` decoded as the request's Content-Encoding says, 413 past ``max_body_bytes`` decoded."""
    coding = body_coding(request)
    if coding is None:
        return raw
    decoder = BodyDecoder(coding, request)
    out = bytearray()
    for piece in decoder.feed(raw):
        out += piece
        if len(out) > config.max_body_bytes:
            raise too_large(config)
    decoder.end()
    return bytes(out)


async def body_chunks(request: web.BaseRequest) -> AsyncIterator[bytes]:
    """The request body as it comes, decoded (see ``body_coding``); not bounded in all (a stream
    bounds its lines), only piece by piece."""
    coding = body_coding(request)
    decoder = None if coding is None else BodyDecoder(coding, request)
    async for chunk in request.content.iter_any():
        if decoder is None:
            yield chunk
            continue
        for piece in decoder.feed(chunk):
            yield piece
    if decoder is not None:
        decoder.end()


async def read_body(request: web.Request, config: GatewayConfig) -> bytes:
    """The body's bytes, decoded (``decode_body``): 413 past ``max_body_bytes``, 408 when it has not
    all arrived within ``body_timeout_s``."""
    return decode_body(request, await _read_raw(request, config), config)


async def _read_raw(request: web.Request, config: GatewayConfig) -> bytes:
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


async def read_json(request: web.Request, config: GatewayConfig, *, unique_keys: bool = False) -> Any:
    """The body as JSON (see ``read_body``); 400 when it is not JSON (see ``loads``)."""
    return loads(await read_body(request, config), unique_keys=unique_keys)


def loads(raw: bytes | str, *, unique_keys: bool = False) -> Any:
    """``raw`` as JSON; 400 naming what is wrong. ``unique_keys``: a key twice in one object is
    refused too (the native API's bodies: the API server refuses a field twice in a custom resource
    too); the trainers' shapes take the last, as their owners' servers (Python's JSON) do."""
    if not raw:
        raise BadRequest(400, "empty body: a JSON object is expected")
    try:
        data = json.loads(raw, object_pairs_hook=_unique_keys if unique_keys else None)
    except _DuplicateKey as exc:
        raise BadRequest(
            400, f"malformed JSON: the key {exc.key[:80]!r} appears twice in one object; send it once"
        ) from None
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


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict, refusing a key sent twice: Python's JSON kept the last value
    without a word (``"payload"`` twice ran the second), while another parser on the way (a proxy,
    an audit log) may read the first, and RFC 8259 leaves which one to the parser."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
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
    return validate(model, await read_json(request, config, unique_keys=issubclass(model, TangramModel)))
