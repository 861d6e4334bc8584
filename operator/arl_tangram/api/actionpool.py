"""ActionPool: a pool of CPU sandboxes that runs code and test actions.

``mode: shared`` keeps long-lived *sandbox host* pods that run many actions at once, each action on
cores of its own; ``mode: dedicated`` runs one pod per session (from the template's image: an image
per session is not served yet) and grants cores per action by in-place pod resize.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Field, field_validator

from arl_tangram.api.meta import (
    API_VERSION,
    DNS_SUBDOMAIN_PATTERN,
    MAX_ENV,
    MAX_MAP_ENTRIES,
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
from arl_tangram.api.quantity import PositiveQuantity, parse_quantity

Language = Literal[
    "python",
    "bash",
    "c",
    "cpp",
    "go",
    "go_test",
    "java",
    "nodejs",
    "typescript",
    "rust",
    "perl",
    "php",
    "ruby",
    "lua",
    "R",
    "D_ut",
    "verilog",
    "scala",
    "junit",
    "lean",
]
LANGUAGES: tuple[str, ...] = get_args(Language)

PoolMode = Literal["shared", "dedicated"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
NetworkAccess = Literal["Disabled", "Enabled"]

# Processes and threads per action (the limit is per uid, and each action has its own): at 64 or
# 128 ordinary programs failed where they pass outside, Python with 200 threads, Java with 150 (the
# JVM has about 20 of its own), Go with 300 goroutines blocked in system calls. A host's actions'
# worth is still far from the kernel's default pid_max (1024 per CPU, 32768 at least): a fork bomb
# stops at this many of its own. A cluster that bounds a pod's processes (the kubelet's
# podPidsLimit) bounds a host's actions together: keep this times the actions a host runs at once
# under it (docs/operations.md). The agent's --nproc default too.
DEFAULT_MAX_PROCESSES = 512

# A name becomes the value of a label on the pool's pods, and label values hold at most 63 characters.
MAX_POOL_NAME_LENGTH = 63
MAX_IMAGE_LENGTH = 512
MAX_ALLOWED_IMAGE_PREFIXES = 32


def _quantity_le(small: str | None, large: str | None) -> bool:
    return small is None or large is None or parse_quantity(small) <= parse_quantity(large)


def _default_languages() -> list[Language]:
    return ["python"]


# The longest a session may live idle: a pool's sessions.ttlSeconds, and what a sandbox agent keeps.
MAX_SESSION_TTL_S = 7 * 24 * 3600


class HostResources(TangramModel):
    """Resources of one sandbox host pod (shared mode) or the ceiling of one session pod (dedicated)."""

    cpu: PositiveQuantity = Field(
        default="8",
        description="CPU cores of one host, e.g. 16. Actions get whole cores of it, exclusively.",
    )
    memory: PositiveQuantity = Field(
        default="16Gi",
        description="Memory of one host, e.g. 32Gi; shared by the sessions and actions it runs.",
    )
    ephemeral_storage: PositiveQuantity | None = Field(
        default=None,
        description="Ephemeral storage one host requests, e.g. 20Gi, and the size limit of its work "
        "volume. The working directories themselves are each a tmpfs of their own, bounded by "
        "limits.workdir and counted in the host's memory, not here.",
    )


class SandboxHostTemplate(TangramModel):
    """What the operator builds each sandbox host pod from."""

    image: str = Field(
        min_length=1,
        max_length=MAX_IMAGE_LENGTH,
        pattern=r"^\S+$",
        description="Container image of the sandbox host (runs `tangram sandbox-agent`), "
        "e.g. arl-tangram-sandbox:0.1.0; in dedicated mode too, every session's pod's (an image "
        "per session is not served yet).",
    )
    image_pull_policy: PullPolicy = Field(
        default="IfNotPresent", description="When the kubelet pulls the image: Always, IfNotPresent, Never."
    )
    resources: HostResources = defaulted(HostResources, "CPU and memory of each host pod.")
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_ENV,
        description="Extra environment variables of the sandbox container.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_MAP_ENTRIES,
        description="Extra labels on each host pod.",
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_MAP_ENTRIES,
        description="Extra annotations on each host pod.",
    )
    pod_spec: dict[str, Any] | None = Field(
        default=None,
        description="Fields of a Kubernetes PodSpec merged into each host pod (tolerations, affinity, "
        "nodeSelector, volumes, imagePullSecrets, ...). The operator owns the sandbox container's command, "
        "resources and ports; the API server validates the rest when it creates the pod.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    @field_validator("env")
    @classmethod
    def _unique_env(cls, env: list[EnvVar]) -> list[EnvVar]:
        no_duplicates([e.name for e in env], "environment variable")
        return env


# A workdir holds at most one file (or directory) per this many bytes of its size limit.
WORKDIR_BYTES_PER_FILE = 16 << 10


class ActionLimits(TangramModel):
    """Limits that apply to every action the pool runs."""

    timeout_seconds: int = Field(
        default=30,
        ge=1,
        le=86400,
        description="Wall-clock limit of one action; its whole process group is killed when it expires.",
    )
    memory: PositiveQuantity = Field(
        default="1Gi",
        description="Memory limit of one action (address space of its processes), e.g. 2Gi.",
    )
    workdir: PositiveQuantity = Field(
        default="1Gi",
        description="Most one action's (or one session's) working directory may hold, e.g. 4Gi; its "
        f"files and directories are bounded too, one per {WORKDIR_BYTES_PER_FILE >> 10}Ki of it. "
        "Workdirs are held in the host's memory (resources.memory counts them; size it for what the "
        "actions and sessions running at once may hold): a write past the limit fails with ENOSPC, "
        "as on a full disk, instead of filling the host.",
    )
    max_output_bytes: int = Field(
        default=1048576,
        ge=0,
        le=67108864,
        description="Bytes of stdout plus stderr kept per action; the rest is dropped and marked truncated.",
    )
    max_processes: int = Field(
        default=DEFAULT_MAX_PROCESSES,
        ge=1,
        le=4096,
        description="Most processes (and threads) one action may run at once.",
    )
    max_cores: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="Most cores one elastic action (e.g. `pytest -n $TANGRAM_DOP`) is granted.",
    )


class Isolation(TangramModel):
    """How actions are kept apart from each other and from the world."""

    network: NetworkAccess = Field(
        default="Disabled",
        description="Whether actions may open network connections: Disabled (default) or Enabled.",
    )
    runtime_class_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="RuntimeClass of the host pods, e.g. gvisor or kata, for a kernel boundary around "
        "untrusted code. Unset: the cluster's default runtime.",
    )


class PoolScaling(TangramModel):
    """How many sandbox hosts the pool runs; the capacity planner moves between the bounds."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.minHosts <= self.maxHosts",
            message="minHosts must not exceed maxHosts",
            check=lambda s: s.min_hosts <= s.max_hosts,
            field="minHosts",
        ),
        CelRule(
            rule="self.warmHosts <= self.maxHosts",
            message="warmHosts must not exceed maxHosts",
            check=lambda s: s.warm_hosts <= s.max_hosts,
            field="warmHosts",
        ),
    )

    min_hosts: int = Field(default=0, ge=0, le=10000, description="Fewest hosts, even when idle.")
    max_hosts: int = Field(default=4, ge=1, le=10000, description="Most hosts the pool may run.")
    warm_hosts: int = Field(
        default=0,
        ge=0,
        le=10000,
        description="Idle hosts kept ready beyond current demand, so a burst does not wait for pod start.",
    )
    idle_timeout_seconds: int = Field(
        default=300,
        ge=0,
        le=604800,
        description="How long a host stays without actions or sessions before it is removed.",
    )
    max_starting: int = Field(
        default=4,
        ge=1,
        le=1000,
        description="Most hosts starting at once, to spare the image registry and the scheduler.",
    )


