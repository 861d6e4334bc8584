# mypy: disable-error-code="no-untyped-call,attr-defined"
# The kubernetes client's stubs type request bodies as models; these tests pass plain dicts (valid JSON).
"""GPUs end to end on the test bed: node agents publish the simulated GPU nodes' inventories, and
RewardModelServices are placed on those GPUs and MIG instances, score the reward actions of
ActionBatches, scale to zero and back, and keep their devices across an operator restart.

How the parts run, all real except the GPUs themselves:
- **Node agents**: the real DaemonSet of ``manifests/node-agent.yaml`` (its ServiceAccount, RBAC and
  the ValidatingAdmissionPolicy that narrows it to its own Node), whose pods the test bed's node
  runner runs on ``tb-gpu-0`` and ``tb-mig-0`` with pod-bound ServiceAccount tokens from the
  TokenRequest API, so the policy's own-node check sees the node name in them. Chosen over a process
  started by the test because it exercises what a cluster installs: the pod template, the security
  context, the token and the policy. Changed for the test bed only where it must be: there are no
  GPUs, so each node gets its own copy of the DaemonSet serving that node's fake topology (``--fake``,
  named by the node's ``tangram.arl.dev/testbed-gpu-topology`` label; ``gpu/fake.py`` has each board)
  and polling every second; and a RuntimeClass ``nvidia`` is created where the cluster has none (the
  manifest's pods name it; the node runner runs no container runtime, so its handler does nothing).
- **Operator**: local processes with a real token of its ServiceAccount, as in ``test_operator.py``.
- **Reward pods**: the real reward runtime, run by the node runner, scoring on the CPU.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from operator_harness import (
    GROUP,
    OPERATOR_NS,
    VERSION,
    Operator,
    batch_manifest,
    create,
    running_operator,
    service_manifest,
    wait_batch,
    wait_object,
)
from testbed import REPO, Cluster, condition, wait_for, wait_for_gone

from arl_tangram.gpu.fake import fake_inventory
from arl_tangram.gpu.inventory import NodeInventory
from arl_tangram.gpu.nodeinfo import (
    ANNOTATION_INVENTORY,
    ANNOTATION_MIG_STATUS,
    LABEL_COUNT,
    LABEL_MIG,
    LABEL_SOURCE,
    PUBLISHED_LABELS,
)

AGENT_MANIFEST = REPO / "manifests" / "node-agent.yaml"
TOPOLOGY_LABEL = "tangram.arl.dev/testbed-gpu-topology"
AGENT_NODE_LABEL = "tangram.arl.dev/e2e-agent-node"
SAMPLES = [("What is 2+2?", "4"), ("Name a prime.", "9"), ("Capital of France?", "Paris"), ("hi", "hello")]


def _agent_daemonset(base: dict[str, Any], node: str, topology: str) -> dict[str, Any]:
    """The manifest's DaemonSet for one node, serving that node's fake topology."""
    ds = copy.deepcopy(base)
    ds["metadata"]["name"] = f"tangram-node-agent-{node}"
    # Each copy selects only its own pods (two DaemonSets with one selector would fight over them).
    ds["spec"]["selector"]["matchLabels"][AGENT_NODE_LABEL] = node
    template = ds["spec"]["template"]
    template["metadata"]["labels"][AGENT_NODE_LABEL] = node
    template["spec"]["nodeSelector"]["kubernetes.io/hostname"] = node
    (container,) = template["spec"]["containers"]
    container["args"] = ["--fake", topology, "--interval", "1"]
    return ds


def _published(node: dict[str, Any]) -> NodeInventory | None:
    text = ((node.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_INVENTORY)
    return None if text is None else NodeInventory.from_json(text)


def _same_devices(a: NodeInventory | None, b: NodeInventory) -> bool:
    if a is None:
        return False
    devices = lambda inv: [(g.uuid, tuple(m.uuid for m in g.mig_instances)) for g in inv.gpus]  # noqa: E731
    return devices(a) == devices(b)


@pytest.fixture(scope="module")
def gpu_nodes(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, NodeInventory]]:
    """Node agents running on the GPU nodes; yields each GPU node's fake inventory (what its agent
    publishes). Afterwards the agents are removed and so is what they published."""
    nodes = {
        n.metadata.name: n.metadata.labels[TOPOLOGY_LABEL]
        for n in cluster.core.list_node().items
        if TOPOLOGY_LABEL in (n.metadata.labels or {})
    }
    if not nodes:
        pytest.skip(
            f"no node names a fake GPU topology ({TOPOLOGY_LABEL}): the local test bed's GPU nodes do"
        )
    assert set(nodes) == {"tb-gpu-0", "tb-mig-0"}, nodes
    cluster.kubectl("apply", "-f", str(REPO / "manifests" / "namespace.yaml"))
    docs = [d for d in yaml.safe_load_all(AGENT_MANIFEST.read_text()) if d]
    (base,) = [d for d in docs if d["kind"] == "DaemonSet"]
    others = [d for d in docs if d["kind"] != "DaemonSet"]
    expected = {name: fake_inventory(topology, name) for name, topology in nodes.items()}
    work = tmp_path_factory.mktemp("node-agent")
    rbac = work / "node-agent-rbac.yaml"
    rbac.write_text(yaml.safe_dump_all(others))
    agents = work / "node-agents.yaml"
    agents.write_text(yaml.safe_dump_all([_agent_daemonset(base, n, t) for n, t in sorted(nodes.items())]))
    made_runtime_class = (
        cluster.kubectl("get", "runtimeclass", "nvidia", "--ignore-not-found", "-o", "name").stdout.strip()
        == ""
    )
    if made_runtime_class:
        cluster.kubectl(
            "apply",
            "-f",
            "-",
            stdin=json.dumps(
                {
                    "apiVersion": "node.k8s.io/v1",
                    "kind": "RuntimeClass",
                    "metadata": {"name": "nvidia"},
                    "handler": "nvidia",
                }
            ),
        )
    cluster.kubectl("apply", "-f", str(rbac))
    cluster.kubectl("apply", "-f", str(agents))
    try:
        for name, inv in expected.items():
            wait_for(
                cluster.core.list_node,
                lambda n, inv=inv: _same_devices(_published(n), inv),
                field_selector=f"metadata.name={name}",
                description=f"node {name}: its agent published the {nodes[name]} inventory",
                timeout=120,
            )
        yield expected
    finally:
        agent_pods = cluster.core.list_namespaced_pod(OPERATOR_NS, label_selector=AGENT_NODE_LABEL).items
        cluster.kubectl("delete", "-f", str(agents), "--ignore-not-found", check=False)
        for p in agent_pods:
            _gone(cluster, OPERATOR_NS, p.metadata.name, "node agent pod")
        unpublish = {
            "metadata": {
                "labels": dict.fromkeys(PUBLISHED_LABELS),
                "annotations": dict.fromkeys((ANNOTATION_INVENTORY, ANNOTATION_MIG_STATUS)),
            }
        }
        for name in nodes:
            cluster.core.patch_node(name, unpublish)
        cluster.kubectl("delete", "-f", str(rbac), "--ignore-not-found", check=False)
        if made_runtime_class:
            cluster.kubectl("delete", "runtimeclass", "nvidia", "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, gpu_nodes: dict[str, NodeInventory], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    with running_operator(cluster, tmp_path_factory.mktemp("operator")) as op:
        yield op


def _model(namespace: str, seed: int = 5) -> str:
    from arl_tangram.rewards.builtin import write_model

    models = REPO / "artifacts" / "e2e" / "models"  # pods see the host's files read-only (not its /tmp)
    models.mkdir(parents=True, exist_ok=True)
    name = f"{namespace}.npz" if seed == 5 else f"{namespace}-{seed}.npz"
    return write_model(str(models / name), buckets=256, dim=16, hidden=16, seed=seed)


def _expected_scores(model: str) -> list[float]:
    from arl_tangram.rewards.builtin import BuiltinScorer

    scorer = BuiltinScorer.from_file(model)
    scorer.restore()
    return [float(x) for x in scorer.score([p + r for p, r in SAMPLES])]


def _start_batch(cluster: Cluster, namespace: str, batch: str, service: str) -> None:
    """A batch of reward actions against ``service``."""
    actions = [
        {"id": f"r{i}", "type": "reward", "target": service, "payload": {"prompt": p, "response": r}}
        for i, (p, r) in enumerate(SAMPLES)
    ]
    create(cluster, namespace, "actionbatches", batch_manifest(batch, actions))


def _check_scores(cluster: Cluster, namespace: str, batch: str, model: str) -> None:
    """The batch completes and every action got the scorer's score."""
    done = wait_batch(cluster, namespace, batch, timeout=180)
    results = {r["id"]: r for r in done["status"]["results"]}
    for i, want in enumerate(_expected_scores(model)):
        assert results[f"r{i}"]["state"] == "Succeeded", results[f"r{i}"]
        assert results[f"r{i}"]["reward"] == pytest.approx(want, rel=1e-5, abs=1e-6)


