"""The pure RewardModelService reconcile and its translation, table-driven (no cluster)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.controllers.failures import UNSCHEDULABLE_AFTER_S
from arl_tangram.controllers.rewardmodelservice import (
    DRAIN_TIMEOUT_S,
    CreateReplica,
    DeleteReplica,
    DrainReplica,
    ServiceObservation,
    backoff_s,
    reconcile_rewardmodelservice,
    service_outage,
)
from arl_tangram.dispatch.rewards import ServiceStats
from arl_tangram.domain.services import reward_text, service_config
from arl_tangram.errors import InvalidSpec
from arl_tangram.runtime.interface import HostObservation

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def rms_of(uri: str = "file:///w/rm.npz", gpu: dict[str, Any] | None = None, **scaling: Any) -> Any:
    return RewardModelService.model_validate(
        {
            "metadata": {"name": "rm", "namespace": "ns", "generation": 2},
            "spec": {
                "model": {"name": "m", "uri": uri},
                "scaling": {"maxReplicas": 3, "idleTimeoutSeconds": 60, **scaling},
                "batching": {"maxBatchSize": 4},
                "gpu": gpu or {"count": [1]},
            },
        }
    )


def cfg(uri: str = "file:///w/rm.npz", **scaling: Any) -> Any:
    return service_config(rms_of(uri, **scaling), uid="u")


def reconcile(
    obs: ServiceObservation, gpu: dict[str, Any] | None = None, **scaling: Any
) -> tuple[dict[str, Any], list[Any]]:
    rms = rms_of(gpu=gpu, **scaling)
    return reconcile_rewardmodelservice(rms, service_config(rms, uid="u"), obs, NOW)


def rep(name: str, phase: str = "ready", template: str | None = None, **kw: Any) -> HostObservation:
    """A replica of ``cfg()`` (``template``: the template hash of another spec it was built from)."""
    template = cfg().template_hash if template is None else template
    return HostObservation(name, "ns/rm", phase, "tb-gpu-0", "10.0.0.9:8000", template, 1.0, 0, 0, **kw)  # type: ignore[arg-type]


def stats(queued: int = 0, running: int = 0, last: float | None = None) -> ServiceStats:
    return ServiceStats(queued, running, last, (0.5,), {})


@pytest.mark.parametrize(
    ("replicas", "load", "now_mono", "ops", "ready"),
    [
        ([], stats(), 1000.0, [], ("True", "ScaledToZero")),
        ([], stats(queued=2, last=999.0), 1000.0, ["create"], ("False", "HostsStarting")),
        ([rep("a", "starting")], stats(queued=2, last=999.0), 1000.0, [], ("False", "HostsStarting")),
        ([rep("a")], stats(queued=9, last=999.0), 1000.0, ["create"], ("True", "HostsReady")),
        ([rep("a")], stats(last=990.0), 1000.0, [], ("True", "HostsReady")),
        ([rep("a")], stats(last=900.0), 1000.0 + 60, [("delete", "a")], ("True", "HostsReady")),
        (
            [rep("a", "failed", failure="exit 2")],
            stats(queued=1, last=999.0),
            1000.0,
            [("delete", "a"), "create"],
            ("False", "HostsStarting"),
        ),
    ],
)
def test_replicas_follow_demand(
    replicas: list[HostObservation],
    load: ServiceStats,
    now_mono: float,
    ops: list[Any],
    ready: tuple[str, str],
) -> None:
    status, got = reconcile(ServiceObservation(replicas, load, now_mono))
    kinds = [
        "create" if isinstance(o, CreateReplica) else ("delete", o.name)
        for o in got
        if isinstance(o, CreateReplica | DeleteReplica)
    ]
    assert kinds == ops
    cond = {c["type"]: c for c in status["conditions"]}
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ready
    assert status["selector"] == "tangram.arl.dev/service=rm"


def test_min_replicas_keep_the_service_up_while_idle() -> None:
    _, ops = reconcile(ServiceObservation([], stats(), 10_000.0), minReplicas=1)
    assert [type(o) for o in ops] == [CreateReplica]


def test_a_replica_that_keeps_failing_is_retried_with_back_off() -> None:
    obs = ServiceObservation(
        [],
        stats(queued=1, last=999.0),
        1000.0,
        failures=3,
        since_failure_s=5.0,
        last_failure="the agent exited 2",
    )
    status, ops = reconcile(obs)
    assert ops == [] and backoff_s(3) == 20.0
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and "exited 2" in degraded["message"]
    later = ServiceObservation([], stats(queued=1, last=999.0), 1000.0, failures=3, since_failure_s=21.0)
    assert [type(o) for o in reconcile(later)[1]] == [CreateReplica]


def test_placements_and_residency_in_status() -> None:
    obs = ServiceObservation([rep("a"), rep("b")], stats(), 1.0, resident={"a": True, "b": False})
    status, _ = reconcile(obs, minReplicas=2)
    assert [(p["pod"], p["state"]) for p in status["placements"]] == [("a", "Resident"), ("b", "Evicted")]


@pytest.mark.parametrize("uri", ["hf://org/model", "s3://bucket/w"])
def test_weights_are_never_downloaded(uri: str) -> None:
    with pytest.raises(InvalidSpec) as err:
        cfg(uri=uri)
    assert err.value.field == "spec.model.uri" and "never downloaded" in err.value.message


def test_server_args_reach_the_runtime_and_the_others_are_named_in_ready() -> None:
    """``server.args`` were accepted and silently dropped; the built-in runtime's own flags now reach
    its command line, and the others (one the operator sets, a vLLM flag) are left out and named in
    the Ready condition, not refused: a service that serves today keeps serving."""
    from unittest import mock

    from arl_tangram.domain.services import BUILTIN_SERVER_FLAGS
    from arl_tangram.rewards import server
    from arl_tangram.runtime.pods import reward_pod

    rms = rms_of()
    rms.spec.server.args = ["--no-prewarm"]
    pod = reward_pod(service_config(rms, uid="u"), "rm-0", "cpu")
    assert pod["spec"]["containers"][0]["args"][-1] == "--no-prewarm"
    rms.spec.server.args = ["--no-prewarm", "--listen=0.0.0.0:9", "--max-num-seqs=64"]
    svc = service_config(rms, uid="u")
    assert svc.args == ("--no-prewarm",) and svc.ignored_args == ("--listen=0.0.0.0:9", "--max-num-seqs=64")
    assert reward_pod(svc, "rm-0", "cpu")["spec"]["containers"][0]["args"].count("--listen=0.0.0.0:9") == 0
    obs = ServiceObservation([rep("a")], stats(), 1.0)
    status, _ = reconcile_rewardmodelservice(rms, svc, obs, NOW)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (
        ready["status"] == "True"
        and "server.args ignored: --listen=0.0.0.0:9 --max-num-seqs=64" in ready["message"]
    )
    # Every flag a service may pass is one the runtime's parser knows (argparse exits otherwise).
    with (
        mock.patch.object(server.asyncio, "run", side_effect=lambda coro: (coro.close(), 0)[1]),
        mock.patch.object(server, "read_services", return_value=[]),
    ):
        for flag in BUILTIN_SERVER_FLAGS:
            assert server.main(["--config", "x.yaml", flag]) == 0


def test_pvc_weights_are_mounted() -> None:
    c = cfg(uri="pvc://weights/rm/model.npz")
    assert c.claim == "weights" and c.weights_path.endswith("/rm/model.npz")


@pytest.mark.parametrize(
    ("payload", "text"),
    [
        ({"prompt": "Q?", "response": "A"}, "Q?A"),
        ({"prompt": [{"role": "user", "content": "Q?"}], "response": "A"}, "Q?A"),
        ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}, "Q\nA"),
        ({"input": "raw"}, "raw"),
    ],
)
def test_reward_payloads_become_the_text_scored(payload: dict[str, Any], text: str) -> None:
    assert reward_text(payload) == text


def test_a_reward_payload_without_a_text_is_refused() -> None:
    with pytest.raises(InvalidSpec):
        reward_text({"label": "x"})


@pytest.mark.parametrize("prompt", [{"a": 1}, 5, True, 1.5])
def test_a_prompt_that_is_neither_text_nor_a_chat_is_refused_naming_it(prompt: object) -> None:
    """Its ``str()`` was scored (``{'a': 1}x``): a reward for a text nobody wrote."""
    with pytest.raises(InvalidSpec) as err:
        reward_text({"prompt": prompt, "response": "x"})
    assert err.value.field == "payload.prompt", err.value


class _Replicas:
    """A runtime whose replicas are what the test says (the controller's calls are recorded)."""

    def __init__(self) -> None:
        self.listed: list[HostObservation] = []
        self.created: list[str] = []
        self.deleted: list[str] = []

    async def ensure_services_file(self, svc: Any) -> None:
        return None

    def replicas(self, key: str) -> list[HostObservation]:
        return list(self.listed)

    async def create_replica(self, svc: Any, name: str, device: str) -> None:
        self.created.append(name)
        self.listed.append(rep(name, "starting", svc.template_hash))

    async def delete_replica(self, svc: Any, name: str) -> None:
        self.deleted.append(name)
        self.listed = [r for r in self.listed if r.name != name]


def test_the_controller_backs_off_after_failed_replicas_instead_of_recreating_at_once() -> None:
    """The controller feeds the reconcile its failure streak: a replica that fails is replaced
    only after the back-off (before, the streak was never counted and the replacement came at once,
    every time, for a replica that could never start)."""
    from arl_tangram.controllers.rewardmodelservice import ServiceController
    from arl_tangram.dispatch.rewards import RewardRouter

    clock = [1000.0]
    body = {
        "metadata": {"name": "rm", "namespace": "ns", "generation": 1, "uid": "u"},
        "spec": {"model": {"name": "m", "uri": "file:///w/rm.npz"}, "scaling": {"minReplicas": 1}},
    }

    async def run() -> None:
        runtime = _Replicas()
        ctl = ServiceController(RewardRouter(client=None, clock=lambda: clock[0]), runtime, None, "cpu")  # type: ignore[arg-type]
        ctl._failures.clock = lambda: clock[0]
        await ctl.reconcile(body)
        assert len(runtime.created) == 1
        first = runtime.created[0]
        runtime.listed = [rep(first, "failed", failure="exit 2")]
        status = await ctl.reconcile(body)  # deleted, and no replacement within the back-off
        assert runtime.deleted == [first] and len(runtime.created) == 1
        degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
        assert degraded["status"] == "True" and "exit 2" in degraded["message"], degraded
        clock[0] += backoff_s(1) + 0.1
        await ctl.reconcile(body)
        assert len(runtime.created) == 2

    asyncio.run(run())


def test_a_failure_streak_counts_each_failed_pod_once_and_ends_at_a_ready_one() -> None:
    from arl_tangram.controllers.failures import FailureStreaks

    now = [0.0]
    streaks = FailureStreaks(clock=lambda: now[0])
    assert streaks.observe("k", [rep("a", "starting")]).count == 0
    assert streaks.observe("k", [rep("a", "failed", failure="oom")]).count == 1
    now[0] = 3.0
    again = streaks.observe("k", [rep("a", "failed", failure="oom")])  # still listed: not twice
    assert (again.count, again.since_s, again.last) == (1, 3.0, "oom")
    assert streaks.observe("k", [rep("b", "failed", failure="exit 1")]).count == 2
    assert streaks.observe("k", [rep("c")]).count == 0
    assert streaks.observe("other", []).since_s == float("inf")


# ---- GPU placement: replicas on the devices the GPU manager chose from the published inventories ----
H100 = "nvswitch-h100"


def _node(name: str, topology: str | None, ready: bool = True, cordoned: bool = False) -> dict[str, Any]:
    """A Node object as the API returns it, with the node agent's inventory when ``topology``."""
    from arl_tangram.gpu.fake import fake_inventory
    from arl_tangram.gpu.nodeinfo import ANNOTATION_INVENTORY

    notes = {ANNOTATION_INVENTORY: fake_inventory(topology, name).to_json()} if topology else {}
    return {
        "metadata": {"name": name, "annotations": notes},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _view(*nodes: dict[str, Any], pods: dict[str, list[dict[str, Any]]] | None = None) -> Any:
    from arl_tangram.controllers.rewardmodelservice import gpu_view

    return gpu_view("ns/rm", nodes, pods or {})


def _uuids(topology: str, node: str, mig_profile: str | None = None) -> list[str]:
    from arl_tangram.gpu.fake import fake_inventory

    inv = fake_inventory(topology, node)
    if mig_profile is None:
        return [g.uuid for g in inv.gpus]
    return [m.uuid for g in inv.gpus for m in g.mig_instances if m.profile == mig_profile]


def _pod(svc: Any, name: str, placement: Any, strategy: str = "device-plugin") -> dict[str, Any]:
    """The pod the controller creates for a placed replica (as the API returns it)."""
    from arl_tangram.gpu.placement import device_request
    from arl_tangram.runtime.pods import pinned, reward_pod

    return reward_pod(pinned(svc, device_request(placement, strategy)), name, "cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("gpu", "nodes", "taken_by_others", "created", "ready_reason"),
    [
        # Whole GPUs, NVLink-joined pairs on the 8-GPU board; one request waiting starts one replica.
        ({"count": [2]}, [("g", H100)], 0, [("g", 2)], "HostsStarting"),
        # Six of its GPUs held by other services: the pair comes from the last two.
        ({"count": [2]}, [("g", H100)], 6, [("g", 2)], "HostsStarting"),
        # All eight held: nothing to place, Ready=False naming what is missing.
        ({"count": [2]}, [("g", H100)], 8, [], "InsufficientGPUs"),
        # A MIG profile goes to a node that has free instances of it, never to whole GPUs.
        (
            {"count": [1], "migProfile": "3g.20gb"},
            [("g", H100), ("m", "mig-a100-40gb")],
            0,
            [("m", 1)],
            "HostsStarting",
        ),
        # Cordoned and NotReady nodes take no new replica, whatever their inventory says.
        ({"count": [1]}, [("c", "cordoned"), ("n", "notready")], 0, [], "InsufficientGPUs"),
    ],
)
def test_new_replicas_are_placed_on_free_devices_of_the_published_inventories(
    gpu: dict[str, Any],
    nodes: list[tuple[str, str]],
    taken_by_others: int,
    created: list[tuple[str, int]],
    ready_reason: str,
) -> None:
    from arl_tangram.gpu.fake import fake_inventory

    node_objs = []
    for name, kind in nodes:
        if kind == "cordoned":
            node_objs.append(_node(name, H100, cordoned=True))
        elif kind == "notready":
            node_objs.append(_node(name, H100, ready=False))
        else:
            node_objs.append(_node(name, kind))
    view = _view(*node_objs)
    others = frozenset(_uuids(H100, "g")[:taken_by_others])
    view = type(view)(view.inventories, view.held, others, view.problems, view.published)
    obs = ServiceObservation([], stats(queued=1, last=999.0), 1000.0, gpu=view)
    status, ops = reconcile(obs, gpu=gpu)
    placed = [o.placement for o in ops if isinstance(o, CreateReplica)]
    assert [(p.node, len(p.uuids)) for p in placed] == created
    for p in placed:
        inv = fake_inventory(dict(nodes)[p.node], p.node)
        assert not set(p.uuids) & others
        if gpu.get("migProfile"):
            assert p.mig_profile == gpu["migProfile"] and p.uuids[0] in _uuids(
                "mig-a100-40gb", p.node, gpu["migProfile"]
            )
        else:
            assert inv.is_clique(p.gpus) and set(p.uuids) <= {g.uuid for g in inv.gpus}
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["reason"] == ready_reason
    if ready_reason == "InsufficientGPUs":
        missing = "takes new pods" if not view.inventories else "found no free"
        assert ready["status"] == "False" and missing in ready["message"], ready
        scaling = {c["type"]: c for c in status["conditions"]}["Scaling"]
        assert scaling["status"] == "True" and missing in scaling["message"]


def test_without_any_inventory_the_device_plugin_chooses_and_status_says_so() -> None:
    view = _view(_node("g", None))
    obs = ServiceObservation([], stats(queued=1, last=999.0), 1000.0, gpu=view)
    status, ops = reconcile(obs)
    assert [(type(o), o.placement) for o in ops] == [(CreateReplica, None)]
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["reason"] == "HostsStarting" and "device plugin chose" in ready["message"]
    # Serving: the placement names the node the scheduler chose, and no UUIDs (none were planned).
    obs = ServiceObservation([rep("a")], stats(last=999.0), 1000.0, gpu=view)
    status, _ = reconcile(obs)
    assert status["placements"] == [{"node": "tb-gpu-0", "gpus": [], "state": "Resident", "pod": "a"}]
    assert "device plugin chose" in {c["type"]: c for c in status["conditions"]}["Ready"]["message"]


def test_a_placed_replicas_pod_carries_its_node_devices_and_env_and_reads_back() -> None:
    from arl_tangram.gpu.placement import place_service
    from arl_tangram.runtime.pods import replica_devices

    inv_node = _node("g", H100)
    for gpu, strategy, resources in [
        ({"count": [2]}, "device-plugin", {"nvidia.com/gpu": "2"}),
        ({"count": [1], "migProfile": "3g.20gb"}, "device-plugin", {"nvidia.com/mig-3g.20gb": "1"}),
        ({"count": [2]}, "visible-devices", None),
    ]:
        rms = rms_of(gpu=gpu)
        svc = service_config(rms, uid="u")
        invs = _view(inv_node, _node("m", "mig-a100-40gb")).inventories
        (p,) = place_service(rms, invs, 1).placements
        pod = _pod(svc, "rm-1", p, strategy)
        (runtime,) = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in runtime["env"]}
        assert env["TANGRAM_GPU_UUIDS"] == ",".join(p.uuids)
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"] == [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [p.node]}]}
        ]
        if resources is None:  # exact devices by UUID, outside the device plugin
            assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(p.uuids)
            assert pod["spec"]["runtimeClassName"] == "nvidia" and runtime["resources"] == {}
        else:
            assert runtime["resources"] == {"requests": resources, "limits": resources}
            assert "NVIDIA_VISIBLE_DEVICES" not in env and "runtimeClassName" not in pod["spec"]
        back = replica_devices(pod)
        assert back is not None and (back.node, back.uuids, back.mig_profile) == (
            p.node,
            p.uuids,
            p.mig_profile if strategy == "device-plugin" else None,
        )
    # A pod the device plugin placed (no planned devices) reads back as None.
    from arl_tangram.runtime.pods import reward_pod

    assert replica_devices(reward_pod(cfg(), "rm-2", "cpu")) is None


