"""How long each pod has been stalled, on its own clock (``failures.Stalls``)."""

from __future__ import annotations

from dataclasses import replace

from arl_tangram.controllers.failures import UNSCHEDULABLE_AFTER_S, Stalls, cannot_start
from arl_tangram.runtime.interface import HostObservation

BASE = HostObservation(
    name="x",
    pool="ns/py",
    phase="starting",
    node="n1",
    address=None,
    template_hash="h",
    created_at=0.0,
    cpu_millicores=1000,
    memory_bytes=1 << 30,
)


def pod(name: str, stalled: str | None = None, setting_up: bool = True) -> HostObservation:
    """A pod stalled on its volumes or sandbox (``setting_up``), or on a container's start."""
    return replace(BASE, name=name, stalled=stalled, setting_up=setting_up and stalled is not None)


def longest(seen: list[HostObservation]) -> float:
    """How long the pod stalled longest has been (0 when none is)."""
    return max((p.stalled_s for p in seen if p.stalled), default=0.0)


def test_pods_each_stalled_a_moment_one_after_another_never_add_up() -> None:
    """A pool starting pods in turn, each with its sandbox not ready for 2 s: some pod is always
    stalled, for minutes, and none ever counts as stuck."""
    now = [0.0]
    stalls = Stalls(clock=lambda: now[0])
    for k in range(100):
        for t in (0.0, 1.0, 2.0):
            now[0] = 2.0 * k + t
            seen = stalls.observe("ns/py", [pod(f"p{k}", "not ready"), pod(f"q{k}")])
            assert longest(seen) <= 2.0 and all(p.stalled is None for p in seen)
            assert cannot_start("host", seen) is None


def test_one_stuck_pod_counts_once_its_own_wait_is_long_enough_and_is_the_one_named() -> None:
    now = [0.0]
    stalls = Stalls(clock=lambda: now[0])
    stalls.observe("ns/py", [pod("stuck", "no secret")])
    now[0] = UNSCHEDULABLE_AFTER_S - 1
    seen = stalls.observe("ns/py", [pod("stuck", "no secret"), pod("new", "not ready")])
    assert longest(seen) == 0.0 and [p.stalled for p in seen] == [None, None]  # both still starting
    now[0] = UNSCHEDULABLE_AFTER_S
    seen = stalls.observe("ns/py", [pod("stuck", "no secret"), pod("new", "not ready")])
    assert cannot_start("host", seen) == "host stuck cannot start: no secret"
    assert [(p.name, p.stalled, p.stalled_s) for p in seen] == [
        ("stuck", "no secret", UNSCHEDULABLE_AFTER_S),
        ("new", None, 0.0),
    ]
    # It starts: the clock is cleared, and a later stall of the same pod starts from zero.
    assert stalls.observe("ns/py", [pod("stuck")]) == [pod("stuck")]
    now[0] += 100
    assert longest(stalls.observe("ns/py", [pod("stuck", "again", setting_up=False)])) == 0.0
    # Other pools keep their own; a forgotten one starts over.
    assert longest(stalls.observe("ns/other", [pod("o", "x", setting_up=False)])) == 0.0
    now[0] += 100
    stalls.forget("ns/py")
    assert longest(stalls.observe("ns/py", [pod("stuck", "again", setting_up=False)])) == 0.0


def test_a_container_that_cannot_start_counts_at_once_each_pod_on_its_own_clock() -> None:
    """A broken image: no normal start looks like that, so a new pod of it is never taken for one
    on its way; and a template that keeps adding such pods is stuck 30 s after its first."""
    now = [0.0]
    stalls = Stalls(clock=lambda: now[0])
    broken = "container agent: ImagePullBackOff"
    pods = [pod("p0", broken, setting_up=False)]
    seen = stalls.observe("ns/py", pods)
    assert [p.stalled for p in seen] == [broken] and longest(seen) == 0.0  # counts at once
    for k in range(1, 4):
        now[0] = 20.0 * k
        pods.append(pod(f"p{k}", broken, setting_up=False))
        seen = stalls.observe("ns/py", pods)
        assert [p.stalled for p in seen] == [broken] * len(pods)  # every pod, however new
        assert longest(seen) == now[0]  # the first pod's wait
    # The host named is the one stuck longest, wherever it is listed.
    assert cannot_start("host", reversed(seen)) == f"host p0 cannot start: {broken}"
    # Only once the longest wait is long enough: p2's 20 s (p3's 0 s) name neither.
    assert [p.stalled_s for p in seen] == [60.0, 40.0, 20.0, 0.0]
    assert cannot_start("host", seen[2:]) is None
