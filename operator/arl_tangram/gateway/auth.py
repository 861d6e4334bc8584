"""Who may call the gateway: Kubernetes ServiceAccount tokens, and RBAC on ActionBatches.

A request's bearer token is checked with a TokenReview bound to the gateway's audience (a token
minted for another audience, such as the API server's default, is refused); the identity it names
is then checked with a SubjectAccessReview for ``<verb> actionbatches.tangram.arl.dev`` in the
target's namespace, so that the RBAC which lets someone create ActionBatches in a namespace is the
RBAC that lets them use that namespace's pools through the gateway.

Both answers are cached with a TTL and a bound on entries, so a warm request makes no API call; a
burst of requests with one new token makes one call, not one per request. The blocking kubernetes
client is only ever called through :func:`asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from arl_tangram.errors import TangramError

GROUP = "tangram.arl.dev"
RESOURCE = "actionbatches"
DEFAULT_AUDIENCE = "tangram-gateway"


class Unauthenticated(TangramError):
    """No valid credentials (401): the message says what is missing or wrong."""


class Forbidden(TangramError):
    """Authenticated, but RBAC does not allow it (403): the message names the permission."""


@dataclass(frozen=True)
class Principal:
    """An authenticated caller, as the API server's TokenReview names it."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()


ANONYMOUS = Principal("system:anonymous", groups=("system:unauthenticated",))


class Authenticator(Protocol):
    """Checks tokens and permissions; :class:`KubernetesAuthenticator` is the real one."""

    async def authenticate(self, token: str) -> Principal:
        """The caller the token names; raises :class:`Unauthenticated`."""
        ...

    async def authorize(self, principal: Principal, namespace: str, verb: str) -> None:
        """Returns when ``principal`` may ``verb`` ActionBatches in ``namespace``; raises
        :class:`Forbidden` otherwise."""
        ...