def test_the_node_pin_is_added_to_every_required_term_of_the_services_own_affinity() -> None:
    from arl_tangram.gpu.placement import DeviceRequest
    from arl_tangram.runtime.pods import pinned

    own = {"key": "pool", "operator": "In", "values": ["rm"]}
    rms = RewardModelService.model_validate(
        {
            "metadata": {"name": "rm", "namespace": "ns"},
            "spec": {
                "model": {"name": "m", "uri": "file:///w"},
                "server": {
                    "podSpec": {
                        "affinity": {
                            "nodeAffinity": {
                                "requiredDuringSchedulingIgnoredDuringExecution": {
                                    "nodeSelectorTerms": [
                                        {"matchExpressions": [own]},
                                        {"matchExpressions": [own]},
                                    ]
                                }
                            }
                        }
                    }
                },
            },
        }
    )
    svc = service_config(rms, uid="u")
    placed = pinned(svc, DeviceRequest("g", {"nvidia.com/gpu": "1"}, {"TANGRAM_GPU_UUIDS": "GPU-1"}))
    terms = placed.pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    pin = {"key": "metadata.name", "operator": "In", "values": ["g"]}
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [own], "matchFields": [pin]}] * 2
    assert svc.pod_spec is not None and "matchFields" not in str(
        svc.pod_spec
    )  # the service's own is untouched


