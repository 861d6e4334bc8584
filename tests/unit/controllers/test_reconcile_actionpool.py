"""The pure ActionPool reconcile, table-driven: observed hosts, load and the planner's decision in;
status and operations out. No cluster, no I/O."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.controllers.actionpool import (
    UNSCHEDULABLE_AFTER_S,
    CreateHost,
    DeleteHost,
    PoolObservation,
    SetDraining,
    missing_languages,
    pool_outage,
    reconcile_actionpool,
)
from arl_tangram.controllers.failures import OUTAGE_AFTER_FAILURES, Rejection, backoff_s
from arl_tangram.dispatch.dispatcher import HostLoad, PoolStats
from arl_tangram.domain.actions import OUTAGE_RETRY_MIN_S, Outage
from arl_tangram.domain.pools import PoolConfig, pool_config
from arl_tangram.planner.plan import (
    InstanceAdd,
    InstanceDrain,
    InstanceRemoval,
    PlacementReport,
    PoolDecision,
    Reason,
    ScalingPlan,
)
from arl_tangram.runtime.interface import HostObservation, HostPhase

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def cfg(**scaling: Any) -> PoolConfig:
    model = ActionPool.model_validate(
        {
            "metadata": {"name": "py", "namespace": "ns", "generation": 3},
            "spec": {"template": {"image": "img:1", "resources": {"cpu": "4"}}, "scaling": scaling},
        }
    )
    return pool_config(model, uid="u")


CFG = cfg(minHosts=0, maxHosts=4, maxStarting=2)


def host(name: str, phase: HostPhase = "ready", template: str | None = None, **kw: Any) -> HostObservation:
    return HostObservation(
        name=name,
        pool=CFG.key,
        phase=phase,
        node="n1",
        address="10.0.0.1:8080",
        template_hash=CFG.template_hash if template is None else template,
        created_at=1.0,
        cpu_millicores=4000,
        memory_bytes=1 << 34,
        **kw,
    )


def stats(
    loads: dict[str, tuple[int, int]] | None = None, queued: int = 0, unhealthy: frozenset[str] = frozenset()
) -> PoolStats:
    hosts = {h: HostLoad(r, s, r) for h, (r, s) in (loads or {}).items()}
    return PoolStats(
        queued,
        queued,
        sum(r for r, _ in (loads or {}).values()),
        0,
        4 * len(hosts),
        0,
        (1.0, 3.0),
        0.0,
        0.0,
        None,
        hosts,
        unhealthy,
    )


def plan(**parts: Any) -> ScalingPlan:
    report = PlacementReport("none", None, "", "not-run", 0.0, 0.0, 0.0, 0.0, "")
    return ScalingPlan(
        0.0, parts.get("adds", ()), parts.get("drains", ()), (), parts.get("removals", ()), (), report, 0.0
    )


R = Reason("ScaleUp", "because")


def _kinds(ops: list[Any]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for op in ops:
        if isinstance(op, CreateHost):
            out.append(("create", op.node or ""))
        elif isinstance(op, DeleteHost):
            out.append(("delete", op.name))
        elif isinstance(op, SetDraining):
            out.append(("drain" if op.draining else "undrain", op.name))
    return out


CASES = [
    pytest.param([], None, plan(), [], ("True", "ScaledToZero"), id="idle-pool-at-zero-is-ready"),
    pytest.param(
        [],
        stats(queued=3),
        plan(adds=(InstanceAdd(CFG.key, "n1", 4, 4000, 1, 0, R),) * 2),
        [("create", "n1"), ("create", "n1")],
        ("True", "ScaledToZero"),
        id="planner-adds-become-creates",
    ),
    pytest.param(
        [host("a", "starting")],
        stats(queued=1),
        plan(),
        [],
        ("False", "HostsStarting"),
        id="starting-not-ready",
    ),
    pytest.param(
        [host("a", "failed", failure="OOMKilled")],
        stats(),
        plan(),
        [("delete", "a")],
        ("True", "ScaledToZero"),
        id="failed-host-is-replaced",
    ),
    pytest.param(
        [host("a"), host("b")],
        stats({"a": (0, 0), "b": (0, 0)}, unhealthy=frozenset({"b"})),
        plan(),
        [("delete", "b")],
        ("True", "HostsReady"),
        id="unhealthy-host-is-replaced",
    ),
    pytest.param(
        [host("a")],
        stats({"a": (0, 0)}),
        plan(drains=(InstanceDrain("a", CFG.key, "n1", R),)),
        [("drain", "a")],
        ("True", "HostsReady"),
        id="planner-drain",
    ),
    pytest.param(
        [host("a", "draining")],
        stats({"a": (0, 0)}),
        plan(removals=(InstanceRemoval("a", CFG.key, "n1", R),)),
        [("delete", "a")],
        ("True", "ScaledToZero"),
        id="drained-host-removed",
    ),
    pytest.param(
        [host("old1", template="x"), host("old2", template="x"), host("new")],
        stats({"old1": (1, 0), "old2": (0, 0), "new": (0, 0)}),
        plan(),
        [("drain", "old1"), ("delete", "old2")],
        ("True", "HostsReady"),
        id="rollout-deletes-idle-outdated-hosts-and-drains-busy-ones",
    ),
    pytest.param(
        [host("old1", template="x")],
        stats({"old1": (2, 1)}),
        plan(),
        [("drain", "old1")],
        ("True", "HostsReady"),
        id="rollout-drains-a-busy-host-with-a-session",
    ),
    pytest.param(
        [host("s", "starting", template="x")],
        stats(),
        plan(),
        [("delete", "s")],
        ("False", "HostsStarting"),
        id="rollout-deletes-outdated-starting-hosts",
    ),
]


@pytest.mark.parametrize(("hosts", "load", "decision", "ops", "ready"), CASES)
def test_reconcile(
    hosts: list[HostObservation],
    load: PoolStats | None,
    decision: ScalingPlan,
    ops: list[tuple[str, ...]],
    ready: tuple[str, str],
) -> None:
    status, got = reconcile_actionpool(CFG, PoolObservation(hosts, load, decision), NOW)
    assert _kinds(got) == ops
    cond = {c["type"]: c for c in status["conditions"]}
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ready
    assert status["observedGeneration"] == 3
    assert status["replicas"] == len(hosts)
    assert status["selector"] == "tangram.arl.dev/pool=py"


def test_a_host_no_node_can_hold_says_so_after_a_while() -> None:
    pending = [host("a", "starting", pending="0/2 nodes are available: 2 Insufficient cpu.")]
    early, _ = reconcile_actionpool(CFG, PoolObservation(pending, stats(), plan(), (), 1.0), NOW)
    late, _ = reconcile_actionpool(
        CFG, PoolObservation(pending, stats(), plan(), (), UNSCHEDULABLE_AFTER_S), NOW
    )
    assert {c["type"]: c["reason"] for c in early["conditions"]}["Ready"] == "HostsStarting"
    cond = {c["type"]: c for c in late["conditions"]}
    assert cond["Ready"]["status"] == "False" and cond["Ready"]["reason"] == "Unschedulable"
    assert "Insufficient cpu" in cond["Ready"]["message"]
    assert cond["Degraded"]["status"] == "True"


def test_transition_time_moves_only_when_the_status_changes() -> None:
    first, _ = reconcile_actionpool(CFG, PoolObservation([], stats(), plan()), NOW)
    later = NOW.replace(hour=13)
    second, _ = reconcile_actionpool(CFG, PoolObservation([], stats(), plan(), first["conditions"]), later)
    assert first["conditions"] == second["conditions"]
    third, _ = reconcile_actionpool(
        CFG, PoolObservation([host("a", "starting")], stats(), plan(), second["conditions"]), later
    )
    ready = {c["type"]: c for c in third["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["lastTransitionTime"] == "2026-12-03T13:00:00Z"


def test_the_same_observation_gives_the_same_answer() -> None:
    obs = PoolObservation([host("a"), host("b", "starting")], stats({"a": (1, 0)}, queued=4), plan())
    assert reconcile_actionpool(CFG, obs, NOW) == reconcile_actionpool(CFG, obs, NOW)


def test_scale_replicas_pin_the_bounds_within_min_and_max() -> None:
    assert cfg(minHosts=1, maxHosts=4).desired_bounds == (1, 4)
    pinned = pool_config(
        ActionPool.model_validate(
            {
                "metadata": {"name": "py", "namespace": "ns"},
                "spec": {
                    "template": {"image": "i"},
                    "scaling": {"minHosts": 1, "maxHosts": 4},
                    "replicas": 9,
                },
            }
        )
    )
    assert pinned.desired_bounds == (4, 4)
    assert pinned.scaling_policy().max_instances == 4 and pinned.scaling_policy().min_instances == 4


def test_hosts_that_keep_failing_are_replaced_with_back_off() -> None:
    adds = plan(adds=(InstanceAdd(CFG.key, "n1", 4, 4000, 1, 0, R),))
    held = PoolObservation([], stats(queued=1), adds, failures=3, since_failure_s=5.0, last_failure="exit 1")
    status, ops = reconcile_actionpool(CFG, held, NOW)
    assert _kinds(ops) == []
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and "exit 1" in degraded["message"] and "20 s" in degraded["message"]
    later = PoolObservation([], stats(queued=1), adds, failures=3, since_failure_s=21.0)
    assert _kinds(reconcile_actionpool(CFG, later, NOW)[1]) == [("create", "n1")]


# ---- a pool with no host coming: its actions are refused, not left waiting -------------------------
def _unplaceable_plan() -> ScalingPlan:
    decision = PoolDecision(
        CFG.key, "sandbox", 4, 4, 0, 0, 4, 0.0, (Reason("Unplaceable", "0/2 nodes have 4 free cores"),)
    )
    return dataclasses.replace(plan(), pools=(decision,))


def _outage(hosts: list[HostObservation], ops: tuple[Any, ...] = (), **observed: Any) -> Outage | None:
    config = observed.pop("cfg", CFG)
    obs = PoolObservation(
        hosts, observed.pop("stats", stats(queued=3)), observed.pop("plan", plan()), **observed
    )
    return pool_outage(config, obs, ops)


LONG = UNSCHEDULABLE_AFTER_S  # a wait long enough to be taken for good


def test_no_outage_while_a_host_is_ready_or_one_may_still_come() -> None:
    waits = "0/2 nodes are available: 2 Insufficient cpu."
    stalled = "container agent: ImagePullBackOff: Back-off pulling image"
    assert _outage([host("a"), host("b", "starting", pending=waits)], unschedulable_for_s=1e6) is None
    assert _outage([host("b", "starting", pending=waits)], unschedulable_for_s=LONG - 1) is None
    assert _outage([host("b", "starting", stalled=stalled, stalled_s=LONG - 1)]) is None
    assert _outage([host("b", "starting", stalled_s=1e6)], unschedulable_for_s=1e6) is None
    # One host waits for good, but another is on its way (placed, starting normally).
    on_its_way = host("c", "starting")
    assert _outage([host("b", "starting", pending=waits), on_its_way], unschedulable_for_s=1e6) is None
    assert _outage([host("b", "starting", stalled=stalled, stalled_s=1e6), on_its_way]) is None
    # A host added or brought back this round is coming, whatever else the plan says.
    for op in (CreateHost("n1", "2 actions waiting"), SetDraining("d", False, "needed again")):
        assert _outage([], (op,), plan=_unplaceable_plan(), unplaceable_for_s=1e6) is None
    # "No room" for a moment is not an outage (another pool's hosts may be going).
    assert _outage([], plan=_unplaceable_plan(), unplaceable_for_s=LONG - 1) is None
    # Failures below the bound, or the back-off over (the next host may start now): it waits.
    last = "the agent exited 1: Error"
    assert _outage([], failures=OUTAGE_AFTER_FAILURES - 1, since_failure_s=0.0, last_failure=last) is None
    over = backoff_s(OUTAGE_AFTER_FAILURES)
    assert _outage([], failures=OUTAGE_AFTER_FAILURES, since_failure_s=over, last_failure=last) is None
    # The planner says no node can hold one, but a host is starting anyway: it may yet come.
    assert _outage([host("b", "starting")], plan=_unplaceable_plan(), unplaceable_for_s=1e6) is None


def test_an_outage_names_why_and_when_to_send_again() -> None:
    unplaceable = _outage([], plan=_unplaceable_plan(), unplaceable_for_s=LONG)
    assert unplaceable is not None and "no node can hold a host of 4 cores" in unplaceable.message
    assert "0/2 nodes have 4 free cores" in unplaceable.message and CFG.key in unplaceable.message
    waits = "0/2 nodes are available: 2 Insufficient cpu."
    pending = _outage([host("b", "starting", pending=waits)], unschedulable_for_s=LONG)
    assert pending is not None and f"host b cannot be placed: {waits}" in pending.message
    stalled = 'container agent: CreateContainerConfigError: secret "token" not found'
    cannot = _outage([host("b", "starting", stalled=stalled, stalled_s=LONG)])
    assert cannot is not None and "host b cannot start" in cannot.message and stalled in cannot.message
    last = "the agent exited 1: Error"
    n = OUTAGE_AFTER_FAILURES + 1
    failing = _outage([host("c", "failed", failure=last)], failures=n, since_failure_s=2.0, last_failure=last)
    assert (
        failing is not None and f"{n} host(s) failed in a row" in failing.message and last in failing.message
    )
    assert failing.retry_after_s == pytest.approx(backoff_s(n) - 2.0)
    # A moment left of the back-off: the caller is still told to wait a while, not to spin.
    almost = _outage([], failures=n, since_failure_s=backoff_s(n) - 0.01, last_failure=last)
    assert almost is not None and almost.retry_after_s == OUTAGE_RETRY_MIN_S
    for outage in (unplaceable, pending, cannot):
        assert outage.retry_after_s > 0


def test_a_dedicated_pool_whose_new_pods_cannot_start_refuses_new_sessions() -> None:
    """Its pods each serve one session for life: the ready pods of running sessions are no host
    for a new one (a rollout to an image that cannot be pulled)."""
    dedicated = cfg(minHosts=0, maxHosts=4)
    dedicated = dataclasses.replace(dedicated, mode="dedicated")
    used = stats({"old": (0, 1)})
    stalled = "container agent: ErrImagePull: not found"
    hosts = [host("old"), host("new", "starting", stalled=stalled, stalled_s=LONG)]
    refused = _outage(hosts, cfg=dedicated, stats=used, plan=None)
    assert refused is not None and "host new cannot start" in refused.message
    free = stats({"old": (0, 0)})
    assert _outage(hosts, cfg=dedicated, stats=free, plan=None) is None


def test_a_held_hosts_stall_is_not_a_new_hosts() -> None:
    """In a dedicated pool a host a session holds is no host for a new session, and how long it has
    been stalled says nothing of a new host: new sessions are refused once the new one itself has
    waited long enough."""
    dedicated = dataclasses.replace(cfg(minHosts=0, maxHosts=4), mode="dedicated")
    held = stats({"old": (0, 1)})

    def hosts(new_for_s: float) -> list[HostObservation]:
        old = host("old", "starting", stalled="container agent: CrashLoopBackOff", stalled_s=600.0)
        new = host("new", "starting", stalled="container agent: ErrImagePull: not found", stalled_s=new_for_s)
        return [old, new]

    assert _outage(hosts(1.0), cfg=dedicated, stats=held, plan=None) is None
    refused = _outage(hosts(LONG), cfg=dedicated, stats=held, plan=None)
    assert refused is not None and "host new cannot start: container agent: ErrImagePull" in refused.message


def test_a_host_whose_container_cannot_start_says_so_after_a_while() -> None:
    def stalled(for_s: float) -> list[HostObservation]:
        why = "container agent: ErrImagePull: pull access denied for img"
        return [host("a", "starting", stalled=why, stalled_s=for_s)]

    early, _ = reconcile_actionpool(CFG, PoolObservation(stalled(1.0), stats(), plan()), NOW)
    assert {c["type"]: c["reason"] for c in early["conditions"]}["Ready"] == "HostsStarting"
    late, _ = reconcile_actionpool(CFG, PoolObservation(stalled(UNSCHEDULABLE_AFTER_S), stats(), plan()), NOW)
    cond = {c["type"]: c for c in late["conditions"]}
    for kind in ("Ready", "Degraded"):
        assert cond[kind]["reason"] == "HostsCannotStart"
        assert (
            "host a cannot start: container agent: ErrImagePull: pull access denied" in cond[kind]["message"]
        )
    assert (cond["Ready"]["status"], cond["Degraded"]["status"]) == ("False", "True")


def test_a_language_the_hosts_cannot_run_is_said() -> None:
    """spec.languages allows ``lean``, which no image here runs: the pool showed Healthy and failed
    every lean action. The hosts' health names what their agents found; a declared language none of
    them runs makes the pool Degraded (LanguagesMissing), naming it and why."""
    health = {
        "languages": {
            "found": {"cpp": {}, "go": {}},
            "missing": {"java": "java not found on PATH"},
        }
    }
    missing = missing_languages(["python", "bash", "cpp", "java", "lean"], health)
    assert missing == {"java": "java not found on PATH", "lean": "the agent has no runner for it"}
    assert missing_languages(["lean"], {}) == {}  # an agent that does not say is not blamed
    observed = PoolObservation([host("a")], stats(), None, missing_languages=missing)
    status, _ = reconcile_actionpool(CFG, observed, NOW)
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "LanguagesMissing"), degraded
    assert "java (java not found on PATH)" in degraded["message"] and "lean" in degraded["message"]
    fine = PoolObservation([host("a")], stats(), None, missing_languages={})
    conditions = reconcile_actionpool(CFG, fine, NOW)[0]["conditions"]
    assert {c["type"]: c["status"] for c in conditions}["Degraded"] == "False"


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


REFUSAL = 'Pod "py-x1" is invalid: spec.volumes[1].name: Duplicate value: "work"'


def test_a_host_pod_the_api_server_refused_is_said_and_not_retried_during_the_back_off() -> None:
    """The API server's answer (which names the field) is the pool's condition and the outage its
    actions are refused with; no create is sent again until the back-off after it has passed."""
    adds = plan(adds=(InstanceAdd(CFG.key, "n1", 4, 4000, 1, 0, R),))
    refused = PoolObservation([], stats(queued=2), adds, rejection=Rejection(1, 1.0, f"422 {REFUSAL}"))
    status, ops = reconcile_actionpool(CFG, refused, NOW)
    conds = _conditions(status)
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "HostsRejected")
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "HostsRejected")
    for cond in (conds["Ready"], conds["Degraded"]):
        assert REFUSAL in cond["message"] and "spec.template" in cond["message"], cond
    assert not any(isinstance(op, CreateHost) for op in ops)  # within the back-off (5 s)
    outage = pool_outage(CFG, refused, ops)
    assert outage is not None and REFUSAL in outage.message and CFG.key in outage.message
    assert outage.retry_after_s == OUTAGE_RETRY_MIN_S  # 4 s of the back-off left: at least 5
    # The back-off over: the next create is sent (and the hosts it starts are on their way).
    later = dataclasses.replace(refused, rejection=Rejection(1, backoff_s(1), f"422 {REFUSAL}"))
    _, ops = reconcile_actionpool(CFG, later, NOW)
    assert any(isinstance(op, CreateHost) for op in ops)
    assert pool_outage(CFG, later, ops) is None
    # A pool with a ready host still serves: Ready, and Degraded saying why it does not grow.
    status, _ = reconcile_actionpool(CFG, dataclasses.replace(refused, hosts=[host("a")]), NOW)
    conds = _conditions(status)
    assert conds["Ready"]["status"] == "True" and conds["Degraded"]["reason"] == "HostsRejected"
    assert pool_outage(CFG, dataclasses.replace(refused, hosts=[host("a")]), ()) is None


def test_a_pool_pinned_to_zero_by_scale_is_not_ready_for_the_actions_that_wait() -> None:
    """/scale's replicas 0 with minHosts 0 pins the pool to no host: no action starts one, so its
    status must not say that the first one does, and what waits on it is told why."""
    pinned = dataclasses.replace(CFG, replicas=0)
    observed = PoolObservation([], stats(queued=3), plan())
    status, ops = reconcile_actionpool(pinned, observed, NOW)
    ready = _conditions(status)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "PinnedToZero"), ready
    assert "pinned to 0 hosts by /scale" in ready["message"] and "3 action(s) wait" in ready["message"]
    assert "first action" not in ready["message"]
    outage = pool_outage(pinned, observed, ops)
    assert outage is not None and "pinned to 0 hosts by /scale" in outage.message
    assert "kubectl scale actionpool/py" in outage.message
    # Idle, it is still no pool an action runs on.
    status, _ = reconcile_actionpool(pinned, dataclasses.replace(observed, stats=stats()), NOW)
    assert _conditions(status)["Ready"]["reason"] == "PinnedToZero"
    # Not pinned (the planner decides, minHosts 0): idle at zero, the first action starts one.
    status, _ = reconcile_actionpool(CFG, dataclasses.replace(observed, stats=stats()), NOW)
    assert _conditions(status)["Ready"]["reason"] == "ScaledToZero"
    assert pool_outage(CFG, observed, ()) is None


def test_an_edit_of_the_session_ttl_replaces_no_host() -> None:
    """sessions.ttlSeconds applies live (the dispatcher closes idle sessions on the pool's current
    TTL and gives each agent session its own when it opens it); it was in the template hash, so an
    edit of it surged a new host for every host and kept the old ones, drained, until their
    sessions ended."""

    def with_ttl(ttl: int, **sessions: Any) -> PoolConfig:
        model = ActionPool.model_validate(
            {
                "metadata": {"name": "py", "namespace": "ns", "generation": 4},
                "spec": {
                    "template": {"image": "img:1", "resources": {"cpu": "4"}},
                    "scaling": {"minHosts": 0, "maxHosts": 4, "maxStarting": 2},
                    "sessions": {"ttlSeconds": ttl, **sessions},
                },
            }
        )
        return pool_config(model, uid="u")

    before, after = with_ttl(600), with_ttl(7200)
    assert after.session_ttl_s == 7200 and before.template_hash == after.template_hash
    hosts = [host("a", template=before.template_hash), host("b", template=before.template_hash)]
    status, ops = reconcile_actionpool(
        after, PoolObservation(hosts, stats({"a": (0, 2), "b": (0, 0)}), plan()), NOW
    )
    assert _kinds(ops) == []
    scaling = {c["type"]: c for c in status["conditions"]}["Scaling"]
    assert scaling["reason"] == "Steady", scaling
    # What a host pod runs with does roll them: sessions per host (the agent's --max-sessions).
    assert with_ttl(600, maxPerHost=8).template_hash != before.template_hash


@pytest.mark.parametrize(
    ("scale", "bound"), [({"maxHosts": 2}, "maxHosts"), ({"replicas": 1}, "/scale replicas")]
)
def test_hosts_over_a_lowered_maximum_are_said_to_be_drained_after_the_idle_timeout(
    scale: dict[str, Any], bound: str
) -> None:
    """maxHosts lowered under the hosts a pool has: the planner drains the ones over it only after
    idleTimeoutSeconds, and removes none that is busy; the status said Steady, "4 host(s), as
    wanted", meanwhile."""
    scaling = {"minHosts": 0, "maxHosts": scale.get("maxHosts", 4)}
    replicas = {"replicas": scale["replicas"]} if "replicas" in scale else {}
    spec = {"template": {"image": "img:1", "resources": {"cpu": "4"}}, "scaling": scaling, **replicas}
    model = ActionPool.model_validate(
        {"metadata": {"name": "py", "namespace": "ns", "generation": 3}, "spec": spec}
    )
    lowered = pool_config(model, uid="u")
    hosts = [host(n) for n in "abcd"]
    status, ops = reconcile_actionpool(lowered, PoolObservation(hosts, stats({"a": (1, 1)}), plan()), NOW)
    assert _kinds(ops) == []
    scaling = {c["type"]: c for c in status["conditions"]}["Scaling"]
    hi = lowered.desired_bounds[1]
    assert (scaling["status"], scaling["reason"]) == ("True", "ScalingDown"), scaling
    assert (
        f"over the maximum of {hi} ({bound})" in scaling["message"]
        and "idleTimeoutSeconds" in scaling["message"]
    )
    # Back within the maximum: Steady again; a failed host (being replaced) is not one over it.
    failed = host("x", "failed", failure="exit 1")
    status, _ = reconcile_actionpool(lowered, PoolObservation([*hosts[:hi], failed], stats(), plan()), NOW)
    assert {c["type"]: c for c in status["conditions"]}["Scaling"]["reason"] == "Steady"
