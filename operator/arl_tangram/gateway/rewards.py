"""Reward endpoints in the shapes trainers call, all into one scoring path.

Each sample becomes one action: ``reward`` on a RewardModelService (the reward runtime scores it; the
action's payload is ``{prompt, response, label}``), or, for a test-based reward, ``test`` in an
ActionPool whose pass fraction is the reward (see :mod:`arl_tangram.gateway.scoring`). The samples
of one request run concurrently, each under the gateway's bounds, so the scheduler batches and
orders them with everyone else's.

Shapes: the native ``POST /v1/rewards``; OpenRLHF's ``POST /get_reward`` (``--remote_rm_url``);
slime's ``POST /slime/reward`` (``--rm-url``, answered with a bare number); vLLM's ``/score``,
``/classify`` and ``/pooling`` (also under ``/v1/``); SGLang's ``/classify`` (``text`` instead of
vLLM's ``input``).
"""

from __future__ import annotations

import array
import asyncio
import base64
import math
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from arl_tangram.domain.actions import ActionRequest, Outcome, Reason
from arl_tangram.domain.batches import native_payload
from arl_tangram.errors import InvalidSpec
from arl_tangram.gateway.config import POOL_HEADER, SERVICE_HEADER, GatewayConfig
from arl_tangram.gateway.errors import REASON_STATUS
from arl_tangram.gateway.keys import scoped_key
from arl_tangram.gateway.models import (
    EmbeddingData,
    EmbeddingsRequest,
    EmbeddingsResponse,
    EncodingFormat,
    OpenRLHFRewardRequest,
    OpenRLHFRewardResponse,
    RewardRequest,
    RewardResponse,
    SglangClassifyItem,
    SglangClassifyRequest,
    SlimeRewardRequest,
    VllmClassifyData,
    VllmClassifyRequest,
    VllmClassifyResponse,
    VllmPoolingData,
    VllmPoolingRequest,
    VllmPoolingResponse,
    VllmScoreData,
    VllmScoreRequest,
    VllmScoreResponse,
)
from arl_tangram.gateway.native import ALL_LANGUAGES, caller_key, keyless_caller, run_action
from arl_tangram.gateway.parsing import BadRequest, parse, read_json, validate
from arl_tangram.gateway.routing import given, namespace_of, pool_of, service_of
from arl_tangram.gateway.scoring import (
    NATIVE_FIELDS,
    OPENRLHF_FIELDS,
    SLIME_FIELDS,
    Fields,
    Sample,
    listed,
    openrlhf_samples,
    score_pairs,
    test_payload,
    texts,
)
from arl_tangram.gateway.state import GatewayState, authorize, state_of

# A failed test run is a low reward, not an error: the answer was wrong, the platform was not.
_PROGRAM_FAILURES = frozenset({Reason.NON_ZERO_EXIT, Reason.TIMEOUT, Reason.OUT_OF_MEMORY, Reason.SIGNALLED})


@dataclass(frozen=True)
class Target:
    """Where a request's samples are scored: a RewardModelService or (test-based) an ActionPool."""

    namespace: str
    service: str | None = None
    pool: str | None = None


def target_of(request: web.Request, namespace: str, model: str | None = None) -> Target:
    """An explicit ``service`` or ``pool`` (header or query), else the body's model, else the
    namespace's default service."""
    pool = given(request, POOL_HEADER, "pool")
    explicit_service = given(request, SERVICE_HEADER, "service")
    if pool is not None and explicit_service is not None:
        raise InvalidSpec("pool", "name a service (model-based reward) or a pool (test-based), not both")
    if pool is not None:
        return Target(namespace, pool=pool_of(request, namespace))
    service = service_of(request, namespace, model)
    if service is None:
        raise InvalidSpec(
            "service",
            f"no reward target named: send {SERVICE_HEADER} or ?service=NAME (a RewardModelService), "
            f"?pool=NAME for a test-based reward, or configure a default service for {namespace!r}",
        )
    return Target(namespace, service=service)


def _action(
    target: Target, sample: Sample, label_field: str, key: str, action_timeout_s: int | None
) -> ActionRequest:
    """The action scoring one sample (``InvalidSpec`` for a sample that cannot be scored)."""
    if target.pool is not None:
        payload = native_payload("test", test_payload(sample, label_field), ALL_LANGUAGES)
        kind, name = "test", target.pool
    else:
        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        kind, name = "reward", target.service or ""
    return ActionRequest(
        key=scoped_key(target.namespace, key, space="gw-reward"),
        namespace=target.namespace,
        target=name,
        kind=kind,  # type: ignore[arg-type]
        payload=payload,
        timeout_s=float(action_timeout_s) if action_timeout_s else None,
    )


