"""RewardModelService -> the operator's view of a service, and reward payloads -> the text a reward
model scores (pure). Defaults are the API models'."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from arl_tangram.api.meta import DNS_SUBDOMAIN_PATTERN
from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.errors import InvalidSpec, NotFound

WEIGHTS_MOUNT = "/var/lib/tangram/weights"
"""Where a ``pvc://`` model's claim is mounted in a replica pod."""

BUILTIN_SERVER_FLAGS = ("--no-prewarm",)
"""The built-in runtime's flags a service may set in ``server.args``; the operator sets the rest
(``--config``, ``--listen``, ``--device``, ``--device-memory``) from the spec and the placement."""


@dataclass(frozen=True)
class ServiceConfig:
    """One RewardModelService as the operator works with it. ``weights_path`` is where the built-in
    runtime reads the weights inside a replica; ``claim`` the PVC to mount for them, if any."""

    namespace: str
    name: str
    uid: str
    generation: int
    runtime: str
    image: str | None
    port: int
    gpus: int
    mig_profile: str | None
    min_replicas: int
    max_replicas: int
    idle_timeout_s: float
    cold_start_budget_s: float
    max_queue: int
    max_batch: int
    max_wait_ms: int
    weights_path: str
    claim: str | None
    env: tuple[tuple[str, str], ...]
    pod_spec: Mapping[str, Any] | None
    template_hash: str
    gpu_memory: str | None = None
    args: tuple[str, ...] = ()  # server.args the runtime takes, appended to its command line
    ignored_args: tuple[str, ...] = ()  # server.args it does not take (shown in Ready)
    # spec.model.name, the model as its server reports it: vLLM and SGLang clients name the service
    # by it in their bodies' ``model`` (``RewardRouter.resolve``).
    model: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def services_file(self) -> dict[str, Any]:
        """The reward runtime's services file for a replica of this service."""
        return {
            "services": [
                {
                    "name": self.name,
                    "backend": "builtin",
                    "path": self.weights_path,
                    "maxBatchSize": self.max_batch,
                    "maxWaitMillis": self.max_wait_ms,
                    "maxQueueLength": self.max_queue,
                    "keepResident": self.min_replicas > 0,
                }
            ]
        }


def service_config(rms: RewardModelService, uid: str = "") -> ServiceConfig:
    """Translate a validated RewardModelService; InvalidSpec for what the operator cannot serve."""
    meta, spec = rms.metadata, rms.spec
    if not meta.name or not meta.namespace:
        raise InvalidSpec("metadata", "a RewardModelService needs a name and a namespace")
    if spec.server.runtime != "builtin":
        raise InvalidSpec(
            "spec.server.runtime",
            f"{spec.server.runtime} servers are not run by this operator yet; use runtime: builtin "
            "(the vLLM and SGLang adapters exist in the reward runtime, their pods do not)",
        )
    # Flags the built-in runtime does not take (a vLLM flag, one the operator sets, a typo) are
    # left out and named in the Ready condition, not refused: they were accepted before, and
    # refusing them now would stop routing to services that serve today.
    args = tuple(a for a in spec.server.args if a in BUILTIN_SERVER_FLAGS)
    ignored = tuple(a for a in spec.server.args if a not in BUILTIN_SERVER_FLAGS)
    uri = spec.model.uri
    scheme, _, rest = uri.partition("://")
    claim: str | None = None
    if scheme == "file":
        path = "/" + rest.lstrip("/")
    elif scheme == "pvc":
        claim, _, inner = rest.partition("/")
        if not claim or not inner:
            raise InvalidSpec(
                "spec.model.uri", f"pvc:// needs a claim and a path, e.g. pvc://weights/rm.npz; got {uri}"
            )
        path = f"{WEIGHTS_MOUNT}/{inner}"
    else:
        raise InvalidSpec(
            "spec.model.uri",
            f"{scheme}:// weights are never downloaded at run time: put them on a PersistentVolumeClaim "
            "(pvc://CLAIM/PATH) or in the image (file:///PATH)",
        )
    relevant: dict[str, Any] = {
        "server": spec.server.model_dump(mode="json"),
        "gpu": spec.gpu.model_dump(mode="json"),
        "model": spec.model.model_dump(mode="json"),
        "batching": spec.batching.model_dump(mode="json"),
    }
    config = ServiceConfig(
        namespace=meta.namespace,
        name=meta.name,
        uid=uid,
        generation=meta.generation or 0,
        runtime=spec.server.runtime,
        image=spec.server.image,
        port=spec.server.port,
        gpus=min(spec.gpu.count),
        mig_profile=spec.gpu.mig_profile,
        min_replicas=spec.scaling.min_replicas,
        max_replicas=spec.scaling.max_replicas,
        idle_timeout_s=float(spec.scaling.idle_timeout_seconds),
        cold_start_budget_s=float(spec.scaling.cold_start_budget_seconds),
        max_queue=spec.scaling.max_queue_length,
        max_batch=spec.batching.max_batch_size,
        max_wait_ms=spec.batching.max_wait_millis,
        weights_path=path,
        claim=claim,
        env=tuple((e.name, e.value) for e in spec.server.env),
        pod_spec=spec.server.pod_spec,
        template_hash="",
        gpu_memory=str(spec.gpu.memory) if spec.gpu.memory else None,
        args=args,
        model=spec.model.name,
        ignored_args=ignored,
    )
    # The services file is part of what a replica is built from: the runtime reads it only at start,
    # and the ConfigMap holding it is rewritten only when the hash changes. Without it, an edit of
    # maxQueueLength reached neither the running replicas nor the ones started after it. Not
    # keepResident (minReplicas > 0): a replica runs this one service, which nothing else evicts
    # (scaling to zero deletes replicas), so it changes nothing worth replacing every replica for.
    relevant["servicesFile"] = [
        {k: v for k, v in entry.items() if k != "keepResident"}
        for entry in config.services_file()["services"]
    ]
    digest = hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]
    return replace(config, template_hash=digest)


