"""Trainers' own HTTP calls, restated as they make them, against a real gateway (a real agent, a
real reward runtime): what they send and how they read the answer, status codes included.

Each client is cited by repository and file; its calls are restated rather than imported, since the
trainers themselves (Ray, torch, their configs) are not dependencies of this project.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import requests
from gateway_harness import NS, POOL, SERVICE, Gateway, serve_gateway, start_reward_runtime
from sandbox_agent_harness import Agent, wait_until

from arl_tangram.gateway import GatewayConfig

LABEL = "from solution import add\n\ndef test_add():\n    assert add(1, 2) == 3\n"
ANSWER = "```python\ndef add(a, b):\n    return a + b\n```"


@pytest.fixture(scope="module")
def gateway(hosts: list[Agent], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # One action at a time per tenant: a test fills the bounded wait with one held action.
    config = GatewayConfig(
        default_namespace=NS,
        default_pools={NS: POOL},
        default_services={NS: SERVICE},
        max_in_flight_per_tenant=1,
    )
    with (
        start_reward_runtime(tmp_path_factory.mktemp("rm")) as rewards,
        serve_gateway(hosts, config=config, rewards=rewards) as gw,
    ):
        yield gw


async def verl_reward_loop_post(
    base: str, endpoint: str, payload: dict[str, Any], max_retries: int = 16
) -> Any:
    """verl's reward loop (volcengine/verl, verl/experimental/reward_loop/reward_loop.py,
    ``RewardLoopWorker._post_request``): a new aiohttp session per try, ``raise_for_status``; a 4xx
    is raised at once, not retried (the step fails), a 5xx or a timeout is retried after 1, 2, 4 ...
    (at most 30) seconds."""
    url = f"{base}/{endpoint}"
    last: BaseException | None = None
    for attempt in range(max_retries):
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session,
                session.post(url, json=payload) as resp,
            ):
                resp.raise_for_status()
                return await resp.json()
        except aiohttp.ClientResponseError as e:
            if 400 <= e.status < 500:
                raise
            last = e
        except (TimeoutError, aiohttp.ClientConnectorError) as e:
            last = e
        if attempt < max_retries - 1:
            await asyncio.sleep(min(2**attempt, 30))
    assert last is not None
    raise last


def _requests_answered(gw: Gateway, route: str, status: int) -> float:
    """How many requests ``route`` answered ``status`` (read from ``/metrics``, as a scraper would)."""
    text = requests.get(gw.url + "/metrics", timeout=30).text
    found = re.search(
        rf'^tangram_gateway_requests_total\{{route="{re.escape(route)}",status="{status}"\}} (\S+)$',
        text,
        re.M,
    )
    return float(found.group(1)) if found else 0.0


class HeldAction:
    """A keyed sleeper on the pool that fills the tenant's bound until it is cancelled."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.key = f"hold-{uuid.uuid4().hex}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.answer: requests.Response | None = None

    def _run(self) -> None:
        body = {"language": "python", "code": "import time\ntime.sleep(25)\n", "run_timeout": 28}
        self.answer = requests.post(
            self.gw.url + "/run_code", json=body, headers={"X-Tangram-Action-Key": self.key}, timeout=120
        )

    def __enter__(self) -> HeldAction:
        self.thread.start()
        wait_until(lambda: self.gw.admission().tenants.get(NS) == 1, what="the sleeper to hold the bound")
        return self

    def release(self) -> None:
        resp = requests.post(
            self.gw.url + "/v1/actions:cancel", json={"keys": [self.key], "namespace": NS}, timeout=30
        )
        assert resp.status_code == 200, resp.text

    def __exit__(self, *exc: object) -> None:
        self.release()
        self.thread.join(120)
        wait_until(lambda: NS not in self.gw.admission().tenants, what="the bound to free")


OPENAI_SHAPES = [
    ("classify", {"model": SERVICE, "input": "q: colour? a: blue", "activation": False}),
    ("v1/embeddings", {"model": SERVICE, "input": "q: colour? a: blue"}),
    ("score", {"model": SERVICE, "text_1": "q: colour?", "text_2": ["a: blue"]}),
    ("pooling", {"model": SERVICE, "input": "q: colour? a: blue"}),
]