async def _one(
    state: GatewayState, request: ActionRequest, where: str, keyless_caller: web.Request | None
) -> float:
    kind = request.kind
    outcome = await run_action(state, request, "reward", keyless_caller)
    if outcome.state is Outcome.SUCCEEDED and outcome.reward is not None:
        return outcome.reward
    if kind == "test" and outcome.reason in _PROGRAM_FAILURES:
        return outcome.reward if outcome.reward is not None else 0.0
    reason = outcome.reason or Reason.SANDBOX_ERROR
    status = REASON_STATUS.get(reason, 502)
    raise BadRequest(status, f"{where}: {reason.value}: {outcome.message or 'no reward was produced'}")


async def score(
    request: web.Request,
    target: Target,
    samples: Sequence[Sample],
    fields: Fields,
    action_timeout_s: int | None = None,
) -> list[float]:
    """The reward of each sample, in order (after authorising the caller for the namespace); a
    refusal names the sample's field as the caller's shape calls it (``fields``)."""
    state = state_of(request)
    await authorize(request, target.namespace)
    if len(samples) > state.config.max_reward_items:
        raise InvalidSpec(
            fields.items, f"{len(samples)} samples; at most {state.config.max_reward_items} per request"
        )
    # Every sample's action is built before any runs: one that cannot be scored is refused with
    # nothing begun (the others ran on, their results thrown away). With the caller's key
    # (X-Tangram-Action-Key), sample i's is KEY/i: a retry (OpenRLHF's, slime's) gets the results
    # of what already ran instead of running every sample again.
    key = caller_key(request, None)
    base = key if key is not None else f"reward-{uuid.uuid4().hex}"
    actions = [
        _action(target, s, fields.label_of(i), f"{base}/{i}", action_timeout_s) for i, s in enumerate(samples)
    ]
    keyless = keyless_caller(request, key)  # its samples are cancelled if it leaves
    return list(await asyncio.gather(*(_one(state, a, fields.of(i), keyless) for i, a in enumerate(actions))))


def _config(request: web.Request) -> GatewayConfig:
    return state_of(request).config


async def native_rewards(request: web.Request) -> web.Response:
    """``POST /v1/rewards``."""
    body = await parse(request, RewardRequest, _config(request))
    namespace = body.namespace or state_of(request).config.default_namespace
    if body.service and body.pool:
        raise InvalidSpec("pool", "give a service (model-based reward) or a pool (test-based), not both")
    asked = given(request, SERVICE_HEADER, "service")
    if asked is not None and (body.pool or (body.service and body.service != asked)):
        # The body's pool or service would win without a word over what the header or query names.
        named = f"pool {body.pool!r}" if body.pool else f"service {body.service!r}"
        raise InvalidSpec(
            "service", f"{SERVICE_HEADER} / ?service names {asked[:80]!r} but the body names {named}"
        )
    target = (
        Target(namespace, pool=body.pool)
        if body.pool
        else Target(namespace, service=body.service or service_of(request, namespace))
    )
    if target.pool is None and target.service is None:
        raise InvalidSpec("service", f"no service or pool given and {namespace!r} has no default service")
    samples = [Sample(i.prompt, i.response, i.label) for i in body.items]
    rewards = await score(request, target, samples, NATIVE_FIELDS, body.timeout_seconds)
    return web.json_response(RewardResponse(rewards=rewards).model_dump())


async def openrlhf_reward(request: web.Request) -> web.Response:
    """``POST /get_reward``: OpenRLHF's remote reward model."""
    body = await parse(request, OpenRLHFRewardRequest, _config(request))
    namespace = namespace_of(request)
    samples = openrlhf_samples(body.query, body.prompts, body.labels)
    rewards = await score(request, target_of(request, namespace), samples, OPENRLHF_FIELDS)
    return web.json_response(OpenRLHFRewardResponse(rewards=rewards, scores=rewards).model_dump())


async def slime_reward(request: web.Request) -> web.Response:
    """``POST /slime/reward``: slime's remote reward model; the answer is the reward itself."""
    body = await parse(request, SlimeRewardRequest, _config(request))
    namespace = namespace_of(request)
    (reward,) = await score(
        request, target_of(request, namespace), [Sample(body.prompt, body.response, body.label)], SLIME_FIELDS
    )
    return web.json_response(reward)


def _served_as(model: str | None, target: Target) -> str:
    """The ``model`` of an OpenAI-style answer: the name the caller used (vLLM and SGLang echo their
    served model's name), else the service's or pool's."""
    return model or target.service or target.pool or ""


