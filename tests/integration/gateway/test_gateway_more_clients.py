"""Clients the other trainer-client tests do not restate, against a real gateway (a real agent, a real
reward runtime) over real HTTP: OpenAI's Python SDK reading reward scores as embeddings, verl's
agent-loop tutorial sandbox tool and its ``SandboxFusionTool`` fed a model's own arguments, and
slime's remote reward model through its shared, bounded session.

Each client is cited by repository and file; the few lines that build its request and read its answer
are restated rather than imported, since those libraries are not dependencies of this project.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import requests
from gateway_harness import NS, POOL, SERVICE, Gateway, serve_gateway, start_reward_runtime
from sandbox_agent_harness import Agent, start_agent, stop_agent

from arl_tangram.gateway import GatewayConfig

TEXTS = ["q: colour? a: blue", "q: colour? a: green"]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    hosts: list[Agent] = [start_agent(tmp_path_factory.mktemp("moreclients") / "work")]
    try:
        config = GatewayConfig(default_namespace=NS, default_pools={NS: POOL}, default_services={NS: SERVICE})
        with (
            start_reward_runtime(tmp_path_factory.mktemp("rm")) as rewards,
            serve_gateway(hosts, config=config, rewards=rewards) as gw,
        ):
            yield gw
    finally:
        for host in hosts:
            stop_agent(host)


def as_float32(value: float) -> float:
    """``value`` as a float32 holds it (what a base64 embedding carries)."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


# --- OpenAI's Python SDK ---------------------------------------------------------------------------


def openai_sdk_embeddings_create(
    base_url: str, model: str, texts: list[str], encoding_format: str | None = None
) -> list[list[float]]:
    """``client.embeddings.create(model=..., input=...)`` (openai/openai-python,
    src/openai/resources/embeddings.py), as a trainer reads a reward model served by vLLM or SGLang
    through ``OpenAI(base_url=..., api_key="EMPTY")``: with no ``encoding_format`` given, the SDK asks
    for ``base64`` and decodes every embedding that comes back as a string (little-endian float32),
    keeping one that comes back as a list; its ``CreateEmbeddingResponse`` needs ``data``, ``model``,
    ``object`` and ``usage``. A status it does not retry (any 4xx but 408, 409 and 429) is raised."""
    body: dict[str, Any] = {"input": texts, "model": model}
    body["encoding_format"] = encoding_format if encoding_format is not None else "base64"
    headers = {
        "Authorization": "Bearer EMPTY",
        "Content-Type": "application/json",
        "Accept": "application/json",
        "User-Agent": "OpenAI/Python 1.0",
        "X-Stainless-Lang": "python",
        "X-Stainless-Retry-Count": "0",
    }
    resp = requests.post(f"{base_url}/embeddings", data=json.dumps(body), headers=headers, timeout=600)
    assert resp.status_code == 200, (resp.status_code, resp.text)  # the SDK raises BadRequestError
    answer = resp.json()
    assert answer["object"] == "list" and isinstance(answer["model"], str), answer
    assert isinstance(answer["usage"]["prompt_tokens"], int), answer
    assert isinstance(answer["usage"]["total_tokens"], int), answer
    vectors: list[list[float]] = []
    for row in sorted(answer["data"], key=lambda row: row["index"]):
        embedding = row["embedding"]
        if encoding_format is None and isinstance(embedding, str):
            raw = base64.b64decode(embedding)
            embedding = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        vectors.append(embedding)
    return vectors


def test_openai_sdks_embeddings_with_its_default_encoding(gateway: Gateway) -> None:
    """The SDK's default asks for base64 (OpenAI's and vLLM's answer is float32 bytes, base64-encoded;
    SGLang's a list the SDK keeps): the gateway refused it (422), so a trainer reading scores with
    ``embeddings.create`` failed on every call."""
    assert gateway.rewards is not None
    want = gateway.rewards.expected(TEXTS)
    got = openai_sdk_embeddings_create(gateway.url + "/v1", SERVICE, TEXTS)
    assert [v[-1] for v in got] == [as_float32(w) for w in want]
    # Asked for floats, the scores are the runtime's own, unrounded.
    floats = openai_sdk_embeddings_create(gateway.url + "/v1", SERVICE, TEXTS, encoding_format="float")
    assert [v[-1] for v in floats] == want


def test_base64_asked_of_the_raw_api_is_a_string(gateway: Gateway) -> None:
    """A client asking ``base64`` of ``/v1/embeddings`` or of vLLM's ``/pooling`` decodes a string, as
    vLLM answers it (float32, little-endian); any other encoding is refused naming the field."""
    assert gateway.rewards is not None
    want = [as_float32(w) for w in gateway.rewards.expected(TEXTS)]
    for route, field in (("/v1/embeddings", "embedding"), ("/pooling", "data")):
        resp = requests.post(
            gateway.url + route,
            json={"model": SERVICE, "input": TEXTS, "encoding_format": "base64"},
            timeout=600,
        )
        assert resp.status_code == 200, (route, resp.text)
        rows = resp.json()["data"]
        assert all(isinstance(row[field], str) for row in rows), rows
        assert [struct.unpack("<f", base64.b64decode(row[field]))[0] for row in rows] == want, route
        bad = requests.post(
            gateway.url + route, json={"model": SERVICE, "input": TEXTS, "encoding_format": "hex"}, timeout=60
        )
        assert bad.status_code == 422 and "encoding_format" in bad.text, (route, bad.text)


# --- verl's sandbox tools ----------------------------------------------------------------------------


