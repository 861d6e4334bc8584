"""In-place resize: cores per CPU limit, the core map, the node fit check, the resize conditions, and
the affinity of a real process tree (a process with a child and a thread, started here)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest
from node_runner import resize
from node_runner.api import Json


@pytest.mark.parametrize(
    ("resources", "available", "cores"),
    [
        ({}, 2, 2),  # no limit: all of them
        ({"requests": {"cpu": "4"}}, 2, 2),  # a request alone restricts nothing
        ({"limits": {"cpu": "1"}}, 2, 1),
        ({"limits": {"cpu": "500m"}}, 2, 1),  # rounded up: a fraction still needs a core
        ({"limits": {"cpu": "1001m"}}, 4, 2),
        ({"limits": {"cpu": "2"}}, 4, 2),
        ({"limits": {"cpu": "8"}}, 2, 2),  # more than the runner has: all it has
        ({"limits": {"memory": "1Gi"}}, 3, 3),
    ],
)
def test_cores_for_a_cpu_limit(resources: Json, available: int, cores: int) -> None:
    assert resize.cores_for(resources, available) == cores


def test_core_map_spreads_containers_and_keeps_their_cores_when_they_do_not_change() -> None:
    m = resize.CoreMap([3, 1, 2, 0])
    assert m.assign("a", 1) == (0,)
    assert m.assign("b", 1) == (1,)  # the least used core
    assert m.assign("c", 2) == (2, 3)
    assert m.assign("a", 1) == (0,)  # unchanged count: unchanged cores
    assert m.assign("b", 3) == (0, 1, 2)  # keeps its core, adds the least used (all once: the lowest)
    assert m.assign("b", 1) == (1,)  # shrinks onto a core it had
    m.release("c")
    assert m.assign("d", 2) == (2, 3)
    assert m.assign("e", 9) == (0, 1, 2, 3)  # capped at what there is
    assert m.held() == {"a": (0,), "b": (1,), "d": (2, 3), "e": (0, 1, 2, 3)}


def test_core_map_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="no CPU"):
        resize.CoreMap([])
    with pytest.raises(ValueError, match="at least one core, not 0"):
        resize.CoreMap([0]).assign("a", 0)


def test_pod_requests_sum_containers_and_take_the_largest_init_container() -> None:
    main = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "1"}}
    side = {"requests": {"cpu": "250m", "nvidia.com/gpu": "1"}}
    init = {"requests": {"cpu": "2"}}
    assert resize.pod_requests([main, side]) == {"cpu": 0.75, "memory": 2.0**30}
    assert resize.pod_requests([main, side], [init]) == {"cpu": 2.0, "memory": 2.0**30}


NODE = {"cpu": "16", "memory": "64Gi", "pods": "110"}


@pytest.mark.parametrize(
    ("wanted", "used", "verdict"),
    [
        ({"cpu": 4.0}, {"cpu": 12.0}, None),  # exactly full fits
        ({"cpu": 4.5}, {"cpu": 12.0}, ("Deferred", "cpu, requested: 4500, used: 12000, capacity: 16000")),
        ({"cpu": 17.0}, {}, ("Infeasible", "cpu, requested: 17000, capacity: 16000")),
        ({"cpu": 1.0, "memory": 65.0 * 2**30}, {}, ("Infeasible", "memory, requested: 69793218560")),
        ({"memory": 2.0**30}, {"memory": 63.5 * 2**30}, ("Deferred", "memory, requested: 1073741824")),
        ({}, {"cpu": 99.0}, None),  # asks for nothing the node counts
    ],
)
def test_fit_defers_what_the_others_block_and_refuses_what_the_node_cannot_hold(
    wanted: dict[str, float], used: dict[str, float], verdict: tuple[str, str] | None
) -> None:
    got = resize.fit(wanted, used, NODE)
    if verdict is None:
        assert got is None
    else:
        assert got is not None and got[0] == verdict[0] and verdict[1] in got[1]


def test_the_pending_condition_changes_only_with_a_new_reason_or_generation() -> None:
    conds = resize.ResizeConditions()
    assert conds.set_pending("Deferred", "used: 12000", 2)
    first = conds.pending
    assert first is not None
    assert (first["type"], first["status"], first["reason"], first["observedGeneration"]) == (
        "PodResizePending", "True", "Deferred", 2,
    )  # fmt: skip
    assert not conds.set_pending("Deferred", "used: 11000", 2)  # retried: nothing to report
    assert conds.pending is first
    assert conds.set_pending("Deferred", "used: 11000", 3)  # a new resize
    assert conds.pending["lastTransitionTime"] == first["lastTransitionTime"]  # same reason
    assert conds.set_pending("Infeasible", "capacity", 4)
    conds.clear_pending()
    assert conds.list() == []


def test_in_progress_lasts_until_done_and_reports_an_error_with_its_generation() -> None:
    conds = resize.ResizeConditions()
    conds.start(5)
    assert conds.in_progress is not None and "reason" not in conds.in_progress
    conds.failed("container main: permission denied")
    cond = conds.list()[0]
    assert (cond["type"], cond["reason"], cond["message"], cond["observedGeneration"]) == (
        "PodResizeInProgress", "Error", "container main: permission denied", 5,
    )  # fmt: skip
    conds.start(6)  # a new allocation clears the error
    assert conds.in_progress is not None and "reason" not in conds.in_progress
    assert conds.in_progress["observedGeneration"] == 6
    conds.done()
    assert conds.list() == []


# A parent with a second thread and a child, all started before the affinity changes: each prints
# its mask on request (one line in on stdin, one line out per task).
TREE = """
import os, subprocess, sys, threading, queue
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
asks, answers = queue.Queue(), queue.Queue()
def thread():
    while asks.get():
        answers.put(sorted(os.sched_getaffinity(0)))
threading.Thread(target=thread, daemon=True).start()
print(child.pid, flush=True)
for _ in sys.stdin:
    asks.put(True)
    print(sorted(os.sched_getaffinity(0)), answers.get(), sorted(os.sched_getaffinity(child.pid)), flush=True)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move a process between")
def test_set_tree_affinity_reaches_every_thread_and_child() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    proc = subprocess.Popen(
        [sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        assert set(resize.process_tree(proc.pid)) >= {proc.pid, child}
        changed = resize.set_tree_affinity(proc.pid, [cpus[1]])
        assert changed >= 3  # the main thread, the second thread, the child (and its threads)
        proc.stdin.write("?\n")
        proc.stdin.flush()
        assert proc.stdout.readline().split("] [") == [f"[{cpus[1]}", f"{cpus[1]}", f"{cpus[1]}]\n"]
        assert resize.set_tree_affinity(proc.pid, [cpus[1]]) == 0  # already there
        resize.set_tree_affinity(proc.pid, cpus)
        proc.stdin.write("?\n")
        proc.stdin.flush()
        everything = str(cpus)
        assert proc.stdout.readline().strip() == f"{everything} {everything} {everything}"
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
