"""The gateway's request and response bodies, as pydantic models: they validate what comes in and
are the one source of ``/openapi.json``.

The native action is the ActionBatch API's own :class:`~arl_tangram.api.actionbatch.Action` (same
fields, limits and camelCase names) plus where it goes, so that one action reads the same through
every door. The trainer shapes (OpenRLHF, slime, vLLM, SGLang, SandboxFusion) keep their owners'
field names; unknown fields are refused by name (a typo must not be silently ignored), except where
the owner's server ignores them: ``/run_code`` (its model is the sandbox agent's own, so that both
answer alike) and vLLM's shapes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model

from arl_tangram.api.actionbatch import Action
from arl_tangram.api.meta import DNS_LABEL_PATTERN, DNS_SUBDOMAIN_PATTERN, TangramModel
from arl_tangram.api.rewardmodelservice import MAX_MODEL_NAME_LENGTH
from arl_tangram.domain.actions import Outcome
from arl_tangram.sandbox.actions import MAX_KEY_CHARS
from arl_tangram.sandbox.models import Text

# Printable ASCII, without outer spaces (HTTP drops them from the header the key may also come in).
KEY_PATTERN = rf"^[!-~](?:[ -~]{{0,{MAX_KEY_CHARS - 2}}}[!-~])?$"
NamespaceName = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)]
TargetName = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_SUBDOMAIN_PATTERN)]
# vLLM's and SGLang's ``model``: the served model's name as their clients send it (a Hugging Face id
# such as Org/Name, which is no Kubernetes name), or the RewardModelService's own name.
ModelName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_MODEL_NAME_LENGTH,
        description="The RewardModelService's name, or the model it serves (its spec.model.name).",
    ),
]
IdempotencyKey = Annotated[
    str,
    Field(
        pattern=KEY_PATTERN,
        description="Idempotency key: a repeat with the same key (a retry) never runs the action twice.",
    ),
]


def _finite(value: float) -> float:
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("must be a finite number")
    return value


class GatewayAction(Action):
    """One action: an ActionBatch action (``type``, ``target``, ``payload``, ``units``...) plus the
    namespace its target lives in and an idempotency key. ``id`` is optional here and is echoed."""

    id: str | None = Field(  # type: ignore[assignment]
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.:/]*[A-Za-z0-9])?$",
        description="The caller's name for the action, echoed in its result.",
    )
    namespace: NamespaceName | None = Field(
        default=None, description="Namespace of the target; unset: the gateway's default namespace."
    )
    key: IdempotencyKey | None = None


# An action run inside a session: the session says where it goes.
SessionAction: type[TangramModel] = create_model(  # type: ignore[call-overload]
    "SessionAction",
    __base__=TangramModel,
    __doc__="An action run in a session (the session names its pool and namespace).",
    **{
        name: (info.annotation, info)
        for name, info in GatewayAction.model_fields.items()
        if name not in ("target", "namespace", "session_id")
    },
)


class ActionResultBody(TangramModel):
    """How one action ended. ``response`` is the target's own answer, verbatim."""

    id: str | None = None
    key: str
    state: Outcome
    reason: str | None = None
    message: str | None = None
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    reward: float | None = None
    duration_seconds: float = 0.0
    queued_seconds: float = 0.0
    attempts: int = 0
    host: str | None = None
    cores: list[int] = Field(default_factory=list)
    truncated: bool = False
    response: dict[str, Any] = Field(default_factory=dict)


class ErrorBody(BaseModel):
    """Every refusal: ``error`` says what is wrong; ``field`` names the culprit when there is one."""

    model_config = ConfigDict(extra="allow")

    error: str
    field: str | None = None
    detail: list[dict[str, Any]] | None = None
    retry_after: float | None = Field(None, alias="retryAfter")
    leader: str | None = None


class StreamError(TangramModel):
    """A line of ``/v1/actions:stream`` output for an action that was refused instead of run."""

    id: str | None = None
    key: str | None = None
    line: int = Field(
        description="1-based line number of the action in the request stream; 0 for the body as a whole."
    )
    status: int = Field(description="The HTTP status the same action would get from POST /v1/actions.")
    error: str
    field: str | None = None
    retry_after: float | None = None


class CancelActions(TangramModel):
    """``POST /v1/actions:cancel``: stop actions of the caller's by their keys."""

    namespace: NamespaceName | None = Field(
        default=None, description="Namespace the keys were sent in; unset: the gateway's default namespace."
    )
    keys: list[IdempotencyKey] = Field(min_length=1, max_length=10_000)


class CancelledActions(TangramModel):
    """What ``POST /v1/actions:cancel`` did with each key."""

    cancelled: list[str] = Field(description="Keys whose action was queued or running, and is stopped.")
    not_running: list[str] = Field(
        description="Keys with nothing queued or running here (ended, or not arrived yet: an action "
        "that arrives under one of them within a few minutes is answered Cancelled, not run)."
    )


class SessionCreate(TangramModel):
    """Open a session (per-trajectory state: working directory, optional live interpreter)."""

    namespace: NamespaceName | None = None
    pool: TargetName
    ttl_seconds: Annotated[float, AfterValidator(_finite)] | None = Field(
        default=None, gt=0, description="Idle time after which the session is closed; unset: the default."
    )


