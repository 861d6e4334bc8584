"""Sandbox host pods: built from a :class:`PoolConfig`, and read back into observations (pure)."""

from __future__ import annotations

import copy
import dataclasses
import math
import secrets
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from arl_tangram.api.meta import API_VERSION, GROUP
from arl_tangram.api.quantity import parse_quantity
from arl_tangram.domain.pools import PoolConfig, pool_key
from arl_tangram.domain.services import WEIGHTS_MOUNT, ServiceConfig
from arl_tangram.errors import InvalidSpec
from arl_tangram.gpu.placement import GPU_UUIDS_ENV, MIG_RESOURCE_PREFIX, DeviceRequest, ReplicaPlacement
from arl_tangram.runtime.interface import AGENT_PORT, HostObservation, HostPhase

POOL_LABEL = f"{GROUP}/pool"
ROLE_LABEL = f"{GROUP}/role"
TEMPLATE_LABEL = f"{GROUP}/template-hash"
DRAINING_ANNOTATION = f"{GROUP}/draining"
PLANNED_NODE_ANNOTATION = f"{GROUP}/planned-node"
ROLE_SANDBOX_HOST = "sandbox-host"
ROLE_REWARD_REPLICA = "reward-replica"
SERVICE_LABEL = f"{GROUP}/service"
PORT_ANNOTATION = f"{GROUP}/port"
DEFAULT_REWARD_IMAGE = "arl-tangram-reward:0.1.0"
SERVICES_FILE = "/etc/tangram/services.yaml"
CPU_DEVICE_MEMORY = "8Gi"  # what a reward runtime on CPU may keep resident when gpu.memory is unset
MANAGED_BY = {"app.kubernetes.io/managed-by": "arl-tangram", "app.kubernetes.io/name": "arl-tangram-sandbox"}
# What the agent needs for full isolation (namespaces, uid switching, killing its actions' trees;
# SYS_CHROOT because joining a prepared mount namespace, setns(2), asks for it besides SYS_ADMIN);
# sandbox-images/README.md explains each. User code never runs with them: the agent drops to a uid
# of its own range for every action.
AGENT_CAPABILITIES = (
    "SYS_ADMIN",
    "SYS_CHROOT",
    "SETUID",
    "SETGID",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "KILL",
)
WORKDIR = "/var/lib/tangram/work"


def new_host_name(pool: PoolConfig) -> str:
    """A fresh host name: the pool's name and a random suffix (never reused)."""
    return f"{pool.name}-{secrets.token_hex(3)}"


def agent_args(pool: PoolConfig) -> list[str]:
    """The sandbox agent's command line for a host of ``pool`` (its limits are the pool's)."""
    lim = pool.limits
    memory_mb = lim.memory_mb
    args = [
        f"--listen=$(POD_IP):{AGENT_PORT}",
        f"--workdir-root={WORKDIR}",
        f"--timeout={lim.timeout_s:g}",
        f"--max-timeout={lim.timeout_s:g}",
        f"--memory-mb={memory_mb}",
        f"--max-memory-mb={memory_mb}",
        f"--workdir-mb={lim.workdir_mb}",
        f"--nproc={lim.max_processes}",
        f"--output-bytes={lim.max_output_bytes}",
        f"--max-sessions={pool.sessions_per_host}",
        f"--session-ttl={pool.agent_session_ttl_s:g}",
    ]
    if pool.network:
        args.append("--network-allowed")
    return args


# A user's entries in these lists of the operator's container are kept after the operator's own,
# except one that clashes with one of the operator's on any of the named fields: the API server
# refuses a pod with two of them, and the operator's is the one its program needs.
MERGED_LISTS: dict[str, tuple[str, ...]] = {
    "env": ("name",),
    "envFrom": (),
    "volumeMounts": ("name", "mountPath"),
    "volumeDevices": ("name", "devicePath"),
}