class Sessions(TangramModel):
    """Per-trajectory state kept between actions (working directory, optional live interpreter)."""

    ttl_seconds: int = Field(
        default=3600,
        ge=1,
        le=MAX_SESSION_TTL_S,
        description="A session without actions for this long is closed and its state deleted. It is "
        "the default and the most a caller may ask for when opening one; an open session keeps the TTL it "
        "was opened with, so an edit applies to sessions opened after it (the hosts are not replaced).",
    )
    persistent_interpreter: bool = Field(
        default=False,
        description="Keep a live interpreter per session (variables survive between actions), as in "
        "notebook-style tools. Off: every action starts from the session's files only.",
    )
    max_per_host: int = Field(
        default=256,
        ge=1,
        le=100000,
        description="Most sessions one host holds; new sessions go to other hosts beyond it.",
    )


class DedicatedMode(TangramModel):
    """Settings of `mode: dedicated` (one pod per session)."""

    allowed_image_prefixes: list[Annotated[str, Field(min_length=1, max_length=MAX_IMAGE_LENGTH)]] = Field(
        default_factory=list,
        max_length=MAX_ALLOWED_IMAGE_PREFIXES,
        description="Reserved for the images a session may ask for (references starting with one of "
        "these, e.g. registry.example.com/swe-tasks/). Not served yet: a session cannot name an "
        "image, and every session's pod runs spec.template.image.",
    )
    max_sessions: int = Field(
        default=64,
        ge=1,
        le=10000,
        description="Most session pods at once; further sessions wait in the queue.",
    )
    idle_cpu: PositiveQuantity = Field(
        default="100m",
        description="CPU a session pod keeps between actions (its cores are resized down to this).",
    )