def test_the_gpu_view_splits_held_and_taken_devices_by_service_and_names_unreadable_inventories() -> None:
    from arl_tangram.gpu.nodeinfo import ANNOTATION_INVENTORY
    from arl_tangram.gpu.placement import place_service

    rms = rms_of(gpu={"count": [1]})
    svc = service_config(rms, uid="u")
    invs = _view(_node("g", H100)).inventories
    a, b = place_service(rms, invs, 2).placements
    broken = _node("x", None)
    broken["metadata"]["annotations"] = {ANNOTATION_INVENTORY: "{not json"}
    view = _view(
        _node("g", H100), broken, pods={"ns/rm": [_pod(svc, "rm-a", a)], "ns/other": [_pod(svc, "o-b", b)]}
    )
    assert [i.node for i in view.inventories] == ["g"]
    assert set(view.held) == {"rm-a"} and view.held["rm-a"].uuids == a.uuids
    assert view.taken == frozenset(b.uuids)
    assert len(view.problems) == 1 and view.problems[0].startswith("node x: inventory is not JSON")


def test_status_placements_come_from_the_pods_and_their_devices_are_not_placed_twice() -> None:
    """Placements are read back from the replica pods each round: a replica that still runs keeps
    its devices in status, and a new replica never gets them (an operator restart loses nothing)."""
    from arl_tangram.gpu.placement import place_service

    rms = rms_of(gpu={"count": [4]})
    svc = service_config(rms, uid="u")
    (a,) = place_service(rms, _view(_node("tb-gpu-0", H100)).inventories, 1).placements
    view = _view(_node("tb-gpu-0", H100), pods={"ns/rm": [_pod(svc, "rm-a", a)]})
    obs = ServiceObservation(
        [rep("rm-a", template=svc.template_hash)],
        stats(queued=9, last=999.0),
        1000.0,
        resident={"rm-a": True},
        gpu=view,
    )
    status, ops = reconcile(obs, gpu={"count": [4]})
    assert status["placements"] == [
        {"node": "tb-gpu-0", "gpus": list(a.uuids), "state": "Resident", "pod": "rm-a"}
    ]
    (new,) = [o.placement for o in ops if isinstance(o, CreateReplica)]
    assert new is not None and not set(new.uuids) & set(a.uuids) and len(new.uuids) == 4
    # The board is now full: a third replica finds nothing and says so in Scaling (Ready stays True).
    view2 = _view(_node("tb-gpu-0", H100), pods={"ns/rm": [_pod(svc, "rm-a", a), _pod(svc, "rm-b", new)]})
    both = [rep("rm-a", template=svc.template_hash), rep("rm-b", template=svc.template_hash)]
    obs2 = ServiceObservation(both, stats(queued=99, last=999.0), 1000.0, gpu=view2)
    status2, ops2 = reconcile(obs2, gpu={"count": [4]})
    conds = {c["type"]: c for c in status2["conditions"]}
    assert not [o for o in ops2 if isinstance(o, CreateReplica)]
    assert conds["Ready"]["status"] == "True" and "found no free [4] GPUs" in conds["Scaling"]["message"]


class _Pods:
    """A runtime that keeps the pods the controller creates, as the operator's pod index would: its
    observations are read from those pod bodies."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}

    async def ensure_services_file(self, svc: Any) -> None:
        return None

    def replicas(self, key: str) -> list[HostObservation]:
        from arl_tangram.runtime.pods import observe_replica

        return [h for h in map(observe_replica, self.pods.values()) if h is not None and h.pool == key]

    async def create_replica(self, svc: Any, name: str, device: str) -> None:
        from arl_tangram.runtime.pods import reward_pod

        pod = reward_pod(svc, name, device)
        pod["status"] = {"phase": "Pending"}
        self.pods[name] = pod

    async def delete_replica(self, svc: Any, name: str) -> None:
        self.pods.pop(name)


def test_the_controller_pins_replicas_and_a_restarted_controller_reads_their_devices_back() -> None:
    from arl_tangram.controllers.rewardmodelservice import ServiceController
    from arl_tangram.dispatch.rewards import RewardRouter

    body = {
        "metadata": {"name": "rm", "namespace": "ns", "generation": 1, "uid": "u"},
        "spec": {
            "model": {"name": "m", "uri": "file:///w/rm.npz"},
            "gpu": {"count": [1], "migProfile": "1g.5gb"},
            "scaling": {"minReplicas": 2, "maxReplicas": 2},
        },
    }
    nodes = [_node("m", "mig-a100-40gb"), _node("g", H100)]
    runtime = _Pods()

    def controller() -> ServiceController:
        return ServiceController(RewardRouter(client=None), runtime, None, "cpu")  # type: ignore[arg-type]

    async def run() -> None:
        first = await controller().reconcile(body, nodes, {"ns/rm": runtime.pods.values()})
        assert len(runtime.pods) == 2 and first["placements"] == [], first
        status = await controller().reconcile(body, nodes, {"ns/rm": runtime.pods.values()})
        got = sorted((p["node"], tuple(p["gpus"])) for p in status["placements"])
        free = _uuids("mig-a100-40gb", "m", "1g.5gb")
        assert [n for n, _ in got] == ["m", "m"] and {u for _, g in got for u in g} <= set(free)
        assert len({g for _, g in got}) == 2
        for pod in runtime.pods.values():
            (c,) = pod["spec"]["containers"]
            assert c["resources"]["requests"] == {"nvidia.com/mig-1g.5gb": "1"}
        # A third controller (another restart) sees the same devices: nothing is created or moved.
        before = dict(runtime.pods)
        again = await controller().reconcile(body, nodes, {"ns/rm": runtime.pods.values()})
        assert runtime.pods == before and again["placements"] == status["placements"]

    asyncio.run(run())


@pytest.mark.parametrize(
    ("value", "ok"), [(None, "device-plugin"), ("visible-devices", "visible-devices"), ("gpu", None)]
)
def test_the_device_strategy_is_one_operator_setting(
    monkeypatch: pytest.MonkeyPatch, value: str | None, ok: str | None
) -> None:
    from arl_tangram.controllers.operator import OperatorSettings

    if value is None:
        monkeypatch.delenv("TANGRAM_GPU_DEVICES", raising=False)
    else:
        monkeypatch.setenv("TANGRAM_GPU_DEVICES", value)
    if ok is None:
        with pytest.raises(InvalidSpec) as err:
            OperatorSettings.from_env()
        assert err.value.field == "TANGRAM_GPU_DEVICES" and "device-plugin" in err.value.message
    else:
        assert OperatorSettings.from_env().gpu_devices == ok


def test_devices_of_pods_the_watch_has_not_shown_yet_are_not_given_to_another_service() -> None:
    """Services are reconciled one after another; a pod just created may not be in the pod watch at
    the next service's round. Its devices stay taken meanwhile (and are forgotten once it shows)."""
    from arl_tangram.controllers.rewardmodelservice import PLACING_TTL_S, ServiceController
    from arl_tangram.dispatch.rewards import RewardRouter

    def body(name: str) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "namespace": "ns", "generation": 1, "uid": name},
            "spec": {
                "model": {"name": "m", "uri": "file:///w/rm.npz"},
                "gpu": {"count": [4]},
                "scaling": {"minReplicas": 1},
            },
        }

    runtime = _Pods()
    ctl = ServiceController(RewardRouter(client=None), runtime, None, "cpu")  # type: ignore[arg-type]
    clock = [0.0]
    ctl.clock = lambda: clock[0]
    nodes = [_node("g", H100)]

    async def run() -> None:
        await ctl.reconcile(body("a"), nodes, {})  # the watch shows no pod yet
        await ctl.reconcile(body("b"), nodes, {})
        status = await ctl.reconcile(body("c"), nodes, {})
        assert status["conditions"][0]["reason"] == "InsufficientGPUs", status["conditions"]
        from arl_tangram.runtime.pods import replica_devices

        held = [replica_devices(p) for p in runtime.pods.values()]
        assert len(held) == 2 and all(h is not None for h in held)
        assert len({u for h in held if h for u in h.uuids}) == 8
        # Once the watch shows the pods, they are the record; in-flight devices are forgotten.
        await ctl.reconcile(body("c"), nodes, {"ns/other": list(runtime.pods.values())})
        assert ctl._placing == {}
        # A create that never shows up frees its devices after the TTL.
        runtime.pods.clear()
        await ctl.reconcile(body("d"), nodes, {})
        clock[0] += PLACING_TTL_S + 1
        await ctl.reconcile(body("e"), nodes, {})
        assert len(ctl._placing) == 1  # only e's: d's expired

    asyncio.run(run())


