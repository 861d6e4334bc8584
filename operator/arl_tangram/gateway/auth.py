"""Who may call the gateway: Kubernetes ServiceAccount tokens, and RBAC on ActionBatches.

A request's bearer token is checked with a TokenReview bound to the gateway's audience (a token
minted for another audience, such as the API server's default, is refused); the identity it names
is then checked with a SubjectAccessReview for ``<verb> actionbatches.tangram.arl.dev`` in the
target's namespace, so that the RBAC which lets someone create ActionBatches in a namespace is the
RBAC that lets them use that namespace's pools through the gateway.

Both answers are cached with a TTL and a bound on entries, so a warm request makes no API call; a
burst of requests with one new token makes one call, not one per request. What cannot be a bearer
token at all (outside RFC 6750's syntax, over :data:`MAX_TOKEN_CHARS`) is refused without a review, and
the reviews of new tokens are bounded (:class:`ReviewThrottle`), in all and per client address, so a
client sending made-up tokens can neither load the API server nor use up the reviews that other
clients' new tokens need. The access reviews are bounded by the same throttle (the same budget in
all), each caller's share keyed by its name: the namespace is the caller's to choose, so a valid
token naming a new namespace in each request cost one SubjectAccessReview per request. The
blocking kubernetes client is only ever called through :func:`asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import re
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

    async def authenticate(self, token: str, client: str = "") -> Principal:
        """The caller the token names; raises :class:`Unauthenticated`. ``client`` (its address)
        is whose share of the reviews a new token spends."""
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
    costs the API server one review per TTL, not one per request. They are kept apart, under a
    bound of their own: a flood of made-up tokens must not push the callers' accepted ones out.
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
        self._refusals: OrderedDict[K, tuple[float, V | None, Exception | None]] = OrderedDict()
        self._pending: dict[K, asyncio.Future[V]] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries) + len(self._refusals)

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
        for entries in (self._entries, self._refusals):
            entry = entries.get(key)
            if entry is not None and entry[0] > now:
                self.hits += 1
                entries.move_to_end(key)
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
        entries, other = (self._entries, self._refusals) if error is None else (self._refusals, self._entries)
        other.pop(key, None)
        entries[key] = (expires, value, error)
        entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)


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


class ReviewsThrottled(AuthUnavailable):
    """Too many new tokens, or new permissions, to review at once (503 with Retry-After: try
    again)."""


# A ServiceAccount token is a JWT of one to two kilobytes, and the other tokens an API server may
# accept (an OIDC ID token, EKS's ``k8s-aws-v1.`` token, GKE's access token, a static or webhook
# token) are of that order too; the bound leaves room for large claims while sparing the API server
# reviews of megabyte-sized garbage.
MAX_TOKEN_CHARS = 4096
# RFC 6750's b64token: the characters a bearer token may hold. Not JWT's shape: a TokenReview asks
# every authenticator the API server has, and a cluster's users may hold tokens of any of them.
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


def token_refusal(token: str) -> str | None:
    """Why ``token`` cannot be a bearer token the API server accepts, judged without asking it (so
    such a token costs it nothing); None where it may be one. Never quotes the token."""
    if len(token) > MAX_TOKEN_CHARS:
        return f"the bearer token is {len(token)} characters long, over the limit of {MAX_TOKEN_CHARS}"
    if any(c.isspace() for c in token):
        return "the bearer token contains whitespace (a line break or space copied with it?)"
    if not _B64TOKEN.fullmatch(token):
        return (
            "the bearer token holds characters no bearer token has (RFC 6750: letters, digits and"
            " -._~+/, then = padding)"
        )
    return None


class _Bucket:
    """A token bucket: ``rate`` per second on average, at most ``burst`` at once."""

    __slots__ = ("at", "level")

    def __init__(self, burst: float, now: float) -> None:
        self.level = burst
        self.at = now

    def take(self, rate: float, burst: float, now: float) -> bool:
        self.level = min(burst, self.level + (now - self.at) * rate)
        self.at = now
        if self.level < 1:
            return False
        self.level -= 1
        return True


# What a throttled review was for, as its refusal names it.
TOKENS = "new tokens"
PERMISSIONS = "new permission checks"


class ReviewThrottle:
    """How many reviews (TokenReviews and SubjectAccessReviews) may be sent: at most
    ``max_in_flight`` at once and ``per_second`` on average (bursts of as many) in all, and of those
    at most ``client_in_flight`` at once and ``client_per_second`` on average (bursts of twice as
    many) for one client (an address for tokens, a caller's name for access reviews). A review
    over a bound is not sent (the caller hears 503 and retries): one client flooding with new tokens
    spends its own share, and the others' new tokens are still reviewed. Warm tokens are never
    reviewed, so they pass whatever the flood. Client addresses are forgotten oldest first past
    ``max_clients``."""

    def __init__(
        self,
        *,
        max_in_flight: int = 32,
        per_second: float = 100.0,
        client_in_flight: int = 4,
        client_per_second: float = 10.0,
        max_clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (
            ("max_in_flight", max_in_flight),
            ("per_second", per_second),
            ("client_in_flight", client_in_flight),
            ("client_per_second", client_per_second),
            ("max_clients", max_clients),
        ):
            if not value > 0:
                raise ValueError(f"ReviewThrottle: {name} must be positive, not {value!r}")
        self.max_in_flight = max_in_flight
        self.per_second = per_second
        self.client_in_flight = client_in_flight
        self.client_per_second = client_per_second
        self.max_clients = max_clients
        self.clock = clock
        self.in_flight = 0
        self._all = _Bucket(per_second, clock())
        self._clients: OrderedDict[str, _Bucket] = OrderedDict()
        self._client_in_flight: dict[str, int] = {}
        self.refused = 0

    def acquire(self, client: str, what: str = TOKENS) -> None:
        """Takes a review's place for ``client``, or raises :class:`ReviewsThrottled`; each
        successful call must be matched by :meth:`release`. ``what`` names the reviews in the
        refusal (:data:`TOKENS` or :data:`PERMISSIONS`); the budget in all is one for both."""
        now = self.clock()
        why = None
        if self._client_in_flight.get(client, 0) >= self.client_in_flight:
            why = f"this client already has {self.client_in_flight} {what} under review"
        elif self.in_flight >= self.max_in_flight:
            why = f"{self.max_in_flight} {what} are under review"  # (the bound counts both kinds)
        else:
            bucket = self._clients.get(client)
            if bucket is None:
                bucket = self._clients[client] = _Bucket(2 * self.client_per_second, now)
                while len(self._clients) > self.max_clients:
                    self._clients.popitem(last=False)
            self._clients.move_to_end(client)
            # The client's share first: a flooding client must not spend the shared budget.
            if not bucket.take(self.client_per_second, 2 * self.client_per_second, now):
                why = f"this client sent more than {self.client_per_second:g} {what} a second"
            elif not self._all.take(self.per_second, self.per_second, now):
                why = f"more than {self.per_second:g} {what} a second are being reviewed"
        if why is not None:
            self.refused += 1
            raise ReviewsThrottled(f"too many {what} to review: {why}; retry shortly")
        self.in_flight += 1
        self._client_in_flight[client] = self._client_in_flight.get(client, 0) + 1

    def release(self, client: str) -> None:
        self.in_flight -= 1
        left = self._client_in_flight[client] - 1
        if left:
            self._client_in_flight[client] = left
        else:
            del self._client_in_flight[client]


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
        throttle: ReviewThrottle | None = None,
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
        self.throttle = throttle or ReviewThrottle(clock=clock)
        self.api_calls = 0

    async def authenticate(self, token: str, client: str = "") -> Principal:
        refusal = token_refusal(token)
        if refusal is not None:
            # Not cached: judging it again costs less than an entry that pushes out a real one.
            raise Unauthenticated(refusal)
        # The cache is keyed by a digest: the tokens themselves are not kept in memory.
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()

        def left() -> float | None:
            # A token is never trusted from the cache past its own expiry.
            expires = token_expiry(token)
            return None if expires is None else expires - time.time()

        return await self.tokens.get(digest, lambda: self._throttled_review(token, client), left)

    async def authorize(self, principal: Principal, namespace: str, verb: str) -> None:
        await self.reviews.get(
            (principal, namespace, verb), lambda: self._throttled_access(principal, namespace, verb)
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

    async def _throttled_review(self, token: str, client: str) -> Principal:
        self.throttle.acquire(client)
        try:
            return await self._review_token(token)
        finally:
            self.throttle.release(client)

    async def _throttled_access(self, principal: Principal, namespace: str, verb: str) -> bool:
        # The caller's share is its name's, not its address's: it is known by now, and one caller
        # must not get more reviews by sending from more addresses. (``user:`` keeps the names
        # apart from the addresses that key the TokenReviews' shares.)
        client = f"user:{principal.username}"
        self.throttle.acquire(client, PERMISSIONS)
        try:
            return await self._review_access(principal, namespace, verb)
        finally:
            self.throttle.release(client)

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