def _score_batch(cluster: Cluster, namespace: str, batch: str, service: str, model: str) -> None:
    _start_batch(cluster, namespace, batch, service)
    _check_scores(cluster, namespace, batch, model)


def _serving(
    cluster: Cluster, namespace: str, service: str, what: str, timeout: float = 120
) -> dict[str, Any]:
    """The service once a replica serves and its placement names its devices."""
    return wait_object(
        cluster,
        namespace,
        "rewardmodelservices",
        lambda o: (
            (o.get("status") or {}).get("readyReplicas", 0) >= 1
            and condition(o, "Ready") == "True"
            and all(p.get("gpus") for p in o["status"].get("placements") or [{}])
        ),
        field_selector=f"metadata.name={service}",
        description=what,
        timeout=timeout,
    )


def _replica_pods(cluster: Cluster, namespace: str, service: str) -> list[dict[str, Any]]:
    listed = json.loads(
        cluster.core.list_namespaced_pod(
            namespace, label_selector=f"tangram.arl.dev/service={service}", _preload_content=False
        ).data
    )
    return [p for p in listed["items"] if not p["metadata"].get("deletionTimestamp")]


def _gone(cluster: Cluster, namespace: str, pod: str, what: str) -> None:
    wait_for_gone(
        cluster.core.list_namespaced_pod,
        pod,
        namespace=namespace,
        description=f"{what} {pod} gone",
        timeout=60,
    )