@pytest.mark.parametrize(
    ("tolerations", "placed"),
    [
        ([], False),
        ([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}], True),
        ([{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present"}], True),
        ([{"key": "nvidia.com/gpu", "operator": "Equal", "value": "other"}], False),
        ([{"operator": "Exists"}], True),
        ([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}], False),
    ],
)
def test_a_gpu_node_tainted_against_the_services_pods_takes_none_of_its_replicas(
    tolerations: list[dict[str, Any]], placed: bool
) -> None:
    tainted = _node("g", H100)
    tainted["spec"]["taints"] = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    from arl_tangram.controllers.rewardmodelservice import gpu_view

    view = gpu_view("ns/rm", [tainted], {}, tolerations)
    assert [i.node for i in view.inventories] == (["g"] if placed else [])
    status, ops = reconcile(ServiceObservation([], stats(queued=1, last=999.0), 1000.0, gpu=view))
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    if placed:
        assert [o.placement.node for o in ops if isinstance(o, CreateReplica) and o.placement] == ["g"]
    else:
        assert not ops and ready["reason"] == "InsufficientGPUs" and "tainted" in ready["message"]


# ---- a service with no replica coming: its requests are refused, not held for the cold start ------
def _outage_of(obs: ServiceObservation) -> Any:
    status, ops = reconcile(obs)
    return service_outage(cfg(), obs, status["conditions"], ops)


def test_a_replica_that_cannot_start_is_named_and_its_requests_refused_after_a_while() -> None:
    why = "container runtime: ImagePullBackOff: img:typo not found"
    early = ServiceObservation(
        [rep("a", "starting", stalled=why, stalled_s=1.0)], stats(queued=1, last=999.0), 1000.0
    )
    status, _ = reconcile(early)
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Ready"] == "HostsStarting"
    assert service_outage(cfg(), early, status["conditions"], []) is None
    stalled = [rep("a", "starting", stalled=why, stalled_s=UNSCHEDULABLE_AFTER_S)]
    late = ServiceObservation(stalled, stats(queued=1, last=999.0), 1000.0)
    status, ops = reconcile(late)
    conds = {c["type"]: c for c in status["conditions"]}
    for kind in ("Ready", "Degraded"):
        assert (
            conds[kind]["reason"] == "HostsCannotStart" and "replica a cannot start" in conds[kind]["message"]
        )
    outage = service_outage(cfg(), late, status["conditions"], ops)
    assert outage is not None and outage.message.startswith("RewardModelService ns/rm has no replica: ")
    assert "ImagePullBackOff: img:typo not found" in outage.message
    # A ready replica serves meanwhile: nothing is refused.
    both = ServiceObservation([*stalled, rep("b")], stats(last=999.0), 1000.0)
    assert _outage_of(both) is None
    # A replica created this round is coming.
    assert service_outage(cfg(), late, status["conditions"], [CreateReplica("1 request(s) waiting")]) is None


def test_no_free_gpu_and_a_crash_loop_refuse_requests_with_the_reason() -> None:
    view = _view(_node("g", H100, cordoned=True))
    short = ServiceObservation([], stats(queued=1, last=999.0), 1000.0, gpu=view)
    assert _outage_of(short) is None  # no GPU for a moment: it waits
    short = ServiceObservation(
        [], stats(queued=1, last=999.0), 1000.0, gpu=view, short_for_s=UNSCHEDULABLE_AFTER_S
    )
    outage = _outage_of(short)
    assert outage is not None and "takes new pods" in outage.message
    failing = ServiceObservation(
        [], stats(queued=1, last=999.0), 1000.0, failures=3, since_failure_s=5.0, last_failure="exited 2"
    )
    outage = _outage_of(failing)
    assert outage is not None and "3 replica(s) failed in a row, last: exited 2" in outage.message
    assert outage.retry_after_s == pytest.approx(backoff_s(3) - 5.0)
    over = ServiceObservation([], stats(queued=1, last=999.0), 1000.0, failures=3, since_failure_s=21.0)
    assert _outage_of(over) is None  # the next may start


def test_a_spec_turned_invalid_is_refused_while_the_last_accepted_one_keeps_serving() -> None:
    """As a pool's: an edit the operator refuses stops nothing. The router keeps the last accepted
    config, the reconcile keeps looking after the replicas (a failed one is removed), and the status
    says the new spec is refused and which one runs, not that the service is down."""
    from arl_tangram.controllers.rewardmodelservice import ServiceController
    from arl_tangram.dispatch.rewards import RewardRouter

    def body(generation: int, uri: str, uid: str = "u") -> dict[str, Any]:
        return {
            "metadata": {"name": "rm", "namespace": "ns", "generation": generation, "uid": uid},
            "spec": {"model": {"name": "m", "uri": uri}, "scaling": {"minReplicas": 1}},
        }

    async def run() -> None:
        runtime = _Replicas()
        router = RewardRouter(client=None)  # type: ignore[arg-type]
        ctl = ServiceController(router, runtime, None, "cpu")  # type: ignore[arg-type]
        await ctl.reconcile(body(1, "file:///w/rm.npz"))
        first = runtime.created[0]
        runtime.listed = [rep(first, "failed", failure="exit 2")]
        status = await ctl.reconcile(body(2, "hf://org/model"))
        assert router._services["ns/rm"].config.generation == 1  # requests keep being served by it
        assert runtime.deleted == [first]  # and its replicas looked after
        conds = {c["type"]: c for c in status["conditions"]}
        assert status["observedGeneration"] == 2
        degraded = conds["Degraded"]
        assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
        assert "spec.model.uri" in degraded["message"]
        assert "the service keeps running its last accepted spec (generation 1)" in degraded["message"]
        assert conds["Ready"]["reason"] != "InvalidSpec" and "queueDepth" in status
        status = await ctl.reconcile(body(3, "file:///w/rm2.npz"))  # fixed
        assert router._services["ns/rm"].config.generation == 3
        assert {c["type"]: c for c in status["conditions"]}["Degraded"]["reason"] != "InvalidSpec"
        # With no accepted spec of this very service (one made again under the name): Ready=False.
        status = await ctl.reconcile(body(1, "hf://org/model", uid="u2"))
        ready = {c["type"]: c for c in status["conditions"]}["Ready"]
        assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")

    asyncio.run(run())


# ---- rollouts: an edited spec replaces the replicas of the older one ------------------------------
OLD_URI = "file:///w/old.npz"  # the spec before the edit: other weights, another template hash


def _roll(
    replicas: list[HostObservation],
    gpu_spec: dict[str, Any],
    view: Any = None,
    inflight: dict[str, int] | None = None,
    draining: dict[str, float] | None = None,
    coming: int = 0,
    minReplicas: int = 1,
) -> tuple[dict[str, Any], list[Any]]:
    """One round of the current spec (``rms_of(gpu=gpu_spec)``) over ``replicas``."""
    load = ServiceStats(0, sum((inflight or {}).values()), None, (), dict(inflight or {}))
    obs = ServiceObservation(
        replicas,
        load,
        1000.0,
        gpu=view if view is not None else _view(),
        draining=draining or {},
        coming=coming,
    )
    return reconcile(obs, gpu=gpu_spec, minReplicas=minReplicas)


def _kinds(ops: list[Any]) -> list[Any]:
    return [
        "create" if isinstance(o, CreateReplica) else (type(o).__name__, o.name)
        for o in ops
        if isinstance(o, CreateReplica | DeleteReplica | DrainReplica)
    ]


def _cond(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return {c["type"]: c for c in status["conditions"]}[kind]


def _placed(gpu_spec: dict[str, Any], n: int, taken: frozenset[str] = frozenset()) -> list[Any]:
    from arl_tangram.gpu.placement import place_service

    return list(place_service(rms_of(gpu=gpu_spec), _view(_node("g", H100)).inventories, n, taken).placements)


def test_an_edit_surges_a_new_replica_where_a_gpu_is_free_then_drains_and_deletes_the_old() -> None:
    """Before, an edited spec never reached the replicas: the old ones served it for ever."""
    gpu_spec = {"count": [1]}
    old = service_config(rms_of(OLD_URI, gpu=gpu_spec), uid="u")
    (pa,) = _placed(gpu_spec, 1)
    a = rep("a", template=old.template_hash)
    view = _view(_node("g", H100), pods={"ns/rm": [_pod(old, "a", pa)]})
    status, ops = _roll([a], gpu_spec, view)
    (create,) = [o for o in ops if isinstance(o, CreateReplica)]
    assert create.placement is not None and not set(create.placement.uuids) & set(pa.uuids)
    assert _kinds(ops) == ["create"]  # a keeps serving meanwhile
    scaling = _cond(status, "Scaling")
    assert (scaling["status"], scaling["reason"]) == ("True", "RollingOut"), scaling
    assert status["updatedReplicas"] == 0 and _cond(status, "Ready")["status"] == "True"
    # The new replica starting: nothing else happens; ready: the old one is drained.
    _, ops = _roll([a, rep("n", "starting")], gpu_spec, view)
    assert _kinds(ops) == []
    status, ops = _roll([a, rep("n")], gpu_spec, view)
    assert _kinds(ops) == [("DrainReplica", "a")] and status["updatedReplicas"] == 1
    # Drained with calls in flight: kept until they are done (or the drain time is up).
    status, ops = _roll([a, rep("n")], gpu_spec, view, inflight={"a": 2}, draining={"a": 1.0})
    assert _kinds(ops) == [] and status["readyReplicas"] == 1 and status["replicas"] == 2
    _, ops = _roll([a, rep("n")], gpu_spec, view, inflight={"a": 0}, draining={"a": 3.0})
    assert _kinds(ops) == [("DeleteReplica", "a")]
    _, ops = _roll([a, rep("n")], gpu_spec, view, inflight={"a": 1}, draining={"a": DRAIN_TIMEOUT_S})
    assert _kinds(ops) == [("DeleteReplica", "a")]
    status, ops = _roll([rep("n")], gpu_spec, view)
    assert _kinds(ops) == [] and status["updatedReplicas"] == 1
    assert (_cond(status, "Scaling")["reason"], _cond(status, "Ready")["reason"]) == ("Steady", "HostsReady")


def test_with_no_gpu_free_old_replicas_are_replaced_one_at_a_time_and_one_always_serves() -> None:
    gpu_spec = {"count": [4]}
    old = service_config(rms_of(OLD_URI, gpu=gpu_spec), uid="u")
    new = service_config(rms_of(gpu=gpu_spec), uid="u")
    pa, pb = _placed(gpu_spec, 2)  # the board's eight GPUs, all held
    a, b = rep("a", template=old.template_hash), rep("b", template=old.template_hash)
    view = _view(_node("g", H100), pods={"ns/rm": [_pod(old, "a", pa), _pod(old, "b", pb)]})
    status, ops = _roll([a, b], gpu_spec, view, minReplicas=2)
    assert _kinds(ops) == [("DrainReplica", "a")], ops  # one only: b serves meanwhile
    assert "replacing a" in _cond(status, "Scaling")["message"]
    # a draining, a call in flight: nothing more (b is not drained, no GPU is free yet).
    status, ops = _roll([a, b], gpu_spec, view, inflight={"a": 1}, draining={"a": 1.0}, minReplicas=2)
    assert _kinds(ops) == [] and status["readyReplicas"] == 1
    assert _cond(status, "Ready")["status"] == "True"
    assert _cond(status, "Ready")["reason"] != "InsufficientGPUs"
    _, ops = _roll([a, b], gpu_spec, view, draining={"a": 2.0}, minReplicas=2)
    assert _kinds(ops) == [("DeleteReplica", "a")]
    # a stopping (its pod still holds the GPUs): b is not touched, no shortage reported.
    stopping = rep("a", "terminating", template=old.template_hash)
    status, ops = _roll([stopping, b], gpu_spec, view, minReplicas=2)
    assert _kinds(ops) == [] and "InsufficientGPUs" not in str(status["conditions"])
    # a gone: its replacement is created in its place; b stays until it is ready.
    view = _view(_node("g", H100), pods={"ns/rm": [_pod(old, "b", pb)]})
    _, ops = _roll([b], gpu_spec, view, minReplicas=2)
    (create,) = [o for o in ops if isinstance(o, CreateReplica)]
    assert create.placement is not None and set(create.placement.uuids) == set(pa.uuids)
    assert _kinds(ops) == ["create"]
    # Created, not in the pod watch yet (its devices taken meanwhile): b is not drained for room.
    unseen = type(view)(view.inventories, view.held, frozenset(pa.uuids), view.problems, view.published)
    _, ops = _roll([b], gpu_spec, unseen, coming=1, minReplicas=2)
    assert _kinds(ops) == []
    n = rep("n", "starting", new.template_hash)
    view = _view(_node("g", H100), pods={"ns/rm": [_pod(old, "b", pb), _pod(new, "n", pa)]})
    _, ops = _roll([b, n], gpu_spec, view, minReplicas=2)
    assert _kinds(ops) == []
    status, ops = _roll([b, rep("n", template=new.template_hash)], gpu_spec, view, minReplicas=2)
    assert _kinds(ops) == [("DrainReplica", "b")] and status["updatedReplicas"] == 1


def test_a_one_replica_service_with_no_gpu_free_is_replaced_in_place_and_says_so() -> None:
    gpu_spec = {"count": [8]}
    old = service_config(rms_of(OLD_URI, gpu=gpu_spec), uid="u")
    (pa,) = _placed(gpu_spec, 1)
    a = rep("a", template=old.template_hash)
    view = _view(_node("g", H100), pods={"ns/rm": [_pod(old, "a", pa)]})
    _, ops = _roll([a], gpu_spec, view)
    assert _kinds(ops) == [("DrainReplica", "a")]  # there is no other way: a gap of one cold start
    obs = ServiceObservation([a], stats(queued=1), 1000.0, gpu=view, draining={"a": 1.0})
    status, ops = reconcile(obs, gpu=gpu_spec, minReplicas=1)
    ready = _cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "RollingOut") and "a" in ready["message"]
    assert _kinds(ops) == [("DeleteReplica", "a")]
    # Its requests wait for the replacement, refused by no outage.
    assert service_outage(cfg(), obs, status["conditions"], ops) is None
    stopping = ServiceObservation(
        [rep("a", "terminating", template=old.template_hash)], stats(queued=1), 1000.0, gpu=view
    )
    status, ops = reconcile(stopping, gpu=gpu_spec, minReplicas=1)
    assert _cond(status, "Ready")["reason"] == "RollingOut" and _kinds(ops) == []
    assert service_outage(cfg(), stopping, status["conditions"], ops) is None


def test_an_old_replica_whose_gpus_would_not_hold_a_new_one_is_not_taken_down() -> None:
    """The new spec asks for 2 GPUs; the old replicas hold one each on a board whose other GPUs
    other services hold: draining one would free a single GPU, so none goes, and Scaling says so."""
    gpu_spec = {"count": [1]}
    old = service_config(rms_of(OLD_URI, gpu=gpu_spec), uid="u")
    pa, pb = _placed(gpu_spec, 2)
    others = frozenset(_uuids(H100, "g")) - set(pa.uuids) - set(pb.uuids)
    view = _view(_node("g", H100), pods={"ns/rm": [_pod(old, "a", pa), _pod(old, "b", pb)]})
    view = type(view)(view.inventories, view.held, others, view.problems, view.published)
    reps = [rep("a", template=old.template_hash), rep("b", template=old.template_hash)]
    status, ops = _roll(reps, {"count": [2]}, view, minReplicas=2)
    assert _kinds(ops) == []
    scaling = _cond(status, "Scaling")
    assert scaling["reason"] == "RollingOut" and "even in place of one old replica" in scaling["message"]


def test_where_the_device_plugin_places_a_new_pod_that_waits_for_a_node_makes_an_old_one_go() -> None:
    old = service_config(rms_of(OLD_URI), uid="u")
    a = rep("a", template=old.template_hash)
    _, ops = _roll([a], {"count": [1]})
    assert [(type(o), getattr(o, "placement", None)) for o in ops] == [(CreateReplica, None)]
    _, ops = _roll([a, rep("n", "starting")], {"count": [1]})
    assert _kinds(ops) == []  # scheduled, starting: it takes over once ready
    waiting = rep("n", "starting", pending="0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    _, ops = _roll([a, waiting], {"count": [1]})
    assert _kinds(ops) == [("DrainReplica", "a")]


def test_old_replicas_of_an_idle_service_simply_go_and_a_starting_one_is_replaced_at_once() -> None:
    old = service_config(rms_of(OLD_URI), uid="u")
    idle = ServiceObservation([rep("a", template=old.template_hash)], stats(), 10_000.0)
    _, ops = reconcile(idle)  # minReplicas 0, idle: no replica of any spec is wanted
    assert _kinds(ops) == [("DrainReplica", "a")]
    status, ops = reconcile(replace(idle, draining={"a": 1.0}))
    assert _kinds(ops) == [("DeleteReplica", "a")] and _cond(status, "Ready")["reason"] == "ScaledToZero"
    status, ops = reconcile(ServiceObservation([], stats(), 10_000.0))
    assert _kinds(ops) == [] and _cond(status, "Ready")["reason"] == "ScaledToZero"
    starting = ServiceObservation([rep("a", "starting", template=old.template_hash)], stats(queued=1), 1.0)
    _, ops = reconcile(starting)
    assert sorted(map(str, _kinds(ops))) == sorted(map(str, ["create", ("DeleteReplica", "a")]))


def test_the_controller_rolls_an_edit_out_and_routes_only_to_replicas_not_drained() -> None:
    """End to end through the controller and its router (no inventory: the device plugin places)."""
    from arl_tangram.controllers.rewardmodelservice import ServiceController
    from arl_tangram.dispatch.rewards import RewardRouter

    def body(generation: int, uri: str) -> dict[str, Any]:
        return {
            "metadata": {"name": "rm", "namespace": "ns", "generation": generation, "uid": "u"},
            "spec": {"model": {"name": "m", "uri": uri}, "scaling": {"minReplicas": 2, "maxReplicas": 2}},
        }

    def ready_all(runtime: _Replicas) -> None:
        runtime.listed = [replace(r, phase="ready") if r.phase == "starting" else r for r in runtime.listed]

    async def run() -> None:
        class Health:
            async def health(self, address: str) -> dict[str, Any]:
                return {"resident": ["rm"]}

        runtime = _Replicas()
        router = RewardRouter(client=None)  # type: ignore[arg-type]
        ctl = ServiceController(router, runtime, Health(), "cpu")  # type: ignore[arg-type]
        await ctl.reconcile(body(1, OLD_URI))
        ready_all(runtime)
        first = set(runtime.created)
        status = await ctl.reconcile(body(1, OLD_URI))
        assert len(first) == 2 and set(router._services["ns/rm"].endpoints) == first
        assert status["updatedReplicas"] == 2
        status = await ctl.reconcile(body(2, "file:///w/rm.npz"))  # the edit: two new ones surge
        new = set(runtime.created) - first
        assert len(new) == 2 and not runtime.deleted
        assert _cond(status, "Scaling")["reason"] == "RollingOut" and status["updatedReplicas"] == 0
        ready_all(runtime)
        await ctl.reconcile(body(2, "file:///w/rm.npz"))  # new ones ready: the old ones drained
        assert set(router._services["ns/rm"].endpoints) == new and not runtime.deleted
        status = await ctl.reconcile(body(2, "file:///w/rm.npz"))  # idle: deleted
        assert set(runtime.deleted) == first and {r.name for r in runtime.listed} == new
        status = await ctl.reconcile(body(2, "file:///w/rm.npz"))
        assert status["updatedReplicas"] == 2 and _cond(status, "Scaling")["reason"] == "Steady"
        assert ctl._draining["ns/rm"] == {}

    asyncio.run(run())


def test_an_unschedulable_replacement_never_takes_the_last_ready_replica_of_a_service_of_two() -> None:
    """Where the device plugin places, one old replica made room and went; its replacement (and the
    other new one) still wait for a node: the new spec does not fit there (more GPUs than a node
    has, say). The last old replica stays serving; draining it too left the service with none, for
    good."""
    old = service_config(rms_of(OLD_URI), uid="u")
    waits = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    b = rep("b", template=old.template_hash)
    pending = [rep("n1", "starting", pending=waits), rep("n2", "starting", pending=waits)]
    status, ops = _roll([b, *pending], {"count": [1]}, minReplicas=2)
    assert _kinds(ops) == [] and status["readyReplicas"] == 1
    scaling = _cond(status, "Scaling")
    assert scaling["reason"] == "RollingOut" and "the old ones keep serving" in scaling["message"]
    # A service of one replica has its gap (one cold start): its only replica makes room.
    _, ops = _roll([b, pending[0]], {"count": [1]}, minReplicas=1)
    assert _kinds(ops) == [("DrainReplica", "b")]


def test_a_replica_started_for_waiting_requests_is_not_deleted_as_surplus_while_it_starts() -> None:
    """More requests wait than the ready replica batches: one more replica is made, and kept while
    it starts (the next round saw one replica ready, wanted one, and deleted the new one: created
    and deleted round after round, it never got to serve)."""
    _, ops = reconcile(ServiceObservation([rep("a")], stats(queued=9, last=999.0), 1000.0))
    assert _kinds(ops) == ["create"]
    starting = ServiceObservation([rep("a"), rep("b", "starting")], stats(queued=9, last=999.0), 1000.0)
    status, ops = reconcile(starting)
    assert _kinds(ops) == [] and _cond(status, "Scaling")["status"] == "True"
    # The requests served meanwhile: it is surplus again.
    _, ops = reconcile(replace(starting, stats=stats(queued=0, last=999.0)))
    assert _kinds(ops) == [("DeleteReplica", "b")]


def test_a_refused_spec_keeps_the_time_it_was_refused_round_after_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Degraded=True InvalidSpec moves its lastTransitionTime only when it becomes true: before, each
    round made it now (the round's own Degraded=False was the status it came from), so the status
    was written again every round for as long as the spec stayed refused."""
    from arl_tangram.controllers import rewardmodelservice as module
    from arl_tangram.controllers.rewardmodelservice import ServiceController
    from arl_tangram.dispatch.rewards import RewardRouter

    times = [NOW]

    class Clock(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return times[0]

    monkeypatch.setattr(module, "datetime", Clock)

    def body(generation: int, uri: str, status: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "metadata": {"name": "rm", "namespace": "ns", "generation": generation, "uid": "u"},
            "spec": {"model": {"name": "m", "uri": uri}},
            "status": status or {},
        }

    async def run() -> None:
        ctl = ServiceController(RewardRouter(client=None), _Replicas(), None, "cpu")  # type: ignore[arg-type]
        status = await ctl.reconcile(body(1, "file:///w/rm.npz"))
        times[0] = NOW.replace(minute=1)
        refused = await ctl.reconcile(body(2, "hf://org/model", status))
        when = _cond(refused, "Degraded")["lastTransitionTime"]
        assert _cond(refused, "Degraded")["reason"] == "InvalidSpec" and when == "2026-12-03T12:01:00Z"
        times[0] = NOW.replace(minute=2)
        again = await ctl.reconcile(body(2, "hf://org/model", refused))
        assert _cond(again, "Degraded")["lastTransitionTime"] == when
        assert again == refused  # nothing to write

    asyncio.run(run())


def test_a_service_made_again_under_its_name_does_not_inherit_the_deleted_ones_state() -> None:
    """A service deleted while its replicas failed (a bad image), then made again fixed: its first
    replica starts at once. Before, the deleted one's failure streak stayed under the name, and the
    new service waited out its back-off (up to 5 min) with its requests refused as a crash loop; a
    round that raced the deletion also put the deleted one's state back, for good."""
    from arl_tangram.controllers.rewardmodelservice import ServiceController
    from arl_tangram.dispatch.rewards import RewardRouter

    def body(uid: str) -> dict[str, Any]:
        return {
            "metadata": {"name": "rm", "namespace": "ns", "generation": 1, "uid": uid},
            "spec": {"model": {"name": "m", "uri": "file:///w/rm.npz"}, "scaling": {"minReplicas": 1}},
        }

    class Slow(_Replicas):
        def __init__(self) -> None:
            super().__init__()
            self.gate = asyncio.Event()
            self.gate.set()

        async def ensure_services_file(self, svc: Any) -> None:
            await self.gate.wait()

    async def run() -> None:
        runtime = Slow()
        ctl = ServiceController(RewardRouter(client=None), runtime, None, "cpu")  # type: ignore[arg-type]
        runtime.listed = [rep(f"rm-{i}", "failed", failure="exit 2") for i in range(3)]
        await ctl.reconcile(body("u-1"))  # three replicas failed in a row: it backs off
        made = len(runtime.created)
        assert made == 0 and ctl.router.outage("ns/rm") is not None
        runtime.listed = []
        ctl.deleted("ns/rm")
        await ctl.reconcile(body("u-2"))
        assert len(runtime.created) == made + 1  # at once
        # A round under way as the service is deleted leaves nothing of it behind.
        runtime.gate.clear()
        round_ = asyncio.create_task(ctl.reconcile(body("u-2")))
        await asyncio.sleep(0)
        ctl.deleted("ns/rm")
        runtime.gate.set()
        await round_
        kept = [ctl._draining, ctl._created, ctl._accepted, ctl._failures._state, ctl._unplaced._since]
        assert not any("ns/rm" in state for state in kept), kept

    asyncio.run(run())


def test_requests_wait_for_an_in_place_replacement_whose_pod_waits_for_the_old_ones_gpus() -> None:
    """Where the device plugin places, the new replica's pod waits for a node from the start of the
    rollout until the old one (drained, its calls finished, then stopping) has given its GPUs back:
    longer than UNSCHEDULABLE_AFTER_S is common. Its requests wait for it, as the Ready condition
    (RollingOut) says, instead of being refused as if no replica could ever be placed."""
    old = service_config(rms_of(OLD_URI), uid="u")
    waits = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    new = rep("n", "starting", pending=waits)
    for a in (rep("a", template=old.template_hash), rep("a", "terminating", template=old.template_hash)):
        draining = {"a": 60.0} if a.phase == "ready" else {}
        obs = ServiceObservation(
            [a, new],
            stats(queued=1),
            1000.0,
            draining=draining,
            unschedulable_for_s=UNSCHEDULABLE_AFTER_S + 30,
        )
        status, ops = reconcile(obs, minReplicas=1)
        assert _cond(status, "Ready")["reason"] == "RollingOut", status["conditions"]
        assert service_outage(cfg(), obs, status["conditions"], ops) is None, a.phase


def test_a_surplus_replica_that_serves_is_never_deleted_before_one_still_starting() -> None:
    """Surplus goes newest first, but a replica still starting goes before one that serves: an older
    one waiting for a node (made for a queue since served) and a newer one ready (the replacement of
    a failed one): deleting the ready one left the service with nothing serving."""
    older_waiting = rep("n2", "starting", pending="0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    _, ops = reconcile(ServiceObservation([older_waiting, rep("n1")], stats(), 1000.0), minReplicas=1)
    assert _kinds(ops) == [("DeleteReplica", "n2")]
    # In a rollout too: the old replica is drained, the new one that serves stays.
    old = service_config(rms_of(OLD_URI), uid="u")
    _, ops = _roll([rep("o1", template=old.template_hash), older_waiting, rep("n1")], {"count": [1]})
    assert sorted(map(str, _kinds(ops))) == sorted(
        map(str, [("DrainReplica", "o1"), ("DeleteReplica", "n2")])
    )


def test_a_rollout_and_a_refused_edit_are_posted_as_events_once_each() -> None:
    """``kubectl describe rewardmodelservice`` showed nothing of a rollout (pools post their
    scaling and removals): now its start, each replica added, drained and removed, and its end are
    Events, as is a refused edit (once per generation). The status each round wrote is fed back,
    as the watch does."""
    from arl_tangram.controllers.conditions import Event
    from arl_tangram.controllers.rewardmodelservice import ServiceController
    from arl_tangram.dispatch.rewards import RewardRouter

    posted: list[tuple[str, Event]] = []
    last: dict[str, Any] = {}

    def body(generation: int, uri: str) -> dict[str, Any]:
        return {
            "metadata": {"name": "rm", "namespace": "ns", "generation": generation, "uid": "u"},
            "spec": {"model": {"name": "m", "uri": uri}, "scaling": {"minReplicas": 1, "maxReplicas": 1}},
            "status": last,
        }

    def ready_all(runtime: _Replicas) -> None:
        runtime.listed = [replace(r, phase="ready") if r.phase == "starting" else r for r in runtime.listed]

    async def run() -> None:
        class Health:
            async def health(self, address: str) -> dict[str, Any]:
                return {"resident": ["rm"]}

        runtime = _Replicas()
        ctl = ServiceController(
            RewardRouter(client=None),  # type: ignore[arg-type]
            runtime,
            Health(),  # type: ignore[arg-type]
            "cpu",
            emit=lambda obj, event: posted.append((obj["metadata"]["name"], event)),
        )

        async def round_(generation: int, uri: str) -> list[tuple[str, str]]:
            nonlocal last
            before = len(posted)
            last = await ctl.reconcile(body(generation, uri))
            return [(e.type, e.reason) for _, e in posted[before:]]

        assert await round_(1, OLD_URI) == [("Normal", "ScalingUp")]
        ready_all(runtime)
        assert await round_(1, OLD_URI) == []
        (old,) = runtime.created
        assert await round_(2, "file:///w/rm.npz") == [("Normal", "RollingOut"), ("Normal", "ScalingUp")]
        assert await round_(2, "file:///w/rm.npz") == []  # under way: said once
        ready_all(runtime)
        assert await round_(2, "file:///w/rm.npz") == [("Normal", "ReplicaDraining")]
        assert await round_(2, "file:///w/rm.npz") == [("Normal", "ReplicaRemoved")]
        assert old in runtime.deleted
        assert await round_(2, "file:///w/rm.npz") == [("Normal", "RolledOut")]
        assert await round_(2, "file:///w/rm.npz") == []
        # An edit the operator refuses (weights it would download): one Warning for it.
        assert await round_(3, "hf://org/model") == [("Warning", "InvalidSpec")]
        assert await round_(3, "hf://org/model") == []
        assert all(name == "rm" for name, _ in posted)
        messages = [e.message for _, e in posted]
        assert any("generation 2" in m for m in messages if m.startswith("every replica"))

    asyncio.run(run())


# ---- edits: what a replica is built from rolls it; specs no node can hold name their field -------
def _hash(**scaling: Any) -> str:
    return service_config(rms_of(**scaling), uid="u").template_hash


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"maxQueueLength": 16}, {"maxQueueLength": 64}),
        ({"maxQueueLength": 64}, {"maxQueueLength": 16}),
    ],
)
def test_an_edit_of_the_services_file_rolls_the_replicas(
    before: dict[str, Any], after: dict[str, Any]
) -> None:
    """The runtime reads its services file only at start, and the ConfigMap with it is rewritten only
    when the template hash changes: an edit of maxQueueLength (or minReplicas across 0) was in no
    replica, running or started after it (they kept refusing with 429 at the old queue length)."""
    old = service_config(rms_of(minReplicas=1, **before), uid="u")
    new = service_config(rms_of(minReplicas=1, **after), uid="u")
    assert old.services_file() != new.services_file()
    assert old.template_hash != new.template_hash
    rms = rms_of(minReplicas=1, **after)
    obs = ServiceObservation([rep("a", template=old.template_hash)], stats(), 1000.0)
    status, ops = reconcile_rewardmodelservice(rms, new, obs, NOW)
    assert _cond(status, "Scaling")["reason"] == "RollingOut" and status["updatedReplicas"] == 0
    assert any(isinstance(o, CreateReplica) for o in ops)  # a replica of the edited spec beside a