class SessionBody(TangramModel):
    """An open session."""

    id: str
    namespace: str
    pool: str
    ttl_seconds: float
    expires_in_seconds: float


# ---- rewards -------------------------------------------------------------------------------------------
Prompt = Text | list[dict[str, Any]]


class RewardItem(TangramModel):
    """One sample to score: what was asked, what the policy answered, and the reference (``label``):
    for a test-based reward, the label is the tests (pytest source) the answer must pass."""

    prompt: Prompt = ""
    response: Text
    label: Any = None


class RewardRequest(TangramModel):
    """Score samples with a RewardModelService (``service``) or by the pass fraction of tests run in an
    ActionPool (``pool``); give exactly one of them, or neither for the namespace's default service."""

    namespace: NamespaceName | None = None
    service: TargetName | None = None
    pool: TargetName | None = None
    items: list[RewardItem] = Field(min_length=1)
    timeout_seconds: int | None = Field(default=None, ge=1, le=86400)


class RewardResponse(TangramModel):
    """One reward per item, in order."""

    rewards: list[float]


class OpenRLHFRewardRequest(BaseModel):
    """OpenRLHF's remote reward model request (``--remote_rm_url``): ``query`` holds prompt and
    response together; ``prompts`` the prompts alone; ``labels`` the references."""

    model_config = ConfigDict(extra="forbid")

    # Empty is a request like any other, answered with empty lists as OpenRLHF's own server answers
    # it: its client shards one sample over every URL of --remote_rm_url, so all but the first get
    # none, and a refusal there (retried, then raised) lost the sample's reward.
    query: list[Text]
    prompts: list[Text] | None = None
    labels: list[Any] | None = None


class OpenRLHFRewardResponse(BaseModel):
    """What OpenRLHF reads: ``rewards`` (and ``scores``, the same values, for its newer versions)."""

    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]] = Field(default_factory=dict)


class SlimeRewardRequest(BaseModel):
    """slime's remote reward model request (``--rm-type remote_rm --rm-url``); it reads the answer
    body itself as the reward, so the answer is a bare JSON number."""

    model_config = ConfigDict(extra="forbid")

    prompt: Prompt = ""
    response: Text
    label: Any = None


class _VllmCommon(BaseModel):
    # vLLM's own request models take fields they do not know and ignore them (its clients send
    # ``task``, ``normalize`` and more, version by version): so do these.
    model_config = ConfigDict(extra="ignore")

    model: ModelName | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=-1000, le=1000)
    add_special_tokens: bool | None = None
    additional_data: Any = None
    # Whether the reward head's activation (sigmoid, for the one score) is applied: vLLM's
    # ``use_activation``, and its older names ``softmax`` and ``activation`` (which vLLM reads
    # first, in that order); unset: the route's default as vLLM's (see docs/gateway.md).
    use_activation: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None


class VllmScoreRequest(_VllmCommon):
    """vLLM's ``/score`` (and ``/v1/score``): ``text_1`` against each of ``text_2``."""

    text_1: Text | list[Text]
    text_2: Text | list[Text]


class VllmClassifyRequest(_VllmCommon):
    """vLLM's ``/classify``."""

    input: Text | list[Text]


# How an embedding or pooled vector is answered: a list of numbers, or (OpenAI's and vLLM's
# ``base64``) its float32 values, little-endian, base64-encoded. OpenAI's Python SDK asks for
# ``base64`` whenever its caller names no format.
EncodingFormat = Literal["float", "base64"]


class VllmPoolingRequest(_VllmCommon):
    """vLLM's ``/pooling`` (how it serves reward models' scores)."""

    input: Text | list[Text]
    encoding_format: EncodingFormat = "float"


class SglangClassifyRequest(BaseModel):
    """SGLang's ``/classify`` for reward models: ``text`` is one conversation or a list of them."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName | None = None
    text: Text | list[Text]


class VllmUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class VllmScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class VllmScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[VllmScoreData]
    usage: VllmUsage = Field(default_factory=VllmUsage)


class VllmClassifyData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class VllmClassifyResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[VllmClassifyData]
    usage: VllmUsage = Field(default_factory=VllmUsage)


class VllmPoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class VllmPoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[VllmPoolingData]
    usage: VllmUsage = Field(default_factory=VllmUsage)


class EmbeddingsRequest(BaseModel):
    """OpenAI's ``/v1/embeddings``, as SGLang serves a reward model there (verl's reward loop reads
    the score as the last element of each embedding). Text only: token ids would need the model's
    tokenizer, which the gateway does not have."""

    # SGLang takes OpenAI's fields it does not use (``user``, ``dimensions``) and ignores them.
    model_config = ConfigDict(extra="ignore")

    model: ModelName | None = None
    input: Text | list[Text]
    encoding_format: EncodingFormat = "float"


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[EmbeddingData]
    usage: VllmUsage = Field(default_factory=VllmUsage)


class SglangClassifyItem(BaseModel):
    embedding: list[float]
    meta_info: dict[str, Any]