def _openai_envelope(model: str | None, target: Target) -> dict[str, Any]:
    name = _served_as(model, target)
    return {"id": f"score-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}


async def vllm_score(request: web.Request) -> web.Response:
    """``POST /score`` (vLLM): ``text_1`` scored against each ``text_2``."""
    body = await parse(request, VllmScoreRequest, _config(request))
    namespace = namespace_of(request)
    target = target_of(request, namespace, body.model)
    rewards = await score(request, target, score_pairs(body.text_1, body.text_2), listed("text_2"))
    # vLLM's cross-encoder score is the activated logit unless the request says otherwise.
    rewards = _activated(rewards, body, target, default=True)
    data = [VllmScoreData(index=i, score=r) for i, r in enumerate(rewards)]
    answer = VllmScoreResponse(**_openai_envelope(body.model, target), data=data)
    return web.json_response(answer.model_dump())


async def classify(request: web.Request) -> web.Response:
    """``POST /classify``: vLLM's (``input``) or SGLang's (``text``) shape, told apart by the field."""
    data = await read_json(request, _config(request))
    namespace = namespace_of(request)
    if isinstance(data, dict) and "text" in data and "input" not in data:
        sglang = validate(SglangClassifyRequest, data)
        target = target_of(request, namespace, sglang.model)
        rewards = await score(request, target, texts(sglang.text, "text"), listed("text"))
        items = [
            SglangClassifyItem(embedding=[r], meta_info={"id": uuid.uuid4().hex, "index": i}).model_dump()
            for i, r in enumerate(rewards)
        ]
        # SGLang answers one object for one text and a list for a list.
        return web.json_response(items[0] if isinstance(sglang.text, str) else items)
    vllm = validate(VllmClassifyRequest, data)
    target = target_of(request, namespace, vllm.model)
    rewards = await score(request, target, texts(vllm.input, "input"), listed("input"))
    # vLLM's ``probs`` are the activated logits unless the request says otherwise.
    rewards = _activated(rewards, vllm, target, default=True)
    rows = [
        VllmClassifyData(index=i, label="reward", probs=[r], num_classes=1) for i, r in enumerate(rewards)
    ]
    answer = VllmClassifyResponse(**_openai_envelope(vllm.model, target), data=rows)
    return web.json_response(answer.model_dump())


def _sigmoid(x: float) -> float:
    """``torch.sigmoid``, without overflow: ``exp(-x)`` of a large negative score is past float's
    range (a score no reward head is barred from answering)."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _activated(
    rewards: list[float],
    body: VllmScoreRequest | VllmClassifyRequest | VllmPoolingRequest,
    target: Target,
    default: bool,
) -> list[float]:
    """The scores as vLLM answers them on a route whose activation is on by ``default``: with it
    on, a one-label model's probability (vLLM's sigmoid of the logit), else the score itself.

    The request turns it on or off by ``softmax``, ``activation`` or ``use_activation`` (vLLM's
    names, version by version), the first one given winning, in that order, as in vLLM. The score
    is the reward head's one (last) value; a model with several labels, whose activation vLLM takes
    as a softmax over all of them, cannot be answered so from it (docs/gateway.md)."""
    if target.pool is not None:
        return rewards  # a pass fraction of tests, no model's logit: never squashed
    asked = next((v for v in (body.softmax, body.activation, body.use_activation) if v is not None), None)
    if asked if asked is not None else default:
        return [_sigmoid(r) for r in rewards]
    return rewards


def _vector(values: list[float], encoding: EncodingFormat) -> list[float] | str:
    """A vector as the caller asked for it: the numbers, or their float32 bytes (little-endian, as
    vLLM and OpenAI send them and OpenAI's SDK decodes them) in base64."""
    if encoding == "base64":
        # array rounds a finite value past float32's range to infinity, as vLLM's numpy does
        # (struct would refuse it, failing the whole request).
        packed = array.array("f", values)
        if sys.byteorder == "big":
            packed.byteswap()
        return base64.b64encode(packed.tobytes()).decode("ascii")
    return values


async def vllm_pooling(request: web.Request) -> web.Response:
    """``POST /pooling`` (vLLM serves reward models' scores there)."""
    body = await parse(request, VllmPoolingRequest, _config(request))
    namespace = namespace_of(request)
    target = target_of(request, namespace, body.model)
    rewards = await score(request, target, texts(body.input, "input"), listed("input"))
    # The score as the runtime reads it from its server (no activation named), unless the request
    # asks for one: vLLM's own default on /pooling differs by version (docs/gateway.md).
    rewards = _activated(rewards, body, target, default=False)
    rows = [VllmPoolingData(index=i, data=_vector([r], body.encoding_format)) for i, r in enumerate(rewards)]
    answer = VllmPoolingResponse(**_openai_envelope(body.model, target), data=rows)
    return web.json_response(answer.model_dump())


async def embeddings(request: web.Request) -> web.Response:
    """``POST /v1/embeddings`` (SGLang serves reward models' scores there): each input's embedding
    is its one score."""
    body = await parse(request, EmbeddingsRequest, _config(request))
    namespace = namespace_of(request)
    target = target_of(request, namespace, body.model)
    rewards = await score(request, target, texts(body.input, "input"), listed("input"))
    rows = [
        EmbeddingData(index=i, embedding=_vector([r], body.encoding_format)) for i, r in enumerate(rewards)
    ]
    return web.json_response(EmbeddingsResponse(model=_served_as(body.model, target), data=rows).model_dump())
