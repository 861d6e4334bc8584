"""Host pods are built from the pool (pure) and read back as observations."""

from __future__ import annotations

from typing import Any

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.domain.pools import pool_config
from arl_tangram.runtime.pods import DRAINING_ANNOTATION, host_pod, observe_host


def _cfg(**spec: Any) -> Any:
    base = {
        "template": {
            "image": "img:1",
            "resources": {"cpu": "4", "memory": "8Gi"},
            "podSpec": {"tolerations": [{"key": "sandbox", "operator": "Exists"}]},
        },
        "limits": {"timeoutSeconds": 90, "memory": "2Gi", "maxOutputBytes": 4096},
    }
    base.update(spec)
    return pool_config(
        ActionPool.model_validate({"metadata": {"name": "py", "namespace": "ns"}, "spec": base}), uid="uid-7"
    )


def test_a_host_pod_is_owned_has_no_token_and_the_pools_limits() -> None:
    pod = host_pod(_cfg(), "py-abc", node="n1")
    meta, spec = pod["metadata"], pod["spec"]
    assert (
        meta["ownerReferences"][0] | {"uid": "uid-7", "kind": "ActionPool", "controller": True}
        == meta["ownerReferences"][0]
    )
    assert meta["labels"]["tangram.arl.dev/pool"] == "py"
    assert spec["automountServiceAccountToken"] is False and spec["restartPolicy"] == "Never"
    assert spec["tolerations"] == [{"key": "sandbox", "operator": "Exists"}]
    (agent,) = spec["containers"]
    assert agent["resources"]["limits"]["cpu"] == "4"
    assert "--timeout=90" in agent["args"] and "--output-bytes=4096" in agent["args"]
    assert "--memory-mb=2048" in agent["args"] and "--network-allowed" not in agent["args"]
    assert agent["securityContext"]["capabilities"]["drop"] == ["ALL"]
    prefs = spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert prefs[0]["preference"]["matchExpressions"][0]["values"] == ["n1"]


def test_the_pools_workdir_limit_reaches_its_agents_in_mb() -> None:
    """The CRD's default (1Gi) and a pool's own, as ``--workdir-mb``: every host bounds its
    workdirs (the agent's 0, no limit, is not the operator's to ask for)."""
    assert "--workdir-mb=1024" in host_pod(_cfg(), "p")["spec"]["containers"][0]["args"]
    limits = {"timeoutSeconds": 90, "workdir": "6Gi"}
    assert "--workdir-mb=6144" in host_pod(_cfg(limits=limits), "p")["spec"]["containers"][0]["args"]
    tiny = _cfg(limits={"workdir": "100Ki"})
    assert tiny.limits.workdir_mb == 1  # under a MB rounds up to the least limit, never to none


def test_network_is_only_allowed_when_the_pool_says_so() -> None:
    pod = host_pod(_cfg(isolation={"network": "Enabled"}), "p")
    assert "--network-allowed" in pod["spec"]["containers"][0]["args"]


def test_template_changes_change_the_hash_and_scaling_does_not() -> None:
    a, b = _cfg(), _cfg(template={"image": "img:2"})
    c = _cfg(scaling={"maxHosts": 9})
    assert a.template_hash != b.template_hash and a.template_hash == c.template_hash


def _observed(pod: dict[str, Any], status: dict[str, Any], **meta: Any) -> Any:
    return observe_host({**pod, "metadata": {**pod["metadata"], **meta}, "status": status})


def test_observations_of_a_host_pod() -> None:
    pod = host_pod(_cfg(), "py-abc")
    ready = {"phase": "Running", "podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}]}
    assert _observed(pod, ready).phase == "ready" and _observed(pod, ready).address == "10.1.2.3:8080"
    draining = _observed(pod, ready, annotations={DRAINING_ANNOTATION: "true"})
    assert draining.phase == "draining"
    pending = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available",
            }
        ],
    }
    obs = _observed(pod, pending)
    assert obs.phase == "starting" and obs.pending == "0/3 nodes are available"
    assert _observed(pod, {"phase": "Failed", "reason": "Evicted"}).phase == "failed"
    assert _observed(pod, ready, deletionTimestamp="2026-01-01T00:00:00Z").phase == "terminating"
    assert observe_host({"metadata": {"name": "x", "labels": {}}}) is None