def test_scaling_knobs_outside_the_services_file_roll_nothing() -> None:
    """Only what a replica is built from rolls it: minReplicas, maxReplicas and the idle timeout are
    the controller's alone (keepResident, which follows minReplicas, changes nothing in a replica
    that runs one service)."""
    base = _hash(minReplicas=1)
    assert _hash(minReplicas=2) == base == _hash(minReplicas=0)
    assert _hash(minReplicas=1, maxReplicas=5) == base
    assert _hash(minReplicas=1, idleTimeoutSeconds=600) == base


@pytest.mark.parametrize(
    ("gpu", "topology", "scaling", "field", "why"),
    [
        # Tensor parallel 8 on a board of 4: it was placed on the four (a replica its runtime cannot
        # shard), reported as starting.
        ({"count": [8]}, "ring4", {}, "spec.gpu.count", "has 4 whole GPUs"),
        # 100 GiB on one 80 GB GPU: it was "no free [1] GPUs", as if other replicas held them.
        ({"count": [1], "memory": "100Gi"}, H100, {}, "spec.gpu.memory", "largest GPU holds 80 GiB"),
        ({"count": [1], "migProfile": "3g.40gb"}, H100, {}, "spec.gpu.migProfile", "no node has"),
        ({"count": [4]}, H100, {"minReplicas": 3}, "spec.scaling.minReplicas", "they hold 2"),
    ],
)
def test_a_spec_no_node_can_hold_says_which_field_and_why(
    gpu: dict[str, Any], topology: str, scaling: dict[str, Any], field: str, why: str
) -> None:
    """A spec that no node could hold even with every GPU free is Unschedulable (Ready, or Degraded
    where some replicas run), naming the field, as a pool's is; and its requests are refused with that
    message once it has lasted UNSCHEDULABLE_AFTER_S, not held as if GPUs were only busy."""
    view = _view(_node("g", topology))
    obs = ServiceObservation([], stats(queued=1, last=999.0), 1000.0, gpu=view)
    rms = rms_of(gpu=gpu, **scaling)
    status, ops = reconcile_rewardmodelservice(rms, service_config(rms, uid="u"), obs, NOW)
    placements = [o.placement for o in ops if isinstance(o, CreateReplica)]
    assert all(p is not None and len(p.uuids) in gpu["count"] for p in placements), placements
    degraded = _cond(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "Unschedulable"), degraded
    assert degraded["message"].startswith(f"{field}:") and why in degraded["message"], degraded
    assert field in _cond(status, "Scaling")["message"]
    if not placements:
        ready = _cond(status, "Ready")
        assert (ready["status"], ready["reason"], ready["message"]) == (
            "False",
            "Unschedulable",
            degraded["message"],
        )
        late = replace(obs, short_for_s=UNSCHEDULABLE_AFTER_S)
        refused = service_outage(service_config(rms, uid="u"), late, status["conditions"], ops)
        assert refused is not None and field in refused.message