def merged_container(own: dict[str, Any], containers: list[Any]) -> dict[str, Any]:
    """The operator's container ``own`` with what the pod spec's container of the same name says
    besides: every field the operator sets is the operator's (command, args, image, resources,
    ports, probes, its securityContext's fields), the lists of ``MERGED_LISTS`` keep the user's
    entries too, and the rest (lifecycle, workingDir, a securityContext's other fields, ...) is the
    user's. Without it a podSpec's container of that name would be dropped whole, its mounts and
    environment with it, while crd-reference.md says podSpec is merged."""
    user = next((c for c in containers if isinstance(c, dict) and c.get("name") == own["name"]), None)
    if user is None:
        return own
    merged: dict[str, Any] = {**copy.deepcopy(user), **own}
    for key, fields in MERGED_LISTS.items():
        ours = own.get(key) or []
        taken = {(f, item[f]) for item in ours for f in fields if item.get(f) is not None}
        theirs = [
            item
            for item in user.get(key) or []
            if not (isinstance(item, dict) and any((f, item.get(f)) in taken for f in fields))
        ]
        if ours or theirs:
            merged[key] = [*ours, *copy.deepcopy(theirs)]
    if isinstance(user.get("securityContext"), dict) and "securityContext" in own:
        # The operator's fields (the uid, the capabilities, no privilege escalation) are what its
        # isolation rests on; a user's others (seccomp, SELinux, AppArmor...) are added to them.
        merged["securityContext"] = {**copy.deepcopy(user["securityContext"]), **own["securityContext"]}
    return merged


def host_pod(pool: PoolConfig, name: str, node: str | None = None) -> dict[str, Any]:
    """The pod of one sandbox host: owned by its ActionPool, no ServiceAccount token, the agent as
    its only container with the pool's cores and memory as requests and limits."""
    spec: dict[str, Any] = copy.deepcopy(dict(pool.pod_spec or {}))
    container: dict[str, Any] = {
        "name": "agent",
        "image": pool.image,
        "imagePullPolicy": pool.image_pull_policy,
        "command": ["tangram", "sandbox-agent"],
        "args": agent_args(pool),
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *({"name": k, "value": v} for k, v in pool.env),
        ],
        "ports": [{"name": "agent", "containerPort": AGENT_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": str(pool.host_cores), "memory": str(pool.host_memory_bytes)},
            "limits": {"cpu": str(pool.host_cores), "memory": str(pool.host_memory_bytes)},
        },
        "readinessProbe": {
            "httpGet": {"path": "/v1/health", "port": "agent"},
            "periodSeconds": 2,
            "failureThreshold": 2,
        },
        "securityContext": {
            "runAsUser": 0,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": list(AGENT_CAPABILITIES)},
        },
        "volumeMounts": [{"name": "work", "mountPath": WORKDIR}],
    }
    if pool.ephemeral_storage_bytes:
        container["resources"]["requests"]["ephemeral-storage"] = str(pool.ephemeral_storage_bytes)
    if pool.mode == "dedicated":
        # Cores per action by in-place resize: the pod starts with its ceiling (so the agent knows
        # every core it may grant) and is resized to each action's cores, and to idleCpu between.
        container["resizePolicy"] = [{"resourceName": "cpu", "restartPolicy": "NotRequired"}]
    work: dict[str, Any] = {"medium": "Memory"}
    if pool.ephemeral_storage_bytes:
        work["sizeLimit"] = str(pool.ephemeral_storage_bytes)
    others = spec.get("containers", [])
    spec["containers"] = [
        merged_container(container, others),
        *[c for c in others if c.get("name") != "agent"],
    ]
    spec["volumes"] = [{"name": "work", "emptyDir": work}, *spec.get("volumes", [])]
    spec["restartPolicy"] = "Never"  # a dead agent lost its sessions: the host is replaced, not restarted
    spec["automountServiceAccountToken"] = False
    spec["enableServiceLinks"] = False
    if pool.runtime_class_name:
        spec["runtimeClassName"] = pool.runtime_class_name
    if node:
        # A preference, not a binding: the kube-scheduler still checks that the node has room.
        term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}
        affinity = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
        affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {"weight": 100, "preference": term}
        )
    labels = {
        **pool.labels,
        **MANAGED_BY,
        POOL_LABEL: pool.name,
        ROLE_LABEL: ROLE_SANDBOX_HOST,
        TEMPLATE_LABEL: pool.template_hash,
    }
    annotations = dict(pool.annotations)
    if node:
        annotations[PLANNED_NODE_ANNOTATION] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": pool.namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "ActionPool",
                    "name": pool.name,
                    "uid": pool.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
    }