def _check_pod_matches(pod: dict[str, Any], placement: dict[str, Any], resources: dict[str, str]) -> None:
    """The replica's pod runs on the placement's node with its device request and environment."""
    assert pod["spec"]["nodeName"] == placement["node"], pod["spec"].get("nodeName")
    (runtime,) = [c for c in pod["spec"]["containers"] if c["name"] == "runtime"]
    assert runtime["resources"]["requests"] == resources and runtime["resources"]["limits"] == resources
    env = {e["name"]: e.get("value") for e in runtime["env"]}
    assert env["TANGRAM_GPU_UUIDS"] == ",".join(placement["gpus"])
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [placement["node"]]}]}
    ]


def test_node_agents_publish_the_gpu_nodes_inventories(
    cluster: Cluster, gpu_nodes: dict[str, NodeInventory]
) -> None:
    for name, inv in gpu_nodes.items():
        node = cluster.core.read_node(name)
        labels = node.metadata.labels
        assert labels[LABEL_COUNT] == str(len(inv.gpus)) and labels[LABEL_SOURCE] == "fake"
        assert labels[LABEL_MIG] == ("true" if name == "tb-mig-0" else "false")
    (pod,) = [
        p
        for p in cluster.core.list_namespaced_pod(OPERATOR_NS, label_selector=AGENT_NODE_LABEL).items
        if p.spec.node_name == "tb-mig-0"
    ]
    assert pod.spec.service_account_name == "tangram-node-agent" and pod.spec.runtime_class_name == "nvidia"
    # The agent may write only its own Node: the admission policy refuses its token anywhere else.
    from kubernetes import client

    token = cluster.kubectl(
        "create",
        "token",
        "tangram-node-agent",
        "-n",
        OPERATOR_NS,
        "--bound-object-kind=Pod",
        f"--bound-object-name={pod.metadata.name}",
        f"--bound-object-uid={pod.metadata.uid}",
    ).stdout.strip()
    cfg = client.Configuration()
    cfg.host = cluster.api.configuration.host
    cfg.ssl_ca_cert = cluster.api.configuration.ssl_ca_cert
    cfg.api_key = {"authorization": f"Bearer {token}"}
    probe = "tangram.arl.dev/e2e-probe"
    try:
        with client.ApiClient(cfg) as api:
            agent = client.CoreV1Api(api)
            agent.patch_node("tb-mig-0", {"metadata": {"labels": {probe: "own"}}})
            refused = _refused_once_in_effect(
                lambda: agent.patch_node("tb-gpu-0", {"metadata": {"labels": {probe: "other"}}}),
                undo=lambda: cluster.core.patch_node("tb-gpu-0", {"metadata": {"labels": {probe: None}}}),
            )
        # A policy's denial is 422 Invalid (its validations give no other reason).
        assert refused.status == 422 and "only the node it runs on" in str(refused.body)
    finally:
        for name in ("tb-mig-0", "tb-gpu-0"):
            cluster.core.patch_node(name, {"metadata": {"labels": {probe: None}}})


