"""A stand-in for the two API server endpoints the gateway's authenticator calls (TokenReview and
SubjectAccessReview), on loopback: ``tangram bench gateway`` measures the gateway with
authentication on without a cluster. It answers exactly the shapes of ``authentication.k8s.io/v1``
and ``authorization.k8s.io/v1``, from a fixed table of tokens and grants, and counts its calls. The
e2e tests use the real API server instead.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiohttp import web


def stand_in_jwt(subject: str, **claims: object) -> str:
    """A token shaped as a ServiceAccount token (a JWT: header, claims, signature), unsigned: only
    the stand-in reviews it, by its whole text. The gateway refuses a token of any other shape
    without a review."""

    def part(value: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part({'sub': subject, **claims})}.c3RhbmQtaW4"


@dataclass(frozen=True)
class StandInToken:
    username: str
    audiences: tuple[str, ...]
    groups: tuple[str, ...] = ("system:serviceaccounts",)
    uid: str = ""


@dataclass
class ReviewServer:
    """``tokens``: token -> identity; ``grants``: (username, namespace, verb) allowed on actionbatches.
    ``review_delay_s`` holds each TokenReview that long (an API server under load), and
    ``most_in_flight`` records how many were ever answered at once."""

    tokens: dict[str, StandInToken] = field(default_factory=dict)
    grants: set[tuple[str, str, str]] = field(default_factory=set)
    calls: int = 0
    token_reviews: int = 0
    access_reviews: int = 0
    review_delay_s: float = 0.0
    in_flight: int = 0
    most_in_flight: int = 0

    def grant(
        self, username: str, namespaces: Iterable[str], verbs: Iterable[str] = ("create", "get")
    ) -> None:
        self.grants.update((username, ns, verb) for ns in namespaces for verb in verbs)

    async def token_review(self, request: web.Request) -> web.Response:
        self.calls += 1
        self.token_reviews += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.review_delay_s:
                await asyncio.sleep(self.review_delay_s)
            return await self._token_review(request)
        finally:
            self.in_flight -= 1

    async def _token_review(self, request: web.Request) -> web.Response:
        body = await request.json()
        spec = body["spec"]
        wanted = spec.get("audiences") or []
        found = self.tokens.get(spec["token"])
        status: dict[str, object]
        if found is None:
            status = {"authenticated": False, "error": "invalid bearer token"}
        elif wanted and not set(wanted) & set(found.audiences):
            status = {"authenticated": False, "error": "token audiences do not match the requested audiences"}
        else:
            status = {
                "authenticated": True,
                "user": {"username": found.username, "uid": found.uid, "groups": list(found.groups)},
                "audiences": [a for a in found.audiences if not wanted or a in wanted],
            }
        return web.json_response({**body, "status": status}, status=201)

    async def access_review(self, request: web.Request) -> web.Response:
        self.calls += 1
        self.access_reviews += 1
        body = await request.json()
        spec = body["spec"]
        attrs = spec["resourceAttributes"]
        allowed = (
            attrs.get("group") == "tangram.arl.dev"
            and attrs.get("resource") == "actionbatches"
            and (spec["user"], attrs.get("namespace"), attrs.get("verb")) in self.grants
        )
        return web.json_response({**body, "status": {"allowed": allowed}}, status=201)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", self.token_review)
        app.router.add_post("/apis/authorization.k8s.io/v1/subjectaccessreviews", self.access_review)
        return app


def api_client_for(url: str) -> object:
    """A kubernetes ``ApiClient`` that talks to ``url`` without credentials (loopback only)."""
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = url
    return client.ApiClient(configuration)
