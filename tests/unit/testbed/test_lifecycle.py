"""The kubelet's container lifecycle and pod status rules, without processes or a cluster."""

from __future__ import annotations

import pytest
from node_runner import lifecycle
from node_runner.api import Json
from node_runner.container import Container
from node_runner.status import PodConditions, pod_status


@pytest.mark.parametrize(("returncode", "code"), [(0, 0), (3, 3), (-9, 137), (-15, 143)])
def test_exit_codes_of_signalled_processes_are_128_plus_the_signal(returncode: int, code: int) -> None:
    assert lifecycle.exit_code(returncode) == code


@pytest.mark.parametrize(
    ("policy", "init", "code", "restart_on_success", "restart"),
    [
        ("Always", False, 0, True, True),
        ("Always", False, 1, True, True),
        ("Always", True, 0, False, False),  # an init container of an Always pod: as OnFailure
        ("Always", True, 1, False, True),
        ("OnFailure", False, 0, False, False),
        ("OnFailure", False, 2, False, True),
        ("Never", False, 2, False, False),
        ("Never", True, 2, False, False),
    ],
)
def test_restart_policy(policy: str, init: bool, code: int, restart_on_success: bool, restart: bool) -> None:
    assert lifecycle.restart_wanted(policy, init, code, restart_on_success) is restart


def test_crash_loop_back_off_doubles_to_five_minutes_and_resets_after_ten_of_good_running() -> None:
    delays = [0.0]
    for _ in range(12):
        delays.append(lifecycle.next_backoff(delays[-1], ran_for_s=1.0))
    assert delays[1:10] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
    assert delays[10:] == [300.0, 300.0, 300.0]
    assert lifecycle.next_backoff(300.0, ran_for_s=601.0) == 1.0


def test_a_container_that_crashes_waits_out_its_back_off_and_counts_the_restart() -> None:
    c = Container({"name": "main"}, False, started_at=100.0, started_iso="t0", container_id="testbed://a")
    c.exited(c.terminated(7), restart=True, now=105.0, pod_ref="p_ns(u)")
    assert c.restart_count == 1 and c.restart_at == 106.0 and not c.done
    assert c.last_state["terminated"]["exitCode"] == 7 and c.last_state["terminated"]["reason"] == "Error"
    assert c.state["waiting"]["reason"] == "CrashLoopBackOff"
    assert "container=main pod=p_ns(u)" in c.state["waiting"]["message"]
    assert c.waiting_to_restart
    c.exited(c.terminated(0), restart=False, now=107.0, pod_ref="p_ns(u)")
    assert c.done and c.state["terminated"]["reason"] == "Completed" and c.restart_count == 1


def test_a_container_waiting_for_its_config_is_not_a_restart() -> None:
    c = Container({"name": "main"}, False, restart_at=5.0)  # CreateContainerConfigError retries
    assert not c.waiting_to_restart and not c.has_run
    assert lifecycle.pod_phase([c]) == "Pending"


def test_the_pod_phase_follows_its_containers() -> None:
    done_ok = Container({"name": "a"}, False, done=True, state={"terminated": {"exitCode": 0}})
    done_bad = Container({"name": "b"}, False, done=True, state={"terminated": {"exitCode": 2}})
    waiting = Container({"name": "c"}, False)
    assert lifecycle.pod_phase([done_ok]) == "Succeeded"
    assert lifecycle.pod_phase([done_ok, done_bad]) == "Failed"
    assert lifecycle.pod_phase([done_ok, waiting]) == "Running"  # one has run
    assert lifecycle.pod_phase([waiting]) == "Pending"


def test_readiness_names_the_unready_containers() -> None:
    a, b = Container({"name": "a"}, False), Container({"name": "b"}, False)
    assert lifecycle.readiness("Running", [a, b]) == (
        False, "ContainersNotReady", "containers with unready status: [a b]",
    )  # fmt: skip
    assert lifecycle.readiness("Succeeded", [a]) == (False, "PodCompleted", "")


def test_container_status_reports_actual_resources_when_running_and_allocated_otherwise() -> None:
    spec = {
        "name": "main",
        "image": "python:3.12",
        "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}},
    }
    c = Container(spec, False)
    assert c.status()["resources"] == spec["resources"] and c.status()["allocatedResources"] == {"cpu": "1"}
    c.allocated = {"requests": {"cpu": "2"}, "limits": {"cpu": "2"}}
    c.actual = {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}}
    c.state = {"running": {}}
    c.proc = object()  # type: ignore[assignment]  # stands for a live process: only its presence is read
    status = c.status()
    assert status["resources"]["limits"]["cpu"] == "1"  # not yet actuated
    assert status["allocatedResources"] == {"cpu": "2"}
    assert "resources" not in Container({"name": "init"}, True).status()


def test_conditions_keep_their_transition_time_while_the_status_holds() -> None:
    conds = PodConditions()
    conds.set("Ready", False, 1, "ContainersNotReady", "containers with unready status: [main]")
    first = conds.list()[0]
    assert (first["status"], first["reason"], first["observedGeneration"]) == (
        "False",
        "ContainersNotReady",
        1,
    )
    conds.set("Ready", False, 2, "ContainersNotReady", "x")
    assert conds.list()[0]["lastTransitionTime"] == first["lastTransitionTime"]
    assert conds.list()[0]["observedGeneration"] == 2
    conds.set("Initialized", True, 2)
    assert [c["type"] for c in conds.list()] == ["Initialized", "Ready"]
    assert "reason" not in conds.list()[0]


def _status(conditions: list[Json], reported: Json) -> Json:
    return pod_status(
        phase="Running",
        conditions=conditions,
        reported=reported,
        host_ip="127.0.0.1",
        pod_ip="198.18.0.9",
        start_time="t0",
        generation=3,
        containers=[{"name": "b"}, {"name": "a"}],
        init_containers=[],
        message="",
    )


def test_pod_status_keeps_others_conditions_and_drops_stale_ones_of_its_own() -> None:
    ours = [{"type": "Ready", "status": "True"}]
    reported = {
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "False"},
            {"type": "PodResizeInProgress", "status": "True"},  # cleared since: must not come back
        ]
    }
    status = _status(ours, reported)
    assert status["conditions"] == [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True"},
    ]
    assert [c["name"] for c in status["containerStatuses"]] == ["a", "b"]
    assert status["podIPs"] == [{"ip": "198.18.0.9"}] and status["observedGeneration"] == 3
    assert status["message"] is None and "initContainerStatuses" not in status