def _refused_once_in_effect(call: Callable[[], object], undo: Callable[[], object]) -> Any:
    """The ApiException ``call`` ends in once the admission policy is in effect. The API server
    loads a new policy a moment after it is created (its own informer; no status says when), and
    the agents can publish sooner than that: a CI run saw the agent's patch of another node
    allowed 0.85 s after the policy was created. A call let through before is undone; one still
    let through after 30 s fails the test."""
    from kubernetes import client

    deadline = time.monotonic() + 30
    while True:
        try:
            call()
        except client.exceptions.ApiException as exc:
            return exc
        undo()
        assert time.monotonic() < deadline, "the admission policy let the call through for 30 s"
        time.sleep(0.5)


def test_a_whole_gpu_service_is_placed_on_published_gpus_and_scales_to_zero_and_back(
    cluster: Cluster, namespace: str, operator: Operator, gpu_nodes: dict[str, NodeInventory]
) -> None:
    model = _model(namespace)
    rms = service_manifest(
        "rm2",
        model,
        "tiny-scorer",
        gpu={"count": [2], "nvlink": "Required"},
        minReplicas=0,
        maxReplicas=1,
        idleTimeoutSeconds=5,
        coldStartBudgetSeconds=60,
    )
    create(cluster, namespace, "rewardmodelservices", rms)
    wait_object(
        cluster,
        namespace,
        "rewardmodelservices",
        lambda o: condition(o, "Ready") == "True" and o["status"].get("replicas") == 0,
        description="the service Ready at zero replicas",
        timeout=60,
    )
    board = gpu_nodes["tb-gpu-0"]
    for round_ in ("first", "again"):
        # Demand starts a replica on two NVLink-joined GPUs of the 8-GPU board.
        _start_batch(cluster, namespace, f"scores-{round_}", "rm2")
        svc = _serving(cluster, namespace, "rm2", f"a replica placed and serving ({round_})")
        (place,) = svc["status"]["placements"]
        assert place["node"] == "tb-gpu-0", place
        index = {g.uuid: g.index for g in board.gpus}
        assert len(place["gpus"]) == 2 and set(place["gpus"]) <= set(index), place
        assert board.is_clique([index[u] for u in place["gpus"]])
        (pod,) = _replica_pods(cluster, namespace, "rm2")
        assert pod["metadata"]["name"] == place["pod"]
        _check_pod_matches(pod, place, {"nvidia.com/gpu": "2"})
        _check_scores(cluster, namespace, f"scores-{round_}", model)
        wait_object(
            cluster,
            namespace,
            "rewardmodelservices",
            lambda o: (
                o.get("status", {}).get("replicas") == 0
                and condition(o, "Ready") == "True"
                and not o["status"].get("placements")
            ),
            description=f"scaled to zero after idle ({round_})",
            timeout=90,
        )
        _gone(cluster, namespace, pod["metadata"]["name"], "the idle replica's pod")