def _timestamp(value: Any) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return 0.0
    return 0.0


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for cond in status.get("conditions") or ():
        if cond.get("type") == kind:
            return dict(cond)
    return None


def observe_host(pod: Mapping[str, Any]) -> HostObservation | None:
    """A host pod as an observation (None for a pod that is not a sandbox host)."""
    return _observe(pod, ROLE_SANDBOX_HOST, POOL_LABEL, AGENT_PORT, "agent")


def observe_replica(pod: Mapping[str, Any]) -> HostObservation | None:
    """A reward replica pod as an observation (``pool`` is its service's key)."""
    port = int(((pod.get("metadata") or {}).get("annotations") or {}).get(PORT_ANNOTATION, "8000"))
    return _observe(pod, ROLE_REWARD_REPLICA, SERVICE_LABEL, port, "runtime")


# The kubelet's waiting reasons that are steps of a normal start; any other (ErrImagePull,
# ImagePullBackOff, InvalidImageName, CreateContainerConfigError, CreateContainerError,
# RunContainerError...) means the container cannot start as things are, and may wait for ever.
STARTING_REASONS = frozenset({"ContainerCreating", "PodInitializing"})
READY_TO_START = "PodReadyToStartContainers"  # a pod condition since Kubernetes 1.29 (beta, on)
# Volume kinds the kubelet makes on the node at once (nothing to attach): a pod waiting on these
# for long waits on something missing, not on something slow.
INSTANT_VOLUMES = frozenset({"secret", "configMap", "projected", "downwardAPI", "emptyDir", "hostPath"})
# ... and the sources of a projected volume made so (a pod certificate waits for a signer).
INSTANT_PROJECTIONS = frozenset(
    {"secret", "configMap", "downwardAPI", "serviceAccountToken", "clusterTrustBundle"}
)


def _stalled(status: Mapping[str, Any]) -> str | None:
    """Why a placed pod's containers (init containers first) cannot start, in the kubelet's words;
    None while they start normally."""
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or ():
            waiting = (cs.get("state") or {}).get("waiting")
            if waiting and waiting.get("reason") and waiting["reason"] not in STARTING_REASONS:
                message = waiting.get("message")
                name = cs.get("name") or "?"
                return f"container {name}: {waiting['reason']}" + (f": {message}" if message else "")
    return None


def _setting_up(spec: Mapping[str, Any], status: Mapping[str, Any]) -> str | None:
    """Why a placed pod waits for its volumes or its sandbox, where that can only be a moment of a
    normal start; None otherwise (``HostObservation.setting_up``).

    The kubelet mounts the volumes its containers use, then makes the pod's sandbox, and says
    PodReadyToStartContainers once both are done (Kubernetes 1.29 and later; images are pulled
    after). A Secret or ConfigMap such a volume needs that does not exist keeps it False and the
    containers "ContainerCreating", silently: the reason is in the pod's events (FailedMount). Only
    pods whose mounted volumes are all made on the node at once count: a claim's volume (a PVC, a
    CSI or ephemeral volume, a resource claim) may take minutes to attach, and its pod is left
    starting for as long as the kubelet waits on it.
    """
    scheduled, ready_to_start = _condition(status, "PodScheduled"), _condition(status, READY_TO_START)
    if (scheduled or {}).get("status") != "True" or (ready_to_start or {}).get("status") != "False":
        return None
    if spec.get("resourceClaims"):
        return None
    used = {
        m.get("name")
        for key in ("initContainers", "containers", "ephemeralContainers")
        for c in spec.get(key) or ()
        for field in ("volumeMounts", "volumeDevices")
        for m in c.get(field) or ()
    }
    needed: list[str] = []
    for volume in spec.get("volumes") or ():
        if volume.get("name") not in used:
            continue  # the kubelet ignores a volume no container mounts
        kind = next((k for k in volume if k != "name"), "")
        sources = (volume.get("projected") or {}).get("sources") or () if kind == "projected" else ()
        if kind not in INSTANT_VOLUMES or any(set(src) - INSTANT_PROJECTIONS for src in sources):
            return None
        needed += _objects(volume)
    said = next(
        (
            str(w["message"])
            for key in ("initContainerStatuses", "containerStatuses")
            for cs in status.get(key) or ()
            if (w := (cs.get("state") or {}).get("waiting")) and w.get("message")
        ),
        None,
    )
    if said:
        return f"its volumes or pod sandbox are not ready: {said}"
    if needed:
        return (
            "its volumes or pod sandbox are not ready (does it lack "
            + ", ".join(needed)
            + "? its events say which)"
        )
    return "its volumes or pod sandbox are not ready (its events say why)"


