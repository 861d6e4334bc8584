"""A stand-in for the two API server endpoints the gateway's authenticator calls (TokenReview and
SubjectAccessReview), on loopback: ``tangram bench gateway`` measures the gateway with
authentication on without a cluster. It answers exactly the shapes of ``authentication.k8s.io/v1``
and ``authorization.k8s.io/v1``, from a fixed table of tokens and grants, and counts its calls. The
e2e tests use the real API server instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from aiohttp import web


@dataclass(frozen=True)
class StandInToken:
    username: str
    audiences: tuple[str, ...]
    groups: tuple[str, ...] = ("system:serviceaccounts",)
    uid: str = ""


@dataclass
class ReviewServer:
    """``tokens``: token -> identity; ``grants``: (username, namespace, verb) allowed on actionbatches."""

    tokens: dict[str, StandInToken] = field(default_factory=dict)
    grants: set[tuple[str, str, str]] = field(default_factory=set)
    calls: int = 0

    def grant(
        self, username: str, namespaces: Iterable[str], verbs: Iterable[str] = ("create", "get")
    ) -> None:
        self.grants.update((username, ns, verb) for ns in namespaces for verb in verbs)

    async def token_review(self, request: web.Request) -> web.Response:
        self.calls += 1
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
