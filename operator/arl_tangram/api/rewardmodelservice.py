"""RewardModelService: one model service (reward model, LLM judge, teacher) on shared GPUs.

The operator deploys the service on GPU chunks, backs its weights up in host memory and restores it on
demand (evict-on-execution), so that many services share few GPUs and idle ones cost no GPU at all.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import AfterValidator, Field

from arl_tangram.api.meta import (
    API_VERSION,
    MAX_ARGS,
    MAX_ENV,
    ActStats,
    CelRule,
    Conditions,
    EnvVar,
    ObjectMeta,
    TangramModel,
    defaulted,
    name_fits_a_label,
    no_duplicates,
)
from arl_tangram.api.quantity import PositiveQuantity

ServerRuntime = Literal["builtin", "vllm", "sglang"]
SERVER_RUNTIMES: tuple[str, ...] = get_args(ServerRuntime)
ModelTask = Literal["reward", "judge", "teacher"]
DType = Literal["auto", "float16", "bfloat16", "float32"]
NVLinkNeed = Literal["Required", "Preferred", "None"]
GpuCount = Literal[1, 2, 4, 8]
GPU_COUNTS: tuple[int, ...] = get_args(GpuCount)
PlacementState = Literal["Resident", "Evicted", "Restoring"]

MAX_SERVICE_NAME_LENGTH = 63
MAX_PLACEMENTS = 256
MAX_GPUS_PER_PLACEMENT = 8
WEIGHTS_URI_PATTERN = r"^(hf|pvc|s3|gs|oci|file)://\S+$"
MIG_PROFILE_PATTERN = r"^[1-7]g\.[0-9]+gb(\+me)?$"
# spec.model.name, and the gateway's vLLM and SGLang ``model`` fields that name a service by it.
MAX_MODEL_NAME_LENGTH = 256


class ModelSource(TangramModel):
    """Which model to serve and where its weights live."""

    name: str = Field(
        min_length=1,
        max_length=MAX_MODEL_NAME_LENGTH,
        description="Model name as the server reports it, e.g. Skywork/Skywork-Reward-V2-Qwen3-0.6B.",
    )
    uri: str = Field(
        max_length=1024,
        pattern=WEIGHTS_URI_PATTERN,
        description="Where the weights live: hf://ORG/NAME, pvc://CLAIM/PATH, s3://BUCKET/PREFIX, "
        "gs://BUCKET/PREFIX, oci://IMAGE or file:///PATH (a path inside the server image).",
    )
    revision: str | None = Field(
        default=None, max_length=256, description="Revision (branch, tag or commit) of the weights."
    )
    task: ModelTask = Field(
        default="reward",
        description="reward: scores a response (one number per request); judge: an LLM that grades by "
        "generating; teacher: an LLM whose outputs or log-probs are the target.",
    )
    dtype: DType = Field(default="auto", description="Weight precision: auto, float16, bfloat16, float32.")
    max_model_len: int | None = Field(
        default=None, ge=1, le=10485760, description="Longest sequence in tokens; unset: the model's own."
    )


class ModelServer(TangramModel):
    """The process that serves the model inside each replica's pod."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.runtime == 'builtin' || has(self.image)",
            message="image is required when runtime is vllm or sglang",
            check=lambda s: s.runtime == "builtin" or s.image is not None,
            field="image",
        ),
    )

    runtime: ServerRuntime = Field(
        default="builtin",
        description="builtin: the operator's reward runtime (holds several services per GPU chunk, swaps "
        "weights from host memory); vllm: a vLLM server, evicted through sleep/wake; sglang: an SGLang "
        "server, evicted through release/resume of its memory.",
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        pattern=r"^\S+$",
        description="Container image of the server. Required for vllm and sglang; builtin defaults to the "
        "operator's reward runtime image.",
    )
    args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list,
        max_length=MAX_ARGS,
        description="Extra command-line arguments of the server, e.g. --max-num-seqs=64. The builtin "
        "runtime takes --no-prewarm (restore the weights on a request, not as the replica starts); "
        "others are left out and named in the Ready condition.",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Port the server listens on in the pod.")
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_ENV,
        description="Extra environment variables of the server container.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    pod_spec: dict[str, Any] | None = Field(
        default=None,
        description="Fields of a Kubernetes PodSpec merged into each replica pod (tolerations, affinity, "
        "volumes, imagePullSecrets, ...). The operator owns the server container's command, resources and "
        "GPU assignment.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


def _unique_counts(counts: list[int]) -> list[int]:
    return no_duplicates(counts, "GPU count")


def _default_counts() -> list[GpuCount]:
    return [1]