async def verl_tutorial_code_interpreter(url: str, code: str) -> str:
    """``SandboxTool.code_interpreter`` (volcengine/verl,
    examples/tutorial/agent_loop_get_started/sandbox.py): aiohttp, ``json={"code": code}`` with no
    language, ``raise_for_status``, then ``run_result.stdout + run_result.stderr``."""
    async with aiohttp.ClientSession() as session, session.post(url, json={"code": code}) as resp:
        resp.raise_for_status()
        result = await resp.json()
        return str(result["run_result"]["stdout"]) + str(result["run_result"]["stderr"])


def test_verls_tutorial_tool_with_no_language_is_refused_as_sandboxfusion_does(gateway: Gateway) -> None:
    """SandboxFusion's ``RunCodeRequest`` requires ``language``: its server answers the tutorial's
    body 422, which ``raise_for_status`` raises; the gateway answers the same, naming the field."""
    with pytest.raises(aiohttp.ClientResponseError) as refused:
        asyncio.run(verl_tutorial_code_interpreter(gateway.url + "/run_code", "print(6 * 7)"))
    assert refused.value.status == 422
    resp = requests.post(gateway.url + "/run_code", json={"code": "print(6 * 7)"}, timeout=60)
    assert resp.status_code == 422 and "language" in resp.text, resp.text


def verl_sandbox_fusion_tool(url: str, parameters: dict[str, Any]) -> str:
    """``SandboxFusionTool.execute`` and ``execute_code`` (volcengine/verl,
    verl/tools/sandbox_fusion_tools.py): ``timeout`` and ``language`` come from the model's tool call
    as it wrote them (defaults 30 and python), and go through ``_process_single_case``
    (verl/utils/reward_score/sandbox_fusion/utils.py) as the compile and run timeouts of a body
    encoded by hand, ``stdin`` null, 1024 MB; the model hears ``stdout + stderr`` when the run is
    ``Finished``, else "no stdout here"."""
    timeout = parameters.get("timeout", 30)
    request_timeout = timeout + timeout + 10  # verl's API_TIMEOUT: a string timeout fails here, unsent
    payload = json.dumps(
        {
            "compile_timeout": timeout,
            "run_timeout": timeout,
            "code": parameters.get("code", ""),
            "stdin": None,
            "memory_limit_MB": 1024,
            "language": parameters.get("language", "python"),
            "files": {},
            "fetch_files": [],
        }
    )
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    resp = requests.post(url, headers=headers, data=payload, timeout=request_timeout)
    if resp.status_code != 200:
        return "no stdout here"  # _process_single_case: an API error is no run
    run_result = resp.json().get("run_result") or {}
    if run_result.get("status") == "Finished":
        return str(run_result["stdout"]) + str(run_result["stderr"])
    return "no stdout here"


@pytest.mark.parametrize("timeout", [5, 7.5], ids=["int", "float"])
def test_verls_sandbox_fusion_tool_with_the_models_own_timeout(gateway: Gateway, timeout: Any) -> None:
    """A model may write ``timeout`` as a whole or a fractional number (SandboxFusion takes both as
    seconds): either must run, or the tool answers the model "no stdout here" for a program that ran.
    A language verl allows that the pool does not offer is SandboxFusion's 200 ``SandboxError``, no
    run: the model hears "no stdout here", and the tool does not fail."""
    code = "import sys\nprint(6 * 7)\nsys.stderr.write('warn\\n')"
    parameters = {"code": code, "timeout": timeout}
    assert verl_sandbox_fusion_tool(gateway.url + "/run_code", parameters) == "42\nwarn\n"
    parameters = {"code": "class P {}", "timeout": timeout, "language": "csharp"}
    assert verl_sandbox_fusion_tool(gateway.url + "/run_code", parameters) == "no stdout here"


# --- slime's remote reward model ---------------------------------------------------------------------


def test_slimes_remote_rm_through_its_shared_session(gateway: Gateway) -> None:
    """``remote_rm`` (THUDM/slime, slime/rollout/rm_hub/__init__.py): one process-wide aiohttp session
    (at most 64 connections, kept alive; 120 s in all), every sample of a rollout at once, the body
    ``{prompt, response, label}`` with the prompt a chat (a list of messages) when the dataset is
    one, and the label whatever the dataset holds; the answer body itself is the reward, a number."""

    async def rollout(url: str, samples: list[dict[str, Any]]) -> list[Any]:
        connector = aiohttp.TCPConnector(limit=64, enable_cleanup_closed=True)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=120)
        ) as session:

            async def remote_rm(payload: dict[str, Any]) -> Any:
                async with session.post(url, json=payload) as resp:
                    resp.raise_for_status()
                    return await resp.json()

            return await asyncio.gather(*(remote_rm(s) for s in samples))

    chat = [{"role": "user", "content": "q: colour?"}]
    samples = [
        {"prompt": chat if i % 2 else "q: colour?", "response": f" a: {i}", "label": label}
        for i, label in enumerate([None, "blue", {"answer": "blue"}, ["blue"], 3] * 20)
    ]
    rewards = asyncio.run(rollout(f"{gateway.url}/slime/reward?namespace={NS}&service={SERVICE}", samples))
    assert len(rewards) == len(samples)
    assert all(isinstance(r, float) for r in rewards), rewards
    assert gateway.rewards is not None
    # A sample with a string prompt is scored as that prompt and its response, as the runtime reads it.
    plain = [s for s in samples if isinstance(s["prompt"], str)]
    got = [r for r, s in zip(rewards, samples, strict=True) if isinstance(s["prompt"], str)]
    assert got == gateway.rewards.expected([s["prompt"] + s["response"] for s in plain])