_OBJECT_NAME = re.compile(DNS_SUBDOMAIN_PATTERN)


def is_object_name(name: str) -> bool:
    """Whether ``name`` can name a Kubernetes object (else it can only be a model a service serves)."""
    return len(name) <= 253 and _OBJECT_NAME.fullmatch(name) is not None


def service_named(namespace: str, target: str, served: Iterable[tuple[str, str, str]]) -> str:
    """The RewardModelService a request names in ``namespace``: by its own name, or by the model it
    serves (``spec.model.name``), as vLLM and SGLang clients name it in their bodies' ``model``
    (verl sends the model's path or Hugging Face id, such as ``Org/Reward-Model``, which no
    Kubernetes object can be named). ``served``: every known service as (namespace, name, model).
    A valid name no service is known by is returned as it is (a service just created may not be
    known yet; the caller then looks it up by name). ``InvalidSpec`` when two services serve the
    model (which one is the caller's to say); ``NotFound`` for a model no service serves."""
    known = [(name, model) for ns, name, model in served if ns == namespace]
    if any(name == target for name, _ in known):
        return target
    serving = sorted(name for name, model in known if model == target)
    if len(serving) == 1:
        return serving[0]
    if serving:
        raise InvalidSpec(
            "model",
            f"model {target[:256]!r} is served by RewardModelServices {', '.join(serving)} in namespace "
            f"{namespace!r}: name one (X-Tangram-Service or ?service=)",
        )
    if is_object_name(target):
        return target
    models = sorted({model for _, model in known})
    raise NotFound(
        "RewardModelService",
        target,
        f"no RewardModelService in namespace {namespace!r} is named {target[:256]!r} or serves that "
        f"model (models served there: {', '.join(models[:10]) or 'none'})",
    )


def reward_text(payload: Mapping[str, Any]) -> str:
    """The one text a reward model scores for a reward action's payload: ``prompt`` (a string or a
    chat's messages) and ``response``, or ``messages`` (a whole chat), or ``input``."""

    def chat(messages: Any) -> str:
        if not isinstance(messages, list):
            raise InvalidSpec("payload.messages", "must be a list of {role, content}")
        parts = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
                raise InvalidSpec(f"payload.messages[{i}]", "must be {role, content} with text content")
            parts.append(m["content"])
        return "\n".join(parts)

    if "input" in payload:
        if not isinstance(payload["input"], str):
            raise InvalidSpec("payload.input", "must be a string")
        return payload["input"]
    if "messages" in payload:
        return chat(payload["messages"])
    if "response" in payload:
        prompt = payload.get("prompt")
        if prompt is not None and not isinstance(prompt, (str, list)):
            # str() of it was scored (a dict's repr, "5"): a reward for a text nobody wrote.
            raise InvalidSpec(
                "payload.prompt",
                f"must be a string or a list of {{role, content}}, not {type(prompt).__name__}",
            )
        prompt_text = chat(prompt) if isinstance(prompt, list) else (prompt or "")
        if not isinstance(payload["response"], str):
            raise InvalidSpec("payload.response", "must be a string")
        return f"{prompt_text}{payload['response']}"
    raise InvalidSpec("payload", "a reward action needs input, messages, or prompt and response")