class GpuNeed(TangramModel):
    """The GPUs one replica needs: whole GPUs from a feasible set, or one MIG slice."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.migProfile) || self.count.all(c, c == 1)",
            message="a MIG slice is one device: count must be [1] when migProfile is set",
            check=lambda s: s.mig_profile is None or all(c == 1 for c in s.count),
            field="count",
        ),
        CelRule(
            rule="!has(self.migProfile) || self.nvlink != 'Required'",
            message="a MIG slice has no NVLink peers: nvlink cannot be Required with migProfile",
            check=lambda s: s.mig_profile is None or s.nvlink != "Required",
            field="nvlink",
        ),
    )

    count: Annotated[list[GpuCount], AfterValidator(_unique_counts)] = Field(
        default_factory=_default_counts,
        min_length=1,
        max_length=len(GPU_COUNTS),
        description="Feasible GPUs per replica (tensor-parallel sizes), any of 1, 2, 4, 8. With several, "
        "the scheduler picks per action: more GPUs when they are free, fewer when they are not.",
        json_schema_extra={"x-kubernetes-list-type": "set", "default": [1]},
    )
    mig_profile: str | None = Field(
        default=None,
        max_length=32,
        pattern=MIG_PROFILE_PATTERN,
        description="Run on one MIG slice of this profile instead of whole GPUs, e.g. 1g.10gb or 3g.40gb.",
    )
    memory: PositiveQuantity | None = Field(
        default=None,
        description="GPU memory one replica needs (weights, KV cache, activations), e.g. 8Gi; used to pack "
        "services onto GPUs and to pick MIG slices.",
    )
    nvlink: NVLinkNeed = Field(
        default="Preferred",
        description="Whether the GPUs of a multi-GPU replica must share NVLink: Required, Preferred, None.",
    )


class ServiceScaling(TangramModel):
    """How many replicas the service runs; 0 allows scale-to-zero (weights stay in host memory)."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.minReplicas <= self.maxReplicas",
            message="minReplicas must not exceed maxReplicas",
            check=lambda s: s.min_replicas <= s.max_replicas,
            field="minReplicas",
        ),
    )

    min_replicas: int = Field(
        default=0, ge=0, le=1000, description="Fewest replicas resident on GPUs; 0 allows scale-to-zero."
    )
    max_replicas: int = Field(default=1, ge=1, le=1000, description="Most replicas at once.")
    cold_start_budget_seconds: int = Field(
        default=60,
        ge=1,
        le=3600,
        description="Longest acceptable restore of an evicted replica; when restores take longer the "
        "service is kept resident and Degraded says why.",
    )
    max_queue_length: int = Field(
        default=1024,
        ge=1,
        le=1000000,
        description="Most requests waiting; beyond it new requests are refused at once (HTTP 429).",
    )
    idle_timeout_seconds: int = Field(
        default=600,
        ge=0,
        le=604800,
        description="A replica without requests for this long may be evicted from its GPUs.",
    )


class Batching(TangramModel):
    """How requests are grouped into one forward pass."""

    max_batch_size: int = Field(default=32, ge=1, le=4096, description="Most requests in one batch.")
    max_wait_millis: int = Field(
        default=10,
        ge=0,
        le=10000,
        description="Longest a request waits for others to join its batch.",
    )


class RewardModelServiceSpec(TangramModel):
    """Desired state of a RewardModelService."""

    model: ModelSource = Field(description="The model and where its weights live.")
    server: ModelServer = defaulted(ModelServer, "The server process of each replica.")
    gpu: GpuNeed = defaulted(GpuNeed, "GPUs of one replica.")
    scaling: ServiceScaling = defaulted(ServiceScaling, "Bounds on the number of replicas.")
    batching: Batching = defaulted(Batching, "Request batching.")
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="Desired replicas, written through the /scale subresource (HPA, KEDA). Unset: the "
        "operator decides. Always clamped to [minReplicas, maxReplicas]. Leave it out of Git.",
    )


class Placement(TangramModel):
    """Where one replica of the service lives."""

    node: str = Field(min_length=1, max_length=253, description="Node that holds the replica's GPUs.")
    gpus: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=list,
        max_length=MAX_GPUS_PER_PLACEMENT,
        description="UUIDs of its GPUs (GPU-...) or of its MIG slice (MIG-...).",
    )
    state: PlacementState = Field(
        description="Resident: weights on the GPUs; Evicted: weights only in host memory; Restoring: "
        "being copied back."
    )
    pod: str | None = Field(default=None, max_length=253, description="Pod that serves the replica.")


class RewardModelServiceStatus(TangramModel):
    """Observed state of a RewardModelService, written by the operator."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation this status was computed from."
    )
    conditions: Conditions = Field(default_factory=list)
    replicas: int = Field(default=0, ge=0, description="Replicas placed, resident or not (for /scale).")
    ready_replicas: int = Field(default=0, ge=0, description="Replicas resident and serving.")
    updated_replicas: int = Field(
        default=0,
        ge=0,
        description="Replicas built from the current spec; while fewer than `replicas`, the others "
        "(an older spec) are being replaced (condition Scaling, reason RollingOut).",
    )
    selector: str | None = Field(
        default=None,
        max_length=1024,
        description="Label selector of the service's pods, as a string (for /scale and HPA).",
    )
    placements: list[Placement] = Field(
        default_factory=list,
        max_length=MAX_PLACEMENTS,
        description="Where each replica lives and whether its weights are on the GPUs.",
    )
    queue_depth: int = Field(default=0, ge=0, description="Requests waiting for a replica.")
    act: ActStats | None = Field(default=None, description="Action completion times over a recent window.")


class RewardModelService(TangramModel):
    """A model service (reward model, judge, teacher) on shared GPUs, restored on demand."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        name_fits_a_label("RewardModelService", MAX_SERVICE_NAME_LENGTH, "service"),
    )

    api_version: Literal["tangram.arl.dev/v1alpha1"] = Field(default=API_VERSION, description="API version.")
    kind: Literal["RewardModelService"] = Field(default="RewardModelService", description="Kind.")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta, description="Standard object metadata.")
    spec: RewardModelServiceSpec = Field(description="Desired state.")
    status: RewardModelServiceStatus | None = Field(default=None, description="Observed state.")