def _objects(volume: Mapping[str, Any]) -> list[str]:
    """The Secrets and ConfigMaps a volume is made from, as "Secret x", that may be missing
    (those marked optional may not be)."""
    sources = [
        (kind, src[key] or {})
        for src in (volume, *((volume.get("projected") or {}).get("sources") or ()))
        for key, kind in (("secret", "Secret"), ("configMap", "ConfigMap"))
        if key in src
    ]
    return [
        f"{kind} {ref.get('secretName') or ref.get('name')}"
        for kind, ref in sources
        if not ref.get("optional") and (ref.get("secretName") or ref.get("name"))
    ]


def _observe(
    pod: Mapping[str, Any], role: str, owner_label: str, port: int, container_name: str
) -> HostObservation | None:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(ROLE_LABEL) != role or owner_label not in labels:
        return None
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    phase_k8s = status.get("phase") or "Pending"
    ready = _condition(status, "Ready")
    scheduled = _condition(status, "PodScheduled")
    pending = None
    stalled = None
    setting_up = False
    failure = None
    phase: HostPhase
    if meta.get("deletionTimestamp"):
        phase = "terminating"
    elif phase_k8s in ("Failed", "Succeeded"):
        phase = "failed"
        failure = status.get("message") or status.get("reason") or f"the pod is {phase_k8s}"
    elif ready is not None and ready.get("status") == "True" and status.get("podIP"):
        phase = "draining" if annotations.get(DRAINING_ANNOTATION) == "true" else "ready"
    else:
        phase = "draining" if annotations.get(DRAINING_ANNOTATION) == "true" else "starting"
        if scheduled is not None and scheduled.get("status") == "False":
            pending = str(scheduled.get("message") or scheduled.get("reason") or "not scheduled")
        for cs in status.get("containerStatuses") or ():
            term = (cs.get("state") or {}).get("terminated")
            if term:
                phase, failure = "failed", f"the agent exited {term.get('exitCode')}: {term.get('reason')}"
        stalled = _stalled(status)
        if stalled is None:
            stalled = _setting_up(spec, status)
            setting_up = stalled is not None
    container: Mapping[str, Any] = next(
        (c for c in spec.get("containers") or () if c.get("name") == container_name), {}
    )
    requests = (container.get("resources") or {}).get("requests") or {}
    ip = status.get("podIP")
    applied = None
    for cs in status.get("containerStatuses") or ():
        if cs.get("name") == container_name:
            limit = ((cs.get("resources") or {}).get("limits") or {}).get("cpu")
            applied = _millicores(limit) if limit is not None else None
    return HostObservation(
        name=str(meta.get("name")),
        pool=pool_key(str(meta.get("namespace")), str(labels[owner_label])),
        phase=phase,
        node=str(spec.get("nodeName") or ""),
        address=f"{ip}:{port}" if ip else None,
        template_hash=str(labels.get(TEMPLATE_LABEL, "")),
        created_at=_timestamp(meta.get("creationTimestamp")),
        cpu_millicores=_millicores(requests.get("cpu", "0")),
        memory_bytes=_bytes(requests.get("memory", "0")),
        pending=pending,
        stalled=stalled if phase == "starting" else None,  # a failed one is replaced, not waited on
        setting_up=setting_up and phase == "starting",
        failure=failure,
        cpu_applied_millicores=applied,
    )


def _millicores(value: Any) -> int:
    try:
        return math.ceil(parse_quantity(str(value)) * 1000)
    except (ValueError, InvalidSpec):
        return 0