class ActionPoolSpec(TangramModel):
    """Desired state of an ActionPool."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.mode == 'dedicated' || !has(self.dedicated)",
            message="dedicated settings apply only with mode: dedicated",
            check=lambda s: s.mode == "dedicated" or s.dedicated is None,
            field="dedicated",
        ),
        CelRule(
            # isQuantity guards keep a malformed quantity to its own (pattern) error.
            rule="!isQuantity(self.limits.memory) || !isQuantity(self.template.resources.memory) || "
            "quantity(self.limits.memory).compareTo(quantity(self.template.resources.memory)) <= 0",
            message="limits.memory must not exceed template.resources.memory",
            check=lambda s: _quantity_le(s.limits.memory, s.template.resources.memory),
            field="limits.memory",
        ),
    )

    mode: PoolMode = Field(
        default="shared",
        description="shared: long-lived sandbox hosts run many actions at once; dedicated: one pod per "
        "session (pod per trajectory), each action's cores granted by in-place resize.",
    )
    template: SandboxHostTemplate = Field(description="What each sandbox host pod is made of.")
    languages: list[Language] = Field(
        default_factory=_default_languages,
        min_length=1,
        max_length=len(LANGUAGES),
        description=f"Languages the pool's image runs: any of {', '.join(LANGUAGES)}. One its hosts "
        "cannot run makes the pool Degraded (LanguagesMissing).",
        json_schema_extra={"x-kubernetes-list-type": "set", "default": ["python"]},
    )
    limits: ActionLimits = defaulted(ActionLimits, "Limits on each action.")
    isolation: Isolation = defaulted(Isolation, "Network access and kernel isolation of actions.")
    scaling: PoolScaling = defaulted(PoolScaling, "Bounds on the number of hosts.")
    sessions: Sessions = defaulted(Sessions, "Per-trajectory state between actions.")
    dedicated: DedicatedMode | None = Field(
        default=None, description="Settings of mode: dedicated; leave unset in shared mode."
    )
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=10000,
        description="Desired number of hosts, written through the /scale subresource (HPA, KEDA). "
        "Unset: the operator's planner decides. Always clamped to [minHosts, maxHosts]. Leave it out "
        "of Git.",
    )

    @field_validator("languages")
    @classmethod
    def _unique_languages(cls, languages: list[str]) -> list[str]:
        return no_duplicates(languages, "language")


class ActionPoolStatus(TangramModel):
    """Observed state of an ActionPool, written by the operator."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation this status was computed from."
    )
    conditions: Conditions = Field(default_factory=list)
    replicas: int = Field(default=0, ge=0, description="Hosts that exist, ready or not (for /scale).")
    selector: str | None = Field(
        default=None,
        max_length=1024,
        description="Label selector of the pool's host pods, as a string (for /scale and HPA).",
    )
    hosts_ready: int = Field(default=0, ge=0, description="Hosts that accept actions.")
    hosts_starting: int = Field(default=0, ge=0, description="Hosts created but not ready yet.")
    cores_total: int = Field(default=0, ge=0, description="Cores of all ready hosts.")
    cores_busy: int = Field(default=0, ge=0, description="Cores granted to running actions now.")
    sessions: int = Field(default=0, ge=0, description="Open sessions.")
    queue_depth: int = Field(default=0, ge=0, description="Actions waiting for cores.")
    act: ActStats | None = Field(default=None, description="Action completion times over a recent window.")


class ActionPool(TangramModel):
    """A pool of CPU sandboxes that runs code and test actions, one action at a time per core grant."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        name_fits_a_label("ActionPool", MAX_POOL_NAME_LENGTH, "pool"),
    )

    api_version: Literal["tangram.arl.dev/v1alpha1"] = Field(default=API_VERSION, description="API version.")
    kind: Literal["ActionPool"] = Field(default="ActionPool", description="Kind.")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta, description="Standard object metadata.")
    spec: ActionPoolSpec = Field(description="Desired state.")
    status: ActionPoolStatus | None = Field(default=None, description="Observed state.")