def test_a_mig_service_lands_on_a_mig_instance_and_keeps_it_across_an_operator_restart(
    cluster: Cluster, namespace: str, operator: Operator, gpu_nodes: dict[str, NodeInventory]
) -> None:
    model = _model(namespace)
    rms = service_manifest(
        "rm-mig",
        model,
        "tiny-scorer",
        gpu={"count": [1], "migProfile": "3g.20gb"},
        minReplicas=1,
        maxReplicas=1,
    )
    create(cluster, namespace, "rewardmodelservices", rms)
    svc = _serving(cluster, namespace, "rm-mig", "the MIG replica placed and serving")
    (place,) = svc["status"]["placements"]
    instances = {m.uuid: m.profile for g in gpu_nodes["tb-mig-0"].gpus for m in g.mig_instances}
    assert place["node"] == "tb-mig-0" and len(place["gpus"]) == 1, place
    assert instances.get(place["gpus"][0]) == "3g.20gb", place
    (pod,) = _replica_pods(cluster, namespace, "rm-mig")
    _check_pod_matches(pod, place, {"nvidia.com/mig-3g.20gb": "1"})
    _score_batch(cluster, namespace, "scores", "rm-mig", model)

    # Every operator replica dies, and a batch comes while none runs. The next operator reads the
    # replica's devices back from its pod (same pod, same instance) and serves the batch, though it
    # sees the batch before its first round of the service.
    for name in list(operator.replicas):
        operator.kill(name)
    _start_batch(cluster, namespace, "scores-after-restart", "rm-mig")
    operator.start("op-c")
    operator.leader(timeout=60)
    _check_scores(cluster, namespace, "scores-after-restart", model)
    after = cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, "rewardmodelservices", "rm-mig"
    )
    assert after["status"]["placements"] == [{**place, "state": after["status"]["placements"][0]["state"]}]
    assert [p["metadata"]["name"] for p in _replica_pods(cluster, namespace, "rm-mig")] == [
        pod["metadata"]["name"]
    ]


def test_a_service_no_node_has_devices_for_says_what_is_missing(
    cluster: Cluster, namespace: str, operator: Operator, gpu_nodes: dict[str, NodeInventory]
) -> None:
    # No GPU of the test bed holds a 2g.10gb instance (tb-mig-0's are 1g.5gb and 3g.20gb; tb-gpu-0
    # is not in MIG mode), and placement never changes a layout by itself.
    rms = service_manifest(
        "rm-none",
        _model(namespace),
        "tiny-scorer",
        gpu={"count": [1], "migProfile": "2g.10gb"},
        minReplicas=1,
    )
    create(cluster, namespace, "rewardmodelservices", rms)
    svc = wait_object(
        cluster,
        namespace,
        "rewardmodelservices",
        lambda o: (
            condition(o, "Ready") == "False"
            and any(c.get("reason") == "Unschedulable" for c in o["status"]["conditions"])
        ),
        description="the service not Ready: no node has the devices it asks for",
        timeout=60,
    )
    # Not InsufficientGPUs (GPUs other replicas hold now): no node has such an instance at all, and
    # the condition names the field to change.
    conds = {c["type"]: c for c in svc["status"]["conditions"]}
    ready, degraded = conds["Ready"], conds["Degraded"]
    assert ready["reason"] == "Unschedulable" and (degraded["status"], degraded["reason"]) == (
        "True",
        "Unschedulable",
    ), conds
    assert ready["message"].startswith("spec.gpu.migProfile: no node has a MIG instance of profile 2g.10gb")
    assert "1g.5gb" in ready["message"] and "3g.20gb" in ready["message"], ready
    assert svc["status"]["replicas"] == 0 and not svc["status"].get("placements")
    assert _replica_pods(cluster, namespace, "rm-none") == []