def test_a_full_bounded_wait_is_a_status_verls_reward_loop_retries(gateway: Gateway) -> None:
    """vLLM and SGLang never answer 429, and verl's reward loop fails the step on any 4xx: a full
    bounded wait on their shapes is 503 with Retry-After, which it retries until it gets the score."""
    with HeldAction(gateway) as held:
        for endpoint, payload in OPENAI_SHAPES:
            resp = requests.post(f"{gateway.url}/{endpoint}", json=payload, timeout=30)
            assert resp.status_code == 503, (endpoint, resp.status_code, resp.text)
            assert int(resp.headers["Retry-After"]) >= 1 and "limit" in resp.json()["error"]
        refused_before = _requests_answered(gateway, "/classify", 503)
        done: dict[str, Any] = {}

        def verl() -> None:
            payload = OPENAI_SHAPES[0][1]
            try:
                done["answer"] = asyncio.run(verl_reward_loop_post(gateway.url, "classify", payload))
            except BaseException as exc:  # handed to the test thread
                done["error"] = exc

        thread = threading.Thread(target=verl, daemon=True)
        thread.start()
        # verl's first try meets the full bound; free it only then, so that its retry is what scores.
        wait_until(
            lambda: _requests_answered(gateway, "/classify", 503) > refused_before or not thread.is_alive(),
            what="verl's first try to be refused",
        )
        held.release()
        thread.join(120)
    assert "error" not in done, done.get("error")
    assert gateway.rewards is not None
    assert done["answer"]["data"][-1]["probs"][-1] == gateway.rewards.expected(["q: colour? a: blue"])[0]


def test_the_sandboxfusion_shape_still_answers_a_full_wait_504(gateway: Gateway) -> None:
    """The mapping above is the OpenAI shapes' own: /run_code keeps verl's 504, the native API 429."""
    with HeldAction(gateway):
        sf = requests.post(gateway.url + "/run_code", json={"language": "python", "code": "1"}, timeout=30)
        assert sf.status_code == 504 and sf.json()["status"] == "SandboxError"
        native = requests.post(
            gateway.url + "/v1/actions",
            json={"type": "code", "target": POOL, "payload": {"language": "python", "code": "1"}},
            timeout=30,
        )
        assert native.status_code == 429 and native.headers["Retry-After"]


def test_verls_sandbox_call_to_a_url_ending_in_a_slash(gateway: Gateway) -> None:
    """verl's ``call_sandbox_api`` (volcengine/verl, verl/utils/reward_score/sandbox_fusion/utils.py)
    posts its body, encoded by hand, to ``sandbox_fusion.url`` as configured. SandboxFusion's FastAPI
    server redirects ``/run_code/`` to ``/run_code`` (307, which requests follows with the body), so
    a URL ending in a slash worked there; the gateway serves it as ``/run_code``."""
    payload = json.dumps(
        {
            "compile_timeout": 10,
            "run_timeout": 10,
            "code": "print(int(input()) * 2)",
            "stdin": "21",
            "memory_limit_MB": 1024,
            "language": "python",
            "files": {},
            "fetch_files": [],
        }
    )
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    for url in (
        f"{gateway.url}/run_code/?namespace={NS}&pool={POOL}",
        f"{gateway.url}/pools/{NS}/{POOL}/run_code/",
    ):
        resp = requests.post(url, headers=headers, data=payload, timeout=30)
        resp.raise_for_status()
        assert resp.json()["status"] == "Success" and resp.json()["run_result"]["stdout"] == "42\n", url
    # What the gateway does with the path is the route's own: its checks and its error shape.
    typo = requests.post(f"{gateway.url}/run_code/?pol={POOL}", headers=headers, data=payload, timeout=30)
    assert typo.status_code == 400 and typo.json()["status"] == "SandboxError"


