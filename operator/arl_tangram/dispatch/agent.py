"""The operator's HTTP client of sandbox agents: one keep-alive pool for all hosts, errors sorted.

Every failure is one of two kinds, and the dispatcher treats them differently:
- :class:`~arl_tangram.errors.InfrastructureError`: the host could not be reached, answered 5xx or
  answered something that is not the agent's JSON. The action may be retried elsewhere, except
  after :class:`Unreachable` (the call may have reached the agent, which may still run it): that
  agent is asked by the action's key first (see the dispatcher's ``_settle``).
- :class:`AgentRefused`: the agent understood the request and refused it (4xx). Retrying the same
  request cannot help; the action fails with the agent's message.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import quote

from arl_tangram.dispatch.http1 import ConnectError, ExchangeError, Http1Client
from arl_tangram.domain.actions import SANDBOXFUSION_WIRES, Wire
from arl_tangram.errors import InfrastructureError

KEY_HEADER = "X-Tangram-Action-Key"
CORES_HEADER = "X-Tangram-Cores"
REPLAYED_HEADER = "X-Tangram-Replayed"
# Beyond an action's own timeout, how long the agent may take to answer (kill, collect, respond)
# before the host counts as unresponsive.
ANSWER_MARGIN_S = 15.0
# The statuses by which an agent refuses a request it understood (bad payload, conflict, too large):
# a retry of the same request cannot help.
REFUSALS = frozenset({400, 409, 413, 422})
# Routes an agent of an older image lacks: its 404 there is the pool's image, not a failing host
# (counted as one, every notebook sent to such a pool took one of its hosts out).
NEWER_ROUTES = frozenset({"/run_jupyter"})
# Control calls (health, sessions, in-flight lists) are small: a host that takes longer is unhealthy.
CONTROL_TIMEOUT_S = 5.0

Lookup = Literal["done", "running", "unknown"]


class ConnectFailed(InfrastructureError):
    """No connection to the agent: the call never reached it. ``refused``: the host answered that
    nothing listens on the agent's port (the agent is gone, and the actions it ran died with it,
    by their parent-death signal); otherwise the host itself did not answer."""

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class Unreachable(InfrastructureError):
    """The connection failed or timed out once the call was on its way: the agent may have it."""


class AgentRefused(Exception):
    """The agent refused the request with a 4xx; ``status`` and ``body`` are its answer."""

    def __init__(self, status: int, body: Mapping[str, Any]) -> None:
        message = body.get("error") or body.get("message") or json.dumps(body)[:300]
        super().__init__(f"agent answered {status}: {message}")
        self.status = status
        self.body = body


class AgentClient:
    """Calls sandbox agents at ``host:port`` addresses. Create once, inside the running loop."""

    def __init__(self, token: str | None = None, max_connections: int = 512) -> None:
        self._token = token
        self._max_connections = max_connections
        self._client: Http1Client | None = None

    def _http(self) -> Http1Client:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
            self._client = Http1Client(self._max_connections, headers)
        return self._client

    async def close(self) -> None:
        # Detached first: a call made while it closes gets a new pool, not a closed one.
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def _call(
        self,
        method: str,
        address: str,
        target: str,
        *,
        timeout_s: float,
        body: Mapping[str, Any] | bytes | None = None,
        headers: Mapping[str, str] | None = None,
        accept: tuple[int, ...] = (200,),
    ) -> tuple[int, dict[str, Any], bytes]:
        """The agent's status and JSON object, and that object as the agent encoded it."""
        url = f"http://{address}{target}"
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        try:
            resp = await self._http().request(
                method, address, target, body=data, headers=headers, timeout_s=timeout_s
            )
        except ConnectError as exc:
            raise ConnectFailed(f"{method} {url}: {exc}", exc.errno == errno.ECONNREFUSED) from exc
        except TimeoutError as exc:
            raise Unreachable(f"{method} {url}: no answer within {timeout_s:g} s") from exc
        except (ExchangeError, OSError) as exc:
            raise Unreachable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        raw, status = resp.body, resp.status
        if status == 404 and target in NEWER_ROUTES:
            message = f"this pool's sandbox agent does not serve {target}: its image predates it"
            raise AgentRefused(404, {"status": "SandboxError", "message": message, "error": message})
        try:
            # UTF-8, as JSON between systems is (RFC 8259): no sniffing of other encodings per call.
            parsed = json.loads(raw.decode()) if raw else {}
        except ValueError:
            parsed = None
        if status >= 500 or status == 429:
            detail = parsed if isinstance(parsed, dict) else raw[:200]
            raise InfrastructureError(f"{method} {url}: agent answered {status}: {detail!r}")
        if not isinstance(parsed, dict):
            raise InfrastructureError(f"{method} {url}: the answer is not a JSON object: {raw[:200]!r}")
        if status not in accept:
            if status in REFUSALS:
                raise AgentRefused(status, parsed)
            # Anything else (404 for a route every agent has, 401, 405...) means whoever answered is
            # not the agent this address was given to (a pod's address reused, a proxy in between).
            raise InfrastructureError(
                f"{method} {url}: unexpected status {status}: {json.dumps(parsed)[:200]}"
            )
        return status, parsed, raw

    async def execute(
        self,
        address: str,
        payload: Mapping[str, Any],
        *,
        key: str,
        cores: tuple[int, ...],
        wire: Wire,
        timeout_s: float,
        session_id: str | None = None,
        encoded: bytes | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        """Run one action on the agent with exactly ``cores``; returns the agent's response body,
        parsed and as it came. ``encoded``: a SandboxFusion payload as JSON bytes, sent as they
        are (the agent parses them as the caller's own body, with no second encoding)."""
        headers = {KEY_HEADER: key}
        body: Mapping[str, Any] | bytes
        if wire in SANDBOXFUSION_WIRES:
            headers[CORES_HEADER] = ",".join(str(c) for c in cores)
            target, body = f"/{wire}", dict(payload) if encoded is None else encoded
        else:
            target = "/v1/execute"
            body = {**payload, "cores": list(cores)}
            if session_id is not None:
                body["session_id"] = session_id
        _, parsed, raw = await self._call(
            "POST", address, target, timeout_s=timeout_s + ANSWER_MARGIN_S, body=body, headers=headers
        )
        return parsed, raw

    async def result(self, address: str, key: str, wait_s: float) -> dict[str, Any] | None:
        """The stored response of a keyed action (None while it still runs, or when it is unknown:
        :meth:`inflight` or :meth:`lookup` tell the two apart)."""
        _, body = await self.lookup(address, key, wait_s)
        return body

    async def lookup(self, address: str, key: str, wait_s: float) -> tuple[Lookup, dict[str, Any] | None]:
        """Where a keyed action stands on the agent, waiting up to ``wait_s`` for it to finish:
        ``done`` with its stored response, ``running``, or ``unknown`` (the agent never got it, or
        its result has expired there)."""
        status, parsed, _ = await self._call(
            "GET",
            address,
            f"/v1/actions/{quote(key, safe='')}?wait={wait_s:g}",
            timeout_s=wait_s + CONTROL_TIMEOUT_S,
            accept=(200, 202, 404),
        )
        if status == 200:
            return "done", parsed
        return ("running" if status == 202 else "unknown"), None

    async def inflight(self, address: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """Keys running on the agent (with the cores each holds), and keys it finished recently (and
        still holds the results of)."""
        _, parsed, _ = await self._call("GET", address, "/v1/actions", timeout_s=CONTROL_TIMEOUT_S)
        running = {
            str(a["key"]): tuple(int(c) for c in a.get("cores") or ())
            for a in parsed.get("running", [])
            if isinstance(a, dict) and "key" in a
        }
        finished = {str(a["key"]) for a in parsed.get("finished", []) if isinstance(a, dict) and "key" in a}
        return running, finished

    async def cancel(self, address: str, key: str) -> bool:
        """Kill a running keyed action; False when it was not running there."""
        status, _, _ = await self._call(
            "DELETE",
            address,
            f"/v1/actions/{quote(key, safe='')}",
            timeout_s=CONTROL_TIMEOUT_S,
            accept=(200, 404, 409),
        )
        return status == 200

    async def create_session(self, address: str, *, persistent: bool, ttl_s: float) -> str:
        _, parsed, _ = await self._call(
            "POST",
            address,
            "/v1/sessions",
            timeout_s=CONTROL_TIMEOUT_S * 6,  # a persistent interpreter starts with the session
            body={"persistent": persistent, "ttl_s": ttl_s},
            accept=(200, 201),
        )
        sid = parsed.get("session_id") or parsed.get("id")
        if not isinstance(sid, str):
            raise InfrastructureError(f"agent at {address} created a session without an id: {parsed!r}")
        return sid

    async def close_session(self, address: str, sid: str) -> None:
        await self._call(
            "DELETE",
            address,
            f"/v1/sessions/{quote(sid, safe='')}",
            timeout_s=CONTROL_TIMEOUT_S,
            accept=(200, 204, 404),
        )

    async def score(self, address: str, service: str, inputs: list[str], timeout_s: float) -> dict[str, Any]:
        """``POST /v1/score`` on a reward runtime (docs/gpu.md)."""
        _, parsed, _ = await self._call(
            "POST",
            address,
            "/v1/score",
            timeout_s=timeout_s,
            body={"service": service, "inputs": inputs},
        )
        return parsed

    async def health(self, address: str) -> dict[str, Any]:
        _, parsed, _ = await self._call("GET", address, "/v1/health", timeout_s=CONTROL_TIMEOUT_S)
        return parsed