def test_a_container_that_cannot_start_is_told_from_one_that_is_starting() -> None:
    pod = host_pod(_cfg(), "py-abc")

    def waiting(reason: str, message: str | None = None, key: str = "containerStatuses") -> Any:
        state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        return _observed(pod, {"phase": "Pending", key: [{"name": "agent", "state": state}]})

    for normal in ("ContainerCreating", "PodInitializing"):
        assert waiting(normal).stalled is None and waiting(normal).phase == "starting"
    pull = waiting("ImagePullBackOff", 'Back-off pulling image "img:typo"')
    assert pull.phase == "starting"
    assert pull.stalled == 'container agent: ImagePullBackOff: Back-off pulling image "img:typo"'
    assert waiting("CreateContainerConfigError", 'secret "x" not found').stalled.endswith(
        'secret "x" not found'
    )
    assert (
        waiting("InvalidImageName", key="initContainerStatuses").stalled
        == "container agent: InvalidImageName"
    )
    assert _observed(pod, {"phase": "Pending"}).stalled is None


def _with_pod_spec(pod_spec: dict[str, Any]) -> Any:
    return _cfg(template={"image": "img:1", "resources": {"cpu": "4", "memory": "8Gi"}, "podSpec": pod_spec})


def _conditions(**status: str) -> list[dict[str, str]]:
    return [{"type": kind, "status": value} for kind, value in status.items()]


def test_a_pod_whose_volumes_or_sandbox_are_not_ready_is_told_from_one_pulling_its_image() -> None:
    """A Secret a volume needs that does not exist: the kubelet keeps PodReadyToStartContainers
    False and the container "ContainerCreating", silent (the reason is in the pod's events). An
    image being pulled comes after the sandbox: the condition is True by then."""
    creating = [{"name": "agent", "state": {"waiting": {"reason": "ContainerCreating"}}}]
    not_ready = _conditions(PodScheduled="True", PodReadyToStartContainers="False")

    def seen(pod: Any, conditions: list[dict[str, str]] = not_ready, statuses: Any = creating) -> Any:
        return _observed(pod, {"phase": "Pending", "conditions": conditions, "containerStatuses": statuses})

    plain = host_pod(_cfg(), "py-abc")  # its one volume, the workdirs' emptyDir
    stuck = seen(plain)
    assert stuck.phase == "starting" and stuck.setting_up
    assert stuck.stalled == "its volumes or pod sandbox are not ready (its events say why)"
    # The Secrets and ConfigMaps its containers mount are named; not the optional ones, nor a
    # volume no container mounts (the kubelet ignores it).
    sidecar = {"name": "creds", "image": "i", "volumeMounts": [{"name": "k", "mountPath": "/k"}]}
    volumes = [
        {
            "name": "k",
            "projected": {"sources": [{"secret": {"name": "api-key"}}, {"configMap": {"name": "cm"}}]},
        },
        {"name": "opt", "secret": {"secretName": "maybe", "optional": True}},
        {"name": "unused", "secret": {"secretName": "nobody-mounts-it"}},
    ]
    secret = host_pod(_with_pod_spec({"containers": [sidecar], "volumes": volumes}), "py-s")
    assert seen(secret).stalled == (
        "its volumes or pod sandbox are not ready (does it lack Secret api-key, ConfigMap cm? "
        "its events say which)"
    )
    # Where the waiting container says why (the test bed's node runner does), that is said.
    said = [
        {
            "name": "agent",
            "state": {"waiting": {"reason": "ContainerCreating", "message": 'secret "s" not found'}},
        }
    ]
    assert (
        seen(plain, statuses=said).stalled == 'its volumes or pod sandbox are not ready: secret "s" not found'
    )
    assert seen(plain, _conditions(PodScheduled="True", PodReadyToStartContainers="True")).stalled is None
    # Not placed yet: pending, not stalled; a cluster without the condition: nothing to tell.
    unplaced = seen(plain, _conditions(PodScheduled="False", PodReadyToStartContainers="False"))
    assert unplaced.stalled is None and unplaced.pending
    assert seen(plain, _conditions(PodScheduled="True")).stalled is None
    # A claim's volume may take minutes to attach: such a pod is left starting, however long.
    pvc = {"name": "w", "persistentVolumeClaim": {"claimName": "weights"}}
    mounts = {**sidecar, "volumeMounts": [{"name": "w", "mountPath": "/w"}]}
    claimed = host_pod(_with_pod_spec({"containers": [mounts], "volumes": [pvc]}), "py-p")
    assert seen(claimed).stalled is None and not seen(claimed).setting_up
    with_claims = host_pod(_with_pod_spec({"resourceClaims": [{"name": "gpu"}]}), "py-g")
    assert seen(with_claims).stalled is None
    # Used as a block device, or only by an ephemeral container, a claim is waited on all the same;
    # and a projected pod certificate waits for its signer.
    block = {**sidecar, "volumeMounts": [], "volumeDevices": [{"name": "w", "devicePath": "/dev/w"}]}
    assert seen(host_pod(_with_pod_spec({"containers": [block], "volumes": [pvc]}), "py-b")).stalled is None
    debug = {"ephemeralContainers": [{"name": "dbg", "volumeMounts": [{"name": "w", "mountPath": "/w"}]}]}
    assert seen(host_pod(_with_pod_spec({**debug, "volumes": [pvc]}), "py-e")).stalled is None
    cert = {"name": "k", "projected": {"sources": [{"secret": {"name": "a"}}, {"podCertificate": {}}]}}
    assert (
        seen(host_pod(_with_pod_spec({"containers": [sidecar], "volumes": [cert]}), "py-c")).stalled is None
    )
    # Ready, failed or going: never stalled, whatever the condition says.
    ready = _observed(
        plain,
        {
            "phase": "Running",
            "podIP": "10.0.0.9",
            "conditions": [*not_ready, {"type": "Ready", "status": "True"}],
        },
    )
    assert ready.phase == "ready" and ready.stalled is None and not ready.setting_up
    failed = _observed(plain, {"phase": "Failed", "conditions": not_ready})
    assert failed.stalled is None and not failed.setting_up
    going = _observed(
        plain, {"phase": "Pending", "conditions": not_ready}, deletionTimestamp="2026-12-06T00:00:00Z"
    )
    assert going.phase == "terminating" and going.stalled is None