def test_openrlhf_sharding_a_sample_over_several_reward_urls(gateway: Gateway) -> None:
    """OpenRLHF's ``--remote_rm_url`` takes several URLs (split on commas) and
    ``_fetch_rewards_via_http`` (OpenRLHF/OpenRLHF, openrlhf/utils/agent.py) shards each call's
    queries over them, one sample per call: every URL but the first gets empty lists, and one
    refusal (5 tries, 1 s apart, then ``RuntimeError`` out of ``gather``) lost the sample's reward.
    OpenRLHF's own server (openrlhf/cli/serve_rm.py) answers empty lists; so does the gateway."""

    async def fetch_rewards(
        urls: list[str], queries: list[str], prompts: list[str], labels: list[Any]
    ) -> Any:
        timeout = aiohttp.ClientTimeout(total=180)
        batch_size = (len(queries) + len(urls) - 1) // len(urls)

        async def post_request(url: str, data: dict[str, Any], try_max_times: int = 5) -> Any:
            for _ in range(try_max_times):
                try:
                    async with (
                        aiohttp.ClientSession(timeout=timeout) as session,
                        session.post(url, json=data) as response,
                    ):
                        response.raise_for_status()
                        return await response.json()
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(1)
            raise RuntimeError(f"Request error for {try_max_times} times")

        tasks = []
        for i, url in enumerate(urls):
            start, end = i * batch_size, min((i + 1) * batch_size, len(queries))
            payload = {
                "query": queries[start:end],
                "prompts": prompts[start:end],
                "labels": labels[start:end],
            }
            tasks.append(asyncio.create_task(post_request(url, payload)))
        return await asyncio.gather(*tasks)

    for target in (f"pool={POOL}", f"service={SERVICE}"):
        urls = [f"{gateway.url}/get_reward?namespace={NS}&{target}"] * 3
        answers = asyncio.run(fetch_rewards(urls, [f"Q{ANSWER}"], ["Q"], [LABEL]))
        # OpenRLHF reads the first answer only (``rewards_info_list[0]``).
        assert len(answers) == 3 and len(answers[0]["rewards"]) == 1, answers
        if target.startswith("pool"):
            assert answers[0]["rewards"] == [1.0], answers
        assert answers[1:] == [{"rewards": [], "scores": [], "extra_logs": {}}] * 2, answers
    # Empty, it is still checked: the namespace's authorisation, the target, the lists' lengths.
    uneven = requests.post(
        f"{gateway.url}/get_reward?pool={POOL}", json={"query": [], "prompts": ["Q"]}, timeout=30
    )
    assert uneven.status_code == 400 and uneven.json()["field"] == "prompts", uneven.text


def test_reward_clients_to_urls_ending_in_a_slash(gateway: Gateway) -> None:
    """OpenRLHF's ``_fetch_rewards_via_http`` (OpenRLHF/OpenRLHF, openrlhf/utils/agent.py) and slime's
    ``remote_rm`` (THUDM/slime, slime/rollout/rm_hub/__init__.py): aiohttp, ``json=``,
    ``raise_for_status``, the URL as given on the command line. OpenRLHF's own reward server is
    FastAPI, which redirects ``/get_reward/`` to ``/get_reward``; so do vLLM's and SGLang's."""

    async def post(url: str, data: dict[str, Any]) -> Any:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session,
            session.post(url, json=data) as response,
        ):
            response.raise_for_status()
            return await response.json()

    openrlhf = {"query": [f"Q{ANSWER}<|im_end|>"], "prompts": ["Q"], "labels": [LABEL]}
    answer = asyncio.run(post(f"{gateway.url}/get_reward/?namespace={NS}&pool={POOL}", openrlhf))
    assert answer["rewards"] == [1.0] and answer["scores"] == [1.0]
    slime = {"prompt": "Q", "response": ANSWER, "label": LABEL}
    assert asyncio.run(post(f"{gateway.url}/slime/reward/?namespace={NS}&pool={POOL}", slime)) == 1.0
    embedded = asyncio.run(post(f"{gateway.url}/v1/embeddings/", OPENAI_SHAPES[1][1]))
    assert gateway.rewards is not None
    assert embedded["data"][-1]["embedding"][-1] == gateway.rewards.expected(["q: colour? a: blue"])[0]