def test_a_shortage_of_busy_gpus_is_no_spec_fault() -> None:
    """GPUs other services hold now are InsufficientGPUs (they may be given back), not Unschedulable."""
    from arl_tangram.controllers.rewardmodelservice import GpuView

    view = _view(_node("g", H100))
    busy = GpuView(view.inventories, {}, frozenset(_uuids(H100, "g")), (), 1)
    status, ops = reconcile(
        ServiceObservation([], stats(queued=1, last=999.0), 1000.0, gpu=busy), gpu={"count": [2]}
    )
    assert not ops and _cond(status, "Ready")["reason"] == "InsufficientGPUs"
    assert _cond(status, "Degraded")["status"] == "False"


def test_an_edit_back_during_a_rollout_serves_on_the_drained_replica_of_that_spec() -> None:
    """A -> B -> A: the replica of A drained for B's serves again at once, and B's (the middle spec)
    is the one drained; before, A's was deleted when its calls were done and a new replica of A
    started from cold while B's served."""
    from arl_tangram.controllers.rewardmodelservice import UndrainReplica

    gpu_spec = {"count": [1]}
    middle = service_config(rms_of(OLD_URI, gpu=gpu_spec), uid="u")
    a, b = rep("a"), rep("b", template=middle.template_hash)
    # Surge: b (B) ready, a (A, the current spec again) drained with a call in flight.
    status, ops = _roll([a, b], gpu_spec, inflight={"a": 1}, draining={"a": 5.0})
    assert [o.name for o in ops if isinstance(o, UndrainReplica)] == ["a"]
    assert _kinds(ops) == [("DrainReplica", "b")], ops
    assert status["readyReplicas"] == 2 and status["updatedReplicas"] == 1  # (b drained from now)
    # In place: a drained to make room for B, whose replica waits for its GPUs: b goes, a serves.
    waiting = rep(
        "b", "starting", template=middle.template_hash, pending="0/1 nodes: Insufficient nvidia.com/gpu"
    )
    status, ops = _roll([a, waiting], gpu_spec, draining={"a": 5.0})
    assert [type(o).__name__ for o in ops] == ["UndrainReplica", "DeleteReplica"], ops
    assert _cond(status, "Ready")["reason"] == "HostsReady"
    # One the controller deleted already (the watch still shows it ready) is not brought back.
    obs = ServiceObservation([a, b], stats(), 1000.0, draining={"a": 5.0}, deleted=frozenset({"a"}))
    _, ops = reconcile(obs, gpu=gpu_spec, minReplicas=1)
    assert not [o for o in ops if isinstance(o, UndrainReplica)] and "create" in _kinds(ops)