K = TypeVar("K")
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    """A bounded cache whose entries expire; concurrent misses of one key share one lookup.

    Failures are cached too (for ``negative_ttl_s``), so that a client hammering with a bad token
    costs the API server one review per TTL, not one per request.
    """

    def __init__(
        self,
        ttl_s: float,
        negative_ttl_s: float,
        max_entries: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[K, tuple[float, V | None, Exception | None]] = OrderedDict()
        self._pending: dict[K, asyncio.Future[V]] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def get(
        self,
        key: K,
        lookup: Callable[[], Awaitable[V]],
        ttl_s: Callable[[], float | None] | None = None,
    ) -> V:
        """The cached value of ``key``, else ``lookup()``'s, kept for ``ttl_s()`` seconds (at most
        the cache's TTL; None: the cache's). ``ttl_s`` is asked only on a miss, after the lookup:
        what it reads (a token's own expiry) costs nothing on the hits that most calls are."""
        now = self.clock()
        entry = self._entries.get(key)
        if entry is not None and entry[0] > now:
            self.hits += 1
            self._entries.move_to_end(key)
            if entry[2] is not None:
                raise entry[2]
            return entry[1]  # type: ignore[return-value]
        pending = self._pending.get(key)
        if pending is not None:
            self.hits += 1
            return await asyncio.shield(pending)
        self.misses += 1
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            value = await lookup()
            # Inside the try: the callers sharing this lookup hear of its failure too.
            left = None if ttl_s is None else ttl_s()
        except (Unauthenticated, Forbidden) as exc:
            self._store(key, self.clock() + self.negative_ttl_s, None, exc)
            future.set_exception(exc)
            future.exception()  # the waiters (if any) re-raise it; nobody else must be told
            raise
        except BaseException as exc:
            # Not an answer (API server unreachable): not cached, and the waiters fail alike.
            if not isinstance(exc, asyncio.CancelledError):
                future.set_exception(exc)
                future.exception()
            else:
                future.cancel()
            raise
        finally:
            self._pending.pop(key, None)
        keep = self.ttl_s if left is None else max(0.0, min(self.ttl_s, left))
        self._store(key, self.clock() + keep, value, None)
        future.set_result(value)
        return value

    def _store(self, key: K, expires: float, value: V | None, error: Exception | None) -> None:
        self._entries[key] = (expires, value, error)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


def token_expiry(token: str) -> float | None:
    """The ``exp`` claim (Unix seconds) of a JWT, read without verifying it (the TokenReview
    verifies); None when the token is not a JWT with one."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, binascii.Error, RecursionError):
        return None
    exp = claims.get("exp") if isinstance(claims, dict) else None
    if not isinstance(exp, int | float) or isinstance(exp, bool):
        return None
    try:
        return float(exp)
    except OverflowError:  # an integer past any float: no expiry we can read
        return None


class AuthUnavailable(TangramError):
    """The API server could not answer a review (503: try again)."""


class KubernetesAuthenticator:
    """TokenReview and SubjectAccessReview against the API server, cached.

    ``api_client`` is a ``kubernetes.client.ApiClient`` (in the operator, its own credentials: the
    operator's ServiceAccount needs ``create`` on ``tokenreviews`` and ``subjectaccessreviews``).
    """

    def __init__(
        self,
        api_client: Any,
        audience: str = DEFAULT_AUDIENCE,
        *,
        ttl_s: float = 60.0,
        negative_ttl_s: float = 5.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from kubernetes import client

        self.audience = audience
        self._authn = client.AuthenticationV1Api(api_client)
        self._authz = client.AuthorizationV1Api(api_client)
        self.tokens: TtlCache[str, Principal] = TtlCache(ttl_s, negative_ttl_s, max_entries, clock)
        self.reviews: TtlCache[tuple[Principal, str, str], bool] = TtlCache(
            ttl_s, negative_ttl_s, max_entries, clock
        )
        self.api_calls = 0

    async def authenticate(self, token: str) -> Principal:
        # The cache is keyed by a digest: the tokens themselves are not kept in memory.
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()

        def left() -> float | None:
            # A token is never trusted from the cache past its own expiry.
            expires = token_expiry(token)
            return None if expires is None else expires - time.time()

        return await self.tokens.get(digest, lambda: self._review_token(token), left)

    async def authorize(self, principal: Principal, namespace: str, verb: str) -> None:
        await self.reviews.get(
            (principal, namespace, verb), lambda: self._review_access(principal, namespace, verb)
        )

    async def _call(self, fn: Callable[[Any], Any], body: dict[str, Any]) -> Any:
        from kubernetes.client.exceptions import ApiException

        self.api_calls += 1
        try:
            return await asyncio.to_thread(fn, body)
        except ApiException as exc:
            raise AuthUnavailable(f"the API server refused the review ({exc.status} {exc.reason})") from exc
        except Exception as exc:  # urllib3's connection errors and timeouts
            raise AuthUnavailable(f"the API server could not be asked: {exc}") from exc

    async def _review_token(self, token: str) -> Principal:
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [self.audience]},
        }
        review = await self._call(self._authn.create_token_review, body)
        status = review.status
        if status is None or not status.authenticated:
            why = (status.error if status is not None else None) or "not authenticated"
            raise Unauthenticated(f"the bearer token was not accepted for audience {self.audience!r}: {why}")
        if self.audience not in (status.audiences or []):
            raise Unauthenticated(f"the bearer token is not bound to audience {self.audience!r}")
        user = status.user
        extra = tuple(sorted((k, tuple(v)) for k, v in (user.extra or {}).items()))
        return Principal(user.username or "", user.uid or "", tuple(user.groups or ()), extra)

    async def _review_access(self, principal: Principal, namespace: str, verb: str) -> bool:
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": principal.username,
                "uid": principal.uid or None,
                "groups": list(principal.groups),
                "extra": {k: list(v) for k, v in principal.extra},
                "resourceAttributes": {
                    "group": GROUP,
                    "resource": RESOURCE,
                    "verb": verb,
                    "namespace": namespace,
                },
            },
        }
        review = await self._call(self._authz.create_subject_access_review, body)
        if review.status is None or not review.status.allowed:
            raise Forbidden(
                f"{principal.username} may not {verb} {RESOURCE}.{GROUP} in namespace {namespace!r}"
                " (grant it with a Role and RoleBinding there)"
            )
        return True