def test_a_podspecs_agent_container_is_merged_into_the_operators() -> None:
    """podSpec is merged (crd-reference.md): a user's ``agent`` container brings its mounts,
    environment and other settings to the agent, while the operator keeps its command, image,
    resources, ports, probe and the securityContext fields its isolation rests on; on a clash of a
    name or mount path the operator's entry wins."""
    user_agent = {
        "name": "agent",
        "image": "evil:1",
        "command": ["sh"],
        "args": ["-c", "true"],
        "ports": [{"containerPort": 22}],
        "resources": {"limits": {"cpu": "64"}},
        "env": [{"name": "POD_IP", "value": "1.2.3.4"}, {"name": "DATA", "value": "/data"}],
        "envFrom": [{"configMapRef": {"name": "settings"}}],
        "volumeMounts": [
            {"name": "data", "mountPath": "/data"},
            {"name": "shadow", "mountPath": "/var/lib/tangram/work"},
        ],
        "securityContext": {
            "runAsUser": 1000,
            "capabilities": {"add": ["NET_ADMIN"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "workingDir": "/data",
    }
    sidecar = {"name": "side", "image": "side:1"}
    pod_spec: dict[str, Any] = {
        "volumes": [{"name": "data", "emptyDir": {}}],
        "containers": [user_agent, sidecar],
    }
    for mode in ("shared", "dedicated"):
        plain = host_pod(_cfg(mode=mode), "p")["spec"]["containers"][0]
        template = {"image": "img:1", "resources": {"cpu": "4", "memory": "8Gi"}, "podSpec": pod_spec}
        spec = host_pod(_cfg(template=template, mode=mode), "p")["spec"]
        agent, side = spec["containers"]
        assert side == sidecar
        for owned in ("image", "command", "args", "ports", "resources", "readinessProbe"):
            assert agent[owned] == plain[owned], owned
        assert [e for e in agent["env"] if e["name"] == "POD_IP"] == [plain["env"][0]]
        assert {"name": "DATA", "value": "/data"} in agent["env"]
        assert agent["envFrom"] == [{"configMapRef": {"name": "settings"}}]
        assert agent["volumeMounts"] == [*plain["volumeMounts"], {"name": "data", "mountPath": "/data"}]
        assert agent["workingDir"] == "/data"
        assert agent["securityContext"] == {
            **plain["securityContext"],
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        assert ("resizePolicy" in agent) == (mode == "dedicated")


def test_a_podspecs_runtime_container_is_merged_into_a_reward_replicas() -> None:
    from arl_tangram.api.rewardmodelservice import RewardModelService
    from arl_tangram.domain.services import service_config
    from arl_tangram.runtime.pods import reward_pod

    runtime = {
        "name": "runtime",
        "command": ["sh"],
        "env": [{"name": "HF_HOME", "value": "/cache"}],
        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
    }
    rms = RewardModelService.model_validate(
        {
            "metadata": {"name": "rm", "namespace": "ns"},
            "spec": {
                "model": {"name": "m", "uri": "file:///w/rm.npz"},
                "server": {
                    "podSpec": {"volumes": [{"name": "cache", "emptyDir": {}}], "containers": [runtime]}
                },
            },
        }
    )
    (container,) = reward_pod(service_config(rms, uid="u"), "rm-0", "cpu")["spec"]["containers"]
    assert container["command"] == ["tangram", "reward-runtime"]
    assert {"name": "HF_HOME", "value": "/cache"} in container["env"]
    assert {"name": "cache", "mountPath": "/cache"} in container["volumeMounts"]
    assert container["volumeMounts"][0]["name"] == "services"