def _bytes(value: Any) -> int:
    try:
        return int(parse_quantity(str(value)))
    except (ValueError, InvalidSpec):
        return 0


OPERATOR_LABELS = {"app.kubernetes.io/name": "arl-tangram-operator"}


def network_policy(pool: PoolConfig, operator_namespace: str) -> dict[str, Any]:
    """The pool's NetworkPolicy: only the operator reaches the agents (their port), and with
    ``isolation.network: Disabled`` (the default) nothing leaves a host pod at all. The agent keeps
    actions off the network by itself too; this holds even against an agent that is compromised."""
    policy_types = ["Ingress"] if pool.network else ["Ingress", "Egress"]
    spec: dict[str, Any] = {
        "podSelector": {"matchLabels": {POOL_LABEL: pool.name, ROLE_LABEL: ROLE_SANDBOX_HOST}},
        "policyTypes": policy_types,
        "ingress": [
            {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": operator_namespace}
                        },
                        "podSelector": {"matchLabels": dict(OPERATOR_LABELS)},
                    }
                ],
                "ports": [{"port": AGENT_PORT, "protocol": "TCP"}],
            }
        ],
    }
    if not pool.network:
        spec["egress"] = []
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": f"tangram-pool-{pool.name}",
            "namespace": pool.namespace,
            "labels": {**MANAGED_BY, POOL_LABEL: pool.name},
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "ActionPool",
                    "name": pool.name,
                    "uid": pool.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
    }


def _owner(kind: str, name: str, uid: str) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": API_VERSION,
            "kind": kind,
            "name": name,
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def services_configmap(svc: ServiceConfig) -> dict[str, Any]:
    """The services file of the service's replicas, as a ConfigMap it owns."""
    import yaml

    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"tangram-rms-{svc.name}",
            "namespace": svc.namespace,
            "labels": {**MANAGED_BY, SERVICE_LABEL: svc.name},
            "ownerReferences": _owner("RewardModelService", svc.name, svc.uid),
        },
        "data": {"services.yaml": yaml.safe_dump(svc.services_file(), sort_keys=False)},
    }


def pinned(svc: ServiceConfig, request: DeviceRequest) -> ServiceConfig:
    """The config of one replica placed by the operator: ``svc`` with its pod bound to the chosen node
    (a required node affinity on the Node's name, so the scheduler still checks the node's room),
    the request's environment (``TANGRAM_GPU_UUIDS``, and ``NVIDIA_VISIBLE_DEVICES`` for the
    ``visible-devices`` strategy), its runtime class, and exactly its device-plugin resources (none
    for ``visible-devices``). ``reward_pod`` of it is the replica's pod; ``replica_devices`` reads the
    placement back from that pod."""
    spec: dict[str, Any] = copy.deepcopy(dict(svc.pod_spec or {}))
    on_node = {"key": "metadata.name", "operator": "In", "values": [request.node]}
    required = (
        spec.setdefault("affinity", {})
        .setdefault("nodeAffinity", {})
        .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    )
    # Terms are ORed: the node goes into every one of them (or is the only one).
    terms = required.setdefault("nodeSelectorTerms", []) or [{}]
    for term in terms:
        term["matchFields"] = [*term.get("matchFields", []), on_node]
    required["nodeSelectorTerms"] = terms
    if request.runtime_class:
        spec["runtimeClassName"] = request.runtime_class
    gpus, profile = 0, None
    for resource, count in request.resources.items():
        if resource.startswith(MIG_RESOURCE_PREFIX):
            profile = resource.removeprefix(MIG_RESOURCE_PREFIX)
        elif resource == "nvidia.com/gpu":
            gpus = int(count)
    env = tuple((k, v) for k, v in svc.env if k not in request.env) + tuple(request.env.items())
    return dataclasses.replace(svc, pod_spec=spec, env=env, gpus=gpus, mig_profile=profile)