def test_the_controller_never_undrains_a_replica_it_deleted() -> None:
    """A deleted replica's pod may still be listed ready by the watch for a while: an edit back to
    its spec must not bring it back (its runtime is stopping). (The runtime is the test's own list;
    the replicas' health is asked over real HTTP of a port nobody listens on: no residency, as for a
    replica not answering.)"""
    from arl_tangram.controllers.rewardmodelservice import ServiceController
    from arl_tangram.dispatch.agent import AgentClient
    from arl_tangram.dispatch.rewards import RewardRouter

    def body(uri: str, generation: int) -> dict[str, Any]:
        return {
            "metadata": {"name": "rm", "namespace": "ns", "generation": generation, "uid": "u"},
            "spec": {"model": {"name": "m", "uri": uri}, "scaling": {"minReplicas": 1}},
        }

    class Stale(_Replicas):
        async def delete_replica(self, svc: Any, name: str) -> None:
            self.deleted.append(name)  # the watch keeps listing it, ready, for now

    def ready(name: str, uri: str, generation: int) -> HostObservation:
        svc = service_config(RewardModelService.model_validate(body(uri, generation)), uid="u")
        return HostObservation(name, "ns/rm", "ready", "n", "127.0.0.1:1", svc.template_hash, 1.0, 0, 0)

    async def run() -> None:
        runtime = Stale()
        router = RewardRouter(client=None)
        ctl = ServiceController(router, runtime, AgentClient(), "cpu")
        runtime.listed = [ready("a", "file:///w/a.npz", 1), ready("b", "file:///w/b.npz", 2)]
        await ctl.reconcile(body("file:///w/b.npz", 2))  # a (older spec) drained: b serves
        await ctl.reconcile(body("file:///w/b.npz", 2))  # a has no call: deleted
        assert runtime.deleted == ["a"]
        await ctl.reconcile(body("file:///w/a.npz", 3))  # back to a's spec; the watch still lists a
        assert set(router._services["ns/rm"].endpoints) == {"b"}
        assert len(runtime.created) == 1  # a new replica of the spec, not the deleted one

    asyncio.run(run())


def test_a_replica_one_node_alone_could_hold_is_no_spec_fault() -> None:
    """60 GiB fits an H100 (80 GB), not an A100-40GB beside it: the replica goes to the H100 (the
    GPU manager once checked the memory against every node and placed it on neither), and the spec
    is not what is wrong, so the service never says Unschedulable naming spec.gpu.memory."""
    view = _view(_node("g", H100), _node("r", "ring4"))
    obs = ServiceObservation([], stats(queued=1, last=999.0), 1000.0, gpu=view)
    status, ops = reconcile(obs, gpu={"count": [1], "memory": "60Gi"})
    assert _cond(status, "Degraded")["reason"] != "Unschedulable", status["conditions"]
    assert [op.placement.node for op in ops if isinstance(op, CreateReplica)] == ["g"]