def test_a_service_too_big_for_any_gpu_names_the_field(
    cluster: Cluster, namespace: str, operator: Operator, gpu_nodes: dict[str, NodeInventory]
) -> None:
    """100 GiB on one GPU: the test bed's largest (tb-gpu-0's H100s) hold 80 GB. It was
    InsufficientGPUs, "no free [1] GPUs", as if other replicas only held them for now."""
    rms = service_manifest(
        "rm-huge", _model(namespace), "tiny-scorer", gpu={"count": [1], "memory": "100Gi"}, minReplicas=1
    )
    create(cluster, namespace, "rewardmodelservices", rms)
    svc = wait_object(
        cluster,
        namespace,
        "rewardmodelservices",
        lambda o: (
            condition(o, "Degraded") == "True"
            and any(c.get("reason") == "Unschedulable" for c in o["status"]["conditions"])
        ),
        description="the service Degraded: no GPU holds it",
        timeout=60,
    )
    conds = {c["type"]: c for c in svc["status"]["conditions"]}
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "Unschedulable"), conds
    assert conds["Ready"]["message"].startswith("spec.gpu.memory: 100Gi per replica does not fit"), conds
    assert svc["status"]["replicas"] == 0 and _replica_pods(cluster, namespace, "rm-huge") == []


def test_an_edited_service_is_rolled_out_in_place_when_no_gpu_is_free_and_loses_no_request(
    cluster: Cluster, namespace: str, operator: Operator, gpu_nodes: dict[str, NodeInventory]
) -> None:
    """An edit (other weights) reaches the replicas; before, the old replica served the old spec for
    ever. The replica holds the whole 8-GPU board, so no new one can start beside it: the old one is
    drained (its calls finish), deleted, and one of the new spec takes its GPUs. A batch sent while
    that happens loses nothing: each of its actions is scored by one model or the other."""
    model, edited = _model(namespace), _model(namespace, seed=6)
    rms = service_manifest(
        "rm-roll",
        model,
        "tiny-scorer",
        gpu={"count": [8]},
        minReplicas=1,
        maxReplicas=1,
        coldStartBudgetSeconds=120,
    )
    create(cluster, namespace, "rewardmodelservices", rms)
    _serving(cluster, namespace, "rm-roll", "the first replica serving")
    (old,) = _replica_pods(cluster, namespace, "rm-roll")
    _score_batch(cluster, namespace, "before", "rm-roll", model)
    edit = {"spec": {"model": {"uri": f"file://{edited}"}}}
    patched = cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "rewardmodelservices", "rm-roll", edit
    )
    _start_batch(cluster, namespace, "during", "rm-roll")
    svc = wait_object(
        cluster,
        namespace,
        "rewardmodelservices",
        lambda o: (
            o["status"].get("observedGeneration") == patched["metadata"]["generation"]
            and (o["status"].get("updatedReplicas"), o["status"].get("replicas")) == (1, 1)
            and o["status"].get("readyReplicas") == 1
            and condition(o, "Ready") == "True"
        ),
        field_selector="metadata.name=rm-roll",
        description="the edit rolled out: one replica, of the new spec, serving",
        timeout=240,
    )
    _gone(cluster, namespace, old["metadata"]["name"], "the old replica's pod")
    (new,) = _replica_pods(cluster, namespace, "rm-roll")
    label = "tangram.arl.dev/template-hash"
    assert new["metadata"]["labels"][label] != old["metadata"]["labels"][label]
    (place,) = svc["status"]["placements"]
    assert place["pod"] == new["metadata"]["name"] and len(place["gpus"]) == 8, place
    done = wait_batch(cluster, namespace, "during", timeout=240)
    results = {r["id"]: r for r in done["status"]["results"]}
    for i, (a, b) in enumerate(zip(_expected_scores(model), _expected_scores(edited), strict=True)):
        got = results[f"r{i}"]
        assert got["state"] == "Succeeded", got
        assert got["reward"] in (pytest.approx(a, rel=1e-5, abs=1e-6), pytest.approx(b, rel=1e-5, abs=1e-6))
    _score_batch(cluster, namespace, "after", "rm-roll", edited)