def replica_devices(pod: Mapping[str, Any]) -> ReplicaPlacement | None:
    """The devices a reward replica's pod was placed on, read back from the pod (the operator keeps
    no memory of them, so they survive its restart): the node of its required node affinity (or the
    node it runs on), the UUIDs in its runtime container's ``TANGRAM_GPU_UUIDS`` and the MIG profile
    of its resources. None for a pod the operator did not place (the device plugin's choice)."""
    spec = pod.get("spec") or {}
    container: Mapping[str, Any] = next(
        (c for c in spec.get("containers") or () if c.get("name") == "runtime"), {}
    )
    uuids = next((e.get("value") for e in container.get("env") or () if e.get("name") == GPU_UUIDS_ENV), None)
    if not uuids:
        return None
    node = str(spec.get("nodeName") or "")
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or ():
        for field in term.get("matchFields") or ():
            if field.get("key") == "metadata.name" and field.get("operator") == "In" and field.get("values"):
                node = node or str(field["values"][0])
    if not node:
        return None
    requests = (container.get("resources") or {}).get("requests") or {}
    profile = next(
        (r.removeprefix(MIG_RESOURCE_PREFIX) for r in requests if r.startswith(MIG_RESOURCE_PREFIX)), None
    )
    return ReplicaPlacement(node, (), tuple(str(uuids).split(",")), profile)


def reward_pod(svc: ServiceConfig, name: str, device: str) -> dict[str, Any]:
    """One replica: ``tangram reward-runtime`` with the service's GPUs (the device plugin's
    resources: ``nvidia.com/gpu`` or the MIG profile's; none when the config asks for no GPU, as a
    ``visible-devices`` placement does), the services file and the weights' claim. A replica the
    operator placed on chosen devices is ``reward_pod(pinned(svc, request), ...)``."""
    spec: dict[str, Any] = copy.deepcopy(dict(svc.pod_spec or {}))
    gpu: dict[str, str] = {}
    if svc.mig_profile:
        gpu = {f"{MIG_RESOURCE_PREFIX}{svc.mig_profile}": "1"}
    elif svc.gpus:
        gpu = {"nvidia.com/gpu": str(svc.gpus)}
    mounts = [{"name": "services", "mountPath": SERVICES_FILE.rsplit("/", 1)[0], "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "services", "configMap": {"name": f"tangram-rms-{svc.name}"}}]
    if svc.claim:
        mounts.append({"name": "weights", "mountPath": WEIGHTS_MOUNT, "readOnly": True})
        volumes.append(
            {"name": "weights", "persistentVolumeClaim": {"claimName": svc.claim, "readOnly": True}}
        )
    container: dict[str, Any] = {
        "name": "runtime",
        "image": svc.image or DEFAULT_REWARD_IMAGE,
        "command": ["tangram", "reward-runtime"],
        "args": [
            f"--config={SERVICES_FILE}",
            f"--listen=$(POD_IP):{svc.port}",
            f"--device={device}",
            # On a GPU the runtime takes 90% of free memory; on a CPU it needs a budget.
            *([f"--device-memory={svc.gpu_memory or CPU_DEVICE_MEMORY}"] if device == "cpu" else []),
            *svc.args,
        ],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *({"name": k, "value": v} for k, v in svc.env),
        ],
        "ports": [{"name": "runtime", "containerPort": svc.port, "protocol": "TCP"}],
        "resources": {"requests": dict(gpu), "limits": dict(gpu)} if gpu else {},
        "readinessProbe": {
            "httpGet": {"path": "/v1/health", "port": "runtime"},
            "periodSeconds": 2,
            "failureThreshold": 2,
        },
        "volumeMounts": mounts,
    }
    others = spec.get("containers", [])
    spec["containers"] = [
        merged_container(container, others),
        *[c for c in others if c.get("name") != "runtime"],
    ]
    spec["volumes"] = [*volumes, *spec.get("volumes", [])]
    spec["restartPolicy"] = "Never"
    spec["automountServiceAccountToken"] = False
    spec["enableServiceLinks"] = False
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": svc.namespace,
            "labels": {
                **MANAGED_BY,
                SERVICE_LABEL: svc.name,
                ROLE_LABEL: ROLE_REWARD_REPLICA,
                TEMPLATE_LABEL: svc.template_hash,
            },
            "annotations": {PORT_ANNOTATION: str(svc.port)},
            "ownerReferences": _owner("RewardModelService", svc.name, svc.uid),
        },
        "spec": spec,
    }
